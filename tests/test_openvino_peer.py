"""OpenVINO GenAI peer rows in `specdecode bench`: method specs, their errors, identity against the peer's own plain
row, and (with openvino-genai installed) one real generation of SmolLM2 exported to int4 OpenVINO IR."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from specdecode.bench import openvino as ov_peer
from specdecode.bench.methods import build_method
from specdecode.bench.metrics import aggregate, identity_baseline
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams


def test_specs():
    assert ov_peer.parse_spec("openvino") == ("openvino", None)
    assert ov_peer.parse_spec("openvino-pld") == ("openvino-pld", None)
    assert ov_peer.parse_spec("openvino-draft:smollm2-135m-instruct") == ("openvino-draft", "smollm2-135m-instruct")


def test_draft_model_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert ov_peer.parse_spec(f"openvino-draft:{tmp_path}") == ("openvino-draft", str(tmp_path))


@pytest.mark.parametrize("spec, message", [
    ("openvino-draft", "names no draft model"),
    ("openvino-draft:", "names no draft model"),
    ("openvino-draft:no-such-model", "unknown draft model 'no-such-model'"),
    ("openvino-speculative", "unknown method 'openvino-speculative'.*openvino-draft:MODEL"),
])
def test_bad_specs(spec, message):
    # refused before anything is imported or exported: no target needed
    with pytest.raises(SpecDecodeError, match=message):
        build_method(spec, object(), None)


def test_missing_install_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino_genai", None)  # import fails as when not installed
    for spec in ("openvino", "openvino-pld", "openvino-draft:smollm2-135m-instruct"):
        with pytest.raises(SpecDecodeError) as info:
            build_method(spec, object(), None)
        assert "\n" not in str(info.value) and "pip install 'specdecode[openvino]'" in str(info.value)


def test_export_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    assert ov_peer.export_dir("smollm2-135m-instruct") == tmp_path / "peers/openvino/smollm2-135m-instruct-int4"
    assert ov_peer.export_dir(str(tmp_path / "m")).name.startswith("m-")


def _record(method, tokens, question=1):
    return {"method": method, "question_id": question, "turn": 0, "repeat": 0, "group": "g", "token_ids": tokens,
            "new_tokens": len(tokens), "seconds": 1.0, "prefill_seconds": 0.1}


def test_peers_compare_with_their_own_plain_row():
    assert [identity_baseline(m) for m in ("pld", "openvino", "openvino-pld", "openvino-draft:x", "llama.cpp-pld")] \
        == ["none", "openvino", "openvino", "openvino", "llama.cpp"]
    outputs = {"none": [1, 2, 3], "pld": [1, 2, 3], "openvino": [1, 2, 4], "openvino-pld": [1, 2, 4],
               "openvino-draft:x": [1, 2, 5], "llama.cpp": [7], "llama.cpp-pld": [7]}
    table = aggregate([_record(m, t) for m, t in outputs.items()], list(outputs), ["g"])
    shares = {m: table[m]["overall"]["identical_share"] for m in outputs}
    assert shares == {"none": 1.0, "pld": 1.0, "openvino": 1.0, "openvino-pld": 1.0, "openvino-draft:x": 0.0,
                      "llama.cpp": 1.0, "llama.cpp-pld": 1.0}
    alone = aggregate([_record("openvino-pld", [1])], ["openvino-pld"], ["g"])  # no plain row: nothing to compare
    assert alone["openvino-pld"]["overall"]["identical_share"] is None


@pytest.mark.real_model
@pytest.mark.skipif(importlib.util.find_spec("openvino_genai") is None,
                    reason="openvino-genai is not installed (pip install 'specdecode[openvino]')")
def test_real_generation(smollm2):
    """SmolLM2 exported to int4 IR (once: its export environment is created on first use); plain decoding returns
    tokens and timings, prompt lookup gives the same greedy tokens. In float32 without dynamic quantization: with
    OpenVINO's CPU defaults its prompt lookup left its plain greedy path on this very prompt (a near-tie)."""
    from specdecode.text import prompt_ids

    prompt = prompt_ids(smollm2.tokenizer, [{"role": "user", "content": (
        "Copy this list exactly, twice: apples, pears, plums, cherries, apples, pears, plums, cherries.")}])
    plain, lookup = (ov_peer.build(spec, smollm2, ov_peer.EXACT_PROPERTIES) for spec in ("openvino", "openvino-pld"))
    greedy = SamplingParams(0.0)
    first = plain.run(prompt, 40, greedy)
    assert first["new_tokens"] == len(first["token_ids"]) > 0
    assert 0 < first["prefill_seconds"] < first["seconds"] and first["openvino_metrics"]["throughput"] > 0
    assert first["weights"] == ov_peer.WEIGHTS
    assert plain.run(prompt, 40, greedy)["token_ids"] == first["token_ids"]  # nothing carried from the last prompt
    assert lookup.run(prompt, 40, greedy)["token_ids"] == first["token_ids"]
