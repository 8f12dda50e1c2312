"""The AQN equivalence test (results/aqn_equivalence/PLAN.md): its power calculation, and its analysis on
synthetic run folders (no training, no GPU).

    .venv/bin/python -m pytest tests/test_aqn_equivalence.py -q
"""

import math

import pytest

from experiments import aqn_power


def test_t_distribution_matches_tables():
    # textbook quantiles: t(0.975, 15) = 2.131, t(0.95, 127) = 1.657, t(0.95, 1) = 6.314
    assert aqn_power.t_quantile(0.975, 15) == pytest.approx(2.1314, abs=1e-4)
    assert aqn_power.t_quantile(0.95, 127) == pytest.approx(1.6570, abs=1e-4)
    assert aqn_power.t_quantile(0.95, 1) == pytest.approx(6.3138, abs=1e-4)
    assert aqn_power.t_cdf(0.0, 7) == 0.5 and aqn_power.t_cdf(-2.1314, 15) == pytest.approx(0.025, abs=1e-5)


def test_tost_power_agrees_with_simulation_and_the_plan():
    """The plan's numbers: 128 pairs give ~81% power at true difference 0 (SD 0.076, margin 0.02, alpha 0.05)."""
    exact = aqn_power.tost_power(128)
    assert exact == pytest.approx(0.812, abs=0.005)
    assert aqn_power.simulated_tost_power(128, studies=8000) == pytest.approx(exact, abs=0.02)
    assert aqn_power.tost_power(125) < 0.8 <= aqn_power.tost_power(126)  # pairs_needed() = 126
    assert aqn_power.tost_power(128, delta=0.005) < exact  # a true difference costs power
    assert aqn_power.tost_power(128, sd=0.2) < 0.01  # too noisy: the margin is never reached
    assert math.isclose(aqn_power.t_test_power(16, 0.057), 0.80, abs_tol=0.01)
