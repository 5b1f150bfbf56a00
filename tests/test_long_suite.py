"""The long-input suite (`specdecode bench --suite long`): questions built from the standard library's sources, fitted
to a target length with a tokenizer, deterministic; the CLI's checks; the report's per-length section."""

from __future__ import annotations

import json
import re

import pytest

from specdecode.bench import long_suite
from specdecode.bench.long_suite import GROUPS, LENGTHS, TOLERANCE
from specdecode.bench.questions import Question, question_from_record
from specdecode.errors import SpecDecodeError

from conftest import bpe_tokenizer, tiny_model
from test_bad_input import run_cli


def char_count(messages: list[dict]) -> int:
    """A stand-in tokenizer: one token per four characters (fast enough for the longer lengths)."""
    return sum(len(m["content"]) for m in messages) // 4


@pytest.fixture(scope="module")
def tokenizer():
    """A small byte-level BPE (the conftest kind) trained on a few standard-library files."""
    root = long_suite.stdlib_root()
    texts = [(root / name).read_text() for name in ("textwrap.py", "shlex.py", "fnmatch.py")]
    return bpe_tokenizer(texts, 400)


@pytest.fixture(scope="module")
def built(tokenizer):
    return long_suite.build(long_suite.token_counter(tokenizer), ["2k"], progress=False)


def test_every_group_is_built_at_its_length(built, tokenizer):
    assert [r["category"] for r in built] == list(GROUPS)
    assert [r["question_id"] for r in built] == long_suite.question_ids(["2k"], 1)
    count = long_suite.token_counter(tokenizer)
    for r in built:
        measured = count([{"role": "user", "content": r["turns"][0]}])
        assert r["length"] == "2k" and r["prompt_tokens"] == measured
        assert abs(measured - LENGTHS["2k"]) <= TOLERANCE * LENGTHS["2k"], (r["category"], measured)
        assert r["files"] and all(f"Lib/{f.removeprefix('Lib/')}" in r["turns"][0] for f in r["files"])
        assert set(r) >= {"question_id", "category", "turns"}  # Spec-Bench's shape
        question = question_from_record(r)
        assert question.group == r["category"] and question.length == "2k"


def test_code_editing_names_a_real_definition_in_the_prompt(built):
    record = next(r for r in built if r["category"] == "code-editing")
    name = record["subject"]
    simple = name.split(".")[-1]
    prompt = record["turns"][0]
    assert f"Rewrite the {record['subject_kind']} `{name}` with type hints" in prompt
    header = re.search(rf"^( *)(class|def|async def) {re.escape(simple)}\b", prompt, re.M)
    assert header, name
    body = prompt[header.start():].split("```")[0].splitlines()
    indent = len(header.group(1))
    # the definition ends inside the prompt: a line at its own indentation or less follows it
    ends = [i for i, line in enumerate(body[1:], 1) if line.strip() and len(line) - len(line.lstrip()) <= indent
            and not line.lstrip().startswith((")", "]", "}"))]
    size = ends[0] if ends else len(body)
    assert 20 <= size <= long_suite.EDIT_LINES[1] + 5


def test_named_questions_name_a_function_in_the_prompt(built):
    for group in ("doc-qa", "follow-up"):
        record = next(r for r in built if r["category"] == group)
        simple = record["subject"].split(".")[-1]
        assert re.search(rf"^ *(async )?def {re.escape(simple)}\(", record["turns"][0], re.M)
        assert f"`{record['subject']}`" in record["turns"][-1]
    follow_up = next(r for r in built if r["category"] == "follow-up")
    assert len(follow_up["turns"]) == 2 and len(follow_up["turns"][1]) < 200  # a short second turn


def test_needle_is_in_the_prompt_with_its_reference(built):
    record = next(r for r in built if r["category"] == "needle")
    assert re.fullmatch(r"[a-z]+-\d{4}", record["reference"])
    prompt = record["turns"][0]
    assert prompt.count(long_suite.needle_sentence(record["reference"])) == 1
    assert prompt.count("secret passphrase") == 2  # the needle, and the question asking for it
    code = prompt.split("```python\n")[1].split("```")[0]
    at = code.index("The secret passphrase") / len(code)
    assert abs(at - record["needle_depth"]) < 0.15


def test_code_completion_stops_at_a_function_start(built):
    record = next(r for r in built if r["category"] == "code-completion")
    prompt = record["turns"][0]
    assert prompt.startswith("Continue this code")
    tail = prompt.rstrip("\n").split("\n")[-12:]  # a signature may take several lines
    assert any(re.match(r" *(async )?def \w+", line) for line in tail)
    assert re.search(r":\s*(#.*)?$", tail[-1])  # the header's colon: the body is the model's to write
    assert not prompt.rstrip().endswith("```")  # the model continues the file's end


def test_builds_are_deterministic(built, tokenizer):
    again = long_suite.build(long_suite.token_counter(tokenizer), ["2k"], progress=False)
    assert again == built
    # a length's questions do not depend on which other lengths are built
    assert long_suite.build(char_count, ["2k"], progress=False) == \
        long_suite.build(char_count, ["2k", "8k"], progress=False)[: len(GROUPS)]


def test_longer_lengths_land_within_tolerance():
    for record in long_suite.build(char_count, ["8k"], progress=False):
        assert abs(record["prompt_tokens"] - LENGTHS["8k"]) <= TOLERANCE * LENGTHS["8k"]


def test_questions_are_cached_per_tokenizer_python_and_lengths(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(long_suite, "token_counter", lambda tokenizer: char_count)
    first = long_suite.load_or_build(None, "some/model", ["2k"])
    path = long_suite.cache_path("some/model", ["2k"], 1)
    assert path.parent == tmp_path / "long_suite" and path.is_file()
    assert json.loads(path.read_text())["questions"] == first
    monkeypatch.setattr(long_suite, "build", lambda *a, **k: pytest.fail("rebuilt despite the cache"))
    assert long_suite.load_or_build(None, "some/model", ["2k"]) == first
    assert long_suite.cache_path("other", ["2k"], 1) != path and long_suite.cache_path("some/model", ["2k", "8k"], 1) != path


def test_questions_too_long_for_the_model_name_the_lengths_that_fit(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(long_suite, "token_counter", lambda tokenizer: char_count)
    target = tiny_model("llama")  # a context of 256 tokens
    with pytest.raises(SpecDecodeError, match="the 2k questions .* do not fit"):
        long_suite.questions_for(target, ["2k"], 1, list(GROUPS), 16)


@pytest.mark.parametrize("extra, message", [
    (["--suite", "long", "--long-lengths", "3k"], "error: unknown --long-lengths value '3k'. Choose from: 2k, 8k"),
    (["--suite", "longer"], "error: unknown --suite 'longer'. Choose spec-bench or long."),
    (["--suite", "long", "--groups", "poetry"], "no long-suite group 'poetry'"),
    (["--long-lengths", "2k"], "--long-lengths is for --suite long"),
])
def test_cli_rejects_bad_suite_arguments_before_loading(capsys, tmp_path, extra, message):
    line = run_cli(capsys, "bench", "--model", "no-such-model", "--out", str(tmp_path / "out"), *extra)
    assert message in line
    assert not (tmp_path / "out").exists()


def test_runner_records_length_and_whether_the_needle_was_answered(tmp_path):
    from specdecode.bench.methods import EngineMethod
    from specdecode.bench.runner import BenchConfig, run_jobs
    from specdecode.drafters import build_drafter

    target = tiny_model("qwen2", vocab=64)
    question = Question(100500, "needle", ("Where is it? " * 3,), length="2k", reference="amber-1234")
    config = BenchConfig(model="tiny", methods=["none"], question_ids=[100500], groups=["needle"], max_new_tokens=4,
                         dtype="float32", suite="long", long_lengths=["2k"])
    records = run_jobs(config, target, [EngineMethod("none", target, lambda: build_drafter("none", target))],
                       [question], tmp_path)
    assert records[0]["length"] == "2k" and records[0]["reference"] == "amber-1234"
    assert records[0]["found_reference"] is False  # the tiny model's tokens spell no passphrase


def test_report_shows_time_to_first_token_and_decode_rate_per_length_and_group(tmp_path):
    from specdecode.bench.report import write_report
    from specdecode.bench.runner import BenchConfig

    def record(method, qid, group, length, seconds, prefill, found=None):
        r = dict(method=method, question_id=qid, group=group, category=group, turn=0, repeat=0, new_tokens=11,
                 seconds=seconds, prefill_seconds=prefill, target_forwards=11, token_ids=list(range(11)),
                 prompt_tokens=2000 if length == "2k" else 8000, length=length)
        if found is not None:
            r.update(reference="amber-1234", found_reference=found)
        return r

    records = [record("none", 100000, "doc-qa", "2k", 3.0, 1.0), record("pld", 100000, "doc-qa", "2k", 2.0, 1.0),
               record("none", 101500, "needle", "8k", 6.0, 4.0, True),
               record("pld", 101500, "needle", "8k", 5.0, 4.0, False)]
    config = BenchConfig(model="tiny", methods=["none", "pld"], question_ids=[100000, 101500],
                         groups=["doc-qa", "needle"], max_new_tokens=11, dtype="float32", suite="long",
                         long_lengths=["2k", "8k"])
    machine = {"cpu": "test cpu", "threads": 2, "platform": "test", "torch": "x", "transformers": "y",
               "python": "3.11.7"}
    write_report(config, records, tmp_path, machine, "2026-01-01 00:00 UTC")
    report = (tmp_path / "report.md").read_text()
    assert "long-input suite built on this machine from Python 3.11.7's standard-library sources" in report
    assert "## Long inputs: per length and group" in report and "### 2k tokens" in report and "### 8k tokens" in report
    # doc-qa at 2k: TTFT 1 s; decode 10 tokens in 2 s (none) and 1 s (pld); end to end 11/3 and 11/2
    assert "| Document QA | none | 2000 | 3.67 | 1.00 s | 5.00 | 1.00x |" in report
    assert "| Document QA | pld | 2000 | 5.50 | 1.00 s | 10.00 | 1.50x |" in report
    assert "| Needle Retrieval | pld | 8000 | 2.20 | 4.00 s | 10.00 | 1.20x |" in report
    assert "Needle passphrase in the answer: none 100%, pld 0%." in report
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["metrics_by_length"]["8k"]["none"]["needle"]["time_to_first_token"] == 4.0
    assert "| time to first token |" in report  # the all-groups details table too


def test_bench_runs_the_long_suite_end_to_end(tmp_path, monkeypatch, capsys, tokenizer):
    """`specdecode bench --suite long` on a tiny model with a long context and the small BPE: built, cached, run,
    reported."""
    from specdecode.bench import runner
    from specdecode.cli import main
    from specdecode.models.hf import HFModel

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    tiny = tiny_model("llama", vocab=len(tokenizer), max_position_embeddings=4096)
    model = HFModel(tiny.model, tokenizer, name="tiny-long")
    monkeypatch.setattr(runner, "load_model", lambda *args, **kwargs: model)
    # +profile=none: pld's default sizes, so no forward-cost curve is measured (and no kernels built) for the row
    out = tmp_path / "out"
    code = main(["bench", "--model", "tiny-long", "--suite", "long", "--long-lengths", "2k", "--groups",
                 "needle,follow-up", "--drafters", "pld+profile=none", "--max-new-tokens", "3", "--dtype", "float32",
                 "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 3  # (needle, follow-up's two turns) x (none, pld)
    assert {r["length"] for r in records} == {"2k"} and all(r["prompt_tokens"] > 1700 for r in records)
    assert sum("found_reference" in r for r in records) == 2
    report = (out / "report.md").read_text()
    assert "### 2k tokens" in report and "| Follow-up Turn | pld+profile=none |" in report
    assert list((tmp_path / "cache" / "long_suite").glob("tiny-long_py*_2k_x1_v1.json"))
