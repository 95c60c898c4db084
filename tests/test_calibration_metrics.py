"""Calibration metrics, bootstrap intervals, the ECE noise floor and the reliability diagram."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import numpy as np
import pytest

from calibration.metrics import (
    MetricReport,
    _BootstrapData,
    accuracy,
    adaptive_ece,
    brier,
    calibration_bins,
    classwise_ece,
    ece,
    ece_noise_floor,
    evaluate,
    mce,
    nll,
)
from calibration.reliability import reliability_diagram

# Four two-choice items, confidences chosen away from the 15 bin edges (multiples of 1/15).
HAND_PROBS = np.array([[0.95, 0.05], [0.92, 0.08], [0.10, 0.90], [0.38, 0.62]])
HAND_Y = np.array([0, 1, 1, 0])


def calibrated(seed: int, n: int = 1000, k: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Probabilities softmax(N(0, 2^2)) with labels drawn from them: calibrated by construction."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, 2.0, size=(n, k))
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    u = rng.random(n)[:, None]
    y = np.minimum((u > np.cumsum(p, axis=1)).sum(axis=1), k - 1)
    return p, y


def test_ece_by_hand() -> None:
    # Top-label confidences and hits: 0.95 right, 0.92 wrong, 0.90 right, 0.62 wrong.
    # 15 bins: 0.95 -> (14/15, 1]; 0.92 and 0.90 -> (13/15, 14/15]; 0.62 -> (9/15, 10/15].
    #   bin 14: 1 item,  acc 1,   conf 0.95, |gap| 0.05 -> 1/4 * 0.05 = 0.0125
    #   bin 13: 2 items, acc 0.5, conf 0.91, |gap| 0.41 -> 2/4 * 0.41 = 0.2050
    #   bin  9: 1 item,  acc 0,   conf 0.62, |gap| 0.62 -> 1/4 * 0.62 = 0.1550
    # ECE = 0.0125 + 0.2050 + 0.1550 = 0.3725; MCE = 0.62.
    assert ece(HAND_PROBS, HAND_Y) == pytest.approx(0.3725, abs=1e-12)
    assert mce(HAND_PROBS, HAND_Y) == pytest.approx(0.62, abs=1e-12)
    # 2 equal-mass bins over sorted confidences [0.62, 0.90 | 0.92, 0.95]:
    #   (acc 0.5, conf 0.76) -> 0.5 * 0.26 = 0.13; (acc 0.5, conf 0.935) -> 0.5 * 0.435 = 0.2175
    assert adaptive_ece(HAND_PROBS, HAND_Y, n_bins=2) == pytest.approx(0.3475, abs=1e-12)
    # Class 0: p0 = .95 (y=0), .92, .10, .38 (y=0), each alone in its bin:
    #   |1-.95| + |0-.92| + |0-.10| + |1-.38| = 0.05 + 0.92 + 0.10 + 0.62 = 1.69 -> 1.69/4
    # Class 1 mirrors it in a two-choice problem, so the mean is 0.4225.
    assert classwise_ece(HAND_PROBS, HAND_Y) == pytest.approx(0.4225, abs=1e-12)
    counts, acc, conf = calibration_bins(HAND_PROBS, HAND_Y)
    assert counts.tolist() == [0] * 9 + [1, 0, 0, 0, 2, 1]
    assert acc[13] == 0.5
    assert conf[13] == pytest.approx(0.91)
    assert np.isnan(acc[0])


def test_bin_edges_belong_to_the_lower_bin() -> None:
    # Confidence exactly 0.5 (an edge of 2 bins) is in (0, 0.5]; confidence 1 in (0.5, 1].
    probs = np.array([[0.5, 0.5], [1.0, 0.0]])
    counts, _, _ = calibration_bins(probs, [1, 0], n_bins=2)
    assert counts.tolist() == [1, 1]
    # bin (0, 0.5]: acc 0 vs conf 0.5; bin (0.5, 1]: acc 1 vs conf 1 -> ECE = 0.5 * 0.5
    assert ece(probs, [1, 0], n_bins=2) == pytest.approx(0.25)


def test_accuracy_nll_brier_by_hand() -> None:
    assert accuracy(HAND_PROBS, HAND_Y) == 0.5
    expected_nll = -(math.log(0.95) + math.log(0.08) + math.log(0.90) + math.log(0.38)) / 4
    assert nll(HAND_PROBS, HAND_Y) == pytest.approx(expected_nll, rel=1e-12)
    # Per item sum_k (p_k - onehot_k)^2: 2 * 0.05^2 = 0.005, 2 * 0.92^2 = 1.6928,
    # 2 * 0.10^2 = 0.02, 2 * 0.62^2 = 0.7688; mean = 2.4866 / 4 = 0.62165.
    assert brier(HAND_PROBS, HAND_Y) == pytest.approx(0.62165, abs=1e-12)
    # A zero probability on the true choice is clipped at 1e-12 rather than infinite.
    assert nll([[1.0, 0.0]], [1]) == pytest.approx(-math.log(1e-12))


def test_calibrated_data_sits_at_its_noise_floor() -> None:
    p, y = calibrated(0)
    floor, floor_p95 = ece_noise_floor(p.max(axis=1))
    assert 0 < floor < floor_p95 < 0.1
    assert ece(p, y) <= floor_p95
    # The same items made overconfident are far above the floor.
    sharp = p**3 / (p**3).sum(axis=1, keepdims=True)
    assert ece(sharp, y) > 3 * ece_noise_floor(sharp.max(axis=1))[1]


def test_noise_floor_matches_a_direct_simulation_and_is_fast() -> None:
    rng = np.random.default_rng(1)
    conf = rng.uniform(0.5, 1.0, size=200)
    floor, floor_p95 = ece_noise_floor(conf, n_draws=50, seed=3)
    # The same draws one at a time, through the public ece() on two-choice probabilities.
    sim = np.random.default_rng(3)
    probs = np.stack([conf, 1.0 - conf], axis=1)
    eces = [ece(probs, np.where(sim.random(conf.shape[0]) < conf, 0, 1)) for _ in range(50)]
    assert floor == pytest.approx(float(np.mean(eces)), rel=1e-12)
    assert floor_p95 == pytest.approx(float(np.quantile(eces, 0.95)), rel=1e-12)


def test_evaluate_intervals_contain_the_point_values() -> None:
    p, y = calibrated(2, k=6)
    report = evaluate(p, y)
    assert report.n == 1000
    for name, fn in [
        ("accuracy", accuracy),
        ("nll", nll),
        ("brier", brier),
        ("ece", ece),
        ("adaptive_ece", adaptive_ece),
        ("mce", mce),
        ("classwise_ece", classwise_ece),
    ]:
        interval = getattr(report, name)
        assert interval.value == pytest.approx(fn(p, y), rel=1e-9, abs=1e-12), name
        assert interval.low <= interval.value <= interval.high, name
        assert type(interval.low) is float
    assert report.accuracy.low < report.accuracy.high
    assert report.ece_noise_floor < report.ece_noise_floor_p95
    decoded = msgspec.json.decode(msgspec.json.encode(report), type=MetricReport)
    assert decoded == report
    assert evaluate(p, y, n_bootstrap=50, seed=7) == evaluate(p, y, n_bootstrap=50, seed=7)


def test_vectorized_bootstrap_matches_the_metric_functions() -> None:
    p, y = calibrated(3, n=120, k=3)
    data = _BootstrapData(p, y, 15)
    idx = np.random.default_rng(4).integers(0, 120, size=(5, 120))
    batch = data.metrics(idx)
    for r in range(5):
        pr, yr = p[idx[r]], y[idx[r]]
        # Resamples hold ties (repeated items); a stable sort of a resample can order tied
        # items differently from the global order only among identical copies, which is moot.
        for name, fn in [
            ("accuracy", accuracy),
            ("nll", nll),
            ("brier", brier),
            ("ece", ece),
            ("adaptive_ece", adaptive_ece),
            ("mce", mce),
            ("classwise_ece", classwise_ece),
        ]:
            assert batch[name][r] == pytest.approx(fn(pr, yr), rel=1e-9, abs=1e-12), name


def test_validation_errors() -> None:
    with pytest.raises(ValueError, match=r"sums to 1\.1"):
        ece([[0.6, 0.5]], [0])
    with pytest.raises(ValueError, match=r"probs\[0, 0\] = 1.5 is not a probability"):
        nll([[1.5, -0.5]], [0])
    with pytest.raises(ValueError, match="2 labels but there are 1 rows"):
        brier([[0.5, 0.5]], [0, 1])
    with pytest.raises(ValueError, match=r"y\[0\] = 2 is out of range: choice indices are 0..1"):
        accuracy([[0.5, 0.5]], [2])
    with pytest.raises(ValueError, match=r"y\[0\] = -1 is out of range"):
        accuracy([[0.5, 0.5]], [-1])
    with pytest.raises(ValueError, match="empty"):
        evaluate(np.zeros((0, 2)), np.zeros(0, dtype=int))
    with pytest.raises(ValueError, match="n_bins must be >= 1, got 0"):
        ece([[0.5, 0.5]], [0], n_bins=0)
    with pytest.raises(ValueError, match=r"confidences\[1\] = 1.5 is not a probability"):
        ece_noise_floor([0.5, 1.5])
    with pytest.raises(ValueError, match="n_bootstrap must be >= 1"):
        evaluate([[0.5, 0.5]], [0], n_bootstrap=0)
    with pytest.raises(ValueError, match="must hold integer choice indices"):
        nll([[0.5, 0.5]], ["a"])


def test_reliability_diagram_writes_a_png_atomically(tmp_path: Path) -> None:
    p, y = calibrated(5, n=300, k=3)
    sharp = p**2 / (p**2).sum(axis=1, keepdims=True)
    target = tmp_path / "reliability.png"
    written = reliability_diagram((sharp, y), (p, y), str(target), title="synthetic")
    assert written == target
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [f.name for f in tmp_path.iterdir()] == ["reliability.png"]
    # Overwriting replaces the file in place and still leaves nothing else behind.
    reliability_diagram((p, y), (p, y), target, n_bins=10)
    assert [f.name for f in tmp_path.iterdir()] == ["reliability.png"]
    with pytest.raises(ValueError, match="directory"):
        reliability_diagram((p, y), (p, y), tmp_path / "missing" / "r.png")
    with pytest.raises(ValueError, match="before must be a"):
        reliability_diagram(p, (p, y), target)  # type: ignore[arg-type]
