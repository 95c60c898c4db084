"""Split conformal prediction sets: coverage, non-empty sets, and the quantile's edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.exceptions import NotFittedError

from calibration.certificates.conformal import (
    ConformalClassifier,
    conformal_quantile,
    prediction_set,
)


def calibrated(rng: np.random.Generator, n: int, k: int = 5) -> tuple[np.ndarray, np.ndarray]:
    z = rng.normal(0.0, 1.5, size=(n, k))
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    u = rng.random(n)[:, None]
    return p, np.minimum((u > np.cumsum(p, axis=1)).sum(axis=1), k - 1)


def test_marginal_coverage_over_many_splits() -> None:
    alpha = 0.1
    rng = np.random.default_rng(0)
    coverages, sizes = [], []
    for _ in range(100):
        p, y = calibrated(rng, 600)
        model = ConformalClassifier().fit(p[:300], y[:300], alpha=alpha)
        sets = model.predict_sets(p[300:])
        assert all(len(s) >= 1 for s in sets)
        coverages.append(np.mean([label in s for s, label in zip(sets, y[300:], strict=True)]))
        sizes.append(np.mean([len(s) for s in sets]))
    assert np.mean(coverages) >= 1 - alpha - 0.01
    # Valid but not trivial: the sets leave out most of the 5 choices on average.
    assert np.mean(sizes) < 4


def test_quantile_is_the_order_statistic() -> None:
    # Scores 1 - p_true are 0.1, 0.2, ..., 0.9 (n = 9). With alpha = 0.2 the rank is
    # ceil(10 * 0.8) = 8, so q_hat is the 8th smallest score, 0.8.
    p_true = np.linspace(0.9, 0.1, 9)
    probs = np.stack([p_true, 1.0 - p_true], axis=1)
    y = np.zeros(9, dtype=int)
    assert conformal_quantile(probs, y, 0.2) == pytest.approx(0.8)
    assert conformal_quantile(probs, y, 0.2) == pytest.approx(
        float(np.quantile(1.0 - p_true, math.ceil(10 * 0.8) / 9, method="inverted_cdf"))
    )
    # alpha = 0.1 needs rank ceil(10 * 0.9) = 9 = n: the largest score.
    assert conformal_quantile(probs, y, 0.1) == pytest.approx(0.9)


def test_quantile_is_one_when_too_few_items() -> None:
    # n = 5, alpha = 0.1: ceil(6 * 0.9) = 6 > 5, so no finite quantile is valid.
    probs = np.array([[0.9, 0.1]] * 5)
    q_hat = conformal_quantile(probs, np.zeros(5, dtype=int), 0.1)
    assert q_hat == 1.0
    assert prediction_set([0.99, 0.01], q_hat) == [0, 1]


def test_prediction_sets_are_never_empty() -> None:
    assert prediction_set([0.2, 0.5, 0.3], 0.0) == [1]
    assert prediction_set([0.2, 0.5, 0.3], 0.7) == [1, 2]
    # Exactly on the threshold counts as inside: score 1 - 0.3 = 0.7 <= 0.7.
    assert 2 in prediction_set([0.2, 0.5, 0.3], 1 - 0.3)
    model = ConformalClassifier().fit([[0.99, 0.01], [0.98, 0.02]] * 20, [0, 0] * 20, 0.1)
    assert model.predict_sets([[0.1, 0.9], [0.6, 0.4]]) == [[1], [0]]


def test_calibration_items_are_covered_at_their_own_quantile() -> None:
    rng = np.random.default_rng(1)
    p, y = calibrated(rng, 200)
    model = ConformalClassifier().fit(p, y, alpha=0.2)
    sets = model.predict_sets(p)
    covered = np.mean([label in s for s, label in zip(sets, y, strict=True)])
    assert covered >= math.ceil(201 * 0.8) / 200
    assert model.alpha_ == 0.2
    assert model.n_classes_ == 5


def test_validation_errors() -> None:
    probs = np.array([[0.5, 0.5]])
    with pytest.raises(ValueError, match="alpha must be in the open interval"):
        conformal_quantile(probs, [0], 1.5)
    with pytest.raises(ValueError, match=r"y\[0\] = 2 is out of range"):
        conformal_quantile(probs, [2], 0.1)
    with pytest.raises(ValueError, match="q_hat must be a number in"):
        prediction_set([0.5, 0.5], -0.1)
    with pytest.raises(ValueError, match="probs_row must be a 1-D"):
        prediction_set([[0.5, 0.5]], 0.5)
    with pytest.raises(ValueError, match="sums to"):
        prediction_set([0.5, 0.6], 0.5)
    with pytest.raises(NotFittedError):
        ConformalClassifier().predict_sets(probs)
    with pytest.raises(ValueError, match="fitted on 2"):
        ConformalClassifier().fit(probs, [0]).predict_sets([[0.2, 0.3, 0.5]])
