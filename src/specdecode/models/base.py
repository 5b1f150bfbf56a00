"""The model interface the engine and drafters use, and the two forwards built on it (prefill, tree verify)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..cache import KVBatch, KVCache
from ..errors import OptionError, SpecDecodeError
from ..kernels import prompt_arithmetic
from ..tree import PROBE, Draft, ancestor_mask, depths, with_root


@dataclass
class HiddenStates:
    """The target's hidden states a caller asks of one forward, which the forward fills in (drafters that read the
    target's features: EAGLE, EAGLE-3, Medusa). Layer i is the residual stream entering decoder layer i: 0 = the
    input embeddings, n_layers = the last layer's output before the final norm. That is transformers'
    output_hidden_states numbering (except its last entry, which is after the norm) and EAGLE-3's (2, L//2, L-3).
    A forward without one computes and keeps nothing extra."""

    layers: tuple[int, ...]
    states: torch.Tensor | None = None  # [K, q, H] once filled: K = len(layers) in that order, every input row

    def check(self, n_layers: int) -> None:
        if not self.layers or not all(0 <= layer <= n_layers for layer in self.layers):
            raise SpecDecodeError(
                f"hidden states of layers {list(self.layers)} asked, the model has layers 0..{n_layers}.",
                "Ask for layers between 0 (the embeddings) and the number of layers (the last layer's output).",
            )


def wanted_layers(hidden: list[HiddenStates | None], n_layers: int) -> tuple[int, ...]:
    """The sorted union of the layers these forwards ask for; () when none asks."""
    for asked in hidden:
        if asked is not None:
            asked.check(n_layers)
    return tuple(sorted({layer for asked in hidden if asked is not None for layer in asked.layers}))


def fill_hidden(hidden: list[HiddenStates | None], layers: tuple[int, ...], captured, lengths: list[int]) -> None:
    """Hand each asker its rows of captured [B, len(layers), q, H] (row b, the layers it asked, its first
    lengths[b] positions)."""
    for row, asked in enumerate(hidden):
        if asked is not None:
            picks = torch.tensor([layers.index(layer) for layer in asked.layers])
            asked.states = captured[row, picks, : lengths[row]]


@dataclass(frozen=True)
class Sublayers:
    """The part of the target a self-speculative drafting forward runs (CausalLM.forward_sublayers): decoder layers
    [0, stop), without the attention sublayers of the layers in skip_attention and the MLP sublayers of those in
    skip_mlp (a skipped sublayer adds nothing to the residual stream, as Draft & Verify skips them). Kangaroo and
    EESD stop after their exit layer; Draft & Verify runs every layer minus its skip set."""

    stop: int
    skip_attention: frozenset[int] = frozenset()
    skip_mlp: frozenset[int] = frozenset()

    def check(self, n_layers: int) -> None:
        if not 0 <= self.stop <= n_layers or not all(0 <= i < n_layers for i in self.skip_attention | self.skip_mlp):
            raise SpecDecodeError(
                f"sublayers up to layer {self.stop}, skipping {sorted(self.skip_attention)} (attention) and "
                f"{sorted(self.skip_mlp)} (MLP), asked of a model with layers 0..{n_layers - 1}.",
                "Name layers the target has.",
            )


@dataclass(frozen=True)
class Resume:
    """Start a forward at decoder layer `layer` from `states` [q, H] (the residual stream entering it), over cache
    slots whose keys and values for the layers below were written by a drafting forward (forward_sublayers) of the
    same tokens at the same positions: the drafter's exit states of Draft.exit_states."""

    layer: int
    states: torch.Tensor  # [q, H]


@dataclass(frozen=True)
class ForwardRequest:
    """The inputs of one CausalLM.forward; a server gathers several requests' into one forward_batch."""

    cache: KVCache
    input_ids: torch.Tensor  # [q]
    positions: torch.Tensor  # [q]
    tree_mask: torch.Tensor  # [q, cache.pending + q] bool
    probe_embedding: torch.Tensor | None = None  # [H]: the input at PROBE tokens (see tree.PROBE)
    hidden: HiddenStates | None = None  # filled by the forward (forward or forward_batch) when given
    resume: Resume | None = None  # run only the layers from resume.layer on (see Resume)

    def run(self, model: "CausalLM") -> torch.Tensor:  # [q, V] float32 logits, uncommitted
        return model.forward(
            self.cache, self.input_ids, self.positions, self.tree_mask, probe_embedding=self.probe_embedding,
            hidden=self.hidden, resume=self.resume,
        )


class CausalLM(ABC):
    """A causal LM that attends over a KVCache with an explicit tree mask and explicit positions."""

    name: str
    tokenizer: object  # a transformers tokenizer
    vocab_size: int  # rows of the logits
    max_context: int
    n_layers: int  # decoder layers (HiddenStates numbers their inputs 0..n_layers)
    eos_token_ids: frozenset[int]
    dtype: torch.dtype
    quant: str = "none"  # weight format: none (dtype), int8, int4
    runs_sublayers: bool = False  # forward_sublayers and Resume work (self-speculative drafters need them)
    kv_cache: str = "auto"  # the KV cache's format (KV_CACHES); auto: the compute dtype

    @abstractmethod
    def new_cache(self, capacity: int) -> KVCache: ...

    def use_kv_cache(self, kv_cache: str) -> None:
        """Hold keys and values in this format from the next new_cache on (a backend that has one format keeps it)."""
        if kv_cache != "auto":
            raise SpecDecodeError(f"--kv-cache {kv_cache} needs the native backend with --quant int4 or int8.",
                                  "Drop --kv-cache, or load the model with --backend native --quant int4.")

    @abstractmethod
    def forward(
        self,
        cache: KVCache,
        input_ids: torch.Tensor,  # [q]
        positions: torch.Tensor,  # [q]
        tree_mask: torch.Tensor,  # [q, cache.pending + q] bool: what each new token sees of the uncommitted part
        last_only: bool = False,
        probe_embedding: torch.Tensor | None = None,  # [H]: the input of every position whose id is PROBE
        hidden: HiddenStates | None = None,  # filled with these layers' states of all q rows (even with last_only)
        resume: Resume | None = None,  # start at resume.layer over the drafter's entries (runs_sublayers only)
    ) -> torch.Tensor:  # [q, V] float32 logits ([1, V] with last_only); the q entries stay uncommitted
        ...

    def forward_sublayers(
        self,
        cache: KVCache,
        input_ids: torch.Tensor,  # [q]
        positions: torch.Tensor,  # [q]
        tree_mask: torch.Tensor,  # [q, cache.pending + q] bool
        sublayers: Sublayers,
    ) -> torch.Tensor:  # [q, H]: the residual stream entering layer sublayers.stop (n_layers: before the final norm)
        """Self-speculation's drafting forward: run only `sublayers` of this model over q tokens, writing the keys and
        values of the attention sublayers it runs into the q slots after the cache's entries, uncommitted (like any
        forward: the committed entries are never touched). The caller drops them, or keeps them for verification by
        sending their states as Draft.exit_states. Backends without it raise OptionError naming the native one."""
        raise needs_native_backend(self)

    def attention_probs(
        self,
        cache: KVCache,  # holds the entries of these rows too (a forward over them has run)
        layer: int,
        states: torch.Tensor,  # [q, H]: the residual stream entering `layer` at these rows (HiddenStates)
        positions: torch.Tensor,  # [q]: their positions
    ) -> torch.Tensor:  # [Hq, q, cache.end] float32: each query head's attention over the cache, causal by position
        """The attention weights of `layer` at rows whose input states a forward captured: what prompt compression
        (SpecPC) reads to rank the prompt's tokens. Backends without it raise OptionError naming the native one."""
        raise needs_native_backend(self)

    def forward_batch(self, requests: list[ForwardRequest]) -> list[torch.Tensor]:
        """Several requests' forwards (each its own cache); the [q_i, V] logits of each; each request's `hidden`
        (if any) is filled. This default runs them one by one; a backend that can batch overrides it."""
        return [request.run(self) for request in requests]

    # The target's own input embeddings, final norm and LM head, for drafters that draft in its feature space
    # (EAGLE heads): the model's tensors, shared, never copied.
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[...] ids -> [..., H] input embeddings (scaled as the model scales them)."""
        raise SpecDecodeError(f"{self.name} does not expose its input embeddings.", "Pick another drafter.")

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., H]: the norm between the last layer's output (HiddenStates layer n_layers) and the LM
        head."""
        raise SpecDecodeError(f"{self.name} does not expose its final norm.", "Pick another drafter.")

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] final-normed states -> [..., V] float32 logits (the LM head alone)."""
        raise SpecDecodeError(f"{self.name} does not expose its LM head.", "Pick another drafter.")

    # What a draft head is built and trained from (heads/target.py): the shapes of one decoder layer like the
    # model's own, and float32 copies of the tensors the head shares with it or starts from.
    def decoder_shapes(self) -> dict:
        """One decoder layer's shapes, named as heads.layer.HeadConfig names them: hidden_size,
        num_attention_heads, num_key_value_heads, head_dim, intermediate_size, rms_norm_eps, rope_theta, and
        target_architecture (the model class, for exported heads' configs)."""
        raise SpecDecodeError(f"{self.name} does not expose its layer shapes.", "Pick a drafter without a head.")

    def frozen_weights(self) -> dict[str, torch.Tensor]:
        """float32 copies of the input embedding [V, H], the final norm's weight [H] and the LM head [V, H]."""
        raise SpecDecodeError(f"{self.name} does not expose its weights.", "Pick a drafter without a head.")

    def lm_head_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[n] ids -> [n, H] float32: those rows of the LM head (a draft vocabulary), without materialising the
        whole head in float32."""
        return self.frozen_weights()["lm_head"][token_ids]

    def last_layer_weights(self) -> dict[str, torch.Tensor] | None:
        """float32 copies of the last decoder layer named as a Llama layer's state dict (self_attn.{q,k,v,o}_proj,
        biases if any, mlp.{gate,up,down}_proj, input_layernorm, post_attention_layernorm; weights only), or None
        where that layer is not a Llama block (Gemma's extra norms, 1 + w norm weights and GELU)."""
        return None


def needs_native_backend(model: CausalLM) -> OptionError:
    return OptionError(
        f"{model.name} runs on transformers, whose forward cannot run a part of the model's layers (self-speculation)",
        "Use --backend native (Llama, SmolLM2, Qwen2 and Gemma 3 models).",
    )


PREFILL_CHUNK = 512  # prompt rows per forward: bounds the activations a long prompt holds at once
CATCH_UP_PROMPT_ROWS = 64  # a drafter's catch-up prefill of at least this many tokens runs in the prompt arithmetic


def prefill(
    model: CausalLM, cache: KVCache, token_ids: list[int] | torch.Tensor, hidden: HiddenStates | None = None,
    prompt: bool = True,
) -> torch.Tensor:
    """Append committed tokens to the cache; return the [V] logits after the last one (and fill `hidden`, if
    given, with every token's states).

    A long prompt runs in forwards of PREFILL_CHUNK rows, each attending to the cache the earlier ones wrote: the
    activations of an 8k-token prompt's MLP would otherwise take gigabytes, fresh pages on every layer. Rows do not
    depend on the rows beside them, so the chunking changes no number of a row-exact model.

    `prompt`: the decoder layers run in the kernels' prompt arithmetic (kernels.prompt_arithmetic: faster on many
    rows where the CPU has AMX, and the same bits in any chunks). A target's prompt always does; a drafter catching
    up on fewer than CATCH_UP_PROMPT_ROWS tokens passes False: the prompt arithmetic decompresses every weight per
    call, which only many rows repay (a drafter's numbers need not match any other forward's)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)  # [q]
    assert cache.pending == 0, "prefill needs a cache without uncommitted entries"
    with prompt_arithmetic(prompt):
        return _prefill_chunks(model, cache, ids, hidden)


def _prefill_chunks(model: CausalLM, cache: KVCache, ids: torch.Tensor, hidden: HiddenStates | None) -> torch.Tensor:
    states = []  # each chunk's [K, rows, H] hidden states, where asked
    for start in range(0, ids.shape[0], PREFILL_CHUNK):
        chunk = ids[start : start + PREFILL_CHUNK]  # [c]
        c = chunk.shape[0]
        positions = torch.arange(cache.length, cache.length + c)
        causal = torch.ones(c, c, dtype=torch.bool).tril()
        asked = None if hidden is None else HiddenStates(hidden.layers)
        logits = model.forward(cache, chunk, positions, causal, last_only=True, hidden=asked)  # [1, V]
        cache.commit_all()
        if asked is not None:
            states.append(asked.states)
    if hidden is not None:
        hidden.states = states[0] if len(states) == 1 else torch.cat(states, dim=1)
    return logits[0]


def tree_request(
    cache: KVCache, root_token: int, draft: Draft, hidden_layers: tuple[int, ...] = (), root_position: int | None = None
) -> ForwardRequest:
    """The verification forward over [root, draft tokens] with tree attention; it yields [N+1, V] target logits,
    uncommitted, and (with hidden_layers) fills request.hidden with those layers' [K, N+1, H] states. The root sits
    at root_position, by default the next free one in the cache (a partial cache, as TriForce's middle level, holds
    fewer entries than the context has tokens).

    Uncommitted entries a self-speculative drafter wrote into the cache are dropped, or, when the draft carries
    exit states, kept: the forward then resumes at draft.exit_layer over those slots (Resume), and the cache keeps
    the accepted path's entries of every layer as it keeps any verified path's."""
    resume = None
    if draft.exit_states is not None:
        assert cache.pending >= len(draft) + 1, "exit states without the drafter's cache entries"
        resume = Resume(draft.exit_layer, draft.exit_states)
    else:
        cache.discard()
    parents = with_root(draft.parents)  # [N+1]
    ids = torch.cat([torch.tensor([root_token]), draft.tokens])  # [N+1]
    root_position = cache.length if root_position is None else root_position
    positions = root_position + depths(parents) - 1  # [N+1]
    hidden = HiddenStates(tuple(hidden_layers)) if hidden_layers else None
    return ForwardRequest(cache, ids, positions, ancestor_mask(parents), draft.probe_embedding, hidden, resume)


def forward_tree(model: CausalLM, cache: KVCache, root_token: int, draft: Draft) -> torch.Tensor:
    """One forward over [root, draft tokens] with tree attention; returns [N+1, V] target logits, uncommitted."""
    return tree_request(cache, root_token, draft).run(model)


def attention_mask(cache: KVCache, q: int, tree_mask: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[q, end+q] bool over every cache entry, once the q new slots are reserved: committed entries are
    visible, the uncommitted ones as tree_mask says; with a sliding window, only keys less than `window`
    positions behind the query; with the cache's `sliding` (sinks, window), also only the first `sinks` positions
    and the keys less than that window behind."""
    committed = torch.ones(q, cache.length, dtype=torch.bool)
    mask = torch.cat([committed, tree_mask], dim=1)  # [q, end+q]
    if window is None and cache.sliding is None:
        return mask
    key_pos = cache.positions[: cache.end + q]  # [end+q]
    behind = cache.positions[cache.end : cache.end + q, None] - key_pos[None, :]  # [q, end+q]
    if window is not None:
        mask &= behind < window
    if cache.sliding is not None:
        sinks, reach = cache.sliding
        mask &= (behind < reach) | (key_pos[None, :] < sinks)
    return mask


@dataclass
class BatchInputs:
    """Requests whose caches fill consecutive slots of one KVPool, padded into one [B, q] forward (resumed forwards
    run alone)."""

    kv: KVBatch
    input_ids: torch.Tensor  # [B, q], padded with token 0
    positions: torch.Tensor  # [B, q], padded with each row's last position
    lengths: list[int]  # each request's own q
    q: int
    probe_embeddings: list[torch.Tensor | None]  # each request's input at its PROBE tokens
    hidden: list[HiddenStates | None]  # each request's hidden-state ask, filled by the forward

    @classmethod
    def of(cls, requests: list[ForwardRequest]) -> "BatchInputs | None":
        """None when the caches are not consecutive slots of one pool (then run them one by one)."""
        if any(request.resume is not None for request in requests):
            return None  # a resumed forward starts at its own layer
        lengths = [request.input_ids.shape[0] for request in requests]
        q = max(lengths)
        pool = requests[0].cache.pool
        kv = pool.batch([request.cache for request in requests], q) if pool is not None else None
        if kv is None:
            return None
        input_ids = torch.zeros(len(requests), q, dtype=torch.long)
        positions = torch.zeros(len(requests), q, dtype=torch.long)
        for row, request in enumerate(requests):
            input_ids[row, : lengths[row]] = request.input_ids
            positions[row] = request.positions[-1]
            positions[row, : lengths[row]] = request.positions
        probes = [request.probe_embedding for request in requests]
        return cls(kv, input_ids, positions, lengths, q, probes, [request.hidden for request in requests])


def place_probes(embeddings: torch.Tensor, input_ids: torch.Tensor, probes: list[torch.Tensor | None]) -> torch.Tensor:
    """[B, q, H] input embeddings with row b's PROBE tokens replaced by probes[b] (drafters that probe in
    embedding space; see tree.PROBE)."""
    for row, probe in enumerate(probes):
        if probe is not None:
            embeddings[row, input_ids[row] == PROBE] = probe.to(embeddings.dtype)
    return embeddings


def batch_attention_mask(
    requests: list[ForwardRequest], q: int, key_count: int, window: int | None = None
) -> torch.Tensor:
    """[B, q, key_count] bool for a batch padded to q tokens: row b is request b's attention_mask, with its padded
    queries seeing only key 0 (a row must see something) and keys past its own entries hidden."""
    mask = torch.zeros(len(requests), q, key_count, dtype=torch.bool)
    for row, request in enumerate(requests):
        own = attention_mask(request.cache, request.input_ids.shape[0], request.tree_mask, window)  # [q_b, end_b+q_b]
        mask[row, : own.shape[0], : own.shape[1]] = own
        mask[row, own.shape[0] :, 0] = True
    return mask


def eos_token_ids(*sources) -> frozenset[int]:
    """Every end-of-sequence id that a generation config, model config or tokenizer names."""
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return frozenset(int(i) for i in ids)
