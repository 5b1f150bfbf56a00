"""How many samples a goodness-of-fit test needs: the power of Pearson's chi-square test against a given shift.

A correct sampler fails a test at level alpha with probability alpha; a wrong one whose distribution differs from the
exact one by a chi-square divergence D = sum (p' - p)^2 / p gives, over n samples, a statistic that is close to
noncentral chi-square with noncentrality n * D. So the smallest shift a test must catch fixes its sample count, and
the number of such tests times alpha bounds how often a correct build fails the suite.
"""

from __future__ import annotations

import math

import torch


def chi_square_survival(statistic: float, dof: int, noncentrality: float = 0.0) -> float:
    """P(X > statistic) for X ~ chi-square(dof, noncentrality): a Poisson mixture of central chi-squares."""
    half = noncentrality / 2
    terms = int(half + 12 * math.sqrt(half) + 30)
    j = torch.arange(terms, dtype=torch.float64)
    weights = torch.exp(-half + j * math.log(half) - torch.lgamma(j + 1)) if half > 0 else (j == 0).double()
    tails = torch.special.gammaincc((dof + 2 * j) / 2, torch.tensor(statistic / 2, dtype=torch.float64))
    return float((weights * tails).sum())


def boundary(holds, low: float, high: float, steps: int = 200) -> float:
    """The point in [low, high] where `holds` (true at low, false at high, monotone) turns false, by bisection."""
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (middle, high) if holds(middle) else (low, middle)
    return high


def critical_value(dof: int, alpha: float) -> float:
    """The statistic a correct sampler exceeds with probability alpha."""
    return boundary(lambda statistic: chi_square_survival(statistic, dof) > alpha, 0.0, dof + 40 * math.sqrt(dof) + 200)


def power(divergence: float, samples: int, dof: int, alpha: float) -> float:
    """The probability that a test at level alpha fails a sampler shifted by this chi-square divergence."""
    return chi_square_survival(critical_value(dof, alpha), dof, samples * divergence)


def samples_for(divergence: float, dof: int, alpha: float, wanted_power: float) -> int:
    """The fewest samples with which a test at level alpha fails a sampler shifted by `divergence` with
    probability `wanted_power`."""
    critical = critical_value(dof, alpha)

    def too_weak(noncentrality: float) -> bool:
        return chi_square_survival(critical, dof, noncentrality) < wanted_power

    high = 1.0
    while too_weak(high):
        high *= 2
    return math.ceil(boundary(too_weak, 0.0, high, steps=100) / divergence)
