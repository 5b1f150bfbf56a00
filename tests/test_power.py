"""The power computation that sizes the sampling tests agrees with closed forms and with simulation."""

from __future__ import annotations

import math

import pytest
import torch

from power import chi_square_survival, critical_value, power, samples_for


def test_central_survival_matches_the_closed_form_for_two_degrees_of_freedom():
    for statistic in (0.5, 3.0, 20.0):
        assert chi_square_survival(statistic, 2) == pytest.approx(math.exp(-statistic / 2), rel=1e-9)


def test_critical_value_is_exceeded_with_probability_alpha():
    for dof, alpha in ((1, 0.05), (10, 1e-4), (60, 1e-5)):
        assert chi_square_survival(critical_value(dof, alpha), dof) == pytest.approx(alpha, rel=1e-6)
    assert critical_value(1, 0.05) == pytest.approx(3.841, abs=1e-3)  # the textbook value


def test_noncentral_survival_matches_simulation():
    gen = torch.Generator().manual_seed(0)
    dof, noncentrality, threshold = 6, 9.0, 20.0
    means = torch.zeros(dof, dtype=torch.float64)
    means[0] = math.sqrt(noncentrality)
    draws = ((torch.randn(200_000, dof, generator=gen, dtype=torch.float64) + means) ** 2).sum(-1)
    simulated = float((draws > threshold).double().mean())
    assert chi_square_survival(threshold, dof, noncentrality) == pytest.approx(simulated, abs=0.005)


def test_samples_for_gives_the_fewest_samples_with_that_power():
    divergence, dof, alpha, wanted = 0.02, 30, 1e-5, 0.99
    n = samples_for(divergence, dof, alpha, wanted)
    assert power(divergence, n, dof, alpha) >= wanted > power(divergence, n - 1, dof, alpha)
    assert samples_for(2 * divergence, dof, alpha, wanted) < n < samples_for(divergence / 2, dof, alpha, wanted)
