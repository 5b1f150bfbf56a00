"""The suffix drafter's datastore (REST, drafters/datastore.py): its suffix array finds what a scan finds, the
ShareGPT datastore leaves the held-out conversations out and is built once per tokenizer, and drafts taken from it
keep the output token-identical to plain greedy decoding."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from specdecode.drafters import build_drafter, datastore as datastore_module, suffix as suffix_module
from specdecode.drafters.datastore import SEPARATOR, Datastore, datastore
from specdecode.drafters.ngram_table import suffix_matches
from specdecode.engine import generate
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams

from conftest import bpe_tokenizer, tiny_model
from test_sampling_distribution import (  # engine_setups: the fixture, used by name
    ALPHA, ENGINE_V, JOINT, chi_square_p_value, engine_counts, engine_setups, exact_joint,  # noqa: F401
)


def _until_separator(tokens: np.ndarray) -> list[int]:
    cut = np.flatnonzero(tokens == SEPARATOR)
    return tokens[: cut[0] if len(cut) else len(tokens)].tolist()


def test_longest_match_and_continuations_equal_a_scan():
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 4, size=rng.integers(1, 40)).tolist() for _ in range(30)]  # 4 ids: long matches
    store = Datastore.build(documents)
    flat = np.array([t for doc in documents for t in doc + [SEPARATOR]])
    lengths = set()
    for _ in range(300):
        query = rng.integers(0, 4, size=rng.integers(1, 12))
        levels = suffix_matches(flat, query, len(query))
        match = store.longest_match(query)
        assert match.length == len(levels)
        lengths.add(match.length)
        if not levels:
            continue
        expected = sorted(_until_separator(flat[end : end + 5]) for end in levels[-1])
        assert sorted(store.continuations(match, 10**6, 5)) == expected
        picked = store.continuations(match, 2, 5)  # fewer than the occurrences: spread over them
        assert len(picked) <= 2 and all(c in expected for c in picked)
    assert len(lengths) > 5  # short and long matches were both exercised


def test_a_continuation_stops_at_its_documents_end():
    store = Datastore.build([[5, 6, 7], [5, 6, 8, 9]])
    match = store.longest_match(np.array([1, 5, 6]))
    assert match.length == 2 and sorted(store.continuations(match, 8, 4)) == [[7], [8, 9]]
    assert store.continuations(store.longest_match(np.array([6, 7])), 8, 4) == [[]]  # the end of a document
    assert store.longest_match(np.array([3])).length == 0


def _sharegpt_json(count: int) -> str:
    """`count` records whose answers are distinct sentences (each answer's words are its own)."""
    records = [
        {"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i}?"},
                                          {"from": "gpt", "value": f"answer{i} alpha{i} beta{i} gamma{i} delta{i}"}]}
        for i in range(count)
    ]
    return json.dumps(records)[:-30]  # cut off mid-record, as the packaged file is


def test_sharegpt_datastore_holds_out_the_last_conversations_and_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr("specdecode.data.sharegpt.sharegpt_text", lambda: _sharegpt_json(12))
    monkeypatch.setattr(datastore_module, "HELD_OUT", 3)
    datastore_module._cached.cache_clear()
    texts = [f"answer{i} alpha{i} beta{i} gamma{i} delta{i}" for i in range(12)]
    tokenizer = bpe_tokenizer(texts, 300)
    store = datastore("sharegpt", tokenizer)
    ids = [np.array(tokenizer.encode(text, add_special_tokens=False)) for text in texts]
    # 12 records written, the last one cut off: 11 usable, the last 3 of them (8, 9, 10) held out
    assert [store.longest_match(i).length == len(i) for i in ids] == [True] * 8 + [False] * 4
    assert (tmp_path / "datastore").is_dir()

    datastore_module._cached.cache_clear()  # a new process: read from the cache, not tokenized again
    monkeypatch.setattr(datastore_module, "_sharegpt_documents", lambda tokenizer: pytest.fail("built again"))
    again = datastore("sharegpt", tokenizer)
    assert isinstance(again.order, np.memmap) and np.array_equal(again.order, store.order)
    datastore_module._cached.cache_clear()


def test_no_sharegpt_datastore_for_a_stand_in_tokenizer():
    target = tiny_model("llama")
    assert datastore("sharegpt", target.tokenizer) is None
    assert build_drafter("suffix", target).datastore is None


def test_drafts_from_the_datastore_are_lossless(monkeypatch):
    target = tiny_model("qwen2", seed=3)
    greedy = SamplingParams()
    prompts = [[11, 5, 60, 2, 33, 48, 7], [19, 50, 41, 13, 8, 30]]
    plain = [generate(target, build_drafter("none", target), prompt, 40, greedy)[0] for prompt in prompts]
    # The datastore holds what the target says after other prompts (and noise): its matches carry over.
    seen = [generate(target, build_drafter("none", target), [p + 1 for p in prompt], 60, greedy)[0] for prompt in prompts]
    rng = np.random.default_rng(1)
    documents = seen + plain[:1] + [rng.integers(0, 64, size=50).tolist() for _ in range(20)]
    store = Datastore.build(documents)
    monkeypatch.setattr(suffix_module, "datastore", lambda corpus, tokenizer: store)
    accepted = {}
    for corpus in ("sharegpt", "none"):
        accepted[corpus] = 0
        for prompt, expected in zip(prompts, plain):
            drafter = build_drafter("suffix", target, corpus=corpus, max_history=0)
            assert (drafter.datastore is store) == (corpus == "sharegpt")
            output, stats = generate(target, drafter, prompt, 40, greedy)
            assert output == expected
            accepted[corpus] += stats.accepted_tokens
    assert accepted["sharegpt"] > accepted["none"]


def test_sampling_from_datastore_drafts_keeps_the_target_distribution(monkeypatch, engine_setups):
    """Datastore drafts are deterministic trees (the point-mass rule): sampling with them must still give the
    target's own distribution of the next tokens (the engine check of test_sampling_distribution)."""
    target, _, prompt, logits = engine_setups["flat"]
    rng = np.random.default_rng(2)  # the 4-token vocabulary: every context matches, at length 4 or more
    store = Datastore.build([rng.integers(0, ENGINE_V, size=200).tolist() for _ in range(5)])
    monkeypatch.setattr(suffix_module, "datastore", lambda corpus, tokenizer: store)
    drafter = build_drafter("suffix", target, max_history=0, alpha=1.0, max_nodes=4, min_prob=0.2)
    params = SamplingParams(temperature=1.0)
    counts, accepted, _ = engine_counts(target, drafter, prompt, params, ENGINE_V, JOINT, 600)
    assert chi_square_p_value(counts, exact_joint(logits, params, ENGINE_V, JOINT)) > ALPHA
    assert accepted >= 2  # datastore drafts were accepted, not only rejected


def test_a_missing_suffix_array_library_is_one_clear_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "pydivsufsort", None)  # its import fails
    with pytest.raises(SpecDecodeError, match="needs the pydivsufsort package.*corpus=none"):
        Datastore.build([[1, 2, 3]])
