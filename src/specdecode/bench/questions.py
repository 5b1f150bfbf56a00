"""The Spec-Bench questions (shipped with the package) and their six groups, with a deterministic subset."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from ..errors import SpecDecodeError

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
GROUP_TITLES = {
    "mt_bench": "Multi-turn Conversation",
    "translation": "Translation",
    "summarization": "Summarization",
    "qa": "Question Answering",
    "math_reasoning": "Mathematical Reasoning",
    "rag": "Retrieval-aug. Generation",
}


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    turns: tuple[str, ...]
    group: str = ""  # the Spec-Bench group, or the MT-bench category it was selected by
    length: str = ""  # the long suite's target length label ("2k", "8k", ...); empty for Spec-Bench
    reference: str = ""  # an answer the output must contain (the long suite's needle passphrase); empty if none

    def __post_init__(self):
        if not self.group:
            object.__setattr__(self, "group", "mt_bench" if self.category in MT_BENCH_CATEGORIES else self.category)


def load_questions(path: str | Path | None = None) -> list[Question]:
    try:
        if path is None:
            text = resources.files("specdecode.data").joinpath("spec_bench_question.jsonl").read_text()
        else:
            text = Path(path).read_text()
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [question_from_record(r) for r in rows]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SpecDecodeError(
            f"cannot read questions from {path}: {type(exc).__name__}: {exc}",
            "Pass a JSONL file with question_id, category and turns on each line (the Spec-Bench format).",
        ) from None


def question_from_record(r: dict) -> Question:
    """A Spec-Bench-format record (the long suite's `length` and `reference` kept where present)."""
    return Question(int(r["question_id"]), r["category"], tuple(r["turns"]), length=str(r.get("length", "")),
                    reference=str(r.get("reference", "")))


def select(questions: list[Question], groups: list[str], per_group: int) -> list[Question]:
    """`per_group` questions of each group (or MT-bench category), evenly spaced over the group in file order
    (so an MT-bench subset covers its categories); all of them when per_group is 0."""
    chosen = []
    for group in groups:
        members = [q for q in questions if group in (q.group, q.category)]
        if not members:
            known = sorted({q.group for q in questions} | {q.category for q in questions})
            raise SpecDecodeError(f"no questions in group '{group}'.", f"Choose from: {', '.join(known)}.")
        if 0 < per_group < len(members):
            members = [members[(i * len(members)) // per_group] for i in range(per_group)]
        chosen.extend(replace(q, group=group) for q in members)
    return chosen
