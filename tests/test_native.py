"""The native backend computes what the transformers adapter computes, and its int8/int4 weights stay close."""

from __future__ import annotations

import pytest
import torch

from specdecode.drafters import build_drafter
from specdecode.engine import generate
from specdecode.models.base import forward_tree, prefill
from specdecode.models.loading import load_model
from specdecode.models.native.linear import Linear
from specdecode.sampling import SamplingParams
from specdecode.tree import Draft
from specdecode.errors import SpecDecodeError

from conftest import native_twin, tiny_model

PROMPT = [3, 9, 4, 17, 3, 9, 4, 22, 5, 31]
TREE = Draft(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, 0, -1, 2, 2]), None)


def scores(model):
    """Prefill logits, a tree's logits, and one level grown on top of an uncommitted tree (as draft models do)."""
    cache = model.new_cache(64)
    first = prefill(model, cache, PROMPT)  # [V]
    tree = forward_tree(model, cache, 11, TREE)  # [6, V]
    # a second forward while the tree is still uncommitted: one query that sees the root and node 2 only
    seen = torch.tensor([[True, False, False, True, False, False, True]])
    grown = model.forward(cache, torch.tensor([12]), torch.tensor([len(PROMPT) + 2]), seen)  # [1, V]
    return torch.cat([first[None], tree, grown])


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma3"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.1)])
def test_native_logits_match_transformers(family, dtype, tol):
    hf = tiny_model(family, seed=3, dtype=dtype)
    expected, actual = scores(hf), scores(native_twin(hf))
    assert (expected - actual).abs().max() <= tol * expected.abs().max()


def test_native_gemma3_slides_its_window_over_a_long_context():
    """Past the sliding window (6 in the tiny config), every decode step must still match transformers."""
    hf = tiny_model("gemma3", seed=5)
    native = native_twin(hf)
    prompt = [(7 * i) % 60 + 2 for i in range(20)]
    expected = generate(hf, build_drafter("none", hf), prompt, 24, SamplingParams())[0]
    assert generate(native, build_drafter("none", native), prompt, 24, SamplingParams())[0] == expected


def test_native_sees_the_tree_mask():
    """A planted mistake (attention to everything) must fail the comparison with transformers above."""
    hf = tiny_model("qwen2", seed=3)
    native = native_twin(hf)
    cache = native.new_cache(64)
    prefill(native, cache, PROMPT)
    ids = torch.cat([torch.tensor([11]), TREE.tokens])
    positions = torch.tensor([10, 11, 12, 11, 12, 12])
    everything = torch.ones(6, 6, dtype=torch.bool).tril()
    wrong = native.forward(cache, ids, positions, everything)  # [6, V]
    expected = scores(hf)[1:7]  # transformers' tree logits, with the right mask
    assert (wrong - expected).abs().max() > 1e-5 * expected.abs().max() * 100  # 100x the float32 tolerance
    leaked = (wrong - expected).abs().amax(-1) > 1e-4 * expected.abs().max()  # [6]: rows the leak changed
    # the root and node 0 (whose ancestors come first in the flat order) see the same tokens either way
    assert leaked.tolist() == [False, False, False, True, True, True]


@pytest.mark.parametrize("quant,bound", [("int8", 0.02), ("int4", 0.25)])
def test_quantization_error_is_bounded(quant, bound):
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.05  # [N, K]
    x = torch.randn(12, 128)
    exact = x @ weight.T
    layer = Linear.of(weight, None, quant, torch.float32)
    for rows in (1, 12):
        out = layer(x[:rows])
        assert (out - exact[:rows]).norm() <= bound * exact[:rows].norm()
    assert torch.equal(layer(x[:1]), layer(x)[:1])  # a row's result does not depend on the other rows


@pytest.mark.real_model
@pytest.mark.parametrize("quant,error,agreement", [("int8", 0.08, 0.95), ("int4", 0.12, 0.9)])
def test_quantized_smollm2_stays_close_to_dense(smollm2, quant, error, agreement):
    """Teacher-forced logits over a text: relative error and top-1 agreement against the float weights."""
    quantized = load_model("smollm2-135m-instruct", "float32", quant=quant)
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)\n\nParis is in France."
    ids = torch.tensor(smollm2.tokenizer(text)["input_ids"])
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    dense, approx = (m.forward(m.new_cache(len(ids)), ids, torch.arange(len(ids)), causal) for m in (smollm2, quantized))
    assert (approx - dense).norm() <= error * dense.norm()
    assert (approx.argmax(-1) == dense.argmax(-1)).float().mean() >= agreement


def test_prepared_weights_cache_round_trip(tmp_path, monkeypatch):
    """The second load reads the quantized layers from the cache file instead of quantizing again."""
    from specdecode.models import native
    from specdecode.models.native import linear, weights

    hf = tiny_model("llama", seed=3)
    config, raw = hf.model.config, {k: v.detach() for k, v in hf.model.state_dict().items()}
    cache_file = tmp_path / "prepared.safetensors"

    def load():
        prepared = weights.PreparedWeights(raw, "int4", torch.float32, cache_file)
        return native.build(config, prepared, hf.tokenizer, "tiny", eos_ids=[])

    first = scores(load())
    assert cache_file.exists()
    monkeypatch.setattr(weights, "prepare", lambda *a: pytest.fail("prepared again instead of read from the cache"))
    assert torch.equal(scores(load()), first)


@pytest.mark.real_model
def test_smollm2_native_greedy_identical_to_transformers(smollm2):
    hf = load_model("smollm2-135m-instruct", "float32", backend="hf")
    prompt = hf.tokenizer("def fibonacci(n):")["input_ids"]
    plain = SamplingParams()
    expected, _ = generate(hf, build_drafter("none", hf), prompt, 32, plain)
    actual, _ = generate(smollm2, build_drafter("none", smollm2), prompt, 32, plain)
    assert type(smollm2).__name__ != type(hf).__name__
    assert actual == expected


def test_quant_needs_the_native_backend():
    with pytest.raises(SpecDecodeError, match="native backend"):
        load_model("smollm2-135m-instruct", "bfloat16", backend="hf", quant="int4")
