"""Sequoia's hardware-aware objective (Chen et al., 2024, arXiv 2402.12374): the best option set of a drafter
maximizes E[tokens per step] / (t_draft + t_verify(nodes)), with t_verify measured on this machine as a
function of the tokens one target forward scores (the root plus the drafted nodes)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Measured:
    """One option set of one drafter, decoded greedily over the tuning prompts."""

    options: dict
    tokens_per_step: float  # accepted draft tokens + the bonus, per target forward
    nodes_per_step: float  # drafted tokens sent to the target per step
    draft_seconds_per_step: float  # propose + commit

    def as_dict(self) -> dict:
        return asdict(self)


def verify_seconds(curve: dict[int, float], tokens: float) -> float:
    """Seconds of one target forward over `tokens` tokens: linear between the measured points, and along the
    last two points' slope beyond them."""
    points = sorted(curve.items())
    if len(points) == 1 or tokens <= points[0][0]:
        return points[0][1]
    for (q0, t0), (q1, t1) in zip(points, points[1:]):
        if tokens <= q1:
            return t0 + (t1 - t0) * (tokens - q0) / (q1 - q0)
    (q0, t0), (q1, t1) = points[-2], points[-1]
    return t1 + (t1 - t0) * (tokens - q1) / (q1 - q0)


def tokens_per_second(candidate: Measured, curve: dict[int, float]) -> float:
    step = candidate.draft_seconds_per_step + verify_seconds(curve, 1 + candidate.nodes_per_step)
    return candidate.tokens_per_step / step


def speedup(candidate: Measured, curve: dict[int, float]) -> float:
    """Estimated speed relative to plain decoding (one token per single-token forward, no drafting)."""
    return tokens_per_second(candidate, curve) * verify_seconds(curve, 1)


# How much faster (estimated) a candidate must be to replace the defaults: estimates closer than this are within
# what a few tuning prompts can tell apart (measured: pld's and goose's 1% picks did not hold up on Spec-Bench).
MARGIN = 0.02


def choose(candidates: list[Measured], curve: dict[int, float], margin: float = MARGIN) -> Measured:
    """The candidate with the most tokens per second (the earlier one on a tie), unless it beats the defaults
    (the first candidate) by less than `margin`: then the defaults."""
    best = max(candidates, key=lambda c: (tokens_per_second(c, curve), -candidates.index(c)))
    defaults = candidates[0]
    return best if tokens_per_second(best, curve) >= (1 + margin) * tokens_per_second(defaults, curve) else defaults
