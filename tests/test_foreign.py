"""Drafting with a draft model of another tokenizer (slem, tli, slrs): the vocabulary map, SLEM's boundary, SLRS's
psi against brute force, errors, and real weights (SmolLM2's tokenizer and model against a target of another)."""

from __future__ import annotations

import pytest
import torch

from specdecode.drafters import build_drafter
from specdecode.drafters.foreign import bridge, token_keys
from specdecode.engine import generate
from specdecode.errors import SpecDecodeError
from specdecode.models.base import prefill
from specdecode.sampling import SamplingParams

from conftest import bpe_tokenizer, foreign_tokenizers, perturbed_copy, tiny_foreign_pair, tiny_model
from test_sampling_distribution import (
    ENGINE_DRAFT_BIAS, ENGINE_DRAFT_MERGES, ENGINE_DRAFT_VOCAB, ENGINE_TARGET_MERGES, ENGINE_TARGET_VOCAB, LogitBias, foreign_target,
)

GREEDY = SamplingParams()


def sentencepiece_tokenizer(vocab: dict[str, int]):
    """A Gemma-style tokenizer: `▁` for a space, <0xNN> byte-fallback pieces."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def test_tokens_match_by_their_bytes_across_byte_level_and_sentencepiece():
    byte_level = bpe_tokenizer(vocab={"a": 0, "Ġ": 1, "Ċ": 2, "Ġa": 3}, merges=[("Ġ", "a")])
    sentencepiece = sentencepiece_tokenizer({"\u2581a": 0, "<0x0A>": 1, "a": 2, "\u2581": 3, "b": 4})
    assert token_keys(byte_level, 4) == (b"a", b" ", b"\n", b" a")
    assert token_keys(sentencepiece, 6) == (b" a", b"\n", b"a", b" ", b"b", None)


def test_the_bridge_maps_shared_pieces_and_knows_which_begin_target_tokens():
    target, draft = foreign_tokenizers()
    target_model, draft_model = tiny_model("llama", vocab=64), tiny_model("llama", vocab=len(draft))
    target_model.tokenizer, draft_model.tokenizer = target, draft
    vocab = bridge(target_model, draft_model)
    for piece, draft_id in draft.get_vocab().items():
        mapped = int(vocab.draft_to_target[draft_id])
        assert mapped == target.get_vocab().get(piece, -1)  # the same byte-level piece, under the target's id
    rat = draft.get_vocab()["rat"]
    assert "rat" not in target.get_vocab() and "ratĠ" in target.get_vocab()
    assert bool(vocab.extendable[rat]) and not bool(vocab.shared[rat])
    probs = torch.softmax(torch.randn(len(draft)), -1)
    assert float(vocab.to_target(probs).sum()) == pytest.approx(float(probs[vocab.shared].sum()))


def test_slem_never_retokenizes_committed_tokens():
    target, draft_model = tiny_foreign_pair("llama")
    slem = build_drafter("slem", target, draft_model=draft_model)
    tokenizer = target.tokenizer
    committed = tokenizer.encode("the rat ate the ca")
    assert tokenizer.encode("the rat ate the cat") [: len(committed)] != committed  # "ca" + "t" merge
    draft = slem.retokenize(committed, "t sat")
    assert tokenizer.decode(committed + draft) == "the rat ate the cat sat"
    no_merge = slem.retokenize(tokenizer.encode("the rat "), "ate the hat")
    assert tokenizer.decode(no_merge) == "ate the hat"


def slrs_engine_pair():
    target = foreign_target(bpe_tokenizer(vocab=ENGINE_TARGET_VOCAB, merges=ENGINE_TARGET_MERGES))
    draft = tiny_model("llama", seed=7, vocab=8, layers=1, hidden=16, initializer_range=0.6)
    from conftest import native_twin

    draft_tokenizer = bpe_tokenizer(vocab=ENGINE_DRAFT_VOCAB, merges=ENGINE_DRAFT_MERGES)
    return target, LogitBias(native_twin(draft), ENGINE_DRAFT_BIAS, draft_tokenizer)


def brute_force_psi(target, draft_model, context: list[int], params) -> torch.Tensor:
    """[Vt] psi by walking every draft path from scratch (one prefill per path): stop at the first boundary whose
    text is a target token, follow text that begins one."""
    vocab = bridge(target, draft_model)
    text_ids = draft_model.tokenizer.encode(target.tokenizer.decode(context))
    psi = torch.zeros(target.vocab_size)

    def walk(path: list[int], text: bytes, weight: float):
        cache = draft_model.new_cache(64)
        probs = torch.softmax(prefill(draft_model, cache, text_ids + path).float() / params.temperature, -1)
        for token, piece in enumerate(vocab.draft_bytes):
            here = text + piece
            if here in vocab.target_id:
                psi[vocab.target_id[here]] += weight * float(probs[token])
            elif vocab.begins_target_string(here):
                walk(path + [token], here, weight * float(probs[token]))

    walk([], b"", 1.0)
    return psi


def test_slrs_psi_sums_every_spelling_when_the_tree_is_large_enough():
    target, draft_model = slrs_engine_pair()
    params = SamplingParams(temperature=1.0)
    context = [1, 2, 3, 1, 2, 3, 1, 2, 2]
    slrs = build_drafter("slrs", target, draft_model=draft_model, expand=64)
    slrs.start(context, 64)
    proposal = slrs.propose_level(slrs.view.sync(context, 64), -1, params)
    expected = brute_force_psi(target, draft_model, context, params)
    assert proposal.mass.tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert float(expected[ENGINE_TARGET_VOCAB["bcab"]]) > 0.1  # spelled by several draft tokens only
    tli = build_drafter("tli", target, draft_model=draft_model)
    tli.start(context, 64)
    single = tli.propose_level(tli.view.sync(context, 64), -1, params).mass
    assert float(single[ENGINE_TARGET_VOCAB["bcab"]]) == 0.0  # TLI cannot propose it


def test_errors_point_to_the_foreign_tokenizer_drafters():
    target, draft_model = tiny_foreign_pair("llama")
    with pytest.raises(SpecDecodeError, match="slem"):
        build_drafter("draft", target, draft_model=draft_model)
    with pytest.raises(SpecDecodeError, match="whatever its tokenizer"):
        build_drafter("tli", target)
    with pytest.raises(SpecDecodeError, match="bad option"):
        build_drafter("slrs", target, draft_model=draft_model, expand=-1)
    stranger = tiny_model("llama", vocab=8)
    stranger.tokenizer = bpe_tokenizer(vocab={c: i for i, c in enumerate("xyzuvwpq")}, merges=[])
    with pytest.raises(SpecDecodeError, match="shares no token"):
        build_drafter("tli", target, draft_model=stranger)


# ---- real weights ----------------------------------------------------------------------------------------------

HETERO = ["slem", "tli", "slrs"]


def tiny_target_with(tokenizer, vocab_size: int, seed: int = 3):
    target = tiny_model("qwen2", seed=seed, vocab=vocab_size)
    target.tokenizer = tokenizer
    return target


@pytest.fixture(scope="module")
def tiny_bpe_target():
    """(a tiny target of the 64-token test vocabulary, a prompt, plain decoding's answer)."""
    target = tiny_target_with(foreign_tokenizers()[0], 64)
    prompt = target.tokenizer.encode("the cat sat on the mat and the rat")
    return target, prompt, generate(target, build_drafter("none", target), prompt, 32, GREEDY)[0]


@pytest.mark.real_model
@pytest.mark.parametrize("name", HETERO)
def test_smollm2_drafts_for_a_target_of_another_vocabulary(smollm2, tiny_bpe_target, name):
    """SmolLM2 (49k byte-level vocabulary) drafts for a tiny target of the 64-token test vocabulary."""
    target, prompt, plain = tiny_bpe_target
    spec, stats = generate(target, build_drafter(name, target, draft_model=smollm2), prompt, 32, GREEDY)
    assert spec == plain and stats.drafted_tokens > 0


@pytest.fixture(scope="module")
def smollm2_reverse(smollm2):
    """(draft model of another tokenizer, prompt, plain decoding's answer) for SmolLM2 as the target: a perturbed
    SmolLM2 under another tokenizer (its pieces without the last 5000 merges, under other ids; the weights' rows
    moved with them), so drafts get accepted."""
    draft_model = perturbed_copy(smollm2, scale=0.02, seed=4)
    draft_model.tokenizer = renumbered(smollm2.tokenizer)
    draft_model = reindexed(draft_model, smollm2.tokenizer)
    prompt = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}],
                                                   add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    return draft_model, prompt, generate(smollm2, build_drafter("none", smollm2), prompt, 40, GREEDY)[0]


@pytest.mark.real_model
@pytest.mark.parametrize("name", HETERO)
def test_smollm2_target_with_a_draft_of_another_vocabulary(smollm2, smollm2_reverse, name):
    """The reverse: SmolLM2 is the target and the draft model speaks another tokenizer (smollm2_reverse)."""
    draft_model, prompt, plain = smollm2_reverse
    spec, stats = generate(smollm2, build_drafter(name, smollm2, draft_model=draft_model), prompt, 40, GREEDY)
    assert spec == plain
    assert stats.accepted_tokens > 10  # the foreign draft agrees with the target often


def renumbered(tokenizer, dropped_merges: int = 5000):
    """SmolLM2's tokenizer without its last merges (and the pieces they make), its regular pieces under reversed
    ids (special tokens keep theirs)."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    merges = spec["model"]["merges"][: -dropped_merges]
    gone = {"".join(m.split(" ") if isinstance(m, str) else m) for m in spec["model"]["merges"][-dropped_merges:]}
    special = {t["id"] for t in spec["added_tokens"]}
    vocab = {piece: i for piece, i in spec["model"]["vocab"].items() if piece not in gone or i in special}
    regular = sorted(i for i in vocab.values() if i not in special)
    new_id = dict(zip(regular, reversed(regular)))
    spec["model"]["vocab"] = {piece: new_id.get(i, i) for piece, i in vocab.items()}
    spec["model"]["merges"] = merges
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))


def reindexed(model, old_tokenizer):
    """The model's embedding and output rows moved to the new tokenizer's ids of the same pieces."""
    old, new = old_tokenizer.get_vocab(), model.tokenizer.get_vocab()
    index = torch.arange(model.vocab_size)  # ids the new tokenizer does not use keep their rows
    for piece, new_id in new.items():
        index[new_id] = old[piece]
    model.embedding = model.embedding[index].clone()
    model.lm_head.dense = model.lm_head.dense[index].clone()
    return model


@pytest.mark.real_model
def test_smollm2_drafts_for_a_target_with_qwens_tokenizer(smollm2):
    """With Qwen's 151k-token tokenizer where a Qwen model was pulled (CI may only have SmolLM2)."""
    from specdecode.models import packaged

    folder = packaged.model_dir("qwen2.5-coder-0.5b-instruct") / "hf"
    if not (folder / "tokenizer.json").exists():
        pytest.skip("no Qwen tokenizer pulled")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    target = tiny_target_with(tokenizer, len(tokenizer))
    prompt = tokenizer.encode("def fibonacci(n):\n    return")
    plain, _ = generate(target, build_drafter("none", target), prompt, 24, GREEDY)
    # tli: the bridge between the two vocabularies carries its distributions (slem and slrs meet another
    # vocabulary in the test above)
    spec, _ = generate(target, build_drafter("tli", target, draft_model=smollm2), prompt, 24, GREEDY)
    assert spec == plain
