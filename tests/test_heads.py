"""Feature-level draft heads: the training-time-test mask, the draft vocabulary, the trainer on a tiny target
(loss falls, checkpoints resume), head folders (ours, speculators, the original EAGLE layouts) and their drafters'
losslessness with imported heads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from specdecode import kernels
from specdecode.drafters import build_drafter
from specdecode.engine import generate
from specdecode.errors import SpecDecodeError
from specdecode.heads.layer import Linear, quantize_head, step_mask
from specdecode.heads.speculators_format import export_speculators
from specdecode.heads.store import load_head, save_head
from specdecode.heads.target import new_head
from specdecode.sampling import SamplingParams
from specdecode.data.sharegpt import records
from specdecode.train.extract import FeatureStore
from specdecode.train.trainer import Budget, TrainingRun, draft_vocabulary, initial_head

from conftest import greedy_sequences, native_twin, tiny_model

GREEDY = SamplingParams()
PROMPTS = [[3, 9, 4, 17, 3, 9, 4, 22, 3, 9], [11, 5, 60, 2, 33, 48, 7, 1]]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=1)


def test_training_time_test_mask():
    mask = step_mask(3, 2)  # [3, 9]: causal over step 0, then each later step's key at the query's own row
    assert mask.int().tolist() == [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]


def test_draft_vocabulary_is_the_most_frequent_answer_tokens_and_d2t_maps_back(target):
    sequences = [{"ids": torch.tensor([1, 2, 9, 9, 9, 5, 5, 7]), "prompt_len": 2},
                 {"ids": torch.tensor([9, 3, 3, 5]), "prompt_len": 1}]
    chosen = draft_vocabulary(sequences, 3, 64)  # answers: 9 x3, 5 x3, 3 x2, 7 x1 (prompt tokens 1, 2, 9 ignored)
    assert chosen.tolist() == [3, 5, 9]
    assert draft_vocabulary(sequences, 6, 64).tolist() == [1, 2, 3, 5, 7, 9]  # then prompt tokens (1, 2)
    assert draft_vocabulary(sequences, 7, 64).tolist() == [0, 1, 2, 3, 5, 7, 9]  # then the lowest unused id
    head = new_head("eagle3", target, draft_vocab_size=3)
    head.set_vocabulary(chosen)
    assert head.target_ids().tolist() == [3, 5, 9]
    assert head.t2d.nonzero().flatten().tolist() == [3, 5, 9]


def test_sharegpt_records_stop_at_the_last_complete_record():
    text = '[\n {"id": "a", "conversations": []},\n {"id": "b", "conversations": [{"from": "hu'
    assert [r["id"] for r in records(text)] == ["a"]


@pytest.mark.parametrize("kind", ["eagle", "fspad", "eagle3", "medusa", "hydra"])  # hass: test_variant_kinds_...
def test_training_lowers_the_loss_and_resumes_from_its_checkpoint(target, tmp_path, kind, monkeypatch):
    from specdecode import files
    from specdecode.heads import head_kind

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    assert files.cache_root() == tmp_path / "cache"
    store = FeatureStore(tmp_path / "features")
    fused = head_kind(kind).reads_layer_states
    layers = head_kind(kind).feature_layers(target) if fused else []
    store.extract(target, greedy_sequences(target, 12), layers, fused, {"test": kind}, shard_tokens=150)
    assert len(store.manifest["shards"]) > 1  # several shards, read back in order
    sequences = store.load()
    assert [len(s["ids"]) for s in sequences] == [30] * 12
    budget = Budget(epochs=1, draft_vocab=32, ttt_steps=2, medusa_heads=2, lr=3e-3, warmup=2, batch=2, eval_tokens=8)
    run = TrainingRun(kind, initial_head(kind, target, sequences, budget), target, sequences, tmp_path, budget, "cpu", False)
    first = run.run(PROMPTS[:1])
    assert first["epoch"] == 1 and first["history"][0]["tau"] >= 1.0
    more = Budget(**{**budget.__dict__, "epochs": 4})
    resumed = TrainingRun(kind, initial_head(kind, target, sequences, more), target, sequences, tmp_path, more, "cpu", False)
    assert resumed.state["epoch"] == 1  # picked up the checkpoint
    history = resumed.run(PROMPTS[:1])["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    assert history[-1]["loss"] < history[0]["loss"]
    trained = load_head(tmp_path / "cache" / "heads" / target.name / kind)  # published where drafters look
    assert torch.equal(trained.state_dict()[next(iter(trained.state_dict()))], resumed.head.state_dict()[next(iter(trained.state_dict()))])


def test_a_new_head_kind_is_one_class_and_its_registration(target, tmp_path, monkeypatch):
    """A kind declared outside the package (Medusa heads whose loss this test counts) is trained by the trainer with
    its own loss, listed by `specdecode train`, stored and found under its own name, and drafts through the drafter
    it names, losslessly; a drafter it does not name refuses it with the fix."""
    from specdecode.cli import build_parser
    from specdecode.heads import HEAD_KINDS, register_kind
    from specdecode.heads.medusa import MedusaKind

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    batches = []

    @register_kind("medusa-counted")
    class CountedMedusa(MedusaKind):
        drafter = "medusa"

        def loss(self, head, batch, frozen, budget, train=True):
            batches.append(batch["ids"].shape[0])
            return super().loss(head, batch, frozen, budget, train)

    try:
        assert build_parser().parse_args(["train", "medusa-counted", "--model", "m"]).kind == "medusa-counted"
        sequences = greedy_sequences(target, 6)
        store = FeatureStore(tmp_path / "features")
        store.extract(target, sequences, [], False, {"test": "new kind"})
        budget = Budget(epochs=1, medusa_heads=2, lr=3e-3, warmup=1, batch=2, eval_tokens=8)
        head = initial_head("medusa-counted", target, store.load(), budget)
        run = TrainingRun("medusa-counted", head, target, store.load(), tmp_path, budget, "cpu", False)
        report = run.run(PROMPTS[:1])
        assert sum(batches) == 6 and report["history"][0]["tau"] >= 1.0
        stored = load_head(tmp_path / "cache" / "heads" / target.name / "medusa-counted", "medusa")
        assert stored.config.kind == "medusa-counted" and stored.config.num_heads == 2
        plain = generate(target, build_drafter("none", target), PROMPTS[0], 20, GREEDY)[0]
        assert generate(target, build_drafter("medusa", target, draft_model=stored), PROMPTS[0], 20, GREEDY)[0] == plain
        refused = "medusa-counted head cannot drive the eagle drafter.*--drafter medusa"
        with pytest.raises(SpecDecodeError, match=refused):
            build_drafter("eagle", target, draft_model=stored)
    finally:
        HEAD_KINDS.pop("medusa-counted")


def test_a_narrower_head_trains_saves_and_exports_with_its_own_width(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    store = FeatureStore(tmp_path / "features")
    store.extract(target, greedy_sequences(target, 4), [0, 1, 1], True, {"test": "narrow"})
    sequences = store.load()
    budget = Budget(epochs=1, draft_vocab=32, ttt_steps=2, lr=3e-3, warmup=1, batch=2, intermediate_size=24)
    head = initial_head("eagle3", target, sequences, budget)
    assert head.layer.mlp.up_proj.weight.shape[0] == 24 != new_head("eagle3", target).config.intermediate_size
    TrainingRun("eagle3", head, target, sequences, tmp_path, budget, "cpu", False).run(PROMPTS[:1])
    trained = load_head(tmp_path / "cache" / "heads" / target.name / "eagle3")
    assert trained.config.intermediate_size == 24
    config = json.loads((export_speculators(trained, tmp_path / "out") / "config.json").read_text())
    assert config["transformer_layer_config"]["intermediate_size"] == 24


@pytest.mark.parametrize("quant", [None, "int8"])
def test_a_head_infers_with_its_weights_as_a_training_step_left_them(quant):
    # torch's fused AdamW changes weights in place without bumping their version, so the inference copy's key cannot
    # see the step: the training forward must drop the copy (train's per-epoch tau once measured the first epoch's)
    torch.manual_seed(0)
    module = torch.nn.Sequential(Linear(64, 16))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1, fused=True)
    x = torch.randn(3, 64)
    quantize_head(module, quant)
    with torch.no_grad():
        before = module(x)
    module(x).square().sum().backward()
    optimizer.step()
    fresh = torch.nn.Sequential(Linear(64, 16))
    fresh.load_state_dict(module.state_dict())
    quantize_head(fresh, quant)
    with torch.no_grad():
        after, expected = module(x), fresh(x)
    assert not torch.equal(after, before)
    assert torch.equal(after, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_training_runs_on_cuda(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    store = FeatureStore(tmp_path / "features")
    store.extract(target, greedy_sequences(target, 4), [0, 1, 1], True, {"test": "cuda"})
    sequences = store.load()
    budget = Budget(epochs=2, draft_vocab=32, ttt_steps=2, lr=3e-3, warmup=1, batch=2)
    run = TrainingRun("eagle3", initial_head("eagle3", target, sequences, budget), target, sequences, tmp_path,
                      budget, "cuda", True)
    assert [h["epoch"] for h in run.run(PROMPTS[:1])["history"]] == [1, 2]


@pytest.mark.parametrize("kind", ["eagle", "fspad", "eagle3", "medusa", "hydra", "kangaroo", "eesd"])
def test_head_folder_loads_back_bit_identically(target, tmp_path, kind):
    head = new_head(kind, target, seed=3, draft_vocab_size=20)
    loaded = load_head(save_head(head, tmp_path / kind), kind)
    assert loaded.config == head.config
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    from specdecode.heads import head_kind

    with pytest.raises(SpecDecodeError, match="not"):
        load_head(tmp_path / kind, "medusa" if head_kind(kind).drafter != "medusa" else "eagle")


def speculators_head(target, tmp_path):
    head = new_head("eagle3", target, seed=4, draft_vocab_size=24)
    head.set_vocabulary(torch.arange(0, 48, 2))
    return head, export_speculators(head, tmp_path / "speculators")


def test_speculators_export_names_and_loads_back_bit_identically(target, tmp_path):
    head, folder = speculators_head(target, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == 24 and config["norm_before_residual"] is False
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["speculators_config"]["algorithm"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == target.name
    from safetensors.torch import load_file

    names = set(load_file(str(folder / "model.safetensors")))
    assert {"fc.weight", "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight",
            "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight", "norm.weight", "lm_head.weight",
            "d2t", "t2d"} <= names
    loaded = load_head(folder, "eagle3")
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.target_ids().tolist() == list(range(0, 48, 2))


def test_speculators_validates_the_exported_config(target, tmp_path):
    eagle3_config = pytest.importorskip("speculators.models.eagle3", reason="speculators is not installed")
    _, folder = speculators_head(target, tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    config = eagle3_config.Eagle3SpeculatorConfig.model_validate(raw)
    assert config.draft_vocab_size == 24 and config.target_vocab_size == target.vocab_size
    assert config.speculators_config.default_proposal_method == "greedy"
    assert config.transformer_layer_config.hidden_size == 32


def save_original_eagle1(head, target, folder):
    """A checkpoint as SafeAILab/EAGLE's EAGLE-1 code saves it: its own parameter names, pytorch_model.bin, a
    Llama config.json; the target's embedding stored alongside (ignored on import)."""
    folder.mkdir()
    state = head.state_dict()
    original = {"embed_tokens.weight": target.embed(torch.arange(target.vocab_size)).clone(),
                "fc.weight": state["fc.weight"], "fc.bias": state["fc.bias"]}
    for name, tensor in state.items():
        if name.startswith("layer."):
            original["layers.0." + name[len("layer."):]] = tensor
    torch.save(original, folder / "pytorch_model.bin")
    c = head.config
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "vocab_size": c.vocab_size,
    }))


def save_original_eagle3(head, folder):
    """EAGLE-3's layout: the decoder layer under `midlayer.`, d2t/t2d, model.safetensors."""
    folder.mkdir()
    original = {}
    for name, tensor in head.state_dict().items():
        if name.startswith("layer."):
            name = "midlayer." + name[len("layer."):]
        elif name.startswith(("input_layernorm.", "hidden_norm.")):
            name = "midlayer." + name
        original[name] = tensor.contiguous()
    save_file(original, str(folder / "model.safetensors"))
    c = head.config
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
    }))


@pytest.mark.parametrize("backend", ["hf", "native"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_original_eagle_checkpoint_imports_and_decodes_losslessly(target, tmp_path, kind, backend):
    head = new_head(kind, target, seed=5, draft_vocab_size=40)
    folder = tmp_path / "original"
    save_original_eagle1(head, target, folder) if kind == "eagle" else save_original_eagle3(head, folder)
    imported = load_head(folder, kind)
    for name, tensor in head.state_dict().items():
        assert torch.equal(imported.state_dict()[name], tensor), name
    model = target if backend == "hf" else native_twin(target)
    for prompt in PROMPTS:
        plain, _ = generate(model, build_drafter("none", model), prompt, 30, GREEDY)
        spec, stats = generate(model, build_drafter(kind, model, draft_model=str(folder)), prompt, 30, GREEDY)
        assert spec == plain
        assert stats.target_forwards + stats.accepted_tokens == len(spec)  # each forward: its accepted + 1


def test_head_of_another_target_is_refused(tmp_path):
    small = tiny_model("llama", seed=1)
    other = tiny_model("llama", seed=2, hidden=48)
    folder = save_head(new_head("eagle", small), tmp_path / "h")
    with pytest.raises(SpecDecodeError, match="hidden size"):
        build_drafter("eagle", other, draft_model=str(folder))


def test_missing_head_and_bad_training_device_are_clear_errors(tmp_path, monkeypatch, capsys):
    from specdecode.cli import main
    from specdecode.heads.store import find_head

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    with pytest.raises(SpecDecodeError, match="specdecode train eagle3 --model some-model"):
        find_head("some-model", "eagle3")
    with pytest.raises(SpecDecodeError, match="not a draft head folder"):
        load_head(tmp_path)
    if not torch.cuda.is_available():
        assert main(["train", "eagle3", "--model", "some-model", "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_batched_regeneration_gives_each_prompt_its_greedy_answer(target):
    from specdecode.train.extract import regenerate_answers

    prompts = [[5, 9, 2], [7, 1, 3, 3, 8, 20], [4], [30, 31, 32, 33]]
    batched = regenerate_answers(target, prompts, 10, batch=3)  # left-padded transformers generate
    alone = [generate(target, build_drafter("none", target), p, 10, GREEDY)[0] for p in prompts]
    assert batched == alone


def test_eagle3_prompt_positions_count_by_their_weight(target):
    from specdecode.heads import head_kind
    from specdecode.heads.eagle3 import eagle3_loss
    from specdecode.train.trainer import make_batches

    store_rows = torch.Generator().manual_seed(3)
    n, d = 12, target.embed(torch.zeros(1, dtype=torch.long)).shape[-1]
    seq = {"ids": torch.randint(0, target.vocab_size, (n,), generator=store_rows), "prompt_len": 6,
           "last": torch.randn(n, d, generator=store_rows), "fused": torch.randn(n, 3 * d, generator=store_rows)}
    head = new_head("eagle3", target)
    frozen = head_kind("eagle3").frozen(target, head)
    changed = {**seq, "last": seq["last"].clone()}
    changed["last"][:4] += 5.0  # the target's distributions at the prompt's first positions only
    for weight, moves in ((0.0, False), (1.0, True)):
        losses = [float(eagle3_loss(head, make_batches([s], 1)[0], frozen, 2, prompt_weight=weight)[0].detach())
                  for s in (seq, changed)]
        assert (losses[0] != losses[1]) == moves


def test_training_data_is_regenerated_until_max_tokens(target, tmp_path, monkeypatch):
    from specdecode.train import trainer
    from specdecode.data.sharegpt import Conversation
    from specdecode.train.extract import Sequence

    convs = [Conversation(str(i), "q", "a") for i in range(200)]
    monkeypatch.setattr(trainer, "sharegpt_text", lambda: "")
    monkeypatch.setattr(trainer, "split", lambda text, count, held: (convs, []))
    # every other prompt is skipped (too long) and answers end early: the first guess falls short
    monkeypatch.setattr(trainer, "chat_sequences", lambda target, chunk, *rest: [
        Sequence([1] * 20, 10) for conv in chunk if int(conv.id) % 2 == 0])
    kept = []
    monkeypatch.setattr(FeatureStore, "extract", lambda self, target, sequences, *rest: kept.extend(sequences))
    budget = Budget(max_tokens=1000, answer_tokens=40, max_prompt=40)
    trainer.prepare_features("eagle", target, tmp_path, budget)
    assert sum(len(s.ids) for s in kept) == 1000


def test_features_record_the_weights_of_the_target_they_came_from(target, tmp_path, monkeypatch, capsys):
    """Features of int4 weights (train --quant int4) never pass for those of the dense weights, or back."""
    from specdecode.cli import main
    from specdecode.train import trainer
    from specdecode.data.sharegpt import Conversation
    from specdecode.train.extract import Sequence

    from conftest import native_twin

    monkeypatch.setattr(trainer, "sharegpt_text", lambda: "")
    monkeypatch.setattr(trainer, "split", lambda text, count, held: ([Conversation("0", "q", "a")] * 10, []))
    monkeypatch.setattr(trainer, "chat_sequences", lambda target, chunk, *rest: [Sequence([1] * 20, 10)] * len(chunk))
    seen = []
    monkeypatch.setattr(FeatureStore, "extract", lambda self, *args: seen.append(args[-1]))
    for model in (target, native_twin(target), native_twin(target, "int4")):
        trainer.prepare_features("eagle", model, tmp_path / model.name, Budget(max_tokens=100))
    assert [s.get("quant") for s in seen] == [None, None, "int4"]  # dense settings as before: their features stay valid
    assert main(["train", "eagle3", "--model", "some-model", "--quant", "int4", "--backend", "hf"]) == 2
    assert "--quant int4 needs the native backend" in capsys.readouterr().err


@pytest.mark.skipif(kernels.native() is None, reason="the kernels cannot be built here")
def test_a_quantized_head_layer_infers_from_int8_weights_and_follows_weight_changes():
    """Heads of a quantized target draft from int8 copies of their weights: close to the float32 product, and
    remade when the weights change (training a head after drafting with it must not draft from stale weights)."""
    torch.manual_seed(5)
    layer = Linear(64, 48, bias=True)
    x = torch.randn(3, 2, 64)
    with torch.no_grad():
        dense = layer(x)
        quantize_head(torch.nn.Sequential(layer), "int8")
        quantized = layer(x)
        assert quantized.shape == dense.shape and not torch.equal(quantized, dense)
        assert (quantized - dense).norm() <= 0.01 * dense.norm()
        layer.weight.mul_(2.0)  # a new version of the weight
        assert (layer(x) - (2 * (dense - layer.bias) + layer.bias)).norm() <= 0.02 * dense.norm()
        for weights in (layer, Linear(64, 48, bias=True).to(torch.bfloat16)):  # bfloat16: its int8 copy copies the bias
            quantize_head(weights, "int8")
            before = weights(x).float()
            weights.bias.add_(1.0)  # a new version of the bias alone
            torch.testing.assert_close(weights(x).float(), before + 1.0, atol=0.02, rtol=0.01)
        layer.quantize(None)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.skipif(kernels.native() is None, reason="the kernels cannot be built here")
def test_a_head_handed_over_as_a_module_drafts_from_int8_weights_for_a_quantized_target(target):
    """The trainer's held-out tau hands its head over as a module: it must draft as the head loaded from a folder
    does (int8 copies for a quantized target, dense for a dense one)."""
    head = new_head("eagle3", target, seed=0, draft_vocab_size=48)
    linears = [m for m in head.modules() if isinstance(m, Linear)]
    build_drafter("eagle3", native_twin(target, "int4"), draft_model=head)
    assert linears and {m.quant for m in linears} == {"int8"}
    build_drafter("eagle3", target, draft_model=head)
    assert {m.quant for m in linears} == {None}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_eagle3_head_starts_from_the_targets_last_layer_on_both_backends(family):
    hf = tiny_model(family, seed=3)
    layers = [t.last_layer_weights() for t in (hf, native_twin(hf))]
    assert layers[0].keys() == layers[1].keys()
    for name, weight in layers[0].items():  # the native backend's fused q/k/v and gate/up split back
        assert torch.equal(weight, layers[1][name]), name
    d = hf.model.config.hidden_size
    sequences = [{"ids": torch.arange(40) % 64, "prompt_len": 4}]
    head = initial_head("eagle3", hf, sequences, Budget(draft_vocab=32))
    attn, source = head.layer.self_attn, hf.model.model.layers[-1]
    for name in ("q_proj", "k_proj", "v_proj"):  # attention reads [embedding, hidden]: the hidden half is the target's
        assert torch.equal(getattr(attn, name).weight[:, d:], getattr(source.self_attn, name).weight)
        assert not torch.equal(getattr(attn, name).weight[:, :d], getattr(source.self_attn, name).weight)
    assert torch.equal(attn.o_proj.weight, source.self_attn.o_proj.weight)
    assert torch.equal(head.layer.mlp.down_proj.weight, source.mlp.down_proj.weight)
    assert torch.equal(head.hidden_norm.weight, source.input_layernorm.weight)
    cold = initial_head("eagle3", hf, sequences, Budget(draft_vocab=32, warm_start=False))
    assert not torch.equal(cold.layer.self_attn.o_proj.weight, source.self_attn.o_proj.weight)
    narrow = initial_head("eagle3", hf, sequences, Budget(draft_vocab=32, intermediate_size=24))
    assert narrow.layer.mlp.up_proj.weight.shape[0] == 24  # a narrower MLP keeps its own start
    assert torch.equal(narrow.layer.self_attn.o_proj.weight, source.self_attn.o_proj.weight)
    gemma = tiny_model("gemma3", seed=3)
    assert gemma.last_layer_weights() is None and native_twin(gemma).last_layer_weights() is None  # not a Llama block: random start


def test_training_picks_bfloat16_only_where_the_hardware_has_it(monkeypatch):
    from specdecode import kernels
    from specdecode.train.commands import bfloat16_is_native

    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma"}))  # emulated: float32 is faster
    assert not bfloat16_is_native("cpu") and bfloat16_is_native("cuda:0")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert bfloat16_is_native("cpu")


def test_hass_top_k_distillation_is_the_cross_entropy_over_the_targets_top_tokens():
    from specdecode.heads.eagle3 import top_k_cross_entropy
    from specdecode.heads.kinds import soft_cross_entropy

    generator = torch.Generator().manual_seed(0)
    target_logits, logits = torch.randn(5, 12, generator=generator), torch.randn(5, 12, generator=generator)
    assert torch.allclose(top_k_cross_entropy(target_logits, logits, 12), soft_cross_entropy(target_logits, logits))
    best = target_logits.argmax(-1, keepdim=True)
    only_best = -(torch.softmax(target_logits, -1).gather(-1, best) * torch.log_softmax(logits, -1).gather(-1, best))
    assert torch.allclose(top_k_cross_entropy(target_logits, logits, 1), only_best[:, 0])


def test_a_run_out_of_time_publishes_its_head_and_a_rerun_finishes_the_epoch(target, tmp_path, monkeypatch):
    from itertools import count

    from specdecode.train import trainer

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    clock = count()
    monkeypatch.setattr(trainer.time, "monotonic", lambda: float(next(clock)))  # one second per reading
    store = FeatureStore(tmp_path / "features")
    store.extract(target, greedy_sequences(target, 8), [], False, {"test": "hours"})
    budget = Budget(epochs=1, hours=4 / 3600, medusa_heads=2, lr=3e-3, warmup=1, batch=1, eval_tokens=8)
    run = TrainingRun("medusa", initial_head("medusa", target, store.load(), budget), target, store.load(), tmp_path,
                      budget, "cpu", False)
    report = run.run(PROMPTS[:1])
    assert not report["finished"] and 0 < report["stopped"]["batch"] < 8 and report["stopped"]["tau"] >= 1.0
    assert (tmp_path / "cache" / "heads" / target.name / "medusa" / "config.json").is_file()  # usable already
    rest = Budget(**{**budget.__dict__, "hours": 0.0})
    resumed = TrainingRun("medusa", initial_head("medusa", target, store.load(), rest), target, store.load(),
                          tmp_path, rest, "cpu", False)
    assert resumed.state["batch"] == report["stopped"]["batch"]
    finished = resumed.run(PROMPTS[:1])
    assert finished["finished"] and finished["epoch"] == 1 and "stopped" not in finished


@pytest.mark.parametrize("kind", ["fspad", "hass"])
def test_variant_kinds_draft_through_their_drafter_identically_to_plain(target, tmp_path, kind):
    """FSPAD's head (2d outputs, split between the LM head and the next step) and HASS's (EAGLE-3's, trained
    otherwise) run through the drafters they name: greedy answers equal plain decoding's, drafts get accepted."""
    from conftest import quick_head

    from specdecode.heads import head_kind

    head = quick_head(target, kind, tmp_path)
    drafter = build_drafter(head_kind(kind).drafter, target, draft_model=head)
    accepted = 0
    for prompt in PROMPTS:
        plain = generate(target, build_drafter("none", target), prompt, 30, GREEDY)[0]
        tokens, stats = generate(target, drafter, prompt, 30, GREEDY)
        assert tokens == plain
        accepted += stats.accepted_tokens
    assert accepted > 0
