"""Approximate inference, lossy by design and only where a caller asks for it: SpecPC prompt compression.

SpecPC (Draft-based Approximate Inference for LLMs, ICLR 2026, arXiv 2506.08373): a small model of the target's
family reads the whole prompt, and its attention from the prompt's last tokens (the question, usually) and from one
token it generates ranks the prompt's tokens; the target then prefills only the best-ranked spans, the start and
the end, at renumbered positions. On a CPU a long prompt's prefill is most of a request's time and grows with the
square of its length, so the target reading a fifth of it answers several times sooner; the draft's own prefill
is the price. The answer is the target's answer to the shorter prompt, not to the prompt sent: it is marked
approximate wherever it is reported, and its quality is measured against full attention (`bench --suite long`).

Ranking, as the paper does it: per scored layer (those from `start_layer` up), each prompt token's score is its
largest attention weight over the query heads and the observation rows, the rows weighted from 0 to 1 towards the
end; a token's score is its largest over those layers; a max pool of `kernel` tokens spreads a token's score to its
neighbours. Here the kept tokens are whole blocks of `block` tokens (the blocks with the highest pooled score, until
`keep` tokens), so that the target reads sentences and statements whole; the first `sinks` tokens (the chat
template's opening) and the last `window` (the question) are always kept.

The draft's read of a long prompt would cost it most of what the target saves (its attention grows with the
square of the length), so by default it reads with a sliding window: each prompt token attends to the first
`sinks` tokens and the `read_window` before it, which makes its states an approximation but its read linear in the
length; the observation rows, whose attention is the ranking, still attend to every token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from .drafters.base import parse_options
from .errors import OptionError
from .models.base import CausalLM, HiddenStates, needs_native_backend, prefill


@dataclass
class CompressedPrompt:
    token_ids: list[int]  # the kept tokens in their order: what the target prefills
    kept: torch.Tensor  # [k] their indices in the original prompt, ascending
    prompt_tokens: int  # the original prompt's length
    seconds: float  # the draft's prefill and the ranking

    @classmethod
    def whole(cls, prompt_ids: list[int], seconds: float = 0.0) -> "CompressedPrompt":
        """The prompt left as it is (too short to compress, or no approximation asked)."""
        return cls(list(prompt_ids), torch.arange(len(prompt_ids)), len(prompt_ids), seconds)


@dataclass
class SpecPC:
    draft: CausalLM  # shares the target's tokenizer
    keep: float = 0.25  # tokens the target reads: a share of the prompt (< 1) or a count (>= 1)
    window: int = 64  # the prompt's last tokens: observation rows, always kept
    sinks: int = 16  # the prompt's first tokens, always kept
    block: int = 32  # kept spans are whole blocks of this many tokens
    kernel: int = 32  # max pool over the scores (tokens)
    start_layer: int = 8  # layers scored: from this one up (clamped to the draft's depth)
    lookahead: bool = True  # the draft's first generated token scores too (weight 1)
    min_prompt: int = 1024  # shorter prompts are not compressed
    read_window: int = 1024  # the draft reads the prompt with sliding-window attention this wide (0: full)

    def __post_init__(self):
        if (self.keep <= 0 or self.window < 1 or self.block < 1 or self.kernel < 1 or self.sinks < 0
                or self.read_window < 0):
            raise OptionError(
                f"SpecPC options keep={self.keep}, window={self.window}, block={self.block}, kernel={self.kernel}, "
                f"sinks={self.sinks}, read_window={self.read_window} are out of range.",
                "Use keep > 0 (a share below 1, or a token count), window, block and kernel >= 1, sinks >= 0, "
                "read_window >= 0 (0: full attention).",
            )
        if type(self.draft).attention_probs is CausalLM.attention_probs:
            raise needs_native_backend(self.draft)

    def mark(self, stats, compressed: CompressedPrompt) -> None:
        """Record in a generation's Stats (engine.Stats, of the compressed prompt) that it answered this compression:
        the prompt as sent, the tokens read, and the compression's time in the time to the first token. A prompt
        left whole is not marked: its answer is the lossless one."""
        if len(compressed.token_ids) == compressed.prompt_tokens:
            return
        stats.approximate, stats.prompt_tokens_read = "specpc", len(compressed.token_ids)
        stats.prompt_tokens = compressed.prompt_tokens
        stats.prefill_seconds += compressed.seconds
        stats.seconds += compressed.seconds

    def budget(self, prompt_tokens: int) -> int:
        """Tokens kept of a prompt this long."""
        return math.ceil(self.keep * prompt_tokens) if self.keep < 1 else int(self.keep)

    def compress(self, prompt_ids: list[int]) -> CompressedPrompt:
        start = time.perf_counter()
        n = len(prompt_ids)
        if n < self.min_prompt or self.budget(n) >= n - self.window - self.sinks:
            return CompressedPrompt.whole(prompt_ids, time.perf_counter() - start)
        scores = self.scores(prompt_ids)
        kept = select_blocks(scores, self.budget(n), self.window, self.sinks, self.block, self.kernel)
        ids = torch.as_tensor(prompt_ids)[kept].tolist()
        return CompressedPrompt(ids, kept, n, time.perf_counter() - start)

    @torch.inference_mode()
    def scores(self, prompt_ids: list[int]) -> torch.Tensor:
        """[n] each prompt token's rank score: its largest weighted attention from the observation rows."""
        n, window = len(prompt_ids), min(self.window, len(prompt_ids))
        layers = tuple(range(min(self.start_layer, self.draft.n_layers - 1), self.draft.n_layers))
        cache = self.draft.new_cache(n + 1)
        if n > window:
            cache.sliding = (self.sinks, self.read_window) if self.read_window else None
            try:
                prefill(self.draft, cache, prompt_ids[: n - window])
            finally:
                cache.sliding = None  # the observation rows attend to every key
        rows = torch.tensor(prompt_ids[n - window :])  # [w]
        positions = torch.arange(n - window, n)  # [w]
        weights = torch.linspace(0, 1, window + 1)[1:]  # [w]: later observation rows count more
        logits, states = self._forward(cache, rows, positions, layers)
        scores = self._layer_max(cache, layers, states, positions, weights)[:n]
        if self.lookahead:
            guess = torch.tensor([int(logits[-1].argmax())])
            _, states = self._forward(cache, guess, torch.tensor([n]), layers)
            scores = torch.maximum(scores, self._layer_max(cache, layers, states, torch.tensor([n]), torch.ones(1))[:n])
        return scores

    def _forward(self, cache, rows: torch.Tensor, positions: torch.Tensor, layers: tuple[int, ...]):
        """Rows [q] at positions [q] into the cache (committed): ([1, V] logits, [L, q, H] their layer inputs)."""
        asked = HiddenStates(layers)
        causal = torch.ones(len(rows), len(rows), dtype=torch.bool).tril()
        logits = self.draft.forward(cache, rows, positions, causal, last_only=True, hidden=asked)
        cache.commit_all()
        return logits, asked.states

    def _layer_max(self, cache, layers, states, positions, weights) -> torch.Tensor:
        """[cache.end] the largest weighted attention weight over the layers, heads and rows."""
        best = torch.zeros(cache.end)
        for index, layer in enumerate(layers):
            probs = self.draft.attention_probs(cache, layer, states[index], positions)  # [Hq, q, K]
            best = torch.maximum(best, (probs * weights[None, :, None]).amax(dim=(0, 1)))
        return best


def load_approximation(spec: str, load) -> SpecPC:
    """'specpc:DRAFT_MODEL[+keep=0.25][+read_window=1024]...' -> SpecPC with those options (its fields); load(name)
    returns the draft model, called once the options are checked."""
    name, options = parse_approximation(spec)
    return SpecPC(load(name), **options)


def parse_approximation(spec: str) -> tuple[str, dict]:
    """The draft model's name and SpecPC's options of an approximation spec, checked before any model loads."""
    method, _, rest = spec.partition(":")
    name, *pairs = rest.split("+")
    if method != "specpc" or not name:
        raise OptionError(f"unknown approximation '{spec}'.",
                          "Write specpc:DRAFT_MODEL[+keep=0.25], e.g. specpc:qwen2.5-coder-0.5b-instruct+keep=0.2.")
    options = parse_options(pairs)
    known = {f.name for f in fields(SpecPC)} - {"draft"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise OptionError(f"'{spec}': SpecPC has no option {', '.join(unknown)}.",
                          f"Use {', '.join(sorted(known))}.")
    return name, options


def select_blocks(scores: torch.Tensor, budget: int, window: int, sinks: int, block: int, kernel: int) -> torch.Tensor:
    """Indices [k] (ascending) of the tokens kept: the first `sinks`, the last `window`, and between them the
    `block`-token blocks of the highest max-pooled score until about `budget` tokens in all (whole blocks: the
    last one chosen may pass the budget by less than a block)."""
    n = scores.shape[0]
    pooled = F.max_pool1d(scores[None, None], kernel, stride=1, padding=kernel // 2)[0, 0, :n]  # [n]
    middle_start, middle_end = min(sinks, n), max(n - window, sinks)
    keep = torch.zeros(n, dtype=torch.bool)
    keep[:middle_start] = True
    keep[middle_end:] = True
    starts = torch.arange(middle_start, middle_end, block)  # [blocks]
    if len(starts):
        block_scores = torch.stack([pooled[s : min(s + block, middle_end)].max() for s in starts.tolist()])
        left = budget - int(keep.sum())
        for s in starts[block_scores.argsort(descending=True, stable=True)].tolist():
            if left <= 0:
                break
            end = min(s + block, middle_end)
            keep[s:end] = True
            left -= end - s
    return keep.nonzero()[:, 0]
