"""specdecode audit: is a drafter lossless on this model, dtype and hardware?

Greedy: plain and speculative decoding on the same prompts. A divergence is a numerical near-tie when the
speculative token is plain decoding's runner-up at the first differing position and plain decoding's top-2 logit
margin there is within the dtype's rounding noise; anything else is a bug.
Sampling: the token after the first one (which the prefill samples, so it is never drafted) is compared, over many
seeds, with the target's exact conditional distribution given that first token; a total-variation distance above
a bound that holds with probability 1 - delta fails the audit.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from .drafters import Drafter, build_drafter
from .engine import generate
from .models.base import CausalLM, prefill
from .sampling import SamplingParams, probs_from_logits
from .verify import Verifier

# Largest top-2 logit margin that rounding can plausibly flip when a forward runs in another batch shape.
TIE_MARGIN = {torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.1}


@dataclass
class Divergence:
    prompt_index: int
    position: int  # first differing new-token index
    plain_token: int
    speculative_token: int
    margin: float  # plain decoding's top-1 minus top-2 logit there
    runner_up: int
    kind: str  # "near-tie" or "bug"


@dataclass
class GreedyAudit:
    identical: int = 0
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def bugs(self) -> list[Divergence]:
        return [d for d in self.divergences if d.kind == "bug"]


def next_token_logits(target: CausalLM, token_ids: list[int]) -> torch.Tensor:
    cache = target.new_cache(len(token_ids) + 1)
    return prefill(target, cache, token_ids)


def audit_greedy(
    target: CausalLM,
    drafter: Drafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    verifier: Verifier | None = None,
    tie_margin: float | None = None,
) -> GreedyAudit:
    greedy = SamplingParams()
    report = GreedyAudit()
    plain_drafter = build_drafter("none", target)
    for index, prompt in enumerate(tqdm(prompts, desc="audit (greedy)", unit="prompt")):
        plain, _ = generate(target, plain_drafter, prompt, max_new_tokens, greedy)
        spec, _ = generate(target, drafter, prompt, max_new_tokens, greedy, verifier)
        divergence = classify_divergence(target, prompt, plain, spec, tie_margin, index)
        if divergence is None:
            report.identical += 1
        else:
            report.divergences.append(divergence)
    return report


def classify_divergence(
    target: CausalLM, prompt: list[int], plain: list[int], spec: list[int], tie_margin: float | None = None,
    prompt_index: int = 0,
) -> Divergence | None:
    """None when identical; else where the outputs part and whether that is a near-tie of the dtype or a bug."""
    if spec == plain:
        return None
    tie_margin = TIE_MARGIN.get(target.dtype, 0.5) if tie_margin is None else tie_margin
    pos = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    if pos == min(len(plain), len(spec)):  # one stopped early: a length difference, never a tie
        return Divergence(prompt_index, pos, -1, -1, float("nan"), -1, "bug")
    top2 = torch.topk(next_token_logits(target, prompt + plain[:pos]), 2)
    margin = float(top2.values[0] - top2.values[1])
    # Exact ties are common in low precision, so either of the top two may count as plain's choice.
    near_tie = {plain[pos], spec[pos]} == set(top2.indices.tolist()) and margin <= tie_margin
    return Divergence(
        prompt_index, pos, plain[pos], spec[pos], margin, int(top2.indices[1]), "near-tie" if near_tie else "bug"
    )


@dataclass
class SamplingAudit:
    samples: int
    tv: float
    bound: float

    @property
    def passed(self) -> bool:
        return self.tv <= self.bound


def audit_sampling(
    target: CausalLM,
    drafter: Drafter,
    prompt: list[int],
    params: SamplingParams,
    samples: int = 400,
    verifier: Verifier | None = None,
    delta: float = 1e-3,
) -> SamplingAudit:
    """Empirical joint of (first, second) new token against count(first) * p(second | first)."""
    pairs = Counter()
    for seed in tqdm(range(samples), desc="audit (sampling)", unit="sample"):
        seeded = SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed)
        tokens, _ = generate(target, drafter, prompt, 3, seeded, verifier)
        if len(tokens) >= 2:
            pairs[(tokens[0], tokens[1])] += 1
    n = sum(pairs.values())
    firsts = Counter(first for first, _ in pairs.elements())
    expected: dict = {}
    for first, count in firsts.items():
        conditional = probs_from_logits(next_token_logits(target, prompt + [first]), params)  # [V]
        for token in (conditional * count >= 0.5).nonzero().flatten().tolist():  # cells expected at least half a time
            expected[(first, token)] = float(conditional[token]) * count / n
    # Cells expected less than half a time are pooled into one "other" cell: K = len(expected) + 1 categories.
    observed: Counter = Counter()
    for cell, c in pairs.items():
        observed[cell if cell in expected else "other"] += c / n
    expected["other"] = max(0.0, 1.0 - sum(expected.values()))
    tv = 0.5 * sum(abs(observed.get(c, 0.0) - p) for c, p in expected.items())
    bound = math.sqrt((len(expected) * math.log(2) + math.log(1 / delta)) / (2 * n))
    return SamplingAudit(n, tv, bound)
