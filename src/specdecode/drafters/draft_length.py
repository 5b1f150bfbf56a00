"""Adaptive draft length: how many levels a drafter grows this step. `depth` is the cap for every policy.

- fixed: always `depth` levels.
- heuristic: transformers' assisted-generation schedule (`num_assistant_tokens_schedule="heuristic"`): the
  length grows by 2 after a step whose whole draft depth was accepted and shrinks by 1 otherwise; kept in
  [1, depth] and carried across requests, as transformers carries it across generate() calls.
- confidence: stop growing once the best path probability of the newest level falls below `threshold`
  (SpecDec++'s cumulative stop rule with the draft's own probabilities in place of a trained head;
  transformers' assistant_confidence_threshold uses the last token's probability, which is the same on a
  chain's first level).
- adaptive: Draft & Verify's adaptive draft-exiting (Zhang et al., 2024, arXiv 2309.08168, `auto_th_stop_draft` in
  its decoding.py): stop as `confidence` does (the self-speculative chains pass each token's own draft
  probability, as the paper does), with a threshold that follows the acceptance rate: after each verification the
  rate's moving average m <- 0.5 m + 0.5 accepted/drafted; the threshold moves towards th + 0.01 while m < 0.9
  (drafts too long), th - 0.01 when m >= 0.9 and the draft stopped before the cap, and stays when it reached the
  cap (th <- 0.9 th + 0.1 th'). `threshold` is its start.
- thompson: EESD's Beta-Thompson controller (Liu et al., 2024, arXiv 2406.03853): a Beta(alpha, beta) posterior
  over the per-token acceptance probability; before each further level draw theta ~ Beta and continue with
  probability theta, so lengths follow the acceptance runs the posterior expects. After verification alpha
  gains the accepted tokens and beta gains 1 if the draft was cut short by a rejection: the conjugate update of
  a Bernoulli acceptance per token observed up to the first rejection. Checked against what is public of the
  paper (its abstract: a Thompson-sampling controller over the number of draft tokens per round, a Beta-TS
  variant); its method section and code were not available to check the exact rule, nor its Calibration-TS
  variant (which also weighs the draft's own confidence), which is not implemented.

The decision only ever looks at the draft model's own outputs and at earlier verdicts, never at the target's
scores for this draft, so it does not bias verification: every policy stays lossless.
"""

from __future__ import annotations

import random

from ..errors import OptionError, SpecDecodeError


class FixedLength:
    def __init__(self, depth: int, threshold: float):
        self.cap = depth

    def depth(self) -> int:
        """Most levels to draft this step."""
        return self.cap

    def depth_within(self, limit: int | None) -> int:
        """depth(), no deeper than `limit`: the depth the engine keeps this step (Drafter.depth_limit; None: all).
        Levels past it would be drafted for nothing."""
        depth = self.depth()
        return depth if limit is None else max(1, min(depth, limit))

    def grow(self, confidence: float) -> bool:
        """Draft one more level, given the best path probability of the newest level?"""
        return True

    def update(self, accepted: int, drafted_depth: int) -> None:
        """The target accepted `accepted` tokens of a draft `drafted_depth` levels deep."""


class HeuristicLength(FixedLength):
    def __init__(self, depth, threshold):
        super().__init__(depth, threshold)
        self.current = depth

    def depth(self):
        return self.current

    def update(self, accepted, drafted_depth):
        if drafted_depth == 0:
            return
        grown = self.current + 2 if accepted == drafted_depth else self.current - 1
        self.current = max(1, min(self.cap, grown))


class ConfidenceLength(FixedLength):
    def __init__(self, depth, threshold):
        super().__init__(depth, threshold)
        if not 0 <= threshold <= 1:
            raise OptionError("threshold must be in [0, 1]")
        self.threshold = threshold

    def grow(self, confidence):
        return confidence >= self.threshold


class AdaptiveLength(ConfidenceLength):
    TARGET_RATE, STEP, RATE_DECAY, THRESHOLD_DECAY = 0.9, 0.01, 0.5, 0.9  # the paper's auto_parameters

    def __init__(self, depth, threshold):
        super().__init__(depth, threshold)
        self.rate = 0.0  # moving average of the acceptance rate (the paper's matchness, starting at 0)

    def update(self, accepted, drafted_depth):
        if drafted_depth == 0:
            return
        self.rate = self.RATE_DECAY * self.rate + (1 - self.RATE_DECAY) * accepted / drafted_depth
        if self.rate < self.TARGET_RATE:
            moved = self.threshold + self.STEP
        else:
            moved = self.threshold if drafted_depth == self.cap else self.threshold - self.STEP
        self.threshold = self.THRESHOLD_DECAY * self.threshold + (1 - self.THRESHOLD_DECAY) * moved


class ThompsonLength(FixedLength):
    def __init__(self, depth, threshold, prior: tuple[float, float] = (1.0, 1.0), seed: int = 0):
        super().__init__(depth, threshold)
        self.alpha, self.beta = prior
        self.rng = random.Random(seed)  # its own stream: the sampling generator's draws stay as they were

    def grow(self, confidence):
        return self.rng.random() < self.rng.betavariate(self.alpha, self.beta)

    def update(self, accepted, drafted_depth):
        self.alpha += accepted
        self.beta += 1 if accepted < drafted_depth else 0


LENGTHS = {"fixed": FixedLength, "heuristic": HeuristicLength, "confidence": ConfidenceLength,
           "adaptive": AdaptiveLength, "thompson": ThompsonLength}


def draft_length(name: str, depth: int, threshold: float) -> FixedLength:
    if name not in LENGTHS:
        raise SpecDecodeError(f"unknown draft length policy '{name}'.", f"Use -o length= one of: {', '.join(LENGTHS)}.")
    return LENGTHS[name](depth, threshold)
