"""Certified routing thresholds, Clopper-Pearson bounds and risk-coverage curves."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from scipy import stats

from calibration.routing import (
    DEFAULT_GRID,
    RiskCoverage,
    ThresholdResult,
    clopper_pearson_lower,
    risk_coverage,
    route,
    select_threshold,
)


def test_default_grid_is_fixed_sorted_and_distinct() -> None:
    assert DEFAULT_GRID[:3] == (0.5, 0.51, 0.52)
    assert DEFAULT_GRID[-3:] == (0.99, 0.995, 0.999)
    assert len(DEFAULT_GRID) == 52
    assert list(DEFAULT_GRID) == sorted(set(DEFAULT_GRID))


def test_clopper_pearson_known_values() -> None:
    # All successes: P(X = n | p) = p^n = alpha at the bound, so the bound is alpha^(1/n).
    assert clopper_pearson_lower(10, 10, 0.05) == pytest.approx(0.05 ** (1 / 10), rel=1e-10)
    assert clopper_pearson_lower(1, 1, 0.1) == pytest.approx(0.1, rel=1e-10)
    assert clopper_pearson_lower(0, 10, 0.05) == 0.0
    assert clopper_pearson_lower(0, 0, 0.05) == 0.0
    # At the bound, observing >= k successes has probability exactly alpha.
    bound = clopper_pearson_lower(45, 50, 0.05)
    assert stats.binom.sf(44, 50, bound) == pytest.approx(0.05, rel=1e-8)
    assert 0.78 < bound < 45 / 50
    # The bound tightens with more data at the same proportion.
    assert clopper_pearson_lower(450, 500, 0.05) > bound


def true_precision(threshold: float) -> float:
    """Precision of confidence ~ U(0.5, 1), correct ~ Bernoulli(confidence), accepting c >= t:
    E[c | c >= t] = (1 + t) / 2 for t in [0.5, 1]."""
    return (1.0 + max(threshold, 0.5)) / 2.0


def test_guarantee_holds_over_simulated_calibration_sets() -> None:
    target, delta, draws = 0.85, 0.1, 200
    rng = np.random.default_rng(0)
    failures = feasible = 0
    for _ in range(draws):
        conf = rng.uniform(0.5, 1.0, size=500)
        correct = rng.random(500) < conf
        result = select_threshold(conf, correct, target_precision=target, delta=delta)
        if result.feasible:
            feasible += 1
            assert result.threshold is not None
            failures += true_precision(result.threshold) < target - 1e-12
    # Bonferroni over 52 thresholds makes failures far rarer than delta; the rule is usable.
    assert failures / draws <= delta
    assert feasible >= draws // 2  # not vacuous: most draws certify a threshold


def test_feasible_result_fields() -> None:
    rng = np.random.default_rng(1)
    conf = rng.uniform(0.5, 1.0, size=2000)
    correct = rng.random(2000) < conf
    result = select_threshold(conf, correct, target_precision=0.85, delta=0.1)
    assert result.feasible
    assert result.threshold is not None
    assert result.threshold in DEFAULT_GRID
    accepted = conf >= result.threshold
    assert result.n_accepted == int(accepted.sum())
    assert result.coverage == pytest.approx(accepted.mean())
    assert result.precision == pytest.approx(correct[accepted].mean())
    assert result.precision is not None
    assert result.precision_lower_bound is not None
    assert 0.85 <= result.precision_lower_bound <= result.precision
    assert result.precision_lower_bound == pytest.approx(
        clopper_pearson_lower(int(correct[accepted].sum()), result.n_accepted, 0.1 / 52)
    )
    assert result.best_certified_precision >= result.precision_lower_bound
    assert result.grid_size == 52
    assert result.method == "clopper-pearson+bonferroni"
    assert result.n == 2000
    # The next lower grid threshold is not certified (the returned one has the most coverage).
    lower_t = DEFAULT_GRID[DEFAULT_GRID.index(result.threshold) - 1]
    below = conf >= lower_t
    assert clopper_pearson_lower(int(correct[below].sum()), int(below.sum()), 0.1 / 52) < 0.85
    assert msgspec.json.decode(msgspec.json.encode(result), type=ThresholdResult) == result


def test_infeasible_when_confidence_carries_no_signal() -> None:
    rng = np.random.default_rng(2)
    conf = np.full(400, 0.5)
    correct = rng.random(400) < 0.5
    result = select_threshold(conf, correct, target_precision=0.9, delta=0.1)
    assert not result.feasible
    assert result.threshold is None
    assert result.coverage == 0.0
    assert result.precision is None
    assert result.precision_lower_bound is None
    assert result.n_accepted == 0
    assert 0.0 < result.best_certified_precision < 0.5
    assert "no threshold on the grid certifies precision 0.9 at delta 0.1 with n=400" in (
        result.reason
    )
    assert "the best certified is" in result.reason


def test_thresholds_with_no_accepted_items_are_never_certified() -> None:
    result = select_threshold([0.2, 0.3], [True, True], target_precision=0.5, grid=[0.9, 0.95])
    assert not result.feasible
    assert result.best_certified_precision == 0.0
    assert "no threshold accepts a correct item" in result.reason


def test_select_threshold_validation() -> None:
    with pytest.raises(ValueError, match="delta must be in the open interval"):
        select_threshold([0.9], [True], delta=1.0)
    with pytest.raises(ValueError, match="target_precision must be in the open interval"):
        select_threshold([0.9], [True], target_precision=0.0)
    with pytest.raises(ValueError, match="2 entries but there are 1 confidences"):
        select_threshold([0.9], [True, False])
    with pytest.raises(ValueError, match=r"correct\[0\] = 2 is not 0/1"):
        select_threshold([0.9], [2])
    with pytest.raises(ValueError, match="repeated thresholds"):
        select_threshold([0.9], [1], grid=[0.5, 0.5])
    with pytest.raises(ValueError, match=r"grid\[0\] = 1.5 is not a threshold"):
        select_threshold([0.9], [1], grid=[1.5])
    with pytest.raises(ValueError, match="confidences is empty"):
        select_threshold([], [])
    with pytest.raises(ValueError, match="successes = 3 exceeds trials = 2"):
        clopper_pearson_lower(3, 2, 0.1)
    with pytest.raises(ValueError, match="alpha must be in the open interval"):
        clopper_pearson_lower(1, 2, 0.0)


def test_route() -> None:
    assert route(0.9, 0.9) == "accept"
    assert route(0.95, 0.9) == "accept"
    assert route(0.89, 0.9) == "escalate"
    with pytest.raises(ValueError, match="confidence must be a number in"):
        route(1.2, 0.9)


def test_risk_coverage_by_hand() -> None:
    # Sorted by confidence: 0.9 (right), 0.8 (wrong), 0.8 (right, later in input), 0.6 (wrong).
    curve = risk_coverage([0.8, 0.9, 0.6, 0.8], [False, True, False, True])
    assert curve.coverage == [0.25, 0.5, 0.75, 1.0]
    # errors among the top i: 0/1, 1/2, 1/3, 2/4
    assert curve.risk == pytest.approx([0.0, 0.5, 1 / 3, 0.5])
    # AURC = (0 + 1/2 + 1/3 + 1/2) / 4 = (4/3) / 4 = 1/3
    assert curve.aurc == pytest.approx(1 / 3)
    assert all(type(v) is float for v in curve.risk)
    assert msgspec.json.decode(msgspec.json.encode(curve), type=RiskCoverage) == curve
