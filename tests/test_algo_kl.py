"""The adaptive KL controller's bound: a step counts as at most one horizon, so the weight stays positive."""

from __future__ import annotations

import pytest

from molt.algo import adaptive_kl_coef
from molt.spec import KLSpec


def test_adaptive_kl_coef_stays_positive_when_a_step_exceeds_the_horizon():
    # The audit's case: 64 rollouts per step against horizon 10 (6.4 horizons), the KL far below target
    # (error clipped to -0.2). TRL's unbounded factor 1 - 0.2 * 6.4 = -0.28 gave -0.028, then 0.0078, ...
    spec = KLSpec(coef=0.1, target=0.5, horizon=10)
    coef, seen = 0.1, []
    for _ in range(5):
        coef = adaptive_kl_coef(coef, 0.01, 64, spec)
        seen.append(coef)
    assert seen == pytest.approx([0.1 * 0.8**k for k in range(1, 6)])   # one horizon's -20% per step
    # and +20% per step the other way (KL far above target), never more
    assert adaptive_kl_coef(0.1, 50.0, 64, spec) == pytest.approx(0.1 * 1.2)
    # at most one horizon of rollouts, TRL's formula unchanged: 1 + e * n / horizon
    assert adaptive_kl_coef(0.1, 0.45, 10, spec) == pytest.approx(0.1 * (1 - 0.1))
    assert adaptive_kl_coef(0.1, 0.45, 4, spec) == pytest.approx(0.1 * (1 - 0.1 * 0.4))


@pytest.mark.parametrize("rollouts", [1, 10, 49, 50, 51, 64, 10_000])
@pytest.mark.parametrize("kl", [0.0, 0.01, 0.5, 5.0])
def test_adaptive_kl_factor_stays_in_the_per_horizon_band(rollouts, kl):
    spec = KLSpec(coef=1.0, target=0.5, horizon=10)
    factor = adaptive_kl_coef(1.0, kl, rollouts, spec)
    assert 0.8 - 1e-12 <= factor <= 1.2 + 1e-12
