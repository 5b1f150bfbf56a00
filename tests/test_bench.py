"""The benchmark harness: metrics from known timings, question selection, resume after a kill, the report."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from specdecode.bench.methods import EngineMethod, build_method
from specdecode.bench.metrics import aggregate
from specdecode.bench.questions import Question, load_questions, select
from specdecode.bench.report import write_report
from specdecode.bench.runner import BenchConfig, run_jobs
from specdecode.drafters import build_drafter
from specdecode.errors import SpecDecodeError

from conftest import tiny_model


def record(method, qid, group, tokens, seconds, forwards=None, draft=0.0, verify=0.0, drafted=0, accepted=0, ids=None,
           prefill=None, repeat=0):
    return dict(
        method=method, question_id=qid, group=group, turn=0, repeat=repeat, new_tokens=tokens, seconds=seconds,
        target_forwards=forwards, draft_seconds=draft, verify_seconds=verify, drafted_tokens=drafted,
        accepted_tokens=accepted, token_ids=ids if ids is not None else list(range(tokens)), prefill_seconds=prefill,
    )


def test_metrics_from_known_timings():
    records = [
        record("none", 1, "a", 10, 2.0, forwards=10, verify=1.5, prefill=0.5),
        record("none", 2, "b", 20, 2.0, forwards=20, verify=1.5, prefill=0.5),
        record("spec", 1, "a", 10, 1.0, forwards=4, draft=0.25, verify=0.5, drafted=12, accepted=6),
        record("spec", 2, "b", 20, 0.5, forwards=5, draft=0.1, verify=0.3, drafted=20, accepted=15, ids=[7] * 20),
        record("peer", 1, "a", 10, 4.0),
        record("peer", 2, "b", 20, 4.0),
    ]
    table = aggregate(records, ["none", "spec", "peer"], ["a", "b"])
    assert table["none"]["a"]["tokens_per_second"] == 5.0
    assert table["none"]["overall"]["decode_tokens_per_second"] == pytest.approx(28 / 3)  # first tokens left out
    assert table["spec"]["a"]["speedup"] == pytest.approx(2.0)  # 10/1 vs 10/2
    assert table["spec"]["b"]["speedup"] == pytest.approx(4.0)  # 40 vs 10 tokens/s
    overall = table["spec"]["overall"]
    assert overall["speedup"] == pytest.approx((30 / 1.5) / (30 / 4.0))
    assert overall["tau"] == pytest.approx(30 / 9)
    assert overall["acceptance_rate"] == pytest.approx(21 / 32)
    assert overall["draft_share"] == pytest.approx(0.35 / 1.5)
    assert overall["verify_share"] == pytest.approx(0.8 / 1.5)
    assert overall["other_share"] == pytest.approx(0.35 / 1.5)
    assert overall["identical_share"] == 0.5  # question 2 produced other tokens
    assert table["peer"]["overall"]["tau"] is None
    assert table["peer"]["overall"]["decode_tokens_per_second"] is None  # no time to first token recorded
    assert table["peer"]["overall"]["speedup"] == pytest.approx(0.5)


def test_selection_is_deterministic_and_spans_mt_bench_categories():
    questions = load_questions()
    assert len(questions) == 480
    chosen = select(questions, ["mt_bench", "rag"], 8)
    assert [q.category for q in chosen[:8]] == [
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"
    ]
    assert {q.group for q in chosen[8:]} == {"rag"} and len(chosen) == 16
    assert select(questions, ["mt_bench", "rag"], 8) == chosen
    coding = select(questions, ["coding"], 3)
    assert {q.category for q in coding} == {"coding"} and {q.group for q in coding} == {"coding"}
    with pytest.raises(SpecDecodeError, match="no questions"):
        select(questions, ["poetry"], 1)


class CountingMethod(EngineMethod):
    calls = 0

    def run(self, prompt_ids, max_new_tokens, params):
        CountingMethod.calls += 1
        return super().run(prompt_ids, max_new_tokens, params)


QUESTIONS = [
    Question(1, "writing", ("Write a poem about the sea.", "Now make it shorter.")),
    Question(2, "summarization", ("Summarize: the the the cat cat sat sat on on the mat.",)),
]


def make_config(methods):
    return BenchConfig(model="tiny", methods=methods, question_ids=[1, 2], groups=["mt_bench", "summarization"],
                       max_new_tokens=12, dtype="float32")


def test_a_killed_run_resumes_where_it_stopped(tmp_path):
    target = tiny_model("qwen2", vocab=64)
    methods = [CountingMethod("none", target, lambda: build_drafter("none", target)),
               CountingMethod("pld", target, lambda: build_drafter("pld", target))]
    config = make_config(["none", "pld"])
    full = run_jobs(config, target, methods, QUESTIONS, tmp_path)
    assert len(full) == 6 and CountingMethod.calls == 6 + 2  # 3 question-turns x 2 methods, plus warm-up
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    (tmp_path / "records.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:40])  # killed mid-write
    CountingMethod.calls = 0
    resumed = run_jobs(config, target, methods, QUESTIONS, tmp_path)
    assert CountingMethod.calls == 3 + 2  # the three missing generations, plus warm-up
    key = lambda r: (r["method"], r["question_id"], r["turn"])
    assert sorted(map(key, resumed)) == sorted(map(key, full))
    assert {key(r): r["token_ids"] for r in resumed} == {key(r): r["token_ids"] for r in full}  # greedy
    with pytest.raises(SpecDecodeError, match="another configuration"):
        run_jobs(make_config(["none"]), target, methods[:1], QUESTIONS, tmp_path)


def test_second_turn_sees_the_methods_own_first_answer(tmp_path):
    target = tiny_model("llama", vocab=64)
    methods = [EngineMethod("none", target, lambda: build_drafter("none", target))]
    records = run_jobs(make_config(["none"]), target, methods, QUESTIONS[:1], tmp_path)
    first, second = sorted(records, key=lambda r: r["turn"])
    assert second["prompt_tokens"] > first["prompt_tokens"] + 4  # the answer is in the second prompt


def test_every_repeat_starts_without_memory_of_earlier_answers(tmp_path):
    """suffix keeps a tree of earlier answers (SuffixDecoding's global tree): within a repeat it learns from the
    earlier questions, but a second repeat must not draft from the first repeat's answers to the same questions."""
    target = tiny_model("qwen2", vocab=64)
    methods = [EngineMethod("suffix", target, lambda: build_drafter("suffix", target))]
    config = make_config(["suffix"])
    config.repeats = 2
    records = run_jobs(config, target, methods, QUESTIONS, tmp_path)
    by_repeat = [[r for r in records if r["repeat"] == repeat] for repeat in (0, 1)]
    assert [r["accepted_tokens"] for r in by_repeat[0]] == [r["accepted_tokens"] for r in by_repeat[1]]
    # without the reset, the memory of repeat 0 (which holds the whole answers) is drafted from in repeat 1
    methods[0].new_repeat = lambda: None
    (tmp_path / "remembered").mkdir()
    remembered = run_jobs(config, target, methods, QUESTIONS, tmp_path / "remembered")
    assert sum(r["accepted_tokens"] for r in remembered if r["repeat"] == 1) > sum(
        r["accepted_tokens"] for r in by_repeat[1])


def test_report_files(tmp_path):
    target = tiny_model("gemma3", vocab=64)
    methods = [EngineMethod(m, target, lambda m=m: build_drafter(m, target)) for m in ("none", "pld")]
    config = make_config(["none", "pld"])
    records = run_jobs(config, target, methods, QUESTIONS, tmp_path)
    machine = {"cpu": "test cpu", "threads": 2, "platform": "test", "torch": "x", "transformers": "y"}
    write_report(config, records, tmp_path, machine, "2026-01-01 00:00 UTC")
    report = (tmp_path / "report.md").read_text()
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["records"]) == 6 and results["metrics"]["pld"]["overall"]["identical_share"] == 1.0
    # pld's row holds its own speedups and tau, recomputed here from the records in results.json
    pld = aggregate(results["records"], ["none", "pld"], ["mt_bench", "summarization"])["pld"]
    row = " | ".join(f"{pld[g]['speedup']:.2f}x" for g in ("mt_bench", "summarization"))
    assert f"| pld | {row} | {pld['overall']['tau']:.2f} | {pld['overall']['speedup']:.2f}x |" in report
    assert pld["overall"]["tau"] > 1  # the repetitive summarization prompt is drafted from
    assert "test cpu" in report and "| decode tok/s |" in report
    assert "| pld | (defaults) | defaults |" in report  # the drafter options in effect
    assert (tmp_path / "speedup.png").stat().st_size > 1000
    assert (tmp_path / "tau_vs_tokens_per_second.png").stat().st_size > 1000


def test_repeats_report_the_median_and_spread_of_each_speedup(tmp_path):
    seconds = {0: (2.0, 1.0), 1: (2.0, 0.5), 2: (1.0, 1.0)}  # repeat: (none, spec) -> speedups 2, 4 and 1
    records = [record(m, 1, "summarization", 10, s, forwards=10, repeat=k)
               for k, pair in seconds.items() for m, s in zip(("none", "spec"), pair)]
    config = BenchConfig(model="tiny", methods=["none", "spec"], question_ids=[1], groups=["summarization"],
                         max_new_tokens=10, dtype="float32", repeats=3)
    machine = {"cpu": "test cpu", "threads": 2, "platform": "test", "torch": "x", "transformers": "y"}
    write_report(config, records, tmp_path, machine, "2026-01-01 00:00 UTC")
    spread = json.loads((tmp_path / "results.json").read_text())["metrics"]["spec"]["overall"]["speedup_repeats"]
    assert spread == {"values": [2.0, 4.0, 1.0], "median": 2.0, "min": 1.0, "max": 4.0}
    report = (tmp_path / "report.md").read_text()
    assert "### Across the 3 repeats: median (min-max) of each repeat's own speedup" in report
    assert "| spec | 2.00x (1.00-4.00) | 2.00x (1.00-4.00) |" in report  # the one group, then overall
    assert "| none | 1.00x (1.00-1.00) |" in report
    one = aggregate([r for r in records if r["repeat"] == 0], ["none", "spec"], ["summarization"])
    assert "speedup_repeats" not in one["spec"]["overall"]  # a single repeat has no spread to report


def test_unknown_method_names_the_choices():
    target = tiny_model("llama")
    with pytest.raises(SpecDecodeError, match="hf-assisted"):
        build_method("medusa-ish", target, load=lambda spec: None)
    assert build_method("pld+k=3", target, load=None).drafter.k == 3


def test_a_row_picks_its_verification_rule():
    target = tiny_model("llama")
    method = build_method("pld+k=3+verify=token", target, load=None)
    assert method.verification == "token" and method.drafter.k == 3  # the engine's key, not the drafter's
    assert build_method("pld", target, load=None).verification is None  # the run's rule
    with pytest.raises(SpecDecodeError, match="unknown verification 'nope'"):
        build_method("pld+verify=nope", target, load=None)


def test_llama_cpp_rows_without_the_extra_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    with pytest.raises(SpecDecodeError, match=r"pip install 'specdecode\[llamacpp\]'"):
        build_method("llama.cpp", tiny_model("llama"), load=None)


@pytest.mark.parametrize("system_info, expected", [
    (b"AVX512 = 1 | AMX_INT8 = 1 |", r"AMX path.*CMAKE_ARGS=.*-DGGML_NATIVE=OFF"),
    (b"AVX512 = 1 |", r"exit -11: boom"),
])
def test_llama_cpp_rows_stop_with_the_cause_where_llama_cpp_crashes(monkeypatch, tmp_path, system_info, expected):
    """A llama.cpp that dies here (a signal in its child-process probe) stops the bench before any row runs, with
    the cause and the fix, instead of killing the bench with everything it measured."""
    import subprocess
    import types

    from specdecode.bench import llamacpp

    crashed = subprocess.CompletedProcess([], returncode=-11, stdout="", stderr="loading\nboom\n")
    monkeypatch.setattr(llamacpp.subprocess, "run", lambda *args, **kwargs: crashed)
    module = types.SimpleNamespace(llama_print_system_info=lambda: system_info)
    monkeypatch.setattr(llamacpp, "llama_cpp", lambda: module)
    llamacpp.check_runs.cache_clear()
    with pytest.raises(SpecDecodeError, match=expected):
        llamacpp.check_runs(tmp_path / f"model-{len(system_info)}.gguf")
    llamacpp.check_runs.cache_clear()


def test_llama_cpp_rows_need_a_gguf_model():
    from specdecode.models.loading import gguf_file

    with pytest.raises(SpecDecodeError, match="not a GGUF model"):
        gguf_file("some/transformers-model")


@pytest.mark.real_model
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_rows_run_in_the_bench(smollm2, tmp_path):
    methods = [EngineMethod("none", smollm2, lambda: build_drafter("none", smollm2))]
    methods += [build_method(spec, smollm2, load=None) for spec in ("llama.cpp", "llama.cpp-pld")]
    config = BenchConfig(model=smollm2.name, methods=[m.label for m in methods], question_ids=[1, 2],
                         groups=["mt_bench", "summarization"], max_new_tokens=8, dtype="float32")
    records = run_jobs(config, smollm2, methods, QUESTIONS, tmp_path)
    assert len(records) == 9
    for r in records:
        assert 0 < r["new_tokens"] <= 8 and 0 < r["prefill_seconds"] <= r["seconds"]
        assert len(r["token_ids"]) == r["new_tokens"] and all(t < smollm2.vocab_size for t in r["token_ids"])
    plain = [r for r in records if r["method"] == "llama.cpp"]
    assert all(r["target_forwards"] == r["new_tokens"] for r in plain)
    machine = {"cpu": "test cpu", "threads": 1, "platform": "test", "torch": "x", "transformers": "y",
               "llama_cpp": "z"}
    write_report(config, records, tmp_path, machine, "2026-01-01 00:00 UTC")
    report = (tmp_path / "report.md").read_text()
    assert "| llama.cpp |" in report and "| llama.cpp-pld |" in report and "llama-cpp-python z" in report


def test_hf_uag_peer_is_universal_assisted_generation():
    """`hf-uag:MODEL` runs transformers' generate with a draft model of another tokenizer; greedy, it says what
    plain decoding says."""
    from specdecode.engine import generate
    from specdecode.sampling import SamplingParams

    from conftest import tiny_foreign_pair

    target, draft_model = tiny_foreign_pair("qwen2")
    target.eos_token_ids = frozenset({63})
    loads = []

    def load(spec, weights=None, draft=False):
        loads.append((spec, weights))
        return draft_model

    method = build_method("hf-uag:tiny-draft", target, load=load)
    assert loads == [("tiny-draft", "hf")]
    assert method.options["assistant_tokenizer"] is draft_model.tokenizer
    prompt = [3, 9, 4, 17, 3, 9, 4, 22, 3, 9]
    plain, _ = generate(target, build_drafter("none", target), prompt, 16, SamplingParams())
    assert method.run(prompt, 16, SamplingParams())["token_ids"] == plain


def test_the_long_suite_prefills_each_prompt_once_for_all_engine_methods(tmp_path):
    """32k-token prompts cost minutes on two cores: the first engine method of a question prefills it, the others
    restore its KV (bit-exact: the same answers) and are charged its prefill time, keeping their own apart."""
    from conftest import native_twin

    target = native_twin(tiny_model("llama", vocab=64), "int4")
    methods = [EngineMethod(name, target, lambda name=name: build_drafter(name, target)) for name in ("none", "pld")]
    config = make_config(["none", "pld"])
    config.suite = "long"
    records = run_jobs(config, target, methods, QUESTIONS, tmp_path)
    by_job = {}
    for r in records:
        by_job.setdefault((r["question_id"], r["turn"]), {})[r["method"]] = r
    for (qid, turn), pair in by_job.items():
        first, second = pair["none"], pair["pld"]
        assert second["token_ids"] == first["token_ids"]
        assert "own_prefill_seconds" not in first and second["prefill_shared_from"] == "none"
        assert second["prefill_seconds"] == first["prefill_seconds"]
        assert second["reused_prompt_tokens"] == second["prompt_tokens"] - 1  # all but the last prompt token
        assert second["seconds"] >= second["prefill_seconds"]
    assert by_job[(QUESTIONS[0].question_id, 1)]["none"]["reused_prompt_tokens"] > 0  # the first turn and its answer
    assert by_job[(QUESTIONS[0].question_id, 0)]["none"]["reused_prompt_tokens"] == 0
    # Spec-Bench prompts are short: every method prefills its own
    config.suite = "spec-bench"
    (tmp_path / "short").mkdir()
    plain = run_jobs(config, target, methods, QUESTIONS, tmp_path / "short")
    assert all(r["reused_prompt_tokens"] == 0 and "own_prefill_seconds" not in r for r in plain)


def test_specpc_rows_are_marked_approximate_and_pay_their_compression(tmp_path):
    """A SpecPC row answers a shorter prompt: its record says so and how long, its time to first token includes the
    compression, the long suite's shared prefill is not charged to it, and the report lists it as not lossless."""
    from conftest import native_twin
    from specdecode.bench.metrics import rouge_l
    from specdecode.bench.report import write_report

    target = native_twin(tiny_model("llama", vocab=64, max_position_embeddings=512), "int4")
    spec = "specpc:tiny+keep=0.5+min_prompt=8+window=4+sinks=2+block=4+kernel=2"
    methods = [EngineMethod("none", target, lambda: build_drafter("none", target)),
               build_method(spec, target, load=lambda name, weights=None, draft=False: target)]
    config = make_config(["none", spec])
    config.suite = "long"
    records = run_jobs(config, target, methods, QUESTIONS, tmp_path)
    compressed = [r for r in records if r["method"] == spec]
    assert compressed and all(r["approximate"] for r in compressed)
    for r in compressed:
        assert r["compressed_prompt_tokens"] < r["prompt_tokens"]
        assert r["prefill_seconds"] >= r["compression_seconds"] > 0 and "prefill_shared_from" not in r
    write_report(config, records, tmp_path, {"cpu": "test", "threads": 1, "platform": "", "torch": "",
                                             "transformers": ""}, "now")
    assert "## Approximate rows (not lossless" in (tmp_path / "report.md").read_text()
    assert rouge_l([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0 and rouge_l([1, 2], [3, 4]) == 0.0
    assert rouge_l([1, 9, 2, 3], [1, 2, 3, 4]) == 0.75  # common subsequence 1 2 3 of 4 and 4 tokens
