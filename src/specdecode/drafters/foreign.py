"""What the drafters for a draft model of another tokenizer share (Timor et al., 2025, arXiv 2502.05202:
slem.py, tli.py, slrs.py): the draft model's own view of the committed text, and the map between the two
vocabularies.

The draft model keeps its own token ids, KV cache and positions. Before each proposal the committed text (the
target's tokens, special tokens included) is decoded and re-tokenized by the draft tokenizer; the draft cache keeps
the longest common prefix of the old and new draft ids and runs the rest. Committed tokens are only ever the target's
own (the verifier emits them), so nothing the draft tokenizer does can change them: a draft only decides how much
gets accepted.

Tokens of the two vocabularies are the same when their bytes are (byte-level pieces such as `Ġthe` and
SentencePiece pieces such as `▁the` both become b" the"; `<0x0A>` byte-fallback pieces become their byte); special
tokens match by their text (`<|im_end|>` in both).
"""

from __future__ import annotations

import bisect
import json
from functools import lru_cache

import torch

from ..errors import SpecDecodeError, OptionError
from ..models.base import CATCH_UP_PROMPT_ROWS, CausalLM, prefill
from .base import Drafter
from .draft_length import draft_length

Key = bytes | str  # a token's bytes, or "special:<text>" for a special token


@lru_cache(maxsize=8)
def token_keys(tokenizer, vocab_size: int) -> tuple[Key | None, ...]:
    """[vocab_size] the key of every token id (None: an id the tokenizer does not use)."""
    keys: list[Key | None] = [None] * vocab_size
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
    added = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    to_bytes = _piece_decoder(tokenizer)
    for piece, index in tokenizer.get_vocab().items():
        if index >= vocab_size:
            continue
        if index in special or (index in added and getattr(tokenizer.added_tokens_decoder[index], "special", False)):
            keys[index] = "special:" + added.get(index, piece)
        elif index in added:
            keys[index] = added[index].encode()
        else:
            keys[index] = to_bytes(piece)
    return tuple(keys)


def _piece_decoder(tokenizer):
    """piece -> bytes: GPT-2's byte alphabet for byte-level BPE (Qwen, SmolLM2, Llama 3), else SentencePiece's
    conventions (Gemma: `▁` is a space, `<0xNN>` a byte)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    if "ByteLevel" in json.dumps(decoder):
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        return lambda piece: bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else piece.encode()

    def sentencepiece(piece: str) -> bytes:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    return sentencepiece


class VocabularyBridge:
    """The draft vocabulary seen from the target's: which draft tokens are target tokens, and which target strings
    a draft token's bytes begin."""

    def __init__(self, target: CausalLM, draft: CausalLM):
        target_keys = token_keys(target.tokenizer, target.vocab_size)
        draft_keys = token_keys(draft.tokenizer, draft.vocab_size)
        self.target_id: dict[Key, int] = {}
        for index, key in enumerate(target_keys):
            if key is not None:
                self.target_id.setdefault(key, index)  # duplicates (rare): the lowest id stands for the string
        self.target_size = target.vocab_size
        self.draft_bytes = [key if isinstance(key, bytes) else None for key in draft_keys]
        # [Vd] the target id of each draft token, -1 when the target has no token with its bytes
        self.draft_to_target = torch.tensor([self.target_id.get(key, -1) if key is not None else -1 for key in draft_keys])
        self.shared = self.draft_to_target >= 0  # [Vd] bool
        self.target_strings = sorted(key for key in self.target_id if isinstance(key, bytes) and key)
        self.draft_ids_of: dict[bytes, list[int]] = {}
        for index, key in enumerate(self.draft_bytes):
            if key:
                self.draft_ids_of.setdefault(key, []).append(index)
        # [Vd] bool: the draft token's bytes begin a longer target string without being a target token themselves
        self.extendable = torch.tensor(
            [bool(key) and key not in self.target_id and self.begins_target_string(key) for key in self.draft_bytes]
        )
        if not bool(self.shared.any()):
            raise SpecDecodeError(
                f"the draft model {draft.name} shares no token with the target {target.name}.",
                "Use a draft model whose tokenizer covers the same text (any tokenizer of the same script will do).",
            )

    def begins_target_string(self, prefix: bytes) -> bool:
        """Is `prefix` a proper prefix of some target token's bytes?"""
        i = bisect.bisect_right(self.target_strings, prefix)
        return i < len(self.target_strings) and self.target_strings[i].startswith(prefix)

    def target_strings_after(self, prefix: bytes) -> list[bytes]:
        """Every target token's bytes that start with `prefix` and are longer."""
        i = bisect.bisect_right(self.target_strings, prefix)
        out = []
        while i < len(self.target_strings) and self.target_strings[i].startswith(prefix):
            out.append(self.target_strings[i])
            i += 1
        return out

    def to_target(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """[Vd] draft distribution -> [Vt] the mass of the draft tokens that are target tokens, in target ids (not
        renormalized)."""
        shared = self.shared[: draft_probs.shape[0]]
        out = torch.zeros(self.target_size)
        return out.index_add_(0, self.draft_to_target[: draft_probs.shape[0]][shared], draft_probs[shared].float())


@lru_cache(maxsize=8)
def bridge(target: CausalLM, draft: CausalLM) -> VocabularyBridge:
    # Cached per model pair: the server builds a drafter per request, and mapping two 150k vocabularies takes seconds.
    return VocabularyBridge(target, draft)


class DraftView:
    """The draft model over the committed text in its own tokens: its ids, its KV cache, and the draft tree grown
    below them (uncommitted entries, dropped after each proposal)."""

    def __init__(self, model: CausalLM, target_tokenizer):
        self.model, self.target_tokenizer = model, target_tokenizer
        self.ids: list[int] = []  # the draft tokenizer's ids of the committed text, as in the cache
        self.cache = None
        self.nodes: list[tuple[list[int], int]] = []  # draft-tree node -> (its ancestors' slots and its own, depth)

    def start(self, capacity: int) -> None:
        self.cache = self.model.new_cache(capacity)
        self.ids = []

    def sync(self, context: list[int], room: int) -> torch.Tensor | None:
        """Catch up with the committed target tokens `context`; return the draft's [Vd] next-token logits, or None
        when the draft model cannot hold the text plus `room` draft tokens."""
        text = self.target_tokenizer.decode(context, skip_special_tokens=False)
        ids = list(self.model.tokenizer.encode(text))
        if not ids or len(ids) + room >= self.model.max_context:
            return None
        if len(ids) + room > self.cache.capacity:  # a tokenizer finer than the target's: a bigger cache
            self.start(2 * (len(ids) + room))
        common = next((i for i, (a, b) in enumerate(zip(self.ids, ids)) if a != b), min(len(self.ids), len(ids)))
        self.cache.truncate(min(common, len(ids) - 1))  # the last id runs again: its logits are the root's
        self.ids = ids
        self.nodes = []
        rest = ids[self.cache.length :]
        return prefill(self.model, self.cache, rest, prompt=len(rest) >= CATCH_UP_PROMPT_ROWS)

    def grow(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Run draft tokens below tree nodes (-1: the committed text) in one forward; return their [F, Vd] logits.
        Node i of this call becomes tree node len(nodes) + i."""
        pending, f = self.cache.pending, len(tokens)
        mask = torch.zeros(f, pending + f, dtype=torch.bool)  # [F, pending+F]
        depth = []
        for row, parent in enumerate(parents):
            seen, parent_depth = self.nodes[parent] if parent >= 0 else ([], 0)
            mask[row, seen] = True
            mask[row, pending + row] = True
            self.nodes.append((seen + [pending + row], parent_depth + 1))
            depth.append(parent_depth + 1)
        positions = len(self.ids) + torch.tensor(depth) - 1  # [F]
        return self.model.forward(self.cache, torch.tensor(tokens), positions, mask)

    def drop_tree(self) -> None:
        self.cache.discard()
        self.nodes = []


class ForeignDrafter(Drafter):
    """A draft model with its own tokenizer drafts a chain of target tokens (not registered; see slem, tli, slrs).

    Options: `depth` (most target tokens per draft), `length` and `threshold` (the draft-length policy of
    draft_length.py; the confidence is the draft's probability of the chain so far)."""

    catches_up = True  # the draft model prefills the tokens decoded plainly
    needs_draft_model = True
    foreign_vocabulary = True
    sizes = {"depth": "depth"}

    def __init__(self, target: CausalLM, draft_model: CausalLM, depth: int = 6, length: str = "fixed",
                 threshold: float = 0.4):
        if depth < 1:
            raise OptionError("need depth >= 1")
        self.target, self.depth = target, depth
        self.max_nodes = depth
        self.length = draft_length(length, depth, threshold)
        self.view = DraftView(draft_model, target.tokenizer)

    def start(self, prompt_ids, capacity):
        self.view.start(2 * capacity + 4 * self.depth)

    def commit(self, verdict, draft, target_logits) -> None:
        drafted = len(draft)
        self.length.update(len(verdict.accepted), drafted)
