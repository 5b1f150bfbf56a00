"""The long-input benchmark suite, built on the user's machine from CPython's standard-library sources.

Spec-Bench's prompts are short (a few hundred tokens), so they say little about how a method does when the prompt is
long: prefill dominates the time to the first token, attention grows with the context, and copy-heavy answers (an
edited class, a continued file) are where prompt-lookup drafters shine. This suite measures that. Its text is the
Python standard library's own `.py` files (PSF license) found under `sysconfig.get_paths()["stdlib"]`: nothing is
downloaded and no benchmark set is copied, and the same Python version yields the same questions (files are taken in
sorted order, every choice is fixed, the needle's passphrase comes from a hash).

Each question is fitted to a target length (2k, 8k, 16k or 32k tokens) measured with the target model's tokenizer
under its chat template, by cutting the concatenated sources at a statement boundary (a function start for code
completion). Groups: doc-qa, summarization, code-completion, code-editing, follow-up (two turns) and needle (a
passphrase hidden at a fixed depth; the record holds the expected answer as `reference`). Records have Spec-Bench's
JSONL shape (`question_id`, `category`, `turns`) plus `length` and `prompt_tokens`; built questions are cached under
~/.cache/specdecode/long_suite/ (or $SPECDECODE_CACHE/long_suite/).
"""

from __future__ import annotations

import ast
import hashlib
import json
import platform
import re
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from ..errors import SpecDecodeError

SUITE_VERSION = 1  # bump when the builder's choices change, so that cached questions are rebuilt
LENGTHS = {"2k": 2048, "8k": 8192, "16k": 16384, "32k": 32768}
DEFAULT_LENGTHS = ("2k", "8k")
GROUPS = ("doc-qa", "summarization", "code-completion", "code-editing", "follow-up", "needle")
GROUP_TITLES = {
    "doc-qa": "Document QA",
    "summarization": "Summarization (long)",
    "code-completion": "Code Completion",
    "code-editing": "Code Editing",
    "follow-up": "Follow-up Turn",
    "needle": "Needle Retrieval",
}
TOLERANCE = 0.15  # a question's prompt lands within 15% of its target length
EDIT_LINES = (30, 150)  # the size of the class or function code-editing asks to rewrite
NEEDLE_DEPTHS = (0.5, 0.25, 0.75, 0.1, 0.9)  # relative depth of the needle in the k-th question of a length
NEEDLE_WORDS = ("amber", "basalt", "cobalt", "juniper", "lantern", "meadow", "orchid", "quartz", "saffron", "willow")
# directories that are not the library's own prose-and-code: tests, data tables, third-party packages
SKIPPED_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data",
                 "encodings", "lib2to3", "turtledemo"}

Count = Callable[[list[dict]], int]  # chat messages -> prompt tokens under the target's chat template


@dataclass(frozen=True)
class Definition:
    """A class or function of the concatenated text: its dotted name and its line span (0-based, end exclusive)."""

    qualname: str
    kind: str  # "class", "function" or "method"
    start: int
    end: int
    body: int  # first line of the body: code completion cuts the text here, after the `def` line(s)


@dataclass
class Document:
    """Standard-library files concatenated (each under a header line), with where the text may be cut."""

    files: list[str]
    lines: list[str]
    cuts: list[int]  # line counts at which a prefix ends just before a statement (or at a file's end)
    definitions: list[Definition]

    def prefix(self, n: int) -> str:
        return "".join(self.lines[:n])


# ---- the source files ---------------------------------------------------------------------------------------


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@lru_cache(maxsize=4)
def stdlib_files(root: Path | None = None) -> tuple[str, ...]:
    """The standard library's own modules, relative POSIX paths in sorted order (the order fixes every choice)."""
    root = root or stdlib_root()
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                   if not SKIPPED_PARTS & set(p.relative_to(root).parts))
    if not files:
        raise SpecDecodeError(f"no Python sources under {root} to build the long suite from.",
                              "Use a Python installation that ships its standard library's .py files.")
    return tuple(files)


@lru_cache(maxsize=64)
def parsed(root: Path, name: str) -> tuple[str, ast.Module] | None:
    """A file's text and syntax tree; None for a file that is not UTF-8 or does not parse (skipped)."""
    try:
        text = (root / name).read_text(encoding="utf-8")
        return text, ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None


def _file_parts(tree: ast.Module, offset: int) -> tuple[list[int], list[Definition]]:
    """Statement starts and definitions of one file whose first line is line `offset` of the document."""
    cuts, definitions = [], []

    def visit(node, prefix: str, in_class: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):  # a decorated definition starts at its first decorator
                cuts.append(offset + min([child.lineno] + [d.lineno for d in getattr(child, "decorator_list", ())]) - 1)
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(child, ast.ClassDef) else "method" if in_class else "function"
                start = min([child.lineno] + [d.lineno for d in child.decorator_list]) - 1
                definitions.append(Definition(prefix + child.name, kind, offset + start, offset + child.end_lineno,
                                              offset + child.body[0].lineno - 1))
                visit(child, prefix + child.name + ".", isinstance(child, ast.ClassDef))
            elif isinstance(child, ast.stmt):
                visit(child, prefix, in_class)

    visit(tree, "", False)
    return cuts, definitions


def gather(root: Path, files: tuple[str, ...], start: int, enough: Callable[[str], bool]) -> Document:
    """Files from `start` on (wrapping round), each under a `# ---- Lib/NAME ----` header, until `enough(text)`."""
    document = Document([], [], [], [])
    for step in range(len(files)):
        name = files[(start + step) % len(files)]
        source = parsed(root, name)
        if source is None:
            continue
        text, tree = source
        if not text.endswith("\n"):
            text += "\n"
        document.lines.append(f"# ---- Lib/{name} ----\n")
        cuts, definitions = _file_parts(tree, len(document.lines))
        document.files.append(name)
        document.cuts += [len(document.lines) - 1] + cuts
        document.definitions += definitions
        document.lines += text.splitlines(keepends=True)
        document.cuts.append(len(document.lines))
        if enough("".join(document.lines)):
            break
    document.cuts = sorted(set(c for c in document.cuts if c > 0))
    return document


# ---- the questions --------------------------------------------------------------------------------------------


def _intro(files: list[str]) -> str:
    names = ", ".join(f"Lib/{f}" for f in files)
    what = "a file" if len(files) == 1 else f"{len(files)} files"
    return f"Below is Python source code from {what} of the CPython standard library ({names})."


def _document_turn(files: list[str], text: str, question: str) -> str:
    return f"{_intro(files)}\n\n```python\n{text}```\n\n{question}"


def _passphrase(label: str, k: int) -> str:
    digest = hashlib.sha256(f"long-suite:{label}:{k}".encode()).digest()
    return f"{NEEDLE_WORDS[digest[0] % len(NEEDLE_WORDS)]}-{1000 + int.from_bytes(digest[1:3], 'big') % 9000}"


def needle_sentence(reference: str) -> str:
    return f"The secret passphrase for the archive is {reference}."


def _with_needle(document: Document, n: int, depth: float, sentence: str) -> str:
    """The first n lines with the sentence (a comment line) inserted at the statement boundary nearest `depth`."""
    cuts = [c for c in document.cuts if c < n] or [0]
    at = min(cuts, key=lambda c: (abs(c - depth * n), c))
    return "".join(document.lines[:at]) + f"# {sentence}\n" + "".join(document.lines[at:n])


def _render(group: str, document: Document, n: int, subject: Definition | None, needle: tuple[float, str]) -> dict:
    """The turns (and extra fields) of a `group` question on the first n lines of the document."""
    files, text = document.files, document.prefix(n)
    name = subject.qualname if subject else "placeholder_name"
    kind = subject.kind if subject else "function"
    if group == "doc-qa":
        return {"turns": [_document_turn(files, text, f"What does the {kind} `{name}` in this code do and what "
                                                      "does it return?")]}
    if group == "summarization":
        what = "this module provides" if len(files) == 1 else "these modules provide"
        return {"turns": [_document_turn(files, text, f"Summarize what {what}.")]}
    if group == "code-completion":
        return {"turns": [f"Continue this code from where it stops; output only the continuation.\n\n"
                          f"{_intro(files)}\n\n```python\n{text}"]}
    if group == "code-editing":
        return {"turns": [_document_turn(files, text, f"Rewrite the {kind} `{name}` with type hints added to every "
                                                      f"function signature; output the whole rewritten `{name}`.")]}
    if group == "follow-up":
        return {"turns": [_document_turn(files, text, "What are the main classes and functions defined in this code?"),
                          f"Now show a short example of calling `{name}`."]}
    if group == "needle":
        depth, reference = needle
        text = _with_needle(document, n, depth, needle_sentence(reference))
        return {"turns": [_document_turn(files, text, "What is the secret passphrase for the archive mentioned in "
                                                      "this code? Answer with the passphrase only.")],
                "reference": reference, "needle_depth": depth}
    raise ValueError(group)


def _subject(group: str, document: Document, n: int) -> Definition | None:
    """The definition a question names: whole inside the first n lines, its name defined once there, the one
    nearest the middle of the text (a fixed choice); classes or functions of 30-150 lines for code-editing."""
    inside = [d for d in document.definitions if d.end <= n]
    counts: dict[str, int] = {}
    for d in inside:
        counts[d.qualname] = counts.get(d.qualname, 0) + 1
    if group == "code-editing":
        fits = [d for d in inside if EDIT_LINES[0] <= d.end - d.start <= EDIT_LINES[1]]
    else:
        fits = [d for d in inside if d.kind != "class" and not d.qualname.split(".")[-1].startswith("_")]
    fits = [d for d in fits if counts[d.qualname] == 1]
    return min(fits, key=lambda d: (abs(d.start - n / 2), d.start), default=None)


NAMED = {"doc-qa", "code-editing", "follow-up"}


def _fit(cuts: list[int], size: Callable[[int], int], target: int) -> int | None:
    """The largest cut whose prompt has at most `target` tokens (sizes grow with the cut: binary search)."""
    lo, hi, best = 0, len(cuts) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if size(cuts[mid]) <= target:
            best, lo = cuts[mid], mid + 1
        else:
            hi = mid - 1
    return best


def build_one(group: str, label: str, k: int, count: Count, root: Path, files: tuple[str, ...],
              start: int) -> dict | None:
    """The k-th `group` question of length `label` from the files from `start` on, or None where no cut of that
    text lands within the tolerance (or no definition fits): the caller then tries the next start."""
    target = LENGTHS[label]
    needle = (NEEDLE_DEPTHS[k % len(NEEDLE_DEPTHS)], _passphrase(label, k))

    def tokens(turns: list[str]) -> int:
        return count([{"role": "user", "content": turns[0]}])

    def enough(text: str) -> bool:
        return len(text) >= target and tokens([text]) >= target * (1 + TOLERANCE)

    document = gather(root, files, start, enough)
    if group == "code-completion":
        cuts = sorted({d.body for d in document.definitions if d.kind != "class" and d.body > d.start})
    else:
        cuts = document.cuts
    n = _fit(cuts, lambda c: tokens(_render(group, document, c, None, needle)["turns"]), target)
    if n is None:
        return None
    subject = _subject(group, document, n) if group in NAMED else None
    if group in NAMED and subject is None:
        return None
    record = _render(group, document, n, subject, needle)
    measured = tokens(record["turns"])
    if abs(measured - target) > TOLERANCE * target:
        return None
    extra = {"subject": subject.qualname, "subject_kind": subject.kind} if subject else {}
    return {"question_id": question_id(label, group, k), "category": group, "turns": record["turns"],
            "length": label, "prompt_tokens": measured, **extra,
            **{key: record[key] for key in ("reference", "needle_depth") if key in record},
            "files": [f"Lib/{f}" for f in document.files]}


def question_id(label: str, group: str, k: int) -> int:
    """Fixed ids (known before any tokenizer is loaded, so a run's folder is checked before the model loads)."""
    return 100_000 + list(LENGTHS).index(label) * 1000 + GROUPS.index(group) * 100 + k


def question_ids(labels: list[str], per_group: int, groups: list[str] | tuple[str, ...] = GROUPS) -> list[int]:
    return [question_id(label, group, k) for label in labels for group in GROUPS if group in groups
            for k in range(per_group)]


def build(count: Count, labels: list[str], per_group: int = 1, root: Path | None = None,
          progress: bool = True) -> list[dict]:
    """Every group's `per_group` questions at each length, in the order of question_ids(labels, per_group).
    Questions start at files spread evenly over the sorted list (so groups read different modules; a question's
    start does not depend on which other lengths are built); where a start gives no fit, the next file is tried."""
    root = root or stdlib_root()
    files = stdlib_files(root)
    slots = [(label, group, k) for label in labels for group in GROUPS for k in range(per_group)]
    records = []
    for label, group, k in tqdm(slots, desc="building long suite", unit="question", disable=not progress or None):
        start = _start(label, group, k, per_group, len(files))
        for attempt in range(len(files)):
            record = build_one(group, label, k, count, root, files, start + attempt)
            if record is not None:
                records.append(record)
                break
        else:
            raise SpecDecodeError(f"cannot build a {label} {group} question from {root}.",
                                  "Choose shorter --long-lengths.")
    return records


def _start(label: str, group: str, k: int, per_group: int, n_files: int) -> int:
    """The first file of a question: its place among every (length, group, k) slot, spread over the files."""
    index = (list(LENGTHS).index(label) * len(GROUPS) + GROUPS.index(group)) * per_group + k
    return index * n_files // (len(LENGTHS) * len(GROUPS) * per_group)


# ---- lengths, tokenizers, the cache ------------------------------------------------------------------------------


def parse_lengths(text: str | None) -> list[str]:
    """`2k,8k` -> ["2k", "8k"] (in the order of LENGTHS); an unknown label is a one-line error."""
    labels = [t.strip().lower() for t in (text or ",".join(DEFAULT_LENGTHS)).split(",") if t.strip()]
    unknown = [t for t in labels if t not in LENGTHS]
    if unknown or not labels:
        raise SpecDecodeError(f"unknown --long-lengths value {', '.join(map(repr, unknown)) or repr(text)}.",
                              f"Choose from: {', '.join(LENGTHS)} (comma-separated).")
    return [label for label in LENGTHS if label in labels]


def token_counter(tokenizer) -> Count:
    """Prompt tokens of chat messages as the bench will feed them (chat template, or plain text for a base model)."""
    from ..text import prompt_ids

    return lambda messages: len(prompt_ids(tokenizer, messages))


def cache_path(tokenizer_name: str, labels: list[str], per_group: int) -> Path:
    from ..files import cache_root

    safe = re.sub(r"[^A-Za-z0-9._-]+", "--", tokenizer_name).strip("-") or "tokenizer"
    key = f"{safe}_py{platform.python_version()}_{'-'.join(labels)}_x{per_group}_v{SUITE_VERSION}.json"
    return cache_root() / "long_suite" / key


def load_or_build(tokenizer, tokenizer_name: str, labels: list[str], per_group: int = 1) -> list[dict]:
    """The questions from the cache, or built with the tokenizer (and cached) on first use."""
    path = cache_path(tokenizer_name, labels, per_group)
    if path.is_file():
        try:
            return json.loads(path.read_text())["questions"]
        except (ValueError, KeyError):
            pass  # a file cut short: build again
    records = build(token_counter(tokenizer), labels, per_group)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"tokenizer": tokenizer_name, "python": platform.python_version(), "lengths": labels,
            "per_group": per_group, "suite_version": SUITE_VERSION, "stdlib": str(stdlib_root())}
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"meta": meta, "questions": records}))
    partial.replace(path)
    return records


def write_jsonl(records: list[dict], path: Path) -> None:
    """The questions as Spec-Bench-format JSONL (for `specdecode bench --questions FILE`)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def questions_for(target, labels: list[str], per_group: int, groups: list[str], max_new_tokens: int) -> list:
    """The run's questions for a loaded target (built with its tokenizer, or from the cache), refused with the
    lengths that fit where a prompt and its answer would not fit the model's context."""
    from .questions import question_from_record

    records = [r for r in load_or_build(target.tokenizer, str(target.name), labels, per_group)
               if r["category"] in groups]
    context = getattr(target, "max_context", None)
    too_long = sorted({r["length"] for r in records if context and r["prompt_tokens"] + max_new_tokens >= context},
                      key=list(LENGTHS).index)
    if too_long:
        fits = [label for label in labels if label not in too_long]
        raise SpecDecodeError(
            f"{target.name} takes at most {context} tokens: the {', '.join(too_long)} questions with "
            f"{max_new_tokens} new tokens do not fit.",
            f"Choose --long-lengths {','.join(fits)}." if fits else "Choose a model with a longer context.")
    return [question_from_record(r) for r in records]


def check_groups(groups: list[str]) -> None:
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise SpecDecodeError(f"no long-suite group {', '.join(map(repr, unknown))}.",
                              f"Choose from: {', '.join(GROUPS)}.")
