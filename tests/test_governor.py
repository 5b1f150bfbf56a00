"""The governor: speculation is kept while it pays, shortened and then rested when it does not; and decoding stays
token-identical to plain decoding whatever it decides, for every drafter."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from specdecode.drafters import DRAFTERS, build_drafter
from specdecode.engine import generate
from specdecode.governor import Governor
from specdecode.sampling import SamplingParams

from conftest import tiny_foreign_pair, tiny_pair

GREEDY = SamplingParams()


def run(governor: Governor, steps: int, spec_seconds: float, spec_tokens: int, depth: int = 4) -> list:
    """Feed the governor `steps` steps of a drafter whose speculative steps take spec_seconds for spec_tokens
    tokens (a plain step: 1 token in 1 second); return the plan of every step."""
    plans = []
    for _ in range(steps):
        plan = governor.plan()
        plans.append(plan)
        if plan == 0:
            governor.record(1.0, 1, 0, plan)
        else:
            drafted = depth if plan is None else min(plan, depth)
            governor.record(spec_seconds * (1 + drafted) / (1 + depth), min(spec_tokens, drafted + 1), drafted, plan)
    return plans


def run_lengths(plans: list, plan) -> list[int]:
    """The lengths of the runs of consecutive steps planned `plan` (0: rests, 1: one-token drafts)."""
    return [len(list(group)) for key, group in itertools.groupby(plans) if key == plan]


def test_speculation_that_pays_is_kept():
    plans = run(Governor(), 100, spec_seconds=1.5, spec_tokens=3)
    assert plans[:2] == [0, 0]  # the plain rate is measured first
    speculative = [p for p in plans[2:] if p != 0]
    assert all(p is None for p in speculative) and len(speculative) >= 90  # a rare refresh of the plain rate only


def test_speculation_that_pays_only_when_short_is_capped():
    plans = run(Governor(), 120, spec_seconds=4.0, spec_tokens=2)  # depth 1 pays (1.25x), depth 2 and 4 lose
    # full drafts lose (the first speculative step is not judged, see below); one token a step was accepted, so
    # the cap goes straight to 1, where it pays
    assert plans[2:9] == [None] * 7 and plans[9:15] == [1] * 6
    assert plans[15:].count(1) > 0.6 * len(plans[15:])  # mostly capped at 1, probing deeper now and then
    assert plans[15:].count(0) < 5


def test_a_loss_caps_the_depth_at_what_was_accepted():
    plans = run(Governor(), 30, spec_seconds=4.0, spec_tokens=3, depth=8)  # 3 tokens for 9 rows' cost: loses
    assert plans[2:9] == [None] * 7 and plans[9:15] == [2] * 6  # accepted 2 a step: cap 2 (not 8 // 2 = 4)


def test_speculation_that_loses_is_shortened_then_rested_then_probed():
    governor = Governor()
    plans = run(governor, 120, spec_seconds=4.0, spec_tokens=1)  # nothing is ever accepted
    caps = [p for p in plans if p not in (None, 0)]
    assert caps and caps[0] == 1  # nothing accepted: straight to one-token drafts, then rest
    rests = run_lengths(plans[2:], 0)
    assert rests[0] >= 8 and max(rests) > rests[0]  # rests, longer after each further loss
    assert plans.count(0) > 60  # most steps ran plain
    assert 1 in plans[plans.index(0, 2) + 8 :]  # ...but it probed again, with one-token drafts


def test_steps_that_accept_nothing_are_judged_lost_before_a_full_window():
    plans = run(Governor(), 20, spec_seconds=1.0, spec_tokens=1)  # as fast as plain (noise), yet nothing accepted
    assert plans[2:6] == [None] * 4 and plans[6:9] == [1] * 3 and plans[9] == 0  # step 2 is not judged (below)
    plans = run(Governor(), 20, spec_seconds=1.0, spec_tokens=2)  # a token accepted now and then: a full window
    assert plans[2:9] == [None] * 7
    plans = run(Governor(), 20, spec_seconds=1.0, spec_tokens=1, depth=0)  # no match found: empty drafts cost a
    assert plans[2:9] == [None] * 7  # plain step, they do not make a retrieval drafter lose


class JudgesCatchUp(Governor):
    """The planted bug: the step after a rest is judged like any other."""

    def record(self, seconds, tokens, depth, planned):
        if planned != 0:
            self.after_rest = False
        super().record(seconds, tokens, depth, planned)


def catch_up_plans(governor: Governor, steps: int = 300) -> list:
    """A draft model that pays (4 tokens for 2.4 plain steps' time) except in a passage where nothing is accepted
    (steps 30-44), and that first catches up on the tokens decoded plainly since it last drafted: 3 plain steps'
    time for each (its prefill of them)."""
    plans, skipped = [], 0
    for step in range(steps):
        plan = governor.plan()
        plans.append(plan)
        if plan == 0:
            governor.record(1.0, 1, 0, plan)
            skipped += 1
            continue
        depth = 3 if plan is None else min(plan, 3)
        tokens = 1 if 30 <= step < 45 else depth + 1
        governor.record(2.4 * (1 + depth) / 4 + 3.0 * skipped, tokens, depth, plan)
        skipped = 0
    return plans


def test_the_step_after_a_rest_is_not_judged():
    """That step is slow because of the rest; judging it would rest the drafter again, longer each time."""
    plans = catch_up_plans(Governor())
    assert plans[100:].count(None) >= 180  # full drafts, a refresh of the plain rate now and then
    assert catch_up_plans(JudgesCatchUp())[100:].count(None) < 50  # the planted bug: rests, each one longer


def test_a_loss_then_a_win_restores_full_drafts():
    governor = Governor()
    run(governor, 30, spec_seconds=4.0, spec_tokens=1)
    plans = run(governor, 120, spec_seconds=1.2, spec_tokens=4)
    assert plans[-20:].count(None) >= 18


class Scripted(Governor):
    """A governor whose plan follows a fixed cycle (plain steps, caps, full drafts), to test the engine's side."""

    def __init__(self):
        super().__init__()
        self.cycle = itertools.cycle([None, 0, 1, None, 0, 0, 2, None])

    def plan(self):
        return next(self.cycle)


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_any_plan_is_lossless(name):
    pair = tiny_foreign_pair if DRAFTERS[name].foreign_vocabulary else tiny_pair
    target, draft_model = pair("qwen2:native-int4", seed=5)
    prompt = [3, 9, 4, 17, 3, 9, 4, 22, 3, 9, 4, 17, 3, 9]
    options = {"draft_model": draft_model} if DRAFTERS[name].needs_draft_model else {}
    plain, _ = generate(target, build_drafter("none", target), prompt, 40, GREEDY)
    spec, stats = generate(target, build_drafter(name, target, **options), prompt, 40, GREEDY, governor=Scripted())
    assert spec == plain
    assert stats.plain_steps >= 5


@pytest.mark.parametrize("name,options", [("draft", {"topk": 1}), ("slem", {}), ("tli", {}), ("slrs", {})])
def test_capped_steps_draft_no_deeper_than_kept(name, options):
    """Under a cap the engine tells the drafter how deep it keeps (depth_limit), and a model-based drafter stops
    growing there instead of expanding levels that would be trimmed: capped at one level, a depth-4 drafter runs
    exactly the draft-model forwards of a depth-1 one."""
    pair = tiny_foreign_pair if DRAFTERS[name].foreign_vocabulary else tiny_pair
    target, draft_model = pair("qwen2:native", seed=5)
    prompt = [3, 9, 4, 17, 3, 9, 4, 22, 3, 9, 4, 17, 3, 9]
    plain, _ = generate(target, build_drafter("none", target), prompt, 30, GREEDY)
    forward = draft_model.forward

    def draft_forwards(depth: int, governor: Governor | None) -> int:
        calls = []

        def counting(*args, **kwargs):
            calls.append(1)
            return forward(*args, **kwargs)

        draft_model.forward = counting
        drafter = build_drafter(name, target, draft_model=draft_model, depth=depth, **options)
        spec, stats = generate(target, drafter, prompt, 30, GREEDY, governor=governor)
        assert spec == plain
        assert stats.drafted_tokens <= stats.target_forwards - 1  # nothing deeper than 1 reached the target
        return len(calls)

    capped = Governor()
    capped.plan = lambda: 1  # every step keeps a one-token draft
    assert draft_forwards(4, capped) == draft_forwards(1, None)


def test_capped_steps_verify_narrow_drafts():
    """A cap of c levels also bounds the rows: at most 2c draft nodes, even from a wide drafter (lookahead's
    window and n-gram candidates), and the output stays plain decoding's."""
    target, _ = tiny_pair("qwen2:native", seed=5)
    prompt = [3, 9, 4, 17, 3, 9, 4, 22, 3, 9, 4, 17, 3, 9]
    plain, _ = generate(target, build_drafter("none", target), prompt, 30, GREEDY)
    uncapped_spec, uncapped = generate(target, build_drafter("lookahead", target), prompt, 30, GREEDY)
    capped = Governor()
    capped.plan = lambda: 1
    spec, stats = generate(target, build_drafter("lookahead", target), prompt, 30, GREEDY, governor=capped)
    assert spec == plain == uncapped_spec
    assert uncapped.drafted_tokens > 2 * (uncapped.target_forwards - 1)  # wide when free
    assert 0 < stats.drafted_tokens <= 2 * (stats.target_forwards - 1)


def test_the_next_request_starts_from_what_was_learned():
    governor = Governor(first_rest=4)
    while governor.next_rest == 4:  # until the first loss of one-token drafts: resting 4 steps, next time 8
        run(governor, 1, spec_seconds=4.0, spec_tokens=1)
    following = governor.for_next_request()
    assert following.plain_rate == governor.plain_rate and following.cap == 1
    assert 0 < following.rest <= following.first_rest  # lost once: probes again soon, the new text may suit it
    while governor.next_rest == 8:  # ...until its probe lost too: resting 8 steps
        run(governor, 1, spec_seconds=4.0, spec_tokens=1)
    assert governor.for_next_request().rest == governor.rest > governor.first_rest  # a losing streak: keeps resting
    fresh = run(Governor(), 10, spec_seconds=1.2, spec_tokens=4)
    assert fresh[:2] == [0, 0]  # a fresh governor measures the plain rate first...
    winning = Governor()
    run(winning, 20, spec_seconds=1.2, spec_tokens=4)
    assert run(winning.for_next_request(), 10, spec_seconds=1.2, spec_tokens=4)[:2] == [None, None]  # ...not again


class AlwaysCatchesUp(Governor):
    """The planted bug: every drafter's step after a rest goes unjudged, whether it caught up on anything or not."""

    def record(self, seconds, tokens, depth, planned):
        self.catch_up = True
        super().record(seconds, tokens, depth, planned)


def test_a_drafter_with_nothing_to_catch_up_on_is_judged_from_the_first_step_after_a_rest():
    """Retrieval and layer skipping have no catch-up cost: a probe of a drafter that never pays ends a step sooner,
    so fewer steps are lost to it."""

    def drafted(governor: Governor) -> int:
        return sum(plan != 0 for plan in run(governor, 300, spec_seconds=4.0, spec_tokens=1))

    assert drafted(Governor(catch_up=False)) < drafted(Governor())
    assert drafted(AlwaysCatchesUp(catch_up=False)) == drafted(Governor())


@pytest.mark.parametrize("name", ["pld", "draft"])
def test_the_engine_tells_the_governor_whether_the_drafter_catches_up(name):
    target, draft_model = tiny_pair("qwen2:native", seed=5)
    governor = Governor(catch_up=not DRAFTERS[name].catches_up)
    drafter = build_drafter(name, target, draft_model=draft_model) if name == "draft" else build_drafter(name, target)
    generate(target, drafter, [1, 2, 3], 4, GREEDY, governor=governor)
    assert governor.catch_up == DRAFTERS[name].catches_up == (name == "draft")


class ResetsEveryRequest(Governor):
    """The planted bug: every request probes within `first_rest` steps, however often the drafter lost."""

    def for_next_request(self):
        return replace(super().for_next_request(), rest=min(self.rest, self.first_rest))


def test_short_requests_do_not_each_pay_a_probe_of_a_drafter_that_keeps_losing():
    def drafted_steps(governor: Governor) -> int:
        total = 0
        for _ in range(30):  # 30 one-line answers of 12 tokens
            total += sum(plan != 0 for plan in run(governor, 12, spec_seconds=4.0, spec_tokens=1))
            governor = governor.for_next_request()
        return total

    assert drafted_steps(Governor()) < 0.12 * 30 * 12  # a probe every ~64 tokens, across requests
    assert drafted_steps(ResetsEveryRequest()) > 2 * drafted_steps(Governor())  # a probe in nearly every request


class CarriesEveryLosingStreak(Governor):
    """The planted bug: a losing streak keeps resting into the next request however little a probe costs."""

    def for_next_request(self):
        losing_streak = self.next_rest > 2 * self.first_rest
        return replace(super().for_next_request(), rest=self.rest if losing_streak else min(self.rest, self.first_rest))


def test_a_cheap_probe_is_tried_again_on_the_next_request():
    """A retrieval drafter that found nothing to copy in one request (its one-token drafts rejected at 1.1 plain
    steps' cost) drafts again early in the next one, which may be a summary of its prompt; a costly one rests on."""

    def losing_streak(governor: Governor, spec_seconds: float) -> Governor:
        while governor.next_rest <= 2 * governor.first_rest:  # lose until the probe lost too
            run(governor, 1, spec_seconds=spec_seconds, spec_tokens=1)
        return governor

    def plain_steps_next_request(governor: Governor) -> int:
        """Plain steps before the first draft of the next request, where the drafter pays (3 tokens a step)."""
        plans = run(governor.for_next_request(), 80, spec_seconds=1.5, spec_tokens=3)
        return plans.index(1) if 1 in plans else len(plans)

    cheap = losing_streak(Governor(), spec_seconds=2.75)  # one drafted token: 2.75 * 2/5 = 1.1 plain steps
    assert cheap.probe_cost == pytest.approx(1.1) and cheap.rest > cheap.first_rest
    assert plain_steps_next_request(cheap) <= cheap.first_rest
    assert plain_steps_next_request(losing_streak(CarriesEveryLosingStreak(), 2.75)) > cheap.first_rest
    costly = losing_streak(Governor(), spec_seconds=4.0)  # 1.6 plain steps: keeps resting
    assert plain_steps_next_request(costly) == costly.rest > costly.first_rest


class ProbesAFullWindow(Governor):
    """The planted bug: a probe after a rest is judged on a full window, like any other."""

    def record(self, seconds, tokens, depth, planned):
        self.probing = False
        super().record(seconds, tokens, depth, planned)


def test_a_probe_after_a_rest_is_judged_after_a_few_steps():
    """A drafter that gets a token accepted now and then but still loses (one drafted token costs 3 plain steps'
    time): each probe costs `quick` steps, not a full window."""

    def probe_lengths(governor: Governor) -> list[int]:
        plans = run(governor, 200, spec_seconds=3.0, spec_tokens=2, depth=1)
        return run_lengths(plans, 1)[1:]  # the probes after the first rest

    assert probe_lengths(Governor(catch_up=False)) and set(probe_lengths(Governor(catch_up=False))) == {3}
    assert set(probe_lengths(ProbesAFullWindow(catch_up=False))) == {6}


class ForgetsLossesOnAWin(Governor):
    """The planted bug: any winning window resets the pause to `first_rest`, whatever came before."""

    def record(self, seconds, tokens, depth, planned):
        before = self.next_rest
        super().record(seconds, tokens, depth, planned)
        # only a win leaves the pause at half its value (a loss keeps or doubles it)
        if self.next_rest == max(self.first_rest, before // 2) and before > self.first_rest:
            self.next_rest = self.first_rest


def test_chance_wins_of_a_drafter_that_loses_on_average_do_not_undo_its_rests():
    """One-token drafts accepted 40% of the time, a drafting step costing 1.6 plain steps: 1.4 tokens for 1.6 steps'
    time loses on average, yet a probe of 3 steps wins by chance about one time in three."""

    def seconds_per_token(governor: Governor, seed: int) -> float:
        rng = random.Random(seed)
        seconds = tokens = 0.0
        for _ in range(3000):
            plan = governor.plan()
            if plan == 0:
                step = (1.0, 1, 0)
            else:
                step = (1.6, 1 + (rng.random() < 0.4), 1)
            governor.record(*step, plan)
            seconds, tokens = seconds + step[0], tokens + step[1]
        return seconds / tokens

    halving = [seconds_per_token(Governor(), seed) for seed in range(5)]
    resetting = [seconds_per_token(ForgetsLossesOnAWin(), seed) for seed in range(5)]
    assert max(halving) < 1.03  # within 3% of plain decoding (1 second a token)
    assert min(resetting) > max(halving) + 0.005  # the reset speculates at a loss more often, every seed


class NeverSitsOut(Governor):
    """The planted bug: a drafter reads every prompt, however long, whatever speculation wins back."""

    def begin(self, prompt_tokens, max_new_tokens, catch_up):
        super().begin(prompt_tokens, max_new_tokens, catch_up)
        self.sit_out = False


def serve(governor: Governor, prompts: list[int], new_tokens: int, spec_seconds: float, spec_tokens: int,
          catch_up: float) -> tuple[float, Governor]:
    """Requests answered by a drafter that catches up: reading a token it has not seen costs `catch_up` seconds
    (a plain step: 1 token in 1 second; a speculative step: spec_tokens in spec_seconds, drafting 2 tokens).
    Returns the total seconds and the last request's governor."""
    total = 0.0
    for i, prompt in enumerate(prompts):
        governor = governor.for_next_request() if i else governor
        governor.begin(prompt, new_tokens, catch_up=True)
        behind, made = prompt, 0
        while made < new_tokens:
            plan = governor.plan()
            if plan == 0:
                seconds, tokens, depth = 1.0, 1, 0
                behind += 1
            else:
                depth = 2 if plan is None else min(plan, 2)
                tokens = min(spec_tokens, depth + 1)
                seconds, behind = spec_seconds * (1 + depth) / 3 + behind * catch_up, 0
            governor.record(seconds, tokens, depth, plan)
            total, made = total + seconds, made + tokens
    return total, governor


def test_a_long_prompt_is_not_read_where_speculation_cannot_win_the_reading_back():
    """A draft model reads a 600-token prompt in 30 plain steps' time and then speculates at 1.33x: over a 50-token
    answer it wins back 12.5 steps, less than the reading cost. After one such request, the governor leaves the
    drafter out of the long ones, and keeps it in the short ones, where reading costs little."""
    long_prompts = [600] * 6
    governed, learned = serve(Governor(), long_prompts, 50, spec_seconds=1.5, spec_tokens=2, catch_up=0.05)
    planted, _ = serve(NeverSitsOut(), long_prompts, 50, spec_seconds=1.5, spec_tokens=2, catch_up=0.05)
    plain = 300.0  # 6 requests x 50 one-token steps
    assert governed < planted - 5 * 15  # the five later requests were spared the reading (17.5 steps lost each)
    assert governed < plain + 35  # only the first request paid to learn it
    assert learned.catch_up_seconds == pytest.approx(0.05, rel=0.1)
    assert learned.speedup == pytest.approx(4 / 3, rel=0.15)
    short, _ = serve(replace(learned.for_next_request()), [20] * 3, 100, spec_seconds=1.5, spec_tokens=2,
                     catch_up=0.05)
    assert short < 3 * 100 * 0.85  # short prompts: read, and speculation pays


def test_a_drafter_that_wins_enough_still_reads_long_prompts():
    """The same reading cost against a drafter that doubles the rate: 50 steps won over 100 tokens, 30 spent."""
    governed, learned = serve(Governor(), [600] * 4, 100, spec_seconds=1.0, spec_tokens=2, catch_up=0.05)
    assert not learned.sit_out
    assert governed < 4 * (30 + 50 + 6)  # each request: the reading, 50 two-token steps, a few plain ones


def test_the_prompt_catch_up_of_a_later_request_is_not_judged_as_speculation():
    """A drafter carried into the next request reads the new prompt in its first speculative step: that cost is the
    reading's (learned as such), not a loss of speculating."""
    _, governor = serve(Governor(), [20], 60, spec_seconds=1.0, spec_tokens=3, catch_up=0.05)
    following = governor.for_next_request()
    following.begin(400, 60, catch_up=True)  # 20 steps' reading; a 60-token answer at 3 tokens a step wins back 40
    assert not following.sit_out and following.plan() is None
    following.record(1.0 + 400 * 0.05, 3, 2, None)
    assert list(following.recent) == [] and following.catch_up_seconds == pytest.approx(0.05, rel=0.2)


def test_the_engine_tells_the_governor_the_prompt():
    class Begins(Governor):
        seen: tuple = ()

        def begin(self, prompt_tokens, max_new_tokens, catch_up):
            self.seen = (prompt_tokens, max_new_tokens)
            super().begin(prompt_tokens, max_new_tokens, catch_up)

    target, draft_model = tiny_pair("qwen2:native", seed=5)
    governor = Begins()
    generate(target, build_drafter("draft", target, draft_model=draft_model), [1, 2, 3], 4, GREEDY,
             governor=governor)
    assert governor.seen == (3, 4)
