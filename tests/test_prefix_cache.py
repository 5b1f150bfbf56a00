"""The prefix cache (cache/prefix.py): a prompt that begins with tokens an earlier request computed reuses their KV,
and the output is bit for bit a full prefill's on row-exact (int4) weights: every drafter, the follow-up turn of a
chat, a shared document prefix, a prompt equal to a stored entry, an end-of-sequence cut, LRU eviction within the
byte bound, and the server's cached_tokens."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from starlette.testclient import TestClient

from specdecode.api import SpecDecoder
from specdecode.cache import KVCache
from specdecode.cache.prefix import PrefixCache
from specdecode.drafters import DRAFTERS, build_drafter
from specdecode.engine import generate
from specdecode.models.base import prefill
from specdecode.models.loading import load_model
from specdecode.sampling import SamplingParams
from specdecode.serve import create_app

from conftest import tiny_foreign_pair, tiny_pair
from test_lossless import ReplayDrafter

GREEDY = SamplingParams()
TINY = "llama:native-int4"  # row-exact kernels: reuse must change no bit
PROMPT = [3, 9, 4, 17, 3, 9, 4, 22, 3, 9, 4, 17, 3, 9]
MB = 2**20


# ---- the cache itself --------------------------------------------------------------------------------------------


def filled_cache(n: int, seed: int = 0, capacity: int = 64) -> KVCache:
    """A KVCache of 2 layers, 1 head of 4 dims with n committed random entries."""
    cache = KVCache(2, 1, 4, capacity, torch.float32)
    generator = torch.Generator().manual_seed(seed)
    cache.keys[:, :, :, :n] = torch.randn(2, 1, 1, n, 4, generator=generator)
    cache.values[:, :, :, :n] = torch.randn(2, 1, 1, n, 4, generator=generator)
    cache.length = cache.end = n
    return cache


ENTRY_BYTES = 2 * (2 * 4 * 4) + 8  # per token: keys and values of 2 layers x 4 dims in float32, and its id


def test_lookup_finds_the_longest_shared_prefix_and_leaves_one_token_to_run():
    prefixes = PrefixCache(MB)
    document = list(range(10, 30))
    prefixes.store(document, filled_cache(20))
    assert prefixes.lookup([99] + document) == (0, None)  # nothing shared from the first token
    n, entry = prefixes.lookup(document[:8] + [1, 2, 3])  # another question about the same document's start
    assert n == 8
    assert prefixes.lookup(document + [5])[0] == 20  # the next turn: everything stored
    assert prefixes.lookup(document)[0] == 19  # the whole prompt stored: its last token still runs
    assert prefixes.lookup(document[:1])[0] == 0
    assert prefixes.lookup(document + [5], like=KVCache(2, 1, 4, 32, torch.bfloat16))[0] == 0  # another KV format
    restored = KVCache(2, 1, 4, 32, torch.float32)
    prefixes.restore(entry, 8, restored)
    source = filled_cache(20)
    assert restored.length == restored.end == 8 and restored.positions[:8].tolist() == list(range(8))
    assert torch.equal(restored.keys[:, :, :, :8], source.keys[:, :, :, :8])
    assert torch.equal(restored.values[:, :, :, :8], source.values[:, :, :, :8])


def test_an_entry_is_a_copy_of_the_cache():
    prefixes = PrefixCache(MB)
    cache = filled_cache(6)
    prefixes.store(list(range(6)), cache)
    expected = cache.keys[:, :, :, :6].clone()
    cache.keys.zero_()  # the request's cache lives on (a pool slot reused by the next request)
    restored = KVCache(2, 1, 4, 8, torch.float32)
    prefixes.restore(prefixes.lookup(list(range(7)))[1], 6, restored)
    assert torch.equal(restored.keys[:, :, :, :6], expected)


def test_a_longer_entry_replaces_its_prefixes_and_a_covered_one_is_not_stored_twice():
    prefixes = PrefixCache(MB)
    assert prefixes.store([1, 2, 3], filled_cache(3))
    assert prefixes.store([1, 2, 3, 4, 5], filled_cache(5))  # turn 2 holds turn 1
    assert len(prefixes) == 1 and prefixes.bytes == 5 * ENTRY_BYTES
    assert not prefixes.store([1, 2, 3, 4], filled_cache(4))  # already held
    assert prefixes.store([1, 2, 7], filled_cache(3))  # shares two tokens only: an entry of its own
    assert len(prefixes) == 2


def test_eviction_keeps_the_byte_bound_and_drops_the_least_recently_used_first():
    prefixes = PrefixCache(25 * ENTRY_BYTES)
    a, b, c = [1] * 10, [2] * 10, [3] * 10
    prefixes.store(a, filled_cache(10))
    prefixes.store(b, filled_cache(10))
    assert prefixes.lookup(a + [0])[0] == 10  # a is now the most recently used
    prefixes.store(c, filled_cache(10))
    assert prefixes.bytes <= prefixes.max_bytes and len(prefixes) == 2
    assert prefixes.lookup(b + [0])[0] == 0  # b went first
    assert prefixes.lookup(a + [0])[0] == 10 and prefixes.lookup(c + [0])[0] == 10
    assert not prefixes.store([4] * 30, filled_cache(30))  # larger than the whole bound: not stored
    assert len(prefixes) == 2 and prefixes.bytes == 20 * ENTRY_BYTES


def test_concurrent_stores_and_lookups_keep_the_accounting():
    prefixes = PrefixCache(40 * ENTRY_BYTES)

    def worker(seed: int):
        for i in range(30):
            ids = [seed, i % 7] + list(range(i % 5))
            prefixes.store(ids, filled_cache(len(ids)))
            prefixes.lookup(ids + [1])

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert prefixes.bytes <= prefixes.max_bytes
    assert prefixes.bytes == sum(entry.nbytes for entry in prefixes._entries.values())


# ---- the engine: every drafter over a cache that starts with reused entries (tiny int4 model) -------------------


@pytest.fixture(scope="module")
def tiny():
    return tiny_pair(TINY, seed=1)


@pytest.fixture(scope="module")
def tiny_foreign():
    return tiny_foreign_pair(TINY, seed=1)


def plain(target, prompt, n):
    return generate(target, build_drafter("none", target), prompt, n, GREEDY)[0]


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_every_drafter_reuses_the_previous_turn_and_decodes_as_without_it(request, name):
    """Turn 1 stores its prompt; turn 2 (turn 1, its answer and a new message) and a question that shares only
    the first prompt's first tokens reuse it, and each output is plain decoding's without a prefix cache.
    Drafters that read the target's hidden states of every prompt token (EAGLE, Medusa, Kangaroo, EESD) get a full
    prefill instead."""
    cls = DRAFTERS[name]
    target, draft_model = request.getfixturevalue("tiny_foreign" if cls.foreign_vocabulary else "tiny")
    options = {"draft_model": draft_model} if cls.needs_draft_model else {}
    prefixes = PrefixCache(MB)
    first, stats = generate(target, build_drafter(name, target, **options), PROMPT, 12, GREEDY, prefix_cache=prefixes)
    assert first == plain(target, PROMPT, 12) and stats.reused_prompt_tokens == 0
    follow_up = PROMPT + first + [5, 61, 7]
    other = PROMPT[:9] + [40, 41, 42]
    for prompt, shared in [(follow_up, len(PROMPT)), (other, 9)]:
        drafter = build_drafter(name, target, **options)
        tokens, stats = generate(target, drafter, prompt, 16, GREEDY, prefix_cache=prefixes)
        assert tokens == plain(target, prompt, 16), f"{name} after reusing {stats.reused_prompt_tokens} tokens"
        assert stats.reused_prompt_tokens == (0 if drafter.hidden_layers else shared)


def test_a_prompt_equal_to_a_stored_entry_still_runs_its_last_token(tiny):
    target, _ = tiny
    prefixes = PrefixCache(MB)
    answer, _ = generate(target, build_drafter("none", target), PROMPT, 8, GREEDY, prefix_cache=prefixes)
    tokens, stats = generate(target, build_drafter("pld", target), PROMPT, 10, GREEDY, prefix_cache=prefixes)
    assert stats.reused_prompt_tokens == len(PROMPT) - 1
    assert tokens == plain(target, PROMPT, 10) and tokens[:8] == answer


def test_only_the_prompt_is_stored_and_a_follow_up_decodes_as_without_the_cache(tiny):
    """The answer's entries come from decoding's arithmetic, which a prefill of the same tokens need not give (on AMX
    the prompt's linear layers run in bfloat16 tiles): the entry holds the prompt's only, even when a draft was
    accepted past the end-of-sequence token, and a follow-up prefills the answer and equals plain decoding."""
    target, _ = tiny
    script = plain(target, PROMPT, 24)
    stop = next(i for i in range(3, len(script)) if script[i] not in script[:i])
    eos, target.eos_token_ids = target.eos_token_ids, frozenset({script[stop]})
    try:
        prefixes = PrefixCache(MB)
        answer, stats = generate(target, ReplayDrafter(len(PROMPT), script, 6), PROMPT, 24, GREEDY,
                                 prefix_cache=prefixes)
        assert answer == script[: stop + 1] and stats.finish_reason == "stop"
        (entry,) = prefixes._entries.values()
        assert entry.tokens.tolist() == PROMPT
        follow_up = PROMPT + answer + [5, 6]
        tokens, stats = generate(target, build_drafter("none", target), follow_up, 8, GREEDY, prefix_cache=prefixes)
        assert stats.reused_prompt_tokens == len(PROMPT) and tokens == plain(target, follow_up, 8)
    finally:
        target.eos_token_ids = eos


# ---- the real model: int4 SmolLM2, bit for bit -------------------------------------------------------------------

DOCUMENT = ("The Hanseatic League was a medieval commercial and defensive network of merchant guilds and market "
            "towns in Central and Northern Europe. It grew from a few North German towns in the late 12th century "
            "to encompass nearly 200 settlements across seven modern-day countries.")


@pytest.fixture(scope="module")
def smollm2_int4(smollm2):
    return load_model("smollm2-135m-instruct", "bfloat16", quant="int4")


def ask(question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer from this text: " + DOCUMENT}, {"role": "user", "content": question}]


@pytest.mark.real_model
def test_smollm2_int4_a_reused_prefix_gives_the_logits_of_a_full_prefill_bit_for_bit(smollm2_int4):
    model = smollm2_int4
    assert model.ops.exact
    prompt = SpecDecoder(model, prefix_cache_mb=0).encode(ask("When did it grow?"), chat=True)
    full = model.new_cache(len(prompt) + 1)
    expected = prefill(model, full, prompt)
    prefixes = PrefixCache(64 * MB)
    prefixes.store(prompt[:40], full)
    n, entry = prefixes.lookup(prompt)
    reused = model.new_cache(len(prompt) + 1)
    prefixes.restore(entry, n, reused)
    assert n == 40 and torch.equal(prefill(model, reused, prompt[n:]), expected)
    assert torch.equal(reused.keys[:, :, :, : len(prompt)], full.keys[:, :, :, : len(prompt)])


@pytest.mark.real_model
@pytest.mark.parametrize("drafter", ["none", "pld"])
def test_smollm2_int4_a_second_question_and_a_follow_up_turn_reuse_exactly(smollm2_int4, drafter):
    cached = SpecDecoder(smollm2_int4, drafter, governor=False)
    fresh = SpecDecoder(smollm2_int4, drafter, governor=False, prefix_cache_mb=0)
    first = cached.generate(ask("When did it grow?"), 24)
    assert first.stats.reused_prompt_tokens == 0
    second = cached.generate(ask("How many towns?"), 24)  # the same system prompt and document
    shared = len(cached.encode(ask("When did it grow?"))) - 12  # at least the document's tokens
    assert second.stats.reused_prompt_tokens > shared
    assert second.token_ids == fresh.generate(ask("How many towns?"), 24).token_ids
    turn2 = ask("How many towns?") + [{"role": "assistant", "content": second.text},
                                      {"role": "user", "content": "Name one."}]
    prompt2, before = cached.encode(turn2), cached.encode(ask("How many towns?"))
    assert prompt2[: len(before)] == before  # turn 2 starts with the second question's prompt
    third = cached.generate(turn2, 24)
    assert third.stats.reused_prompt_tokens == len(before)
    assert third.token_ids == fresh.generate(turn2, 24).token_ids


@pytest.mark.real_model
def test_the_server_reports_the_prompt_tokens_it_reused(smollm2_int4):
    decoder = SpecDecoder(smollm2_int4, "pld", governor=False)
    fresh = SpecDecoder(smollm2_int4, "pld", governor=False, prefix_cache_mb=0)
    with TestClient(create_app(decoder, "m")) as client:
        answers = []
        for question, stream in [("When did it grow?", False), ("How many towns?", False), ("Where?", True)]:
            body = {"messages": ask(question), "max_tokens": 16, "temperature": 0, "stream": stream}
            if stream:
                with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    lines = [line for line in response.iter_lines() if line.startswith("data: {")]
                usage = json.loads(lines[-1].removeprefix("data: "))["usage"]
            else:
                reply = client.post("/v1/chat/completions", json=body).json()
                usage = reply["usage"]
                answers.append((question, reply["choices"][0]["message"]["content"]))
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert (cached == 0) if question == "When did it grow?" else (cached > 40)
        health = client.get("/health").json()
    assert health["prefix_cache"]["hits"] == 2 and 0 < health["prefix_cache"]["bytes"] <= 1024 * MB
    for question, text in answers:
        assert text == fresh.generate(ask(question), 16).text


@pytest.mark.real_model
def test_local_chat_prefills_only_the_last_answer_and_the_new_message(smollm2_int4, monkeypatch, capsys):
    from specdecode.chat import chat_local

    lines = iter(["Name a color.", "And another one?"])

    def next_line(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", next_line)
    decoder = SpecDecoder(smollm2_int4, "pld", governor=False)
    assert chat_local(decoder, 12, {"temperature": 0.0}) == 0
    first, second = [line for line in capsys.readouterr().err.splitlines() if "tokens/s" in line]
    assert "reused" not in first
    reused = int(second.split(", ")[-1].split()[0])
    assert reused == len(decoder.encode([{"role": "user", "content": "Name a color."}]))  # turn 1's prompt


def test_a_negative_prefix_cache_is_refused_before_any_model_loads(capsys):
    from specdecode.cli import main

    assert main(["chat", "--model", "no-such-model", "--prefix-cache-mb", "-1"]) == 2
    assert "--prefix-cache-mb must be >= 0" in capsys.readouterr().err
