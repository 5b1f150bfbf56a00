"""Self-speculation (layerskip, kangaroo, eesd): the sublayer seam computes what the target computes, drafting never
touches the target's committed cache and the entries a draft keeps are the ones plain decoding writes, the
transformers backend refuses with the fix, Draft & Verify's adaptive threshold, the skip-set search and its profile,
the exit heads' training, and the missing-head error."""

from __future__ import annotations

import pytest
import torch

from specdecode.drafters import DRAFTERS, build_drafter
from specdecode.drafters.draft_length import draft_length
from specdecode.engine import generate
from specdecode.errors import SpecDecodeError
from specdecode.models.base import HiddenStates, Sublayers, prefill
from specdecode.sampling import SamplingParams
from specdecode.tree import Draft

from conftest import greedy_sequences, native_twin, tiny_model, tiny_pair

GREEDY = SamplingParams()
PROMPT = [3, 9, 4, 17, 3, 9, 4, 22, 3, 9, 4, 17]
SELF_DRAFTERS = sorted(name for name, cls in DRAFTERS.items() if cls.needs_sublayers)


def test_every_self_drafter_is_registered():
    assert SELF_DRAFTERS == ["eesd", "kangaroo", "layerskip"]


# ---- the seam -----------------------------------------------------------------------------------------------------

def zeroed_sublayers(model, skip: Sublayers):
    """Hooks that make transformers' layers add nothing from the skipped sublayers at the last position (their
    output zeroed there): a draft token skips them, the context before it was computed by the whole target."""

    def zero(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        first = torch.cat([first[:, :-1], torch.zeros_like(first[:, -1:])], dim=1)
        return (first,) + tuple(output[1:]) if isinstance(output, tuple) else first

    layers = model.model.model.layers
    return [layers[i].self_attn.register_forward_hook(zero) for i in skip.skip_attention] + [
        layers[i].mlp.register_forward_hook(zero) for i in skip.skip_mlp
    ]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_sublayers_compute_what_the_target_computes(family):
    hf = tiny_model(family, seed=3, layers=4)
    native = native_twin(hf)
    prompt, token = PROMPT[:8], 21
    see_all = torch.ones(1, 1, dtype=torch.bool)

    def sublayer_state(sublayers: Sublayers) -> torch.Tensor:  # [1, d] for `token` after the prompt
        cache = native.new_cache(16)
        prefill(native, cache, prompt)
        state = native.forward_sublayers(cache, torch.tensor([token]), torch.tensor([len(prompt)]), see_all, sublayers)
        assert cache.pending == 1 and cache.length == len(prompt)
        return state

    # a layer prefix: the state a full forward has entering that layer
    asked = HiddenStates((2,))
    prefill(native, native.new_cache(16), prompt + [token], asked)
    assert torch.allclose(sublayer_state(Sublayers(2)), asked.states[0, -1:], atol=1e-5)
    # a skip set: transformers' forward with those sublayers' outputs zeroed
    skip = Sublayers(4, frozenset({1, 2}), frozenset({0, 2}))
    handles = zeroed_sublayers(hf, skip)
    try:
        expected = hf.model(torch.tensor([prompt + [token]])).logits[0, -1].float()
    finally:
        for handle in handles:
            handle.remove()
    logits = native.lm_head_logits(native.final_norm(sublayer_state(skip)))[0]
    assert torch.allclose(logits, expected, atol=1e-4)


class Watched:
    """Wraps a drafter: the target cache it is handed, and around every proposal that its committed entries are
    unchanged; counts the uncommitted entries each proposal leaves."""

    def __init__(self, drafter):
        self.drafter, self.caches, self.pending = drafter, [], []
        use, propose = drafter.use_target_cache, drafter.propose

        def use_target_cache(cache):
            self.caches.append(cache)
            use(cache)

        def watched_propose(context, params, generator):
            cache = self.caches[-1]
            committed = cache.keys[:, :, :, : cache.length].clone(), cache.values[:, :, :, : cache.length].clone()
            draft = propose(context, params, generator)
            assert torch.equal(cache.keys[:, :, :, : committed[0].shape[3]], committed[0])
            assert torch.equal(cache.values[:, :, :, : committed[1].shape[3]], committed[1])
            self.pending.append(cache.pending)
            return draft

        drafter.use_target_cache, drafter.propose = use_target_cache, watched_propose


def committed_cache(cache) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.keys[:, :, :, : cache.length], cache.values[:, :, :, : cache.length]


@pytest.mark.parametrize("name,options", [
    ("layerskip", {"skip_attn": "none", "skip_mlp": "0", "depth": 4, "length": "fixed"}),
    ("kangaroo", {"depth": 4, "threshold": 0.0}),
    ("eesd", {}),
])
def test_drafting_never_touches_the_committed_cache_and_kept_entries_are_plain_decodings(name, options):
    """On int4 weights (row-exact kernels) the target's whole committed cache after self-speculative decoding is
    bit for bit the cache of plain decoding: what drafting wrote is dropped, or kept where it is the target's own."""
    target, _ = tiny_pair("llama:native-int4")
    plain = Watched(build_drafter("none", target))
    plain_tokens, _ = generate(target, plain.drafter, PROMPT, 30, GREEDY)
    spec = Watched(build_drafter(name, target, **options))
    tokens, stats = generate(target, spec.drafter, PROMPT, 30, GREEDY)
    assert tokens == plain_tokens and stats.accepted_tokens > 0
    assert max(spec.pending) > 1  # proposals wrote uncommitted entries (kangaroo, eesd: the root's and drafts')
    for ours, theirs in zip(committed_cache(spec.caches[0]), committed_cache(plain.caches[0])):
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)


def test_exit_states_stay_only_with_the_slots_they_describe():
    states = torch.arange(4.0)[:, None].expand(4, 3)  # root + 3 nodes
    chain = Draft(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 1]), None, None, states, 2)
    trimmed = chain.depth_limited(1)
    assert trimmed.exit_layer == 2 and torch.equal(trimmed.exit_states, states[:2])
    reordered = chain.subset(torch.tensor([1, 2]))  # not the leading nodes: their slots moved
    assert reordered.exit_states is None


def test_transformers_backend_refuses_with_the_native_fix():
    target = tiny_model("llama", seed=1)
    assert not target.runs_sublayers
    for name in SELF_DRAFTERS:
        with pytest.raises(SpecDecodeError, match="--backend native"):
            build_drafter(name, target)


def test_bad_skip_sets_are_refused():
    target = native_twin(tiny_model("llama", seed=1))
    with pytest.raises(SpecDecodeError, match="skip_attn"):
        build_drafter("layerskip", target, skip_attn="0,7")
    drafter = build_drafter("layerskip", target, skip_attn=1, skip_mlp="none")  # -o skip_attn=1 parses as an int
    assert drafter.sublayers == Sublayers(2, frozenset({1}), frozenset())


# ---- Draft & Verify ---------------------------------------------------------------------------------------------

def test_adaptive_threshold_follows_draft_and_verify():
    """auto_th_stop_draft with the paper's parameters [1, 0.5, 0.9, 1e-2, 0.9], worked by hand."""
    length = draft_length("adaptive", depth=4, threshold=0.8)
    assert length.grow(0.81) and not length.grow(0.79)
    length.update(1, 2)  # m = 0.25 < 0.9: th -> 0.9 * 0.8 + 0.1 * 0.81
    assert length.rate == pytest.approx(0.25) and length.threshold == pytest.approx(0.801)
    length.update(4, 4)  # m = 0.625: still up
    assert length.threshold == pytest.approx(0.9 * 0.801 + 0.1 * 0.811)
    for _ in range(5):
        length.update(3, 3)  # all accepted, drafts stopped before the cap: m climbs past 0.9, then down
    assert length.rate > 0.9 and length.threshold < 0.8
    before = length.threshold
    length.update(4, 4)  # all accepted at the cap: stays
    assert length.threshold == pytest.approx(before)


def test_skip_set_search_finds_the_best_set():
    from specdecode.drafters.layerskip import search_skip_set

    wanted = (frozenset({1}), frozenset({0, 2}))
    calls = []

    def score(attention, mlp):
        calls.append((attention, mlp))
        return -len(attention ^ wanted[0]) - len(mlp ^ wanted[1])

    seed = (frozenset({0}), frozenset())
    assert search_skip_set(3, score, trials=60, seed_sets=[seed]) == wanted
    assert calls[0] == seed and len(calls) == len(set(calls))  # seeded first, each set measured once


def test_tune_searches_the_skip_set_and_the_profile_keeps_it(tmp_path, monkeypatch):
    from specdecode.tune.measure import run_tune
    from specdecode.tune.profile import save_profile, tuned_drafter

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    target = native_twin(tiny_model("llama", seed=1, layers=3))
    profile = run_tune(target, ["layerskip"], [PROMPT], max_new_tokens=6, max_tokens=2, repeats=1, search_trials=3)
    candidates = [c["options"] for c in profile["drafters"]["layerskip"]["candidates"]]
    searched = [c for c in candidates if "skip_attn" in c]
    assert len(searched) == 1 + len(DRAFTERS["layerskip"].tune_grid)
    profile["drafters"]["layerskip"]["options"] = searched[0]
    save_profile(target, profile)
    drafter = tuned_drafter("layerskip", target)
    assert drafter.tuned and drafter.options == searched[0]


# ---- exit heads -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["kangaroo", "eesd"])
def test_exit_head_training_lowers_the_loss_and_drafts_losslessly(tmp_path, monkeypatch, kind):
    from specdecode.heads.store import load_head
    from specdecode.train.extract import FeatureStore
    from specdecode.train.trainer import Budget, TrainingRun, initial_head

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    target = tiny_model("llama", seed=1, layers=4)  # transformers: held-out tau runs on its native twin
    budget = Budget(epochs=3, draft_vocab=40, exit_layer=2, lr=3e-3, warmup=2, batch=4, eval_tokens=12)
    store = FeatureStore(tmp_path / "features")
    store.extract(target, greedy_sequences(target, 12), [2], True, {"test": kind})
    sequences = store.load()
    head = initial_head(kind, target, sequences, budget)
    assert head.exit_layer == 2 and head.vocab.shape == (40,)
    report = TrainingRun(kind, head, target, sequences, tmp_path, budget, "cpu", False).run([PROMPT])
    history = report["history"]
    assert history[-1]["loss"] < history[0]["loss"] and all(h["tau"] >= 1.0 for h in history)
    trained = load_head(tmp_path / "cache" / "heads" / target.name / kind, kind)  # where the drafter looks
    native = native_twin(target)
    native.name = target.name
    plain, _ = generate(native, build_drafter("none", native), PROMPT, 24, GREEDY)
    drafter = build_drafter(kind, native, draft_model=str(tmp_path / "cache" / "heads" / target.name / kind))
    assert drafter.exit_layer == trained.exit_layer == 2 and drafter.hidden_layers == (2,)
    assert generate(native, drafter, PROMPT, 24, GREEDY)[0] == plain


def test_a_missing_exit_head_names_the_training_command(tmp_path, monkeypatch):
    monkeypatch.undo()  # the real head lookup (conftest gives tiny targets a quick head)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    target = native_twin(tiny_model("llama", seed=1))
    for kind in ("kangaroo", "eesd"):
        with pytest.raises(SpecDecodeError, match=f"specdecode train {kind} --model {target.name}"):
            build_drafter(kind, target)


def test_server_batches_self_speculative_requests_and_each_gets_its_answer_alone():
    """Resumed verifications run alone inside a batch round; requests finishing at different times move the others'
    caches (kept draft entries included) between pool slots."""
    from specdecode.engine import decode_steps
    from specdecode.serve.scheduler import Scheduler

    from test_batching import run_jobs

    target = native_twin(tiny_model("qwen2", seed=1))
    prompts = [PROMPT, [11, 5, 60, 2, 33, 48, 7, 1], [60, 61, 2], PROMPT[::-1]]
    drafters = [("kangaroo", {"threshold": 0.0}), ("pld", {}), ("layerskip", {"skip_attn": "0"}), ("eesd", {})]
    lengths = [30, 8, 20, 14]
    expected = [generate(target, build_drafter(n, target, **o), p, k, GREEDY)[0]
                for (n, o), p, k in zip(drafters, prompts, lengths)]
    jobs = [decode_steps(target, build_drafter(n, target, **o), p, k, GREEDY)
            for (n, o), p, k in zip(drafters, prompts, lengths)]
    scheduler = Scheduler(target, max_batch=3)
    assert run_jobs(scheduler, jobs) == expected
    assert scheduler.active == 0 and scheduler.pool.keys is None


def test_an_untrained_exit_head_at_the_last_layer_is_the_target_itself(tmp_path):
    """The exit loss pairs each position's head output with the target's distribution at that position: a fresh
    head (zero output projections, the target's final norm) exiting after the last layer predicts exactly it."""
    from specdecode.heads import head_kind
    from specdecode.heads.target import new_head
    from specdecode.train.extract import FeatureStore
    from specdecode.train.trainer import Budget, make_batches

    target = tiny_model("llama", seed=1)
    store = FeatureStore(tmp_path)
    store.extract(target, greedy_sequences(target, 4), [target.n_layers], True, {"test": "alignment"})
    for kind in ("kangaroo", "eesd"):
        head = new_head(kind, target, feature_layers=[target.n_layers])
        batch = make_batches(store.load(), 4)[0]
        loss, metrics = head_kind(kind).loss(head, batch, head_kind(kind).frozen(target, head), Budget(), train=False)
        assert metrics["acc"] == 1.0
