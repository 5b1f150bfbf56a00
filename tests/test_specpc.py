"""SpecPC prompt compression (approximate.py): the attention weights it ranks by are the model's, the selection keeps
what it promises, and on a real model the span a question asks about survives compression."""

import pytest
import torch

from conftest import FAMILIES, native_twin, tiny_model
from specdecode.approximate import SpecPC, select_blocks
from specdecode.errors import OptionError
from specdecode.models.base import HiddenStates, prefill


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quant,kv_cache", [("none", "auto"), ("int8", "f32"), ("int8", "int8")])
def test_attention_probs_are_the_models(family, quant, kv_cache):
    """The weights read from captured layer inputs equal transformers' own (eager attention, output_attentions):
    exactly up to float rounding on dense weights, within the int8 rounding on int8 weights and cache (a wrong
    rotary position, mask or head grouping is off by far more)."""
    hf = tiny_model(family, seed=3, layers=2)
    hf.model.config._attn_implementation = "eager"
    native = native_twin(hf, quant)
    native.use_kv_cache(kv_cache)
    ids = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf.model(ids[None], output_attentions=True).attentions  # per layer [1, Hq, q, q]
    cache = native.new_cache(32)
    prefill(native, cache, ids[:12])
    asked = HiddenStates((0, 1))
    positions = torch.arange(12, 20)
    native.forward(cache, ids[12:], positions, torch.ones(8, 8, dtype=torch.bool).tril(), hidden=asked)
    for layer in (0, 1):
        probs = native.attention_probs(cache, layer, asked.states[layer], positions)  # [Hq, 8, 20]
        reference = expected[layer][0, :, 12:20]
        if quant == "none":
            torch.testing.assert_close(probs, reference, atol=1e-5, rtol=0)
        else:  # int8 rounding of the tiny model's large weights moves a weight by a few hundredths at most
            difference = (probs - reference).abs()
            assert difference.mean() < 5e-3 and difference.max() < 0.15, (difference.mean(), difference.max())
        assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-5)


def test_select_blocks_keeps_ends_budget_and_best_blocks():
    scores = torch.zeros(400)
    scores[203] = 1.0  # the best block (blocks start after the sinks): 176..207
    scores[60] = 0.5  # the second: 48..79 (pooling spreads it over 57..64)
    kept = select_blocks(scores, budget=16 + 64 + 64, window=64, sinks=16, block=32, kernel=8)
    kept_set = set(kept.tolist())
    assert kept.tolist() == sorted(kept_set)
    assert set(range(16)) <= kept_set and set(range(336, 400)) <= kept_set
    assert set(range(176, 208)) <= kept_set and set(range(48, 80)) <= kept_set
    assert len(kept) == 16 + 64 + 64
    assert 120 not in kept_set


def test_select_blocks_planted_bug_dropping_the_window_is_seen():
    """The window is the question: a selection that dropped it (window=0 here) would fail the check above."""
    kept = set(select_blocks(torch.rand(200), budget=40, window=0, sinks=0, block=10, kernel=1).tolist())
    assert not set(range(136, 200)) <= kept


def test_options_checked():
    with pytest.raises(OptionError, match="out of range"):
        SpecPC(draft=None, keep=0)


def test_short_prompt_is_left_alone(smollm2):
    compressed = SpecPC(smollm2, keep=0.25).compress(list(range(100, 400)))
    assert compressed.token_ids == list(range(100, 400)) and len(compressed.kept) == 300


def test_sliding_read_is_the_masked_forward(smollm2):
    """A prefill through a cache with `sliding` set gives the logits of one forward whose mask hides exactly the
    keys outside the sinks and the window: the sliding mask reaches the kernels, through the chunked prefill too."""
    ids = torch.randint(100, 5000, (300,), generator=torch.Generator().manual_seed(1))
    sinks, reach = 4, 50
    cache = smollm2.new_cache(301)
    cache.sliding = (sinks, reach)
    sliding_logits = prefill(smollm2, cache, ids)  # [V] after the last token
    positions = torch.arange(300)
    behind = positions[:, None] - positions[None, :]  # [q, q]
    mask = (behind >= 0) & ((behind < reach) | (positions[None, :] < sinks))
    reference = smollm2.forward(smollm2.new_cache(301), ids, positions, mask, last_only=True)[-1]
    torch.testing.assert_close(sliding_logits, reference, atol=1e-4, rtol=0)
    full_logits = prefill(smollm2, smollm2.new_cache(301), ids)
    assert (full_logits - sliding_logits).abs().max() > 1e-2  # the window changed something: it was applied


FILLER = "The grass is green and the sky is blue today. " * 60
FACT = "The secret code of the vault is 48213. "
QUESTION = "Question: what is the secret code of the vault? Answer: the secret code of the vault is"


def fact_prompt(tokenizer) -> tuple[list[int], range]:
    """A fact in the middle of filler and a question about it at the end: the ids, and where the fact is."""
    filler_ids, fact_ids, question_ids = (
        tokenizer(t, add_special_tokens=False)["input_ids"] for t in (FILLER, FACT, QUESTION)
    )
    return filler_ids + fact_ids + filler_ids + question_ids, range(len(filler_ids), len(filler_ids) + len(fact_ids))


@pytest.mark.parametrize("planted", [False, True])
@pytest.mark.parametrize("read_window", [0, 128])
def test_the_asked_span_survives(smollm2, monkeypatch, planted, read_window):
    """A fact in the middle of filler, and a question about it at the end: the draft's attention (SmolLM2-135M as its
    own scorer) keeps the fact's tokens at a quarter of the prompt, whether it read the prompt with full attention or
    with a sliding window far narrower than the prompt. Planted bug: ranking by the negated scores (the least attended
    blocks) loses the fact."""
    if planted:
        scores = SpecPC.scores
        monkeypatch.setattr(SpecPC, "scores", lambda self, ids: -scores(self, ids))
    ids, fact = fact_prompt(smollm2.tokenizer)
    compressor = SpecPC(smollm2, keep=0.25, window=24, min_prompt=256, read_window=read_window)
    compressed = compressor.compress(ids)
    assert len(ids) * 0.2 < len(compressed.token_ids) <= len(ids) * 0.25 + compressor.block
    assert (set(fact) <= set(compressed.kept.tolist())) != planted
    assert compressed.token_ids[-24:] == ids[-24:]


def test_decoder_answers_the_compressed_prompt_and_says_so(smollm2):
    """SpecDecoder(approximate=...): the answer is plain decoding's answer to the compressed prompt, and the stats
    say the generation was approximate, how long the prompt was and how much of it the target read; a prompt too
    short to compress is answered losslessly and not marked."""
    from specdecode.api import SpecDecoder

    compressor = SpecPC(smollm2, keep=0.25, window=24, min_prompt=256)
    decoder = SpecDecoder(smollm2, "pld", approximate=compressor, prefix_cache_mb=0)
    ids, _ = fact_prompt(smollm2.tokenizer)
    result = decoder.generate(ids, max_new_tokens=8)
    shorter = compressor.compress(ids).token_ids
    plain = SpecDecoder(smollm2, "none", prefix_cache_mb=0)
    assert result.token_ids == plain.generate(shorter, max_new_tokens=8).token_ids
    stats = result.stats
    assert (stats.approximate, stats.prompt_tokens, stats.prompt_tokens_read) == ("specpc", len(ids), len(shorter))
    assert stats.prompt_tokens_read < 0.3 * stats.prompt_tokens
    short = decoder.generate(ids[-200:], max_new_tokens=8)
    assert short.stats.approximate == "" and short.token_ids == plain.generate(ids[-200:], max_new_tokens=8).token_ids


def test_server_answers_the_compressed_prompt_and_says_so(smollm2):
    """serve --approximate: the response is the decoder's approximate answer, its usage counts the prompt as sent,
    and its `speculative` object says how much of it the target read."""
    from starlette.testclient import TestClient

    from specdecode.api import SpecDecoder
    from specdecode.serve import create_app

    decoder = SpecDecoder(smollm2, "pld", approximate=SpecPC(smollm2, keep=0.25, window=24, min_prompt=256),
                          prefix_cache_mb=0)
    prompt = FILLER + FACT + FILLER + QUESTION
    expected = decoder.generate(prompt, max_new_tokens=8)
    with TestClient(create_app(decoder, "m")) as client:
        body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
    assert body["choices"][0]["text"] == expected.text
    assert body["usage"]["prompt_tokens"] == expected.stats.prompt_tokens
    assert body["speculative"]["approximate"] == "specpc"
    assert body["speculative"]["prompt_tokens_read"] == expected.stats.prompt_tokens_read < expected.stats.prompt_tokens
