"""specdecode tune: the cost model's choice, the Sequoia DP, the length policies, and a tuned profile that
tuned_drafter picks up (explicit options and profile=none win)."""

from __future__ import annotations

import inspect
import json

import pytest

from specdecode.cli import main
from specdecode.drafters import build_drafter
from specdecode.drafters.draft_length import draft_length
from specdecode.errors import SpecDecodeError
from specdecode.tree import sequoia_tree
from specdecode.tune.cost import Measured, choose, speedup, verify_seconds
from specdecode.tune.measure import run_tune
from specdecode.tune.profile import profile_path, save_profile, tuned_drafter

from conftest import native_twin, perturbed_copy, tiny_model

CPU_LIKE = {1: 0.10, 2: 0.11, 4: 0.13, 8: 0.20, 16: 0.40, 32: 0.80}  # verify cost grows with the tree
GPU_LIKE = {1: 0.10, 2: 0.10, 4: 0.10, 8: 0.10, 16: 0.11, 32: 0.12}  # nearly flat
CHAIN = Measured({"depth": 3, "topk": 1}, tokens_per_step=2.2, nodes_per_step=3, draft_seconds_per_step=0.03)
TREE = Measured({"structure": "opt", "budget": 24}, tokens_per_step=3.4, nodes_per_step=24, draft_seconds_per_step=0.05)


def test_verify_seconds_interpolates_and_extrapolates():
    assert verify_seconds(CPU_LIKE, 1) == 0.10
    assert verify_seconds(CPU_LIKE, 6) == pytest.approx(0.165)
    assert verify_seconds(CPU_LIKE, 48) == pytest.approx(1.2)


def test_cost_model_prefers_small_drafts_when_verification_is_dear():
    # A step scores 1 + nodes tokens: chain 2.2 / (0.03 + 0.13) = 13.8 tokens/s against 3.4 / (0.05 + 0.625) = 5.0
    assert choose([CHAIN, TREE], CPU_LIKE) is CHAIN
    assert choose([CHAIN, TREE], GPU_LIKE) is TREE  # 2.2 / 0.13 = 16.9 against 3.4 / 0.166 = 20.5
    assert speedup(CHAIN, CPU_LIKE) == pytest.approx(2.2 / 0.16 * 0.10)


def test_cost_model_keeps_the_defaults_on_a_tie():
    twin = Measured({"depth": 9}, CHAIN.tokens_per_step, CHAIN.nodes_per_step, CHAIN.draft_seconds_per_step)
    assert choose([CHAIN, twin], CPU_LIKE) is CHAIN
    # 1% faster is not enough to leave the defaults; 3% is
    near = Measured({"depth": 8}, CHAIN.tokens_per_step * 1.01, CHAIN.nodes_per_step, CHAIN.draft_seconds_per_step)
    clear = Measured({"depth": 7}, CHAIN.tokens_per_step * 1.03, CHAIN.nodes_per_step, CHAIN.draft_seconds_per_step)
    assert choose([CHAIN, near], CPU_LIKE) is CHAIN and choose([CHAIN, near, clear], CPU_LIKE) is clear


def test_sequoia_dp_trades_depth_for_width_by_acceptance():
    assert sequoia_tree(2, 2, (0.6, 0.3)) == (pytest.approx(1.96), [-1, 0])  # chain: 1 + .6 + .36
    assert sequoia_tree(2, 2, (0.5, 0.45)) == (pytest.approx(1.95), [-1, -1])  # siblings: 1 + .5 + .45
    value, parents = sequoia_tree(12, 4, (0.7, 0.1, 0.04))
    assert len(parents) == 12 and all(p < i for i, p in enumerate(parents))


def test_heuristic_length_follows_transformers_schedule():
    length = draft_length("heuristic", depth=6, threshold=0.4)
    trace = []
    for accepted, drafted in [(6, 6), (2, 6), (5, 5), (5, 5), (0, 6), (0, 5), (0, 4), (0, 3), (0, 2), (0, 1)]:
        length.update(accepted, drafted)
        trace.append(length.depth())
    assert trace == [6, 5, 6, 6, 5, 4, 3, 2, 1, 1]


def test_confidence_and_thompson_lengths():
    confidence = draft_length("confidence", depth=5, threshold=0.4)
    assert confidence.grow(0.5) and not confidence.grow(0.3)
    thompson = draft_length("thompson", depth=5, threshold=0.4)
    for _ in range(50):
        thompson.update(4, 5)  # 4 of 5 accepted: theta near 0.8
    grows = sum(thompson.grow(0.0) for _ in range(1000))
    assert (thompson.alpha, thompson.beta) == (201, 51) and 700 < grows < 900
    with pytest.raises(SpecDecodeError, match="length"):
        draft_length("sometimes", 5, 0.4)


def test_opt_tree_respects_the_budget_and_stops_on_small_gains():
    target = tiny_model("qwen2", seed=1)
    draft_model = perturbed_copy(target, scale=0.1, seed=2)
    from specdecode.sampling import SamplingParams

    prompt = [3, 9, 4, 17, 3, 9]
    for min_gain, most_depth in [(0.0, 6), (2.0, 1)]:  # a gain of 2 tokens per level is never reached
        drafter = build_drafter("draft", target, draft_model=draft_model, structure="opt", budget=7, depth=6,
                                min_gain=min_gain)
        drafter.start(prompt, 64)
        draft = drafter.propose(prompt, SamplingParams(), None)
        from specdecode.tree import depths

        assert 1 <= len(draft) <= 7 and int(depths(draft.parents).max()) <= most_depth
        assert draft.draft_probs is None


@pytest.fixture
def tiny_pair():
    target = tiny_model("llama", seed=1)
    return target, perturbed_copy(target, scale=0.1, seed=2)


def test_tune_writes_a_profile_that_tuned_drafter_applies(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    target, draft_model = tiny_pair
    prompts = [[3, 9, 4, 17, 3, 9, 4, 22, 3, 9], [11, 5, 60, 2, 33, 48, 7, 1]]
    profile = run_tune(target, ["pld", "draft"], prompts, draft_model, max_new_tokens=10, max_tokens=4, repeats=1)
    assert sorted(profile["verify_seconds"]) == [1, 2, 3, 4]
    assert len(profile["drafters"]["draft"]["candidates"]) > 1
    save_profile(target, profile)
    chosen = profile["drafters"]["pld"]["options"]
    tuned, by_hand = tuned_drafter("pld", target), build_drafter("pld", target, **chosen)
    assert (tuned.k, tuned.branches, tuned.max_ngram) == (by_hand.k, by_hand.branches, by_hand.max_ngram)
    # tune chose the defaults: they apply as chosen, not re-sized from the cost curve
    profile["drafters"]["pld"]["options"] = {}
    save_profile(target, profile)
    tuned = tuned_drafter("pld", target)
    assert tuned.tuned and not tuned.sized and tuned.k == build_drafter("pld", target).k
    # A profile with known choices: tuned_drafter must apply them when no option is given.
    profile["drafters"]["pld"]["options"] = {"k": 3, "branches": 2}
    profile["drafters"]["draft"]["options"] = {"structure": "opt", "budget": 5, "depth": 3}
    path = save_profile(target, profile)
    assert path == profile_path(target) and path.parent == tmp_path / "profiles"
    assert "float32" in path.name and "HFModel" in path.name

    pld = tuned_drafter("pld", target)
    assert (pld.k, pld.branches) == (3, 2)
    draft = tuned_drafter("draft", target, draft_model=draft_model)
    assert (draft.tree.structure, draft.tree.budget, draft.tree.depth) == ("opt", 5, 3) and draft.tuned
    assert not build_drafter("pld", target).tuned and build_drafter("pld", target).k == 8  # build_drafter: no profile
    # Explicit options win, whole: nothing of the tuned set mixes in.
    pld = tuned_drafter("pld", target, k=5)
    assert (pld.k, pld.branches) == (5, 1)
    # The opt-out, and a draft model the profile was not tuned with.
    assert tuned_drafter("pld", target, profile="none").k == 8
    other = perturbed_copy(target, scale=0.1, seed=4)
    other.name = "another-draft"
    assert tuned_drafter("draft", target, draft_model=other).tree.structure == "eagle2"
    with pytest.raises(SpecDecodeError, match="profile"):
        tuned_drafter("pld", target, profile="sometimes")
    # Tuning one drafter again keeps the others' saved choices.
    save_profile(target, dict(profile, drafters={"pld": dict(profile["drafters"]["pld"], options={"k": 2})}))
    assert tuned_drafter("pld", target).k == 2
    assert tuned_drafter("draft", target, draft_model=draft_model).tree.budget == 5


@pytest.mark.parametrize(
    "options,needle",
    [({"structure": "star"}, "structure"), ({"accept": "0.7,x"}, "accept"), ({"length": "often"}, "length"),
     ({"structure": "opt", "budget": 0}, "budget"), ({"length": "confidence", "threshold": 2}, "threshold")],
)
def test_draft_options_are_checked(tiny_pair, options, needle):
    target, draft_model = tiny_pair
    with pytest.raises(SpecDecodeError, match=needle):
        build_drafter("draft", target, draft_model=draft_model, **options)


def test_tune_cli_rejects_bad_input_before_loading(capsys):
    assert main(["tune", "--model", "smollm2-135m-instruct", "--drafters", "nosuch"]) == 2
    assert "unknown drafter" in capsys.readouterr().err
    assert main(["tune", "--model", "smollm2-135m-instruct", "--repeats", "0"]) == 2
    assert main(["tune", "--model", "smollm2-135m-instruct", "--drafters", "draft"]) == 2
    assert "no drafter to tune" in capsys.readouterr().err


def test_sized_drafts_follow_the_cost_curve():
    from specdecode.drafters import DRAFTERS
    from specdecode.tune.machine import sized, sized_options

    flat = {1: 1.0, 2: 1.0, 4: 1.02, 8: 1.05, 16: 1.1, 32: 1.3}  # verifying more rows costs almost nothing
    steep = {1: 1.0, 2: 1.9, 4: 3.8, 8: 7.5, 16: 15.0, 32: 30.0}  # every row costs a full forward
    middle = {1: 1.0, 2: 1.12, 4: 1.4, 8: 2.0, 16: 3.8, 32: 9.0}
    assert sized(flat)["depth"] >= 6 and sized(flat)["nodes"] >= 12
    assert sized(steep) == {"depth": 1, "nodes": 1}
    assert sized(steep)["depth"] < sized(middle)["depth"] < sized(flat)["depth"]
    assert sized_options(DRAFTERS["pld"], middle) == {"k": sized(middle)["depth"]}
    for name, cls in DRAFTERS.items():  # every sized option set builds
        assert set(sized_options(cls, middle)) <= set(inspect.signature(cls.__init__).parameters)


def test_given_options_keep_the_sizes_of_the_cost_curve_they_do_not_name(tiny_pair, tmp_path, monkeypatch):
    """`-o vocab=N` must not silently drop the tree this machine's curve sized (the bench measured a budget-8 tree
    against a budget-4 one that way); a given size option wins over the curve's."""
    from specdecode.bench.report import option_source
    from specdecode.tune import machine
    from specdecode.tune.machine import sized

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))  # no tuned profile
    steep = {1: 1.0, 2: 1.9, 4: 3.8, 8: 7.5, 16: 15.0, 32: 30.0}
    monkeypatch.setattr(machine, "cost_report", lambda target: {"curve": [{"rows": q, "ms": 1e3 * s} for q, s in steep.items()]})
    target, draft_model = tiny_pair
    depth, nodes = sized(steep)["depth"], sized(steep)["nodes"]
    assert (depth, nodes) != (build_drafter("draft", target, draft_model).tree.depth, 8)  # the curve changes them
    for given, sized_names in (({}, ("depth", "budget")), ({"vocab": 40}, ("depth", "budget")), ({"depth": 3}, ("budget",))):
        drafter = tuned_drafter("draft", target, draft_model=draft_model, **given)
        assert (drafter.tree.depth, drafter.tree.budget) == (given.get("depth", depth), nodes)
        assert drafter.sized == sized_names and not drafter.tuned
        record = dict(drafter.options, tuned=False, sized=list(drafter.sized))
        chosen = dict(drafter.options)
        assert option_source(record, chosen) == ("sized from the cost curve" if not given else
                                                 f"given; {', '.join(sized_names)} sized from the cost curve")
    assert tuned_drafter("draft", target, draft_model=draft_model, vocab=40).model is not draft_model  # vocab applied

    def unwanted(target):
        raise AssertionError("the curve was measured though every size option was given")

    monkeypatch.setattr(machine, "cost_report", unwanted)
    drafter = tuned_drafter("draft", target, draft_model=draft_model, depth=2, budget=3)
    assert (drafter.tree.depth, drafter.tree.budget, drafter.sized) == (2, 3, ())


def test_every_tune_grid_entry_is_a_valid_option_set():
    """A misspelled option in a drafter's tune grid would fail only when `tune` reaches it, minutes in."""
    from specdecode.drafters import DRAFTERS
    from specdecode.drafters.building import check_options

    for name, cls in DRAFTERS.items():
        for options in cls.tune_grid:
            check_options(name, dict(options))  # raises SpecDecodeError naming the option


def test_cost_is_measured_after_the_context_asked_and_cached_apart():
    """`specdecode cost --context N`: the curve of forwards after N cached tokens, reported with its context and
    cached apart from the default 300-token curve (a long context steepens it: every row pays attention over every
    cached key)."""
    from specdecode.tune import machine

    target = native_twin(tiny_model("llama", seed=1), "int4")
    report = machine.measure(target, repeats=1, context=40)
    assert report["context"] == 40 and [point["rows"] for point in report["curve"]] == list(machine.ROWS)
    assert machine.curve_path(target, 40) != machine.curve_path(target)
    assert machine.curve_path(target, machine.CONTEXT) == machine.curve_path(target)


def test_drafts_are_capped_by_the_curves_of_longer_contexts(tiny_pair, tmp_path, monkeypatch):
    """Verification steepens with the context: where a curve after N tokens is cached, a drafter sized on the
    short-context curve keeps its drafts, after N tokens, within the sizes that pay on that curve; the output stays
    plain decoding's."""
    from specdecode.engine import generate
    from specdecode.sampling import SamplingParams
    from specdecode.tune import machine

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    target, draft_model = tiny_pair
    flat = {1: 1.0, 2: 1.0, 4: 1.02, 8: 1.05, 16: 1.1, 32: 1.3}
    steep = {1: 1.0, 2: 1.9, 4: 3.8, 8: 7.5, 16: 15.0, 32: 30.0}
    for context, curve in ((machine.CONTEXT, flat), (600, steep)):
        path = machine.curve_path(target, context)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"context": context, "curve": [{"rows": q, "ms": 1e3 * s} for q, s in curve.items()]}))
    assert machine.measured_contexts(target) == [600]
    drafter = tuned_drafter("draft", target, draft_model=draft_model)
    assert drafter.sized == ("depth", "budget") and drafter.tree.budget == machine.sized(flat)["nodes"] > 1
    sizing = drafter.context_sizing
    assert sizing.at(599) == {} and sizing.at(600) == sizing.at(10**6) == {"depth": 1, "nodes": 1}

    prompt = [3, 17, 9, 41, 5, 22, 8, 30]
    plain, _ = generate(target, build_drafter("none", target), prompt, 24, SamplingParams())
    tokens, free = generate(target, drafter, prompt, 24, SamplingParams())
    assert tokens == plain and free.drafted_tokens > len(free.accepted_per_step)  # wide drafts below 600 tokens
    drafter.context_sizing = machine.ContextSizing({len(prompt): {"depth": 1, "nodes": 1}})
    tokens, capped = generate(target, drafter, prompt, 24, SamplingParams())
    assert tokens == plain and capped.drafted_tokens <= len(capped.accepted_per_step)  # one node a step
