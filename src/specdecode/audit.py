"""specdecode audit: is a drafter lossless on this model, dtype and hardware?

Greedy: plain and speculative decoding on the same prompts, every divergence examined: after one, speculative
decoding restarts from plain decoding's path just past it, so each prompt's divergences are all found. A divergence
is a numerical near-tie only when rounding, as measured there, explains it:
- `one_row`: the logits plain decoding chose its token from (a one-row forward);
- `tree_row`: the logits speculative decoding chose its token from (a row of the tree forward it actually ran);
- `observed`: their largest difference over the vocabulary, the rounding the two forward shapes showed there;
- `reference`: the largest difference between `one_row` and the same position computed by a plain causal forward
  with as many rows as that tree forward: what an honest change of shape rounds like at this position.
It is a near-tie when plain's top two are the two tokens, their margin is within `observed`, and `observed` is at
most twice `reference` (a tree forward that reads a wrong mask, position or cache entry differs by more than
rounding does). Anything else is a bug.
Sampling: the token at new index `depth` (drafted at depth `depth` of the first draft) is compared, over many seeds,
with the target's exact conditional distribution given the new tokens before it, through its randomized probability
integral transform; a Kolmogorov-Smirnov distance above a bound that holds with probability 1 - delta fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

from .drafters import Drafter, build_drafter
from .engine import generate
from .models.base import CausalLM, prefill
from .sampling import SamplingParams, probs_from_logits
from .verify import GreedyVerifier, Verifier

REFERENCE_SLACK = 2.0  # a tree forward may round up to this many times the reference's difference


@dataclass
class Divergence:
    prompt_index: int
    position: int  # new-token index where the outputs differ (plain's path before it)
    plain_token: int
    speculative_token: int
    margin: float  # plain's top-1 minus top-2 logit there (one-row forward)
    runner_up: int
    observed: float  # largest |tree_row - one_row| over the vocabulary
    reference: float  # largest |same-shape causal row - one_row|
    kind: str  # "near-tie" or "bug"


@dataclass
class GreedyAudit:
    identical: int = 0
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def bugs(self) -> list[Divergence]:
        return [d for d in self.divergences if d.kind == "bug"]


class RecordingVerifier(Verifier):
    """Wraps a verifier; keeps, for every token a step emits, the target logits row it was chosen from and the
    number of rows of that forward."""

    def __init__(self, inner: Verifier):
        self.inner = inner
        self.rows: list[torch.Tensor] = []  # [V] each
        self.forward_rows: list[int] = []

    def verify(self, draft, target_logits, params, generator):
        verdict = self.inner.verify(draft, target_logits, params, generator)
        path = [0] + [i + 1 for i in verdict.accepted]
        self.rows += [target_logits[row].clone() for row in path]  # not views: the forward's logits can be large
        self.forward_rows += [target_logits.shape[0]] * len(path)
        return verdict


def next_token_logits(target: CausalLM, token_ids: list[int]) -> torch.Tensor:
    cache = target.new_cache(len(token_ids) + 1)
    return prefill(target, cache, token_ids)


def causal_last_row(target: CausalLM, token_ids: list[int], rows: int) -> torch.Tensor:
    """[V] logits after token_ids from one causal forward over its last `rows` tokens (the rest prefilled)."""
    rows = min(rows, len(token_ids))
    head, tail = token_ids[: len(token_ids) - rows], torch.tensor(token_ids[len(token_ids) - rows :])
    cache = target.new_cache(len(token_ids) + 1)
    if head:
        prefill(target, cache, head)
    causal = torch.ones(rows, rows, dtype=torch.bool).tril()
    return target.forward(cache, tail, torch.arange(len(head), len(token_ids)), causal)[-1]


def recorded_generate(target, drafter, prompt, max_new_tokens, verifier: Verifier):
    """Greedy tokens, and for each the (logits row it came from, rows of that forward); the first token's row is
    the prefill's."""
    recorder = RecordingVerifier(verifier)
    tokens, _ = generate(target, drafter, prompt, max_new_tokens, SamplingParams(), recorder)
    rows = [next_token_logits(target, prompt)] + recorder.rows
    return tokens, list(zip(rows, [len(prompt)] + recorder.forward_rows))


def audit_greedy(
    target: CausalLM,
    drafter: Drafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    verifier: Verifier | None = None,
) -> GreedyAudit:
    report = GreedyAudit()
    plain_drafter = build_drafter("none", target)
    for index, prompt in enumerate(tqdm(prompts, desc="audit (greedy)", unit="prompt")):
        plain, plain_rows = recorded_generate(target, plain_drafter, prompt, max_new_tokens, GreedyVerifier())
        found = prompt_divergences(target, drafter, prompt, plain, plain_rows, verifier or GreedyVerifier())
        for divergence in found:
            divergence.prompt_index = index
        report.divergences += found
        report.identical += not found
    return report


def prompt_divergences(target, drafter, prompt, plain, plain_rows, verifier) -> list[Divergence]:
    """Every divergence of speculative decoding from `plain`, restarting from plain's path past each one."""
    found, start = [], 0
    while start < len(plain):
        context = prompt + plain[:start]
        spec, spec_rows = recorded_generate(target, drafter, context, len(plain) - start, verifier)
        offset = next((i for i, (a, b) in enumerate(zip(plain[start:], spec)) if a != b), None)
        if offset is None:
            if len(spec) != len(plain) - start:  # one stopped early without a differing token: never a tie
                found.append(Divergence(0, start + min(len(spec), len(plain) - start), -1, -1, math.nan, -1,
                                        math.nan, math.nan, "bug"))
            return found
        pos = start + offset
        tree_row, forward_rows = spec_rows[offset]
        reference_row = causal_last_row(target, prompt + plain[:pos], forward_rows)
        found.append(classify(pos, plain[pos], spec[offset], plain_rows[pos][0], tree_row, reference_row))
        start = pos + 1
    return found


def classify(position, plain_token, spec_token, one_row, tree_row, reference_row) -> Divergence:
    """A near-tie when measured rounding explains the flip (see the module docstring); else a bug."""
    one_row, tree_row, reference_row = one_row.float(), tree_row.float(), reference_row.float()
    top2 = torch.topk(one_row, 2)
    margin = float(top2.values[0] - top2.values[1])
    observed = float((tree_row - one_row).abs().max())
    reference = float((reference_row - one_row).abs().max())
    near_tie = (
        {plain_token, spec_token} == set(top2.indices.tolist())  # exact ties: either of the two is plain's choice
        and margin <= observed
        and observed <= REFERENCE_SLACK * reference
    )
    return Divergence(0, position, plain_token, spec_token, margin, int(top2.indices[1]), observed, reference,
                      "near-tie" if near_tie else "bug")


@dataclass
class SamplingAudit:
    samples: int
    distance: float  # largest gap between the PIT values' empirical CDF and the uniform CDF (Kolmogorov-Smirnov)
    bound: float  # the gap a lossless engine stays under with probability 1 - delta (DKW inequality)
    depth: int = 1

    @property
    def passed(self) -> bool:
        return self.distance <= self.bound


def audit_sampling(
    target: CausalLM,
    drafter: Drafter,
    prompt: list[int],
    params: SamplingParams,
    samples: int = 400,
    verifier: Verifier | None = None,
    delta: float = 1e-3,
    depth: int = 1,
) -> SamplingAudit:
    """The token at new index `depth`, over `samples` seeded generations of depth + 2 tokens (so the first draft,
    below the prefill's token, reaches that depth), against the target's exact distribution given the new tokens
    before it. Each sampled token becomes a randomized probability integral transform (PIT) value under that
    distribution (tokens in order of decreasing probability): exactly uniform on [0, 1] when sampling is lossless,
    whatever the vocabulary size or depth, so one Kolmogorov-Smirnov distance with the DKW bound
    sqrt(ln(2 / delta) / 2n) tests every depth."""
    conditionals: dict[tuple[int, ...], torch.Tensor] = {}
    uniform = torch.Generator().manual_seed(0)
    pit = []
    for seed in tqdm(range(samples), desc=f"audit (sampling, depth {depth})", unit="sample"):
        seeded = replace(params, seed=seed)
        tokens, _ = generate(target, drafter, prompt, depth + 2, seeded, verifier)
        if len(tokens) <= depth:  # stopped at an end-of-sequence token before that depth
            continue
        prefix = tuple(tokens[:depth])
        if prefix not in conditionals:
            conditionals[prefix] = probs_from_logits(next_token_logits(target, prompt + list(prefix)), params)
        pit.append(randomized_pit(conditionals[prefix], tokens[depth], uniform))
    n = len(pit)
    values = torch.tensor(sorted(pit), dtype=torch.float64)  # [n]
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    distance = float(torch.maximum(ranks / n - values, values - (ranks - 1) / n).max()) if n else math.inf
    bound = math.sqrt(math.log(2 / delta) / (2 * n)) if n else 0.0
    return SamplingAudit(n, distance, bound, depth)


def randomized_pit(probs: torch.Tensor, token: int, generator: torch.Generator) -> float:
    """F(token-) + U * p(token), with tokens ordered by decreasing probability: uniform on [0, 1] when token ~ probs."""
    order = torch.argsort(probs, descending=True, stable=True)
    rank = int((order == token).nonzero())
    before = float(probs[order[:rank]].double().sum())
    return before + float(torch.rand((), generator=generator, dtype=torch.float64)) * float(probs[token])
