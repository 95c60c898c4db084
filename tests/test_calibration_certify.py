"""Certified thresholds (calibration.certificates.certify), Clopper-Pearson bounds and risk-coverage curves."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from scipy import stats

from calibration.certificates.certify import (
    DEFAULT_GRID,
    PROCEDURES,
    RiskCoverage,
    ThresholdResult,
    clopper_pearson_lower,
    minimum_accepted,
    risk_coverage,
    select_threshold,
    sequence_start,
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


@pytest.mark.parametrize("procedure", PROCEDURES)
def test_guarantee_holds_over_simulated_calibration_sets(procedure: str) -> None:
    target, delta, draws = 0.85, 0.1, 200
    rng = np.random.default_rng(0)
    failures = feasible = 0
    for _ in range(draws):
        conf = rng.uniform(0.5, 1.0, size=500)
        correct = rng.random(500) < conf
        # The sequence's start comes from items the certification set does not contain.
        start = sequence_start(rng.uniform(0.5, 1.0, size=200), 500, target_precision=target)
        result = select_threshold(
            conf,
            correct,
            target_precision=target,
            delta=delta,
            procedure=procedure,
            start=start if procedure == "fixed_sequence" else None,
        )
        if result.feasible:
            feasible += 1
            assert result.threshold is not None
            failures += true_precision(result.threshold) < target - 1e-12
    assert failures / draws <= delta
    assert feasible >= draws // 2  # not vacuous: most draws certify a threshold


def test_fixed_sequence_certifies_more_than_bonferroni() -> None:
    rng = np.random.default_rng(3)
    lower_fs, lower_bf = [], []
    for _ in range(50):
        conf = rng.uniform(0.5, 1.0, size=500)
        correct = rng.random(500) < conf
        fs = select_threshold(conf, correct, target_precision=0.85, start=0.95)
        bf = select_threshold(conf, correct, target_precision=0.85, procedure="bonferroni")
        lower_fs.append(fs.threshold or 1.0)
        lower_bf.append(bf.threshold or 1.0)
    # Every test runs at delta instead of delta / 52: the certified thresholds sit lower.
    assert np.mean(lower_fs) < np.mean(lower_bf) - 0.02


def test_fixed_sequence_stops_at_the_first_failure() -> None:
    # Thresholds 0.9 and 0.8 accept only correct items; 0.7 adds many errors; 0.6 adds so many
    # correct items that its precision would pass again. The sequence must stop at 0.7.
    conf = np.array([0.95] * 60 + [0.85] * 60 + [0.75] * 60 + [0.65] * 2000)
    correct = np.array([True] * 120 + [False] * 60 + [True] * 2000)
    grid = [0.6, 0.7, 0.8, 0.9]
    result = select_threshold(conf, correct, target_precision=0.9, grid=grid)
    assert result.threshold == 0.8
    assert result.tested == 3 and result.start == 0.9
    assert result.procedure == "fixed_sequence"
    bonferroni = select_threshold(
        conf, correct, target_precision=0.9, grid=grid, procedure="bonferroni"
    )
    assert bonferroni.threshold == 0.6 and bonferroni.tested == 4


def test_fixed_sequence_starts_where_told() -> None:
    conf = np.array([0.999] * 3 + [0.9] * 200)
    correct = np.ones(203, dtype=bool)
    # From the top, 0.999 accepts 3 items: 0.9 ** 3 > delta, so the sequence ends at once.
    assert select_threshold(conf, correct, grid=[0.9, 0.999]).threshold is None
    started = select_threshold(conf, correct, grid=[0.9, 0.999], start=0.9)
    assert started.threshold == 0.9 and started.tested == 1
    with pytest.raises(ValueError, match=r"start 0\.95 is not a threshold of the grid"):
        select_threshold(conf, correct, grid=[0.9, 0.999], start=0.95)
    with pytest.raises(ValueError, match="procedure must be one of"):
        select_threshold(conf, correct, procedure="holm")


def test_minimum_accepted_and_sequence_start() -> None:
    # 0.9 ** 21 = 0.109 > 0.1 >= 0.9 ** 22 = 0.098
    assert minimum_accepted(0.9, 0.1) == 22
    assert minimum_accepted(0.5, 0.5) == 1
    conf = np.linspace(0.5, 1.0, 101)
    # 500 items expected, 44 needed: the highest threshold where >= 8.8% of items lie above.
    start = sequence_start(conf, 500, target_precision=0.9, delta=0.1)
    assert start in DEFAULT_GRID
    assert 500 * np.mean(conf >= start) >= 44
    above = [t for t in DEFAULT_GRID if t > start]
    assert all(500 * np.mean(conf >= t) < 44 for t in above)
    assert sequence_start(np.zeros(10), 5) == DEFAULT_GRID[0]


def test_feasible_result_fields() -> None:
    rng = np.random.default_rng(1)
    conf = rng.uniform(0.5, 1.0, size=2000)
    correct = rng.random(2000) < conf
    result = select_threshold(
        conf, correct, target_precision=0.85, delta=0.1, procedure="bonferroni"
    )
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
    assert result.method == "clopper-pearson, bonferroni" and result.start is None
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
    result = select_threshold(
        conf, correct, target_precision=0.9, delta=0.1, procedure="bonferroni"
    )
    assert not result.feasible
    assert result.threshold is None
    assert result.coverage == 0.0
    assert result.precision is None
    assert result.precision_lower_bound is None
    assert result.n_accepted == 0
    assert 0.0 < result.best_certified_precision < 0.5
    assert "no threshold certifies precision 0.9 at delta 0.1 with n=400" in result.reason
    assert "the best lower bound is" in result.reason


def test_thresholds_with_no_accepted_items_are_never_certified() -> None:
    result = select_threshold([0.2, 0.3], [True, True], target_precision=0.5, grid=[0.9, 0.95])
    assert not result.feasible
    assert result.best_certified_precision == 0.0
    assert "no tested threshold accepts a correct item" in result.reason


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
