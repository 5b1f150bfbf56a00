"""Speculate only while it pays: an online guard that keeps speculative decoding from ever being much slower than plain
decoding on the machine at hand.

Speculation pays when the tokens a step yields outweigh what the step costs (drafting plus verifying N+1 rows)
against a one-token step. Both sides change with the text (a copy-heavy passage, a creative one), the machine and
the load, so the governor measures them while decoding: the rate of recent speculative steps (tokens per second,
drafting included) against the rate of plain one-token steps. When speculation loses, it first caps the draft's
depth to what the window actually got accepted (shorter drafts cost fewer rows), then rests the drafter (plain
steps, no drafting at all) and probes again with one-token drafts after a pause that doubles while speculation keeps
losing; steps that accepted nothing are judged lost after a few, without waiting for a full window, and so is a
probe (the first window after a rest: a drafter that lost there is likely to lose again, and each probe step costs
more than a plain one). A winning window halves the next pause rather than resetting it, so that chance wins of a
drafter that loses on average do not each buy a return to short rests. Drafts grow back twice as deep after every
few winning windows. The first speculative step after a rest is not judged when the drafter catches up there on the
tokens decoded while it rested (a draft model's prefill of them), a cost of the rest: judging it rested good
drafters again, longer each time. A drafter with nothing to catch up on (retrieval, layer skipping) is judged from
that step on, so a probe that loses costs one step less. No anchor system does this (llama.cpp has only
--draft-min); the output never depends on it (every step is verified the same way).

A request's first speculative step is a catch-up too (a draft model's prefill of the prompt): on a CPU it can cost
more than speculation wins back over a short answer to a long prompt. The governor learns what a caught-up token
costs and what speculation wins against plain steps, and at the start of a request (`begin`) leaves the drafter out
of it where reading the prompt would cost more than the request's expected gain; a catch-up under `explore` of the
request's plain time is always allowed, so short prompts keep probing.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace


@dataclass
class Governor:
    margin: float = 1.0  # speculation must reach this share of plain decoding's rate
    window: int = 6  # speculative steps judged together
    quick: int = 3  # ...or fewer: when none of them accepted a drafted token, or when probing after a rest
    first_rest: int = 8  # plain steps after the first loss; doubles on each further loss
    max_rest: int = 64
    refresh: int = 48  # one plain step every `refresh` speculative ones keeps the plain rate current
    plain_rate: float | None = None  # tokens per second of a one-token step (EWMA)
    cap: int | None = None  # the current draft depth cap; None = the drafter's own
    rest: int = 0  # plain steps left before speculating again
    next_rest: int = 0
    since_plain: int = 0
    full_depth: int = 0  # the deepest draft seen without a cap
    wins: int = 0  # winning windows in a row under the current cap
    grow_after: int = 2  # winning windows under a cap before trying twice as deep
    after_rest: bool = False  # the next speculative step follows a rest: not judged (see record)
    catch_up: bool = True  # the drafter catches up after a rest (Drafter.catches_up; set by `begin`)
    probing: bool = False  # the next judged window follows a rest: `quick` steps long
    recent: deque = field(default_factory=deque)  # (seconds, tokens, depth) of recent speculative steps
    probe_cost: float = math.inf  # a step of the last window of one-token drafts that lost, in plain steps
    cheap_probe: float = 1.25  # ...at most this: probing again costs a few tenths of a step (for_next_request)
    behind: int = 0  # tokens a catching-up drafter has not read yet (the prompt, then the tokens of plain steps)
    catch_up_seconds: float | None = None  # what catching up on one token costs (EWMA of measured catch-ups)
    step_seconds: float | None = None  # a judged speculative step's mean seconds (EWMA over windows)
    speedup: float | None = None  # speculation's rate over the plain rate in judged windows (EWMA)
    explore: float = 0.05  # a catch-up under this share of the request's plain time is always allowed
    sit_out: bool = False  # this request runs plain: reading its prompt would cost more than speculation wins

    def __post_init__(self):
        self.next_rest = self.next_rest or self.first_rest
        if self.plain_rate is None:
            self.rest = 2  # measure the plain rate first

    def for_next_request(self) -> "Governor":
        """The governor of the next generation with the same drafter on this machine: it keeps the plain rate and
        the depth cap it learned (no plain steps spent measuring again, no full-depth window lost relearning a cap).
        A drafter resting after one loss probes again within `first_rest` steps (the new text may suit it), and so
        does one whose probes cost little (`cheap_probe`: a retrieval lookup that failed on a translation may pay
        on the summary that follows). One that lost its costly probes too keeps resting across the request
        boundary, so that short requests (a translation, a one-line answer) do not each pay a probe of a drafter
        that does not pay on this machine."""
        losing_streak = self.next_rest > 2 * self.first_rest  # lost at least twice in a row, the probe included
        keep = losing_streak and self.probe_cost > self.cheap_probe
        rest = self.rest if keep else min(self.rest, self.first_rest)
        return replace(self, recent=deque(), since_plain=0, wins=0, rest=rest, sit_out=False)

    def begin(self, prompt_tokens: int, max_new_tokens: int, catch_up: bool) -> None:
        """A request starts, with a drafter that catches up or not (Drafter.catches_up). One that does has yet to
        read the prompt: its first speculative step does (not judged as speculation: `after_rest`), unless that
        would cost more than the request can win back."""
        self.catch_up = catch_up
        if not catch_up:
            return
        self.behind, self.after_rest = prompt_tokens, True
        if None in (self.catch_up_seconds, self.speedup, self.plain_rate):
            return
        plain_seconds = max_new_tokens / self.plain_rate
        gain = plain_seconds * max(0.0, 1.0 - 1.0 / self.speedup)
        cost = prompt_tokens * self.catch_up_seconds
        self.sit_out = cost > max(gain, self.explore * plain_seconds)

    def plan(self) -> int | None:
        """This step's draft depth cap: 0 = a plain step (no drafting), None = no cap."""
        if self.sit_out or self.rest > 0 or self.since_plain >= self.refresh:
            return 0
        return self.cap

    def record(self, seconds: float, tokens: int, depth: int, planned: int | None) -> None:
        """A step ran as planned: it took `seconds` (drafting and verifying) and yielded `tokens`; its draft was
        `depth` deep."""
        if planned == 0:
            # after a rest (or the first plain-rate measurement), not a refresh step, for a drafter that catches up
            self.after_rest = self.after_rest or (self.rest > 0 and self.catch_up)
            self.behind += tokens if self.catch_up else 0
            self.rest = max(self.rest - 1, 0)
            self.since_plain = 0
            rate = tokens / max(seconds, 1e-9)
            self.plain_rate = _ewma(self.plain_rate, rate, weight=0.3)
            return
        self.since_plain += 1
        if planned is None:
            self.full_depth = max(self.full_depth, depth)
        behind, self.behind = self.behind, 0
        if self.after_rest:  # the drafter caught up on what it skipped (a draft model's prefill of those tokens):
            self.after_rest = False  # a cost of having rested, not of speculating from here on
            self._learn_catch_up(seconds, behind)
            return
        self.recent.append((seconds, tokens, depth))
        if self.plain_rate is None:
            return
        # A step that drafted and accepted nothing yields the one token of a plain step at a higher cost: `quick` of
        # those and none better are a loss already, whatever the clock says, so a drafter that does not fit the text
        # stops sooner.
        drafted = [t for _, t, d in self.recent if d > 0]  # an empty draft (no match found) costs a plain step
        nothing_accepted = len(drafted) >= self.quick and all(t == 1 for t in drafted)
        if len(self.recent) < (self.quick if self.probing else self.window) and not nothing_accepted:
            return
        self.probing = False
        seconds_sum, window_steps = sum(s for s, _, _ in self.recent), len(self.recent)
        rate = sum(t for _, t, _ in self.recent) / max(seconds_sum, 1e-9)
        deepest = max(d for _, _, d in self.recent)
        accepted = sum(t - 1 for _, t, _ in self.recent) / window_steps  # mean accepted draft tokens a step
        self.recent.clear()
        self.speedup = _ewma(self.speedup, rate / self.plain_rate)
        self.step_seconds = _ewma(self.step_seconds, seconds_sum / window_steps)
        if rate >= self.margin * self.plain_rate and not nothing_accepted:
            # A win halves the next pause instead of forgetting the losses: a few lucky steps of a drafter that
            # loses on average (a probe of `quick` steps wins by chance) then buy one short spell, not a return to
            # short rests; a drafter that keeps winning is back at `first_rest` after a few windows.
            self.next_rest = max(self.first_rest, self.next_rest // 2)
            self.wins += 1
            if self.cap is not None and self.wins >= self.grow_after:  # winning under a cap for a while: go deeper
                self.cap = None if self.cap * 2 >= self.full_depth else self.cap * 2
                self.wins = 0
            return
        self.wins = 0
        if deepest > 1:  # losing: shorter drafts first, no deeper than what got accepted
            self.cap = max(1, min(deepest // 2, math.ceil(accepted)))
            return
        self.rest, self.cap = self.next_rest, 1  # even one drafted token does not pay: rest, then probe short drafts
        self.probe_cost = seconds_sum / window_steps * self.plain_rate  # plain_rate: 1 / a plain step's seconds
        self.probing = True
        self.next_rest = min(2 * self.next_rest, self.max_rest)

    def _learn_catch_up(self, seconds: float, behind: int, fewest: int = 16) -> None:
        """A step that caught up on `behind` tokens took `seconds`: beyond a speculative step's usual cost (a plain
        step's before any was judged), that is the catch-up's. Short catch-ups say little about the per-token cost."""
        if behind < fewest or self.plain_rate is None:
            return
        usual = self.step_seconds if self.step_seconds is not None else 1.0 / self.plain_rate
        self.catch_up_seconds = _ewma(self.catch_up_seconds, max(seconds - usual, 0.0) / behind)


def _ewma(old: float | None, new: float, weight: float = 0.5) -> float:
    return new if old is None else (1 - weight) * old + weight * new
