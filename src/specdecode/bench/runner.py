"""specdecode bench: every method on the same prompts, in one process, interleaved question by question so that
machine drift hits all methods alike; one JSON line per generation, so a killed run resumes where it stopped."""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import MISSING, asdict, dataclass, field, fields
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from ..cache.prefix import PrefixCache
from ..errors import SpecDecodeError
from ..models.loading import check_load_options, load_model, parse_weights
from ..sampling import SamplingParams
from ..text import prompt_ids
from .method import Method
from .methods import build_method
from .metrics import BASELINE
from .questions import Question

WARMUP_PROMPT = "Say hello."


@dataclass
class BenchConfig:
    model: str
    methods: list[str]
    question_ids: list[int]
    groups: list[str]
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    verification: str = "block"  # sampled chains (sampling.VERIFICATIONS); a method's +verify=... overrides it
    dtype: str = "bfloat16"
    backend: str = "auto"
    quant: str = "auto"
    draft_quant: str | None = None  # draft models' weights (default: quant)
    kv_cache: str = "auto"  # the KV cache's format (cache/kv.py KV_CACHES)
    repeats: int = 1
    suite: str = "spec-bench"  # or "long" (long_suite.py)
    long_lengths: list[str] = field(default_factory=list)  # the long suite's target lengths
    command: str = field(default="", compare=False)

    def comparable(self) -> dict:
        out = asdict(self)
        out.pop("command")
        return out


def machine() -> dict:
    import torch
    import transformers

    from ..tune.machine import capability

    features = capability()
    return {
        "cpu": features["model"],
        "cpu_flags": features["flags"],  # those the kernels choose by
        "kernels": features["isa"],
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llama_cpp": _version("llama-cpp-python"),
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def run_bench(config: BenchConfig, questions: list[Question] | Callable[[object], list[Question]],
              out_dir: Path) -> list[dict]:
    """Load the models, then run (or resume) the benchmark; return all records. `questions` may be a function of
    the loaded target (the long suite is built with its tokenizer)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_or_write_config(config, out_dir)  # refuse a mismatched folder before the slow model loads
    check_load_options(config.dtype, config.backend, config.quant, config.kv_cache)
    loaded: dict[tuple, object] = {}

    def load(spec: str, weights: str | None = None, draft: bool = False):
        """A model on the run's backend and quant, or on `weights` ('hf', 'native', 'native-int4', ...)."""
        backend, quant = (config.backend, config.quant) if weights is None else parse_weights(weights)
        if draft and config.draft_quant is not None:
            quant = config.draft_quant
        key = (spec, backend, quant)
        if key not in loaded:
            loaded[key] = load_model(spec, config.dtype, backend, quant, config.kv_cache)
        return loaded[key]

    target = load(config.model)
    if callable(questions):
        questions = questions(target)

    methods = [build_method(spec, target, load) for spec in config.methods]
    return run_jobs(config, target, methods, questions, out_dir)


def run_jobs(config: BenchConfig, target, methods: list[Method], questions: list[Question], out_dir: Path) -> list[dict]:
    """Every (repeat, question, turn, method) not yet in out_dir/records.jsonl, appended there as it finishes."""
    _check_or_write_config(config, out_dir)
    records_path = out_dir / "records.jsonl"
    records = _read_records(records_path)
    done = {(r["method"], r["question_id"], r["turn"], r["repeat"]) for r in records}
    jobs = [
        (repeat, q, turn, m)
        for repeat in range(config.repeats)
        for q in questions
        for turn in range(len(q.turns))
        for m in methods
    ]
    todo = [j for j in jobs if (j[3].label, j[1].question_id, j[2], j[0]) not in done]
    if todo:
        _warm_up(target, methods, config)
    answers = {(r["method"], r["question_id"], r["turn"], r["repeat"]): r["token_ids"] for r in records}
    shared = SharedPrefill(records) if config.suite == "long" else None
    for method in methods:  # also undoes an earlier long run's sharing where these methods are run again
        method.prefix_cache = shared.prefixes if shared is not None else None
    with open(records_path, "a") as sink, tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="bench", unit="gen") as bar:
        current = None
        for repeat, q, turn, method in todo:
            if repeat != current:  # each repeat starts from drafters without memory of earlier answers
                current = repeat
                for each in methods:
                    each.new_repeat()
                if shared is not None:
                    shared.prefixes.clear()
            bar.set_postfix_str(f"{method.label} q{q.question_id} t{turn + 1}")
            prompt = _prompt_ids(target, q, turn, [answers[(method.label, q.question_id, t, repeat)] for t in range(turn)])
            params = SamplingParams(config.temperature, config.top_k, config.top_p, seed=_seed(config, q, turn, repeat),
                                    verification=config.verification)
            record = method.run(prompt, config.max_new_tokens, params)
            if shared is not None:
                shared.charge(record, method.label, (q.question_id, turn, repeat))
            record.update(method=method.label, question_id=q.question_id, group=q.group, category=q.category,
                          turn=turn, repeat=repeat, prompt_tokens=len(prompt), **_long_fields(target, q, record))
            answers[(method.label, q.question_id, turn, repeat)] = record["token_ids"]
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            records.append(record)
            bar.update()
    return records


SHARED_PREFILL_MB = 4096  # the long suite's shared prompts: one 32k-token prompt's float32 KV (Qwen2.5-1.5B) fits


class SharedPrefill:
    """The long suite's prompts prefilled once for all engine methods of a run: the first engine method to run a
    (question, turn, repeat) prefills it and leaves its KV in a prefix cache the others restore (bit-exact, so
    their answers are unchanged). Each later method is charged the first one's prefill time in its record (time to
    first token, end-to-end seconds) instead of its own restore, and keeps its own as own_prefill_seconds: a
    32k-token prompt costs minutes on two cores, once rather than once per method. A later turn's prompt starts
    with the earlier turn and its answer, which the API's prefix cache would hold as well."""

    def __init__(self, records: list[dict]):
        self.prefixes = PrefixCache(SHARED_PREFILL_MB * 2**20)  # the methods' prefix_cache (run_jobs sets it)
        self.first: dict[tuple, tuple[str, float]] = {}  # job -> (method that prefilled it, its prefill seconds)
        for record in records:  # a resumed run: the prefills recorded so far (their KV is gone: the next recomputes)
            if "own_prefill_seconds" not in record and "reused_prompt_tokens" in record:
                job = (record["question_id"], record["turn"], record["repeat"])
                self.first.setdefault(job, (record["method"], record["prefill_seconds"]))

    def charge(self, record: dict, label: str, job: tuple) -> None:
        if "reused_prompt_tokens" not in record or record.get("approximate"):  # a peer's row, or one that reads
            return  # another (compressed) prompt: it prefills on its own
        if job not in self.first:
            self.first[job] = (label, record["prefill_seconds"])
            return
        source, seconds = self.first[job]
        own = record["prefill_seconds"]
        record.update(own_prefill_seconds=own, prefill_shared_from=source, prefill_seconds=seconds,
                      seconds=record["seconds"] - own + seconds)
        record["tokens_per_second"] = record["new_tokens"] / record["seconds"]


def _long_fields(target, question: Question, record: dict) -> dict:
    """The long suite's length label, and for a question with a reference answer (the needle) whether the output
    holds it."""
    extra = {"length": question.length} if question.length else {}
    if question.reference:
        text = target.tokenizer.decode(record["token_ids"], skip_special_tokens=True)
        extra.update(reference=question.reference, found_reference=question.reference in text)
    return extra


def _prompt_ids(target, question: Question, turn: int, own_answers: list[list[int]]) -> list[int]:
    """The chat prompt for `turn` (plain text for a base model); earlier turns carry the method's own earlier
    answers (as Spec-Bench does)."""
    messages = []
    for t in range(turn + 1):
        messages.append({"role": "user", "content": question.turns[t]})
        if t < turn:
            messages.append({"role": "assistant", "content": target.tokenizer.decode(own_answers[t], skip_special_tokens=True)})
    return prompt_ids(target.tokenizer, messages)


def _seed(config: BenchConfig, q: Question, turn: int, repeat: int) -> int:
    return config.seed * 1_000_003 + q.question_id * 101 + turn * 7 + repeat


def _warm_up(target, methods: list[Method], config: BenchConfig) -> None:
    prompt = prompt_ids(target.tokenizer, [{"role": "user", "content": WARMUP_PROMPT}])
    for method in tqdm(methods, desc="warm-up", unit="method", leave=False):
        method.run(prompt, 8, SamplingParams(config.temperature, config.top_k, config.top_p, seed=0))


def _check_or_write_config(config: BenchConfig, out_dir: Path) -> None:
    path = out_dir / "config.json"
    if path.exists():
        previous = {**_defaults(), **json.loads(path.read_text())}  # folders written before a field existed
        previous.pop("command", None)
        if previous != config.comparable():
            raise SpecDecodeError(
                f"{out_dir} holds a run with another configuration.",
                "Use another --out folder to start a new run, or repeat the same command to resume it.",
            )
        return
    path.write_text(json.dumps(asdict(config), indent=1))


def _defaults() -> dict:
    """BenchConfig's fields that have defaults, with them."""
    out = {}
    for f in fields(BenchConfig):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


def _read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill: that generation runs again
            pass
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def timestamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def command_line() -> str:
    return "specdecode " + " ".join(sys.argv[1:])


__all__ = ["BenchConfig", "run_bench", "machine", "timestamp", "command_line", "BASELINE"]
