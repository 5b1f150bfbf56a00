"""The target's hidden states for drafters that read them (EAGLE-style): both backends return what transformers'
output_hidden_states computes, for prefill and tree rows, alone and batched; the engine hands a drafter exactly the
rows of the tokens that entered the cache (the prompt, then root + accepted path); nobody asking costs nothing."""

from __future__ import annotations

import pytest
import torch

from specdecode.cache import KVPool
from specdecode.drafters import Drafter, build_drafter
from specdecode.engine import decode_steps, generate
from specdecode.errors import SpecDecodeError
from specdecode.models.base import HiddenStates, prefill, tree_request
from specdecode.sampling import SamplingParams
from specdecode.serve.scheduler import Scheduler
from specdecode.tree import Draft, path_to

from conftest import native_twin, perturbed_copy, tiny_model
from test_batching import run_jobs

PROMPT = [3, 9, 4, 17, 3, 9, 4, 22, 5, 31]
TREE = Draft(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, 0, -1, 2, 2]))
LAYERS = 4
EVERY = tuple(range(LAYERS + 1))  # the embeddings, each layer's input, the last layer's output
GREEDY = SamplingParams()
CLOSE = dict(atol=1e-4, rtol=1e-4)  # float32 sums in another order (tree masks, padded batches)


def reference(hf, ids: list[int]) -> torch.Tensor:
    """[L+1, len(ids), H]: transformers' own output_hidden_states of a plain causal forward (its last entry is
    after the final norm)."""
    with torch.inference_mode():
        out = hf.model(torch.tensor([ids]), output_hidden_states=True)
    return torch.stack(out.hidden_states)[:, 0]


def as_reference(model, states: torch.Tensor) -> torch.Tensor:
    """Our [L+1, q, H] states (layer L before the final norm) in output_hidden_states' convention."""
    return torch.cat([states[:LAYERS], model.final_norm(states[LAYERS:])])


@pytest.fixture(scope="module", params=["qwen2", "llama", "gemma3"])
def hf(request):
    return tiny_model(request.param, seed=3, layers=LAYERS)


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_prefill_and_tree_states_match_output_hidden_states(hf, backend):
    model = hf if backend == "hf" else native_twin(hf)
    cache = model.new_cache(64)
    prompt_hidden = HiddenStates(EVERY)
    prefill(model, cache, PROMPT, prompt_hidden)
    assert prompt_hidden.states.shape == (LAYERS + 1, len(PROMPT), model.embed(torch.tensor(0)).shape[-1])
    torch.testing.assert_close(as_reference(model, prompt_hidden.states), reference(hf, PROMPT), **CLOSE)

    request = tree_request(cache, 11, TREE, EVERY)
    request.run(model)
    tree_states = as_reference(model, request.hidden.states)  # [L+1, 6, H]: the root, then each node
    parents = TREE.parents.tolist()
    for node in range(-1, len(TREE)):
        path = [] if node < 0 else [int(TREE.tokens[n]) for n in path_to(parents, node)]
        expected = reference(hf, PROMPT + [11] + path)[:, -1]  # [L+1, H]: the node's path as a plain sequence
        torch.testing.assert_close(tree_states[:, node + 1], expected, **CLOSE)


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_a_subset_of_layers_comes_in_the_order_asked_and_the_head_is_shared(hf, backend):
    model = hf if backend == "hf" else native_twin(hf)
    every, some = HiddenStates(EVERY), HiddenStates((LAYERS, 2, 0))
    logits = prefill(model, model.new_cache(32), PROMPT, every)
    prefill(model, model.new_cache(32), PROMPT, some)
    torch.testing.assert_close(some.states, every.states[[LAYERS, 2, 0]])
    # The LM head on the normed last layer gives the forward's own logits.
    torch.testing.assert_close(model.lm_head_logits(model.final_norm(every.states[LAYERS, -1])), logits)
    with pytest.raises(SpecDecodeError, match="layers 0..4"):
        prefill(model, model.new_cache(32), PROMPT, HiddenStates((LAYERS + 1,)))


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_forward_batch_fills_each_requests_states(hf, backend):
    model = hf if backend == "hf" else native_twin(hf)
    prompts = [PROMPT, PROMPT[:4], PROMPT[3:] + [40, 41]]
    drafts = [TREE, Draft.empty(), Draft.chain([4, 17])]
    asks = [EVERY, (), (1, LAYERS)]  # requests that ask differently, or not at all, share one forward
    alone, pooled = [], []
    for prompt in prompts:
        for caches in (alone, pooled):
            caches.append(model.new_cache(32))
            prefill(model, caches[-1], prompt)
    pool = KVPool()
    for cache in pooled:
        pool.adopt(cache)
    expected = [tree_request(c, 11, d, a) for c, d, a in zip(alone, drafts, asks)]
    for request in expected:
        request.run(model)
    batched = [tree_request(c, 11, d, a) for c, d, a in zip(pooled, drafts, asks)]
    model.forward_batch(batched)
    for want, got in zip(expected, batched):
        if want.hidden is None:
            assert got.hidden is None
        else:
            torch.testing.assert_close(got.hidden.states, want.hidden.states, **CLOSE)


class Recording(Drafter):
    """A draft-model drafter that asks for hidden states and records what the engine hands it."""

    def __init__(self, target, draft_model, layers):
        self.inner = build_drafter("draft", target, draft_model=draft_model, depth=3, topk=2, budget=5)
        self.max_nodes = self.inner.max_nodes
        self.hidden_layers = layers
        self.received: list[torch.Tensor] = []
        self.context: list[int] = []

    def start(self, prompt_ids, capacity):
        self.inner.start(prompt_ids, capacity)

    def propose(self, context, params, generator):
        assert sum(rows.shape[1] for rows in self.received) == len(context) - 1  # all of context[:-1], no more
        self.context = list(context)
        return self.inner.propose(context, params, generator)

    def receive_hidden(self, hidden):
        self.received.append(hidden)

    def commit(self, verdict, draft, target_logits):
        self.inner.commit(verdict, draft, target_logits)


def check_rows(model, recording: Recording, prompt: list[int], tokens: list[int]) -> None:
    """The received rows, in order, are the states of a plain prefill of the whole sequence but its last token."""
    plain = HiddenStates(recording.hidden_layers)
    sequence = prompt + tokens
    prefill(model, model.new_cache(len(sequence)), sequence[:-1], plain)
    received = torch.cat(recording.received, dim=1)  # [K, len - 1, H]
    torch.testing.assert_close(received, plain.states, **CLOSE)


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_the_engine_hands_the_drafter_the_prompt_and_accepted_rows(backend):
    target = tiny_model("qwen2", seed=1, layers=LAYERS)
    draft_model = perturbed_copy(target, scale=0.1, seed=2)  # agrees often, not always: partial acceptance
    if backend == "native":
        target, draft_model = native_twin(target), native_twin(draft_model)
    layers = (2, LAYERS // 2, LAYERS - 3, LAYERS)
    recording = Recording(target, draft_model, layers)
    tokens, stats = generate(target, recording, PROMPT, 30, GREEDY)
    assert tokens == generate(target, build_drafter("none", target), PROMPT, 30, GREEDY)[0]
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # some steps rejected nodes: rows were picked
    assert recording.received[0].shape[:2] == (len(layers), len(PROMPT))
    check_rows(target, recording, PROMPT, tokens)


def test_batched_requests_in_the_server_get_their_rows():
    target = native_twin(tiny_model("llama", seed=1, layers=LAYERS))
    draft_model = perturbed_copy(target, scale=0.1, seed=2)
    prompts = [PROMPT, PROMPT[2:7], [8, 8, 21, 30, 12]]
    recordings = [Recording(target, draft_model, (LAYERS,)), Recording(target, draft_model, (0, 3)), None]
    drafters = [r if r is not None else build_drafter("pld", target) for r in recordings]
    results = run_jobs(Scheduler(target, max_batch=3), [decode_steps(target, d, p, 20, GREEDY)
                                                        for d, p in zip(drafters, prompts)])
    for recording, prompt, tokens in zip(recordings, prompts, results):
        assert tokens == generate(target, build_drafter("none", target), prompt, 20, GREEDY)[0]
        if recording is not None:
            check_rows(target, recording, prompt, tokens)


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_nothing_is_captured_when_no_drafter_asks(backend, monkeypatch):
    target = tiny_model("qwen2", seed=1, layers=LAYERS)
    draft_model = perturbed_copy(target, scale=0.1, seed=2)
    if backend == "native":
        target, draft_model = native_twin(target), native_twin(draft_model)
    asked = []  # the layers each target forward captured
    if backend == "native":
        run = target._run
        monkeypatch.setattr(target, "_run", lambda *args: asked.append(args[6]) or run(*args))
    else:
        capture = target._capture
        monkeypatch.setattr(target, "_capture", lambda layers: asked.append(layers) or capture(layers))
    generate(target, build_drafter("draft", target, draft_model=draft_model), PROMPT, 12, GREEDY)
    assert asked and not any(asked)
    generate(target, Recording(target, draft_model, (1,)), PROMPT, 12, GREEDY)
    assert set(asked) == {(), (1,)}  # the spy sees a capture when one is asked
    if backend == "hf":  # the hooks live for one forward only
        decoder = target.model.get_decoder()
        assert not any(module._forward_pre_hooks for module in [*decoder.layers, decoder.norm])
