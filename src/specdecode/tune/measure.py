"""The measurements behind a profile: the target's verify cost per number of scored tokens, and each drafter's
acceptance and drafting cost on the shipped tuning prompts (data/tune_prompts.jsonl, written for this; never
Spec-Bench), all through the CausalLM interface, so any backend can be tuned."""

from __future__ import annotations

import itertools
import json
import time
from importlib import resources

import torch
from tqdm import tqdm

from ..drafters import DRAFTERS, build_drafter
from ..engine import generate
from ..models.base import CausalLM, prefill
from ..sampling import SamplingParams
from ..text import prompt_ids
from .cost import Measured, choose, speedup, tokens_per_second


def tune_prompts(tokenizer, limit: int = 0) -> list[list[int]]:
    """Token ids of the tuning prompts (under the chat template when the tokenizer has one). A limit takes them
    from every kind (code, chat, summarize, ...) in turn, so a few prompts still cover the kinds."""
    lines = resources.files("specdecode.data").joinpath("tune_prompts.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    by_kind: dict[str, list[str]] = {}
    for record in records:
        by_kind.setdefault(record["kind"], []).append(record["prompt"])
    rounds = itertools.zip_longest(*by_kind.values())
    texts = [text for texts in rounds for text in texts if text is not None][: limit or None]
    return [prompt_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]


def candidates_for(name: str, found: list[dict] = ()) -> list[dict]:
    """The defaults first, then the drafter's tune grid, then the option sets its search found."""
    grid = [{}]
    for options in list(DRAFTERS[name].tune_grid) + list(found):
        if options not in grid:
            grid.append(dict(options))
    return grid


def search_candidates(target, name: str, draft_model, prompts, max_new_tokens: int, curve, trials: int) -> list[dict]:
    """What drafter `name`'s own search (Drafter.search) finds in `trials` evaluations, each scored as the tuning
    scores a candidate: estimated tokens per second on these prompts."""
    if trials <= 0:
        return []
    bars = []  # one progress bar, opened by the first evaluation (most drafters search nothing)

    def score(options: dict) -> float:
        bars or bars.append(tqdm(desc=f"{name} search", unit="generation"))
        measured = measure_drafter(target, name, options, draft_model, prompts, max_new_tokens, bars[0])
        bars[0].set_postfix_str(f"{options}: {tokens_per_second(measured, curve):.1f} tokens/s")
        return tokens_per_second(measured, curve)

    try:
        return DRAFTERS[name].search(target, score, trials)
    finally:
        for bar in bars:
            bar.close()


PREFILLED = 512  # tokens of a measuring context that are prefilled; a longer one repeats their entries


def verify_curve(
    target: CausalLM, context: list[int], max_tokens: int, repeats: int, bar, sizes: list[int] | None = None
) -> dict[int, float]:
    """Seconds of one target forward over q new tokens after `context`, for q in `sizes` (default 1..max_tokens).
    Each size keeps its fastest of `repeats` forwards, the sizes taken in turn so that a burst of other work on the
    machine spreads over them; then a size never counts as slower than any larger one (more tokens cannot cost
    less). A context longer than PREFILLED tokens is prefilled that far and filled up with copies of those entries
    (KVCache.repeat_to): the forwards read as many keys, and the curve after 16k tokens costs seconds instead of a
    16k-token prefill."""
    sizes = sorted(sizes or range(1, max_tokens + 1))
    max_tokens = sizes[-1]
    cache = target.new_cache(len(context) + max_tokens)
    prefill(target, cache, context[:PREFILLED])
    cache.repeat_to(len(context))
    ids = torch.tensor((context * (max_tokens // len(context) + 1))[:max_tokens])  # [max_tokens]
    positions = torch.arange(len(context), len(context) + max_tokens)
    causal = torch.ones(max_tokens, max_tokens, dtype=torch.bool).tril()
    fastest = {q: float("inf") for q in sizes}
    for _ in range(repeats):
        for q in fastest:
            start = time.perf_counter()
            target.forward(cache, ids[:q], positions[:q], causal[:q, :q])
            fastest[q] = min(fastest[q], time.perf_counter() - start)
            cache.discard()
            bar.update()
    for smaller, larger in zip(sizes[-2::-1], sizes[:0:-1]):
        fastest[smaller] = min(fastest[smaller], fastest[larger])
    return fastest


def measure_drafter(target, name: str, options: dict, draft_model, prompts, max_new_tokens: int, bar) -> Measured:
    drafter = build_drafter(name, target, draft_model, **options)
    steps = accepted = drafted = 0
    draft_seconds = 0.0
    for prompt in prompts:
        _, stats = generate(target, drafter, prompt, max_new_tokens, SamplingParams())
        steps += len(stats.accepted_per_step)
        accepted += stats.accepted_tokens
        drafted += stats.drafted_tokens
        draft_seconds += stats.draft_seconds
        bar.update()
    steps = max(steps, 1)
    return Measured(options, (accepted + steps) / steps, drafted / steps, draft_seconds / steps)


def run_tune(
    target: CausalLM,
    drafters: list[str],
    prompts: list[list[int]],
    draft_model: CausalLM | None = None,
    max_new_tokens: int = 48,
    max_tokens: int = 64,
    repeats: int = 3,
    search_trials: int = 40,
    search_prompts: int = 6,
) -> dict:
    """Measure everything and return the profile: the verify curve, every candidate (the defaults, the tune grid
    and what a drafter's search finds in `search_trials` evaluations on the first `search_prompts` prompts, at
    most 32 new tokens each, as Draft & Verify searches), each drafter's choice."""
    with tqdm(total=max_tokens * repeats, desc="verify cost", unit="forward") as bar:
        curve = verify_curve(target, prompts[0], max_tokens, repeats, bar)
    found = {
        name: search_candidates(target, name, draft_model, prompts[:search_prompts], min(32, max_new_tokens), curve,
                                search_trials)
        for name in drafters
    }
    jobs = [(name, options) for name in drafters for options in candidates_for(name, found[name])]
    measured: dict[str, list[Measured]] = {name: [] for name in drafters}
    with tqdm(total=len(jobs) * len(prompts), desc="acceptance", unit="generation") as bar:
        for name, options in jobs:
            bar.set_postfix_str(f"{name} {options or 'defaults'}")
            measured[name].append(measure_drafter(target, name, options, draft_model, prompts, max_new_tokens, bar))
    chosen = {}
    for name, results in measured.items():
        best = choose(results, curve)
        chosen[name] = {
            "options": best.options,
            "draft_model": draft_model.name if DRAFTERS[name].needs_draft_model else None,
            "estimated_speedup": speedup(best, curve),
            "candidates": [dict(r.as_dict(), estimated_speedup=speedup(r, curve)) for r in results],
        }
    return {
        "target": target.name, "dtype": str(target.dtype).removeprefix("torch."), "model_class": type(target).__name__,
        "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "verify_seconds": curve, "drafters": chosen,
    }
