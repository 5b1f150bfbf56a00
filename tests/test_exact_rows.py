"""Row-exact verification: with int4/int8 weights (specdecode's kernels), a forward over N rows (a draft tree, a
batch of requests) gives bit for bit what N one-row forwards give, on the real SmolLM2 weights; and the kernels
themselves compute the right numbers, the same on every code path (AMX, AVX-512 VNNI, AVX2, scalar)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from specdecode import kernels
from specdecode.cache import KVPool
from specdecode.models.base import HiddenStates, prefill, tree_request
from specdecode.models.loading import load_model
from specdecode.models.native.linear import Linear, dequantize
from specdecode.tree import Draft, ancestor_mask, with_root

pytestmark = pytest.mark.skipif(kernels.native() is None, reason="the kernels cannot be built here")


def not_run_because(isa: str) -> str | None:
    """Why this machine does not run a code path, or None where it does (its CPU flags, the OS lending AMX, and the
    build having the AMX code)."""
    if kernels.unsupported_because(isa):
        return f"{isa}: {kernels.unsupported_because(isa)}"
    if isa == "avx512-amx" and kernels.native() is not None and not kernels.native().module.amx_built():
        return "avx512-amx: this build has no AMX code (the compiler lacks its intrinsics)"
    return None


NOT_RUN = {isa: not_run_because(isa) for isa in kernels.ISAS}
PATHS = [isa for isa, why in NOT_RUN.items() if why is None]  # the paths this machine runs, slowest first
EVERY_PATH = [  # as a parameter: the paths this machine cannot run are reported as skipped, with the reason
    pytest.param(isa, marks=pytest.mark.skip(reason=why)) if why else isa for isa, why in NOT_RUN.items()
]


def on(isa: str) -> kernels.Kernels:
    return kernels.Kernels(kernels.native().module, isa)


@pytest.mark.skipif(bool(os.environ.get("SPECDECODE_ISA")), reason="SPECDECODE_ISA forces a path")
def test_the_kernels_run_on_the_fastest_path_built():
    """What native() picks is the last path this machine runs (a build without AMX code says so instead)."""
    assert kernels.native().isa == PATHS[-1]


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_quantized_linear_is_exact_per_row_and_path(quant):
    torch.manual_seed(0)
    # N not a multiple of 16: AMX takes the first 32 rows, AVX-512 the rest, in one call
    weight, bias, x = torch.randn(72, 96) * 0.05, torch.randn(72), torch.randn(37, 96)
    layer = Linear.of(weight, bias, quant, torch.float32)
    y = layer(x)  # [37, 72]
    # the function: de-quantized weights times the input, up to the int8 rounding of the activations
    reference = x @ dequantize(layer.packed, quant)[:72].T + bias
    assert (y - reference).norm() <= 0.01 * reference.norm()
    assert torch.equal(y, torch.cat([layer(x[i : i + 1]) for i in range(37)]))
    bits = 8 if quant == "int8" else 4
    outputs = [on(isa).quant_linear(x, layer.packed, bits) for isa in PATHS]
    assert all(torch.equal(outputs[0], out) for out in outputs[1:]), f"paths {PATHS} disagree"


@pytest.mark.parametrize("isa", EVERY_PATH)
@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_many_rows_run_in_passes_and_each_row_is_still_computed_alone(isa, quant):
    """A prefill's rows go through the weights in passes of a block of rows (kernels' ROW_BLOCK): a row's numbers
    do not depend on its pass or its place in it."""
    torch.manual_seed(1)
    bits = 8 if quant == "int8" else 4
    layer = Linear.of(torch.randn(48, 288) * 0.05, None, quant, torch.float32)  # 9 blocks: AMX's groups of 8 and 1
    x = torch.randn(300, 288)  # more rows than a pass holds, not a multiple of it
    y = on(isa).quant_linear(x, layer.packed, bits)
    for i in (0, 15, 16, 127, 128, 129, 255, 256, 299):
        assert torch.equal(y[i : i + 1], on(isa).quant_linear(x[i : i + 1], layer.packed, bits)), f"row {i}"
    reference = x @ dequantize(layer.packed, quant)[:48].T
    assert (y - reference).norm() <= 0.01 * reference.norm()


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_the_prompt_arithmetic_computes_each_row_alone(quant):
    """A prefill's layers (kernels.prompt_arithmetic): on AMX bfloat16 tiles, each row's numbers its own whatever
    rows share the call (1 row, a partial group of 32, many groups; a column tile without its pair), close to the
    de-quantized weights times the bfloat16-rounded input; elsewhere the int8 arithmetic, unchanged."""
    torch.manual_seed(2)
    bits = 8 if quant == "int8" else 4
    layer = Linear.of(torch.randn(80, 1088) * 0.05, None, quant, torch.float32)  # 5 column tiles, 34 blocks
    kernel = kernels.native()
    x = torch.randn(77, 1088)
    with kernels.prompt_arithmetic():
        y = kernel.fused_linear(x, layer.packed, bits, 80)
        alone = [kernel.fused_linear(x[i : i + 1], layer.packed, bits, 80) for i in (0, 31, 32, 63, 64, 76)]
        some = kernel.fused_linear(x[30:70], layer.packed, bits, 80)
    assert all(torch.equal(y[i : i + 1], row) for i, row in zip((0, 31, 32, 63, 64, 76), alone))
    assert torch.equal(y[30:70], some)
    decode = kernel.fused_linear(x, layer.packed, bits, 80)
    if kernel.isa != "avx512-amx":
        assert torch.equal(y, decode)
        return
    weights = dequantize(layer.packed, quant)[:80]
    reference = x.bfloat16().float() @ weights.bfloat16().float().T
    assert (y - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert not torch.equal(y, decode)  # the other arithmetic: why only prompts take it


KV_DTYPES = [torch.float32, torch.bfloat16, torch.int8]


def cache_of(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """Keys or values [..., D] float32 in a KV cache format: float32, bfloat16 or int8 entries [..., D + 8]."""
    return kernels.native().quantize_entries(x) if kv_dtype == torch.int8 else x.to(kv_dtype)


def dequantized(cache: torch.Tensor) -> torch.Tensor:
    """A cache's entries as the float32 numbers they stand for."""
    if cache.dtype != torch.int8:
        return cache.float()
    d = cache.shape[-1] - 8
    scales = cache[..., d : d + 4].contiguous().view(torch.float32)  # [..., 1]
    return cache[..., :d].float() * scales


def expected_attention(queries, k_cache, v_cache, mask, keys: int, scale: float) -> torch.Tensor:
    """torch's attention over the caches' first `keys` entries as float32: [B, q, Hq * D]."""
    b, hq, q, d = queries.shape
    group = hq // k_cache.shape[1]
    return F.scaled_dot_product_attention(
        queries, dequantized(k_cache[:, :, :keys]).repeat_interleave(group, 1),
        dequantized(v_cache[:, :, :keys]).repeat_interleave(group, 1), attn_mask=mask[:, None], scale=scale,
    ).transpose(1, 2).reshape(b, q, hq * d)


def assert_attention_close(out, expected, kv_dtype):
    """Float caches: the same function up to float32 rounding; int8: up to the queries' int8 rounding as well."""
    if kv_dtype == torch.int8:
        assert (out - expected).norm() <= 0.02 * expected.norm()
    else:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_int8_entries_hold_codes_and_a_scale():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    entries = kernels.native().quantize_entries(x)  # [2, 4 + 8]
    assert entries.shape == (2, 12) and entries.dtype == torch.int8
    assert entries[0, :4].tolist() == [64, -127, 32, 0]  # 0.5 * 127 = 63.5 -> 64 (to even); 0.25 * 127 -> 32
    assert dequantized(entries)[0, 1].item() == pytest.approx(-1.0)
    assert entries[1].tolist() == [0] * 12  # all zero: scale 0, codes 0


@pytest.mark.parametrize("isa", EVERY_PATH)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_tree_attention_matches_sdpa_and_skips_hidden_keys(isa, kv_dtype):
    torch.manual_seed(1)
    b, hq, hkv, q, d, keys = 2, 6, 2, 5, 64, 30
    queries = torch.randn(b, hq, q, d)
    k_cache, v_cache = cache_of(torch.randn(b, hkv, 40, d), kv_dtype), cache_of(torch.randn(b, hkv, 40, d), kv_dtype)
    mask = torch.rand(b, q, keys) > 0.4
    mask[..., 0] = True
    out = on(isa).tree_attention(queries, k_cache, v_cache, mask, keys, 0.2)  # [B, q, Hq*D]
    assert_attention_close(out, expected_attention(queries, k_cache, v_cache, mask, keys, 0.2), kv_dtype)
    # a row alone, over only its visible keys compacted (what a one-row decode step sees): the same bits
    for row, i in [(0, 0), (1, 3)]:
        visible = mask[row, i].nonzero()[:, 0]
        alone = on(isa).tree_attention(
            queries[row : row + 1, :, i : i + 1].contiguous(), k_cache[row : row + 1, :, visible].contiguous(),
            v_cache[row : row + 1, :, visible].contiguous(), None, len(visible), 0.2,
        )
        assert torch.equal(alone[0, 0], out[row, i])


@pytest.mark.parametrize("isa", EVERY_PATH)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("hq, hkv", [(6, 2), (3, 1), (7, 1), (4, 4), (16, 1)])
def test_many_rows_over_a_long_context_equal_each_row_alone(isa, kv_dtype, hq, hkv):
    """At a long context the rows of a verification (or a prompt) share their keys, which the AVX-512 and AVX2 paths
    read once per tile of rows: each row must still get what it gets alone, a one-row decode step over its visible keys, for
    every head grouping (tiles of 24 / heads rows; 16 heads split into two calls), a causal prompt's rows and a
    tree's rows (ancestors past a shared context), and rows whose visible keys have holes."""
    torch.manual_seed(2)
    b, q, d, context = 2, 13, 64, 2500
    keys = context + q
    queries = torch.randn(b, hq, q, d)
    k_cache = cache_of(torch.randn(b, hkv, keys + 3, d), kv_dtype)
    v_cache = cache_of(torch.randn(b, hkv, keys + 3, d), kv_dtype)
    parents = [-1, 0, 1, 1, 0, 4, 5, 2, 3, 3, 6, 9, 11]  # a tree over the q new rows (row 0 the root)
    tree = ancestor_mask(torch.tensor(parents))  # [q, q]
    mask = torch.ones(b, q, keys, dtype=torch.bool)
    mask[0, :, context:] = tree  # batch row 0: a tree after the context
    mask[1, :, context:] = torch.ones(q, q, dtype=torch.bool).tril()  # batch row 1: causal (a prompt's tail)
    mask[1, 5, 101:900] = False  # a hole in the shared context (an odd shared run: bfloat16 pairs cross it)
    out = on(isa).tree_attention(queries, k_cache, v_cache, mask, keys, 0.125)  # [B, q, Hq*D]
    for row in range(b):
        for i in range(q):
            visible = mask[row, i].nonzero()[:, 0]
            alone = on(isa).tree_attention(
                queries[row : row + 1, :, i : i + 1].contiguous(), k_cache[row : row + 1, :, visible].contiguous(),
                v_cache[row : row + 1, :, visible].contiguous(), None, len(visible), 0.125,
            )
            assert torch.equal(alone[0, 0], out[row, i]), f"batch row {row}, query row {i}"
    assert_attention_close(out, expected_attention(queries, k_cache, v_cache, mask, keys, 0.125), kv_dtype)


AVX512_PATHS = [isa for isa in PATHS if isa.startswith("avx512")]


def shares_bits(a: str, b: str, kv_dtype: torch.dtype) -> bool:
    """Whether two AVX-512 paths give the same attention bits: all of them do, except that with BF16 (and on AMX,
    which has it) an int8 cache's value sums run in bfloat16 pairs."""
    return kv_dtype != torch.int8 or (a == "avx512-vnni") == (b == "avx512-vnni")


@pytest.mark.skipif(len(AVX512_PATHS) < 2, reason=f"fewer than two AVX-512 paths run here (paths: {PATHS})")
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("hq, hkv, d, q", [(6, 2, 128, 13), (6, 2, 128, 1), (16, 1, 64, 5), (3, 1, 256, 9)])
def test_the_avx512_paths_give_the_same_attention_bits(kv_dtype, hq, hkv, d, q):
    """AMX's key dot products (int8 cache) are the exact integers AVX-512 VNNI computes, and the rest of the tile is
    shared: AMX and AVX-512 BF16 give the same bits for every row, and AVX-512 VNNI too except for an int8 cache's
    value sums (float32 FMAs there, bfloat16 pairs with BF16: close, and not the same bits, which shows the pairs
    ran). (The AVX2 and scalar rows reduce floats in 8-lane and scalar order, so their attention differs from these
    in the last bits.)"""
    torch.manual_seed(3)
    b, context = 2, 1201
    keys = context + q
    queries = torch.randn(b, hq, q, d)
    k_cache = cache_of(torch.randn(b, hkv, keys, d), kv_dtype)
    v_cache = cache_of(torch.randn(b, hkv, keys, d), kv_dtype)
    mask = torch.ones(b, q, keys, dtype=torch.bool)
    mask[0, :, context:] = ancestor_mask(torch.tensor([-1] + [i // 2 for i in range(q - 1)]))  # a tree
    mask[1, :, context:] = torch.ones(q, q, dtype=torch.bool).tril()  # a prompt's causal rows
    mask[1, 0, 37:501] = False  # a hole
    outputs = {isa: on(isa).tree_attention(queries, k_cache, v_cache, mask, keys, d**-0.5) for isa in AVX512_PATHS}
    first = AVX512_PATHS[0]
    for isa, out in outputs.items():
        if shares_bits(isa, first, kv_dtype):
            assert torch.equal(out, outputs[first]), f"{isa} differs from {first}"
        else:
            assert not torch.equal(out, outputs[first]) and (out - outputs[first]).norm() <= 0.01 * out.norm()


@pytest.mark.parametrize("isa", EVERY_PATH)
def test_row_ops_match_torch_and_are_exact_per_row(isa):
    torch.manual_seed(2)
    x, weight, gate_up = torch.randn(6, 200) * 3, torch.randn(200), torch.randn(6, 2 * 75) * 4
    ops = on(isa)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), F.rms_norm(x, (200,), weight, 1e-6))
    assert torch.equal(ops.rms_norm(x, weight, 1e-6)[2:3], ops.rms_norm(x[2:3], weight, 1e-6))
    gate, up = gate_up.chunk(2, -1)
    for gelu, act in [(False, F.silu(gate)), (True, F.gelu(gate, approximate="tanh"))]:
        torch.testing.assert_close(ops.glu(gate_up, gelu), act * up, atol=1e-5, rtol=1e-5)
        assert torch.equal(ops.glu(gate_up, gelu)[4:5], ops.glu(gate_up[4:5], gelu))


@pytest.mark.parametrize("isa", EVERY_PATH)
@pytest.mark.parametrize("pre", [None, "norm", "silu", "gelu"])
def test_fused_linear_gives_the_separate_ops_bits(isa, pre):
    """A decoder layer's linear step in one native call (input norm or gated activation, linear, bias, output norm,
    residual add) computes each row exactly as the separate calls do, and each row as it would alone."""
    torch.manual_seed(3)
    ops = on(isa)
    k = 64
    layer = Linear.of(torch.randn(40, k) * 0.05, torch.randn(40), "int4", torch.float32)  # 40: padded to 48 columns
    x = torch.randn(5, 2 * k if pre in ("silu", "gelu") else k) * 2
    norm, post_norm, residual = torch.randn(k), torch.randn(40), torch.randn(5, 40)
    expected = x
    if pre == "norm":
        expected = ops.rms_norm(x, norm, 1e-6)
    elif pre is not None:
        expected = ops.glu(x, pre == "gelu")
    expected = ops.quant_linear(expected.contiguous(), layer.packed, 4)[:, :40] + layer.bias
    expected = residual + ops.rms_norm(expected.contiguous(), post_norm, 1e-6)
    act = pre if pre in ("silu", "gelu") else None
    fused = lambda rows, into: ops.fused_linear(  # noqa: E731
        x[rows], layer.packed, 4, 40, layer.bias, norm if pre == "norm" else None, act, post_norm, into, 1e-6
    )
    into = residual.clone()
    assert fused(slice(None), into) is into  # updated in place
    assert torch.equal(into, expected)
    assert torch.equal(fused(slice(3, 4), residual[3:4].clone()), expected[3:4])
    bare = ops.fused_linear(x[:, :k].contiguous(), layer.packed, 4, 40)  # no pre, bias, post-norm or residual
    assert torch.equal(bare, ops.quant_linear(x[:, :k].contiguous(), layer.packed, 4)[:, :40])


@pytest.mark.parametrize("isa", EVERY_PATH)
@pytest.mark.parametrize("normed, kv_dtype", [(False, torch.float32), (True, torch.float32), (True, torch.int8)])
def test_attention_step_gives_the_separate_ops_bits(isa, normed, kv_dtype):
    """Query/key norms, rotary, the cache write and attention in one native call: the same numbers as the separate
    kernels, the same cache entries, and a one-token call (its query heads split across threads) gives the row the
    batched call gave."""
    torch.manual_seed(4)
    ops = on(isa)
    b, q, hq, hkv, d, capacity = 2, 3, 4, 1, 64, 12
    qkv = torch.randn(b * q, (hq + 2 * hkv) * d)
    q_norm, k_norm = (torch.randn(d), torch.randn(d)) if normed else (None, None)
    cos, sin = torch.randn(b, q, d), torch.randn(b, q, d)
    keys = cache_of(torch.randn(b, hkv, capacity, d), kv_dtype)
    values = cache_of(torch.randn(b, hkv, capacity, d), kv_dtype)
    slots = torch.tensor([[4, 5, 6], [2, 3, 4]])  # row 1's cache is shorter; keys beyond its entries are masked
    mask = torch.zeros(b, q, 7, dtype=torch.bool)
    mask[0, :, :4] = mask[1, :, :2] = True
    mask[:, torch.arange(q), slots] = True  # each new row sees itself
    mask[0, 2, 5] = True  # and row 0's third token sees the second
    # the separate kernels
    heads = qkv.view(b, q, hq + 2 * hkv, d).transpose(1, 2)  # [B, H, q, D]
    queries, new_keys = heads[:, :hq], heads[:, hq : hq + hkv]
    if normed:
        queries = ops.rms_norm(queries.reshape(-1, d).contiguous(), q_norm, 1e-6).view(b, hq, q, d)
        new_keys = ops.rms_norm(new_keys.reshape(-1, d).contiguous(), k_norm, 1e-6).view(b, hkv, q, d)
    queries, new_keys = ops.rotary(queries, cos, sin), ops.rotary(new_keys, cos, sin)
    expected_keys, expected_values = keys.clone(), values.clone()
    for row in range(b):
        expected_keys[row, :, slots[row]] = cache_of(new_keys[row].contiguous(), kv_dtype)
        expected_values[row, :, slots[row]] = cache_of(heads[row, hq + hkv :].contiguous(), kv_dtype)
    expected = ops.tree_attention(queries, expected_keys, expected_values, mask, 7, 0.3).view(b * q, hq * d)

    out = ops.attention_step(qkv, hq, hkv, q_norm, k_norm, 1e-6, cos, sin, keys, values, slots, 7, mask, 0.3)
    assert torch.equal(out, expected)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    # row 0's first token alone, as a decode step over the 5 entries it sees (its own written by the call)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    try:
        alone = ops.attention_step(qkv[:1], hq, hkv, q_norm, k_norm, 1e-6, cos[:1, :1].contiguous(),
                                   sin[:1, :1].contiguous(), keys[:1].clone(), values[:1].clone(),
                                   torch.tensor([[4]]), 5, None, 0.3)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, out[:1])


# --- the whole model, real weights ---------------------------------------------------------------------------------

TREE = Draft(torch.tensor([28, 253, 314, 1099, 17, 42, 9]), torch.tensor([-1, 0, 1, -1, 3, 3, 5]))


def one_row_logits(model, prompt: list[int], path: list[int], prompt_arithmetic: bool = True) -> torch.Tensor:
    """The logits after `path`, decoding it one token per forward after the prompt (plain decoding's forwards)."""
    cache = model.new_cache(len(prompt) + len(path) + 1)
    prefill(model, cache, prompt, prompt=prompt_arithmetic)
    for token in path:
        logits = model.forward(cache, torch.tensor([token]), torch.tensor([cache.length]), torch.ones(1, 1, dtype=torch.bool))
        cache.commit_all()
    return logits[0]


def node_paths(draft: Draft, root: int) -> list[list[int]]:
    """[root, ..., node] for the root and every node."""
    parents = with_root(draft.parents).tolist()
    tokens = [root] + draft.tokens.tolist()
    paths = []
    for node in range(len(tokens)):
        path, at = [], node
        while at >= 0:
            path.append(tokens[at])
            at = parents[at]
        paths.append(path[::-1])
    return paths


MODEL_CASES = [  # weights+KV cache@code path: every format on the fastest path, two on each other path
    *(f"{case}@{PATHS[-1]}" for case in ("int4", "int8", "int4+bf16", "int4+int8")),
    *(f"{case}@{isa}" for isa in PATHS[:-1] for case in ("int4", "int8+int8")),
    *(pytest.param(f"int4@{isa}", marks=pytest.mark.skip(reason=why)) for isa, why in NOT_RUN.items() if why),
]


def load_on_path(isa: str, quant: str, kv_cache: str = "auto"):
    """SmolLM2 with its kernels bound to one code path (SPECDECODE_ISA while it loads)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDECODE_ISA", isa)
        model = load_model("smollm2-135m-instruct", "bfloat16", quant=quant, kv_cache=kv_cache)
    assert model.ops.kernels.isa == isa
    return model


@pytest.fixture(scope="module", params=MODEL_CASES)
def quantized_smollm2(request, smollm2):
    """Quantized weights, with a float32 KV cache or (+bf16, +int8) a bfloat16 or int8 one, on one code path: the
    rows are exact with each."""
    formats, _, isa = request.param.partition("@")
    quant, _, kv_cache = formats.partition("+")
    model = load_on_path(isa, quant, kv_cache or "auto")
    assert model.new_cache(1).keys.dtype == {"bf16": torch.bfloat16, "int8": torch.int8}.get(kv_cache, torch.float32)
    return model


@pytest.mark.real_model
def test_a_tree_forward_equals_one_row_forwards_bit_for_bit(quantized_smollm2):
    model = quantized_smollm2
    assert model.ops.exact
    prompt = model.tokenizer("def fibonacci(n):\n    ")["input_ids"]
    cache = model.new_cache(len(prompt) + 16)
    prefill(model, cache, prompt[:-1])
    tree_logits = tree_request(cache, prompt[-1], TREE).run(model)  # [N+1, V]
    for node, path in enumerate(node_paths(TREE, prompt[-1])):
        assert torch.equal(tree_logits[node], one_row_logits(model, prompt[:-1], path)), f"node {node} differs"


@pytest.mark.real_model
def test_a_prompt_forward_equals_one_row_forwards_bit_for_bit(quantized_smollm2):
    """A forward of many rows in decoding's arithmetic (40 rows: on AMX machines the kernels' int8 tile path takes
    the first 32) leaves the cache and the last logits that decoding them one token at a time leaves. (A target's
    prompt runs in the prompt arithmetic instead, exact among prompts: the next test.)"""
    model = quantized_smollm2
    prompt = model.tokenizer("def fibonacci(n):\n    " + "a, b = b, a + b\n    " * 6)["input_ids"][:40]
    assert len(prompt) == 40
    cache = model.new_cache(len(prompt) + 2)
    prefill(model, cache, prompt[:-1], prompt=False)
    together = tree_request(cache, prompt[-1], Draft.empty()).run(model)[0]  # the logits after the whole prompt
    assert torch.equal(together, one_row_logits(model, prompt[:1], prompt[1:], prompt_arithmetic=False))


@pytest.mark.real_model
def test_a_prompt_in_chunks_leaves_what_one_forward_leaves(quantized_smollm2, monkeypatch):
    """A long prompt is prefilled in forwards of PREFILL_CHUNK rows: the logits, the cache and the hidden states it
    leaves are bit for bit those of one forward over the whole prompt (here chunks of 16 rows over 40, the last
    of 8), in the prompt arithmetic."""
    from specdecode.models import base

    model = quantized_smollm2
    prompt = model.tokenizer("def fibonacci(n):\n    " + "a, b = b, a + b\n    " * 6)["input_ids"][:40]
    results = []
    for chunk in (len(prompt), 16):
        monkeypatch.setattr(base, "PREFILL_CHUNK", chunk)
        cache, hidden = model.new_cache(len(prompt)), HiddenStates((0, 3, model.n_layers))
        logits = prefill(model, cache, prompt, hidden)
        results.append((logits, cache.keys[:, :, :, : cache.length].clone(), hidden.states))
    (whole, whole_keys, whole_states), (chunked, chunked_keys, chunked_states) = results
    assert torch.equal(whole, chunked) and torch.equal(whole_keys, chunked_keys)
    assert chunked_states.shape == (3, len(prompt), whole_states.shape[-1])
    assert torch.equal(whole_states, chunked_states)


@pytest.mark.real_model
def test_a_batch_of_requests_equals_each_row_alone_bit_for_bit(quantized_smollm2):
    model = quantized_smollm2
    prompts = [model.tokenizer(text)["input_ids"] for text in ("Paris is", "import numpy as np\n", "1, 2, 3, 4,")]
    drafts = [Draft.chain([5, 6]), TREE, Draft.empty()]
    pool = KVPool()
    caches = []
    for prompt in prompts:
        cache = model.new_cache(len(prompt) + 16)
        prefill(model, cache, prompt[:-1])
        pool.adopt(cache)
        caches.append(cache)
    batched = model.forward_batch([tree_request(c, p[-1], d) for c, p, d in zip(caches, prompts, drafts)])
    for logits, prompt, draft in zip(batched, prompts, drafts):
        for node, path in enumerate(node_paths(draft, prompt[-1])):
            assert torch.equal(logits[node], one_row_logits(model, prompt[:-1], path))


@pytest.mark.real_model
@pytest.mark.skipif(len(PATHS) < 2, reason=f"one code path runs here ({PATHS})")
def test_every_path_computes_the_same_tree_logits(smollm2):
    """The whole model on each code path (int4 weights, float32 KV cache, decoding's arithmetic for the prompt too):
    the AVX-512 paths give the same bits, since their linear layers and attention do; AVX2 and scalar the same
    numbers up to rounding, since their attention sums floats in another order (and a last-bit difference can move
    an activation's int8 rounding in the next layer)."""
    prompt = smollm2.tokenizer("def fibonacci(n):\n    ")["input_ids"]
    logits = {}
    for isa in PATHS:
        model = load_on_path(isa, "int4")
        cache = model.new_cache(len(prompt) + 16)
        prefill(model, cache, prompt[:-1], prompt=False)
        logits[isa] = tree_request(cache, prompt[-1], TREE).run(model)  # [N+1, V]
    avx512 = [isa for isa in PATHS if isa.startswith("avx512")]
    for isa in avx512[1:]:
        assert torch.equal(logits[isa], logits[avx512[0]]), f"{isa} differs from {avx512[0]}"
    reference = logits[PATHS[-1]]
    for isa in PATHS:
        assert (logits[isa] - reference).norm() <= 0.05 * reference.norm(), isa
        assert torch.equal(logits[isa].argmax(-1), reference.argmax(-1)), isa


def test_tree_masks_used_here_are_ancestor_masks():
    """The helper's paths agree with the engine's tree mask (a check on the test itself)."""
    mask = ancestor_mask(with_root(TREE.parents))
    for node, path in enumerate(node_paths(TREE, 0)):
        assert int(mask[node].sum()) == len(path)


@pytest.mark.parametrize("quant", ["int4", "int8", "none"])
def test_selected_outputs_are_the_same_numbers(quant):
    """A draft vocabulary's slice of an LM head computes what the whole head computes for those rows: bit for bit
    with quantized weights (the same bytes through the same column-wise kernels), up to torch's rounding if dense."""
    torch.manual_seed(2)
    weight, x = torch.randn(70, 128) * 0.05, torch.randn(3, 128)
    layer = Linear.of(weight, None, quant, torch.float32)
    ids = torch.tensor([0, 3, 17, 18, 40, 69])
    sliced, whole = layer.select_outputs(ids)(x), layer(x)[:, ids]
    assert sliced.shape == (3, 6)
    assert torch.equal(sliced, whole) if quant != "none" else torch.allclose(sliced, whole, atol=1e-6)


def test_rotary_kernel_matches_torch_and_is_the_same_on_every_path():
    from specdecode.models.native.ops import RotaryTable, apply_rotary, inverse_frequencies

    torch.manual_seed(3)
    table = RotaryTable(inverse_frequencies(64, 10000.0), torch.float32)
    positions = torch.tensor([[5, 6, 6, 300], [0, 1, 2, 3]])  # [B, q]: a tree repeats a position
    cos, sin = table(positions)  # [B, 1, q, D]
    x = torch.randn(2, 4, 6, 64).transpose(1, 2)  # [B, H=6, q=4, D], strided like the model's q/k heads
    outputs = [on(isa).rotary(x, cos[:, 0].contiguous(), sin[:, 0].contiguous()) for isa in PATHS]
    assert torch.allclose(outputs[0], apply_rotary(x, cos, sin), atol=1e-6)
    assert all(torch.equal(outputs[0], out) for out in outputs[1:]), f"paths {PATHS} disagree"
