"""The decode loop. It knows interfaces only: a drafter proposes a tree, the target scores it in one forward,
the verifier picks the accepted path plus one bonus token, and the cache keeps that path.

The loop (decode_steps) is a generator that hands its verification forwards out as ForwardRequests and is sent
back the target logits, so whoever drives it decides how forwards run: decode() runs each with target.forward;
the server's scheduler gathers many requests' forwards into one target.forward_batch.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

import torch

from .cache import KVCache
from .cache.prefix import PrefixCache
from .drafters import Drafter
from .errors import SpecDecodeError
from .governor import Governor
from .models.base import CausalLM, ForwardRequest, HiddenStates, prefill, tree_request
from .sampling import SamplingParams, sample, probs_from_logits
from .tree import Draft, depths
from .verify import Verifier, verifier_for


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # the prefill counts: it yields the first token
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # draft tokens accepted (bonus tokens excluded)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # target forward + verification (in a server batch: the wait for the batch's forward)
    seconds: float = 0.0
    finish_reason: str = ""
    accepted_per_step: list[int] = field(default_factory=list)
    plain_steps: int = 0  # steps the governor ran without drafting (speculation did not pay then)
    reused_prompt_tokens: int = 0  # leading prompt tokens whose KV came from the prefix cache, not the prefill
    approximate: str = ""  # the approximation that shortened the prompt (approximate.py; "": none, lossless)
    prompt_tokens_read: int = 0  # with an approximation: the prompt tokens the target read (of prompt_tokens)

    @property
    def tau(self) -> float:
        """Mean tokens per target forward, bonus included (EAGLE / Spec-Bench convention)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "accepted_per_step"}
        out.update(tau=self.tau, tokens_per_second=self.tokens_per_second, acceptance_rate=self.acceptance_rate)
        return out


def check_max_new_tokens(max_new_tokens: int) -> None:
    if max_new_tokens <= 0:
        raise SpecDecodeError(f"max-new-tokens must be > 0, got {max_new_tokens}.", "Pass a positive number.")


def check_prompt(target: CausalLM, prompt_len: int, max_new_tokens: int) -> None:
    check_max_new_tokens(max_new_tokens)
    if prompt_len == 0:
        raise SpecDecodeError("the prompt is empty.", "Pass a non-empty prompt.")
    if prompt_len >= target.max_context:
        raise SpecDecodeError(
            f"the prompt has {prompt_len} tokens but {target.name} takes at most {target.max_context}.",
            "Shorten the prompt.",
        )


def decode(
    target: CausalLM,
    drafter: Drafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    stats: Stats | None = None,
    verifier: Verifier | None = None,
    governor: Governor | None = None,
    prefix_cache: PrefixCache | None = None,
) -> Iterator[list[int]]:
    """Yield the new tokens of each step; `stats` (if given) is filled in as decoding goes."""
    steps = decode_steps(target, drafter, prompt_ids, max_new_tokens, params, stats, verifier, governor, prefix_cache)
    item = next(steps, None)
    while item is not None:
        if isinstance(item, ForwardRequest):
            item = steps.send(item.run(target))
        else:
            yield item
            item = next(steps, None)


CAPPED_NODES_PER_LEVEL = 2  # under a governor cap of c levels, at most 2c draft nodes
Step = list[int] | ForwardRequest  # what decode_steps yields: a step's new tokens, or a forward it needs


def decode_steps(
    target: CausalLM,
    drafter: Drafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    stats: Stats | None = None,
    verifier: Verifier | None = None,
    governor: Governor | None = None,
    prefix_cache: PrefixCache | None = None,
) -> Generator[Step, torch.Tensor | None, None]:
    """The decode loop: yields each step's new tokens, and before each verification a ForwardRequest, which the
    driver answers by sending its [N+1, V] target logits. With a governor, steps where speculation does not pay
    run plain: the drafter is not asked (its commit gets the empty draft, as for a draft trimmed to nothing).
    With a prefix cache, the prompt's longest stored prefix is restored instead of prefilled, and a generation that
    ends stores its prompt's KV. Not the answer's: decoding computed those entries in its own arithmetic, which a
    prefill of the same tokens (kernels.prompt_arithmetic) need not reproduce, and a reused entry must be what a
    full prefill gives, so that a request's answer does not depend on what the cache held."""
    check_prompt(target, len(prompt_ids), max_new_tokens)
    if not params.greedy and not drafter.supports_sampling:
        raise SpecDecodeError(f"drafter '{drafter.name}' supports greedy decoding only.", "Use --temperature 0.")
    stats = stats if stats is not None else Stats()
    verifier = verifier or verifier_for(params)
    generator = params.generator()
    max_new_tokens = min(max_new_tokens, target.max_context - len(prompt_ids))
    capacity = len(prompt_ids) + max_new_tokens + drafter.max_nodes + 1
    stats.prompt_tokens = len(prompt_ids)
    start = time.perf_counter()

    if governor is not None:
        governor.begin(len(prompt_ids), max_new_tokens, drafter.catches_up)
    cache = target.new_cache(capacity)
    hidden_layers = tuple(drafter.hidden_layers)
    if hidden_layers:  # the drafter reads every prompt token's hidden states, which only a full prefill computes
        prefix_cache = None
    stats.reused_prompt_tokens = _restore_prefix(prefix_cache, prompt_ids, cache)
    drafter.use_target_cache(cache)
    drafter.start(list(prompt_ids), capacity)
    prompt_hidden = HiddenStates(hidden_layers) if hidden_layers else None
    rest = prompt_ids[stats.reused_prompt_tokens :]
    first = sample(probs_from_logits(prefill(target, cache, rest, prompt_hidden), params), generator)
    if prompt_hidden is not None:
        drafter.receive_hidden(prompt_hidden.states)  # [K, prompt, H]
    context = list(prompt_ids) + [first]  # context[-1] is committed but not yet in the target's cache
    stats.target_forwards = 1
    stats.prefill_seconds = time.perf_counter() - start
    new = [first]
    while True:
        new = _finish(new, target.eos_token_ids, max_new_tokens - stats.new_tokens, stats)
        stats.new_tokens += len(new)
        if stats.finish_reason and prefix_cache is not None:
            prefix_cache.store(list(prompt_ids), cache)
        stats.seconds = time.perf_counter() - start
        yield new
        if stats.finish_reason:
            return
        remaining = max_new_tokens - stats.new_tokens

        t0 = time.perf_counter()
        cap = governor.plan() if governor is not None else None
        limit = remaining - 1 if cap is None else min(cap, remaining - 1)  # the draft depth this step keeps
        sizing = drafter.context_sizing.at(len(context)) if drafter.context_sizing is not None else {}
        limit = min(limit, sizing.get("depth", limit))
        if cap == 0:
            draft = Draft.empty()
            stats.plain_steps += 1
        else:
            drafter.depth_limit = limit
            draft = drafter.propose(context, params, generator)
            assert len(draft) <= drafter.max_nodes, f"drafter '{drafter.name}' sent {len(draft)} > max_nodes nodes"
        draft = draft.depth_limited(limit)  # may trim the draft: commit gets the trimmed one
        if "nodes" in sizing:  # verifying a wide tree after a long context costs more than it wins
            draft = draft.first(sizing["nodes"])
        if cap:  # the governor's cap bounds the rows as well: a capped step verifies a short, narrow draft
            draft = draft.first(CAPPED_NODES_PER_LEVEL * cap)
        t1 = time.perf_counter()
        request = tree_request(cache, context[-1], draft, hidden_layers)  # drops or keeps the drafter's entries
        target_logits = yield request  # [N+1, V], sent by the driver
        verdict = verifier.verify(draft, target_logits, params, generator)
        kept = [0] + [i + 1 for i in verdict.accepted]  # root + accepted path
        cache.keep(kept)
        t2 = time.perf_counter()
        if request.hidden is not None:
            drafter.receive_hidden(request.hidden.states[:, kept])  # [K, 1 + accepted, H]
        drafter.commit(verdict, draft, target_logits)
        t3 = time.perf_counter()

        if governor is not None:
            depth = int(depths(draft.parents).max()) if len(draft) else 0
            governor.record(t3 - t0, len(verdict.new_tokens), depth, cap)
        stats.draft_seconds += (t1 - t0) + (t3 - t2)
        stats.verify_seconds += t2 - t1
        stats.target_forwards += 1
        stats.drafted_tokens += len(draft)
        stats.accepted_tokens += len(verdict.accepted)
        stats.accepted_per_step.append(len(verdict.accepted))
        new = verdict.new_tokens
        context.extend(new)


def _restore_prefix(prefix_cache: PrefixCache | None, prompt_ids: list[int], cache: KVCache) -> int:
    """Restore the prompt's longest stored prefix (never its last token) into the empty cache; the count."""
    if prefix_cache is None:
        return 0
    n, entry = prefix_cache.lookup(prompt_ids, like=cache)
    if n:
        prefix_cache.restore(entry, n, cache)
    return n


def _finish(new: list[int], eos: frozenset[int], room: int, stats: Stats) -> list[int]:
    """Cut the step's tokens at the first end-of-sequence token or at the length limit; set finish_reason."""
    for i, token in enumerate(new[:room]):
        if token in eos:
            stats.finish_reason = "stop"
            return new[: i + 1]
    if len(new) >= room:
        stats.finish_reason = "length"
    return new[:room]


def generate(
    target, drafter, prompt_ids, max_new_tokens, params, verifier=None, governor: Governor | None = None,
    prefix_cache: PrefixCache | None = None,
) -> tuple[list[int], Stats]:
    stats = Stats()
    steps = decode(target, drafter, prompt_ids, max_new_tokens, params, stats, verifier, governor, prefix_cache)
    tokens = [t for step in steps for t in step]
    return tokens, stats
