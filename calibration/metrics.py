"""Calibration metrics for finite-choice probabilities, with bootstrap intervals.

A calibration set is usually a few hundred to a few thousand items, and at that size every
metric here is noisy: a perfectly calibrated judge still shows a nonzero ECE from sampling
alone. So ``evaluate`` reports each metric with a bootstrap interval, together with the ECE
"noise floor" (the ECE a perfectly calibrated judge with the same confidences would show), which
is what a measured ECE should be read against.

Conventions: ``probs`` is an (n, k) array whose rows sum to 1, ``y`` an (n,) array of correct
choice indices in 0..k-1. Binned metrics use equal-width bins over [0, 1] where bin i covers
(i/B, (i+1)/B] and a value of exactly 0 falls in the first bin (Guo et al. 2017, "On
Calibration of Modern Neural Networks"). Everything is computed in float64. Inputs are checked
by ``calibration.validation``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated

import msgspec
import numpy as np
from msgspec import Meta

from calibration.errors import RuleError
from calibration.validation import (
    _FloatArray,
    _IntArray,
    check_confidences,
    check_int,
    check_probs_labels,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from numpy.typing import ArrayLike

__all__ = [
    "Interval",
    "MetricReport",
    "accuracy",
    "adaptive_ece",
    "brier",
    "calibration_bins",
    "classwise_ece",
    "ece",
    "ece_noise_floor",
    "evaluate",
    "mce",
    "nll",
]


_NLL_CLIP = 1e-12
# Bootstrap and noise-floor simulations run in blocks of at most this many (draw, item) cells
# so that memory stays bounded for large calibration sets.
_BLOCK_CELLS = 1 << 21


class Interval(msgspec.Struct, frozen=True, kw_only=True):
    """A point estimate and its bootstrap 95% percentile interval.

    ``low``/``high`` are the 2.5th/97.5th percentiles of the metric over resamples, extended to
    ``value`` when ``value`` falls outside them: binned metrics (ECE, MCE, class-wise ECE) are
    biased upward under resampling, because duplicated items make every bin noisier, and for a
    well-calibrated judge the whole resampled distribution can lie above the point value. An
    interval that excluded its own point value would misreport the uncertainty as a shift.
    """

    value: float
    low: float
    high: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.value) and math.isfinite(self.low) and math.isfinite(self.high)):
            raise RuleError(
                f"an interval's value, low and high must be finite, got {self.value!r}, "
                f"{self.low!r}, {self.high!r}"
            )


class MetricReport(msgspec.Struct, frozen=True, kw_only=True):
    """Every calibration metric of one set of probabilities, with bootstrap intervals."""

    n: Annotated[int, Meta(ge=1)]
    accuracy: Interval
    nll: Interval
    brier: Interval
    ece: Interval
    adaptive_ece: Interval
    mce: Interval
    classwise_ece: Interval
    ece_noise_floor: float  # mean ECE of a perfectly calibrated judge with these confidences
    ece_noise_floor_p95: float  # its 95th percentile

    def __post_init__(self) -> None:
        if self.n < 1:
            raise RuleError(f"metrics n must be at least 1, got {self.n}")
        if not (math.isfinite(self.ece_noise_floor) and math.isfinite(self.ece_noise_floor_p95)):
            raise RuleError("metrics ece_noise_floor must be finite")


# ---------------------------------------------------------------------------------------------
# Point metrics.


def _bin_index(values: _FloatArray, n_bins: int) -> _IntArray:
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    # side="left" sends a value equal to an edge to the bin that edge closes, so bin i is
    # (i/B, (i+1)/B]; 0 maps to -1 and is clipped into the first bin.
    idx = np.searchsorted(edges, values, side="left") - 1
    return np.clip(idx, 0, n_bins - 1).astype(np.int64)


def _weighted_bincount(bins: _IntArray, weights: _FloatArray, size: int) -> _FloatArray:
    # np.bincount returns float64 whenever weights are given; the stubs only know its int form.
    return np.bincount(bins, weights=weights, minlength=size).astype(np.float64, copy=False)


def _binned_sums(
    values: _FloatArray, hits: _FloatArray, bins: _IntArray, n_bins: int
) -> tuple[_FloatArray, _FloatArray, _FloatArray]:
    counts = np.bincount(bins, minlength=n_bins).astype(np.float64)
    sum_hits = _weighted_bincount(bins, hits, n_bins)
    sum_values = _weighted_bincount(bins, values, n_bins)
    return counts, sum_hits, sum_values


def _ece_of(values: _FloatArray, hits: _FloatArray, bins: _IntArray, n_bins: int) -> float:
    # sum_b |B|/n * |acc(B) - conf(B)| = sum_b |sum_hits(B) - sum_values(B)| / n
    _, sum_hits, sum_values = _binned_sums(values, hits, bins, n_bins)
    return float(np.abs(sum_hits - sum_values).sum() / values.shape[0])


def _top_label(p: _FloatArray, labels: _IntArray) -> tuple[_FloatArray, _FloatArray]:
    # np.argmax breaks ties toward the lowest index, as the engine's reported choice does.
    confidences = p.max(axis=1)
    hits = (p.argmax(axis=1) == labels).astype(np.float64)
    return confidences, hits


def _checked_top_label(
    probs: ArrayLike, y: ArrayLike, n_bins: int
) -> tuple[_FloatArray, _FloatArray, int]:
    """``_top_label`` of the checked inputs, and the checked ``n_bins``: what every top-label
    binned metric starts from."""
    p, labels = check_probs_labels(probs, y)
    n_bins = check_int(n_bins, "n_bins", 1)
    return *_top_label(p, labels), n_bins


def _item_mean(
    per_item: Callable[[_FloatArray, _IntArray], _FloatArray], probs: ArrayLike, y: ArrayLike
) -> float:
    """The mean over items of ``per_item(p, labels)``, on checked inputs."""
    p, labels = check_probs_labels(probs, y)
    return float(per_item(p, labels).mean())


def _item_hit(p: _FloatArray, labels: _IntArray) -> _FloatArray:
    return _top_label(p, labels)[1]


def accuracy(probs: ArrayLike, y: ArrayLike) -> float:
    """Fraction of items whose most probable choice is correct (ties go to the lowest index).

    Parameters
    ----------
    probs, y : arrays of shapes (n, k) and (n,)
    """
    return _item_mean(_item_hit, probs, y)


def nll(probs: ArrayLike, y: ArrayLike) -> float:
    """Mean negative log probability of the correct choice (probabilities clipped at 1e-12).

    Parameters
    ----------
    probs, y : arrays of shapes (n, k) and (n,)
    """
    return _item_mean(_item_nll, probs, y)


def _item_nll(p: _FloatArray, labels: _IntArray) -> _FloatArray:
    true_p = p[np.arange(p.shape[0]), labels]
    return -np.log(np.clip(true_p, _NLL_CLIP, 1.0))


def _item_brier(p: _FloatArray, labels: _IntArray) -> _FloatArray:
    sq = p**2
    # sum_k (p_k - onehot_k)^2 = sum_k p_k^2 - 2 p_y + 1, without building the one-hot matrix
    true_p = p[np.arange(p.shape[0]), labels]
    return sq.sum(axis=1) - 2.0 * true_p + 1.0


def brier(probs: ArrayLike, y: ArrayLike) -> float:
    """Multiclass Brier score: mean over items of sum_k (p_k - onehot_k)^2, in [0, 2].

    Parameters
    ----------
    probs, y : arrays of shapes (n, k) and (n,)
    """
    return _item_mean(_item_brier, probs, y)


def ece(probs: ArrayLike, y: ArrayLike, n_bins: int = 15) -> float:
    """Top-label expected calibration error with ``n_bins`` equal-width confidence bins.

    ECE = sum_b |B|/n * |accuracy(B) - mean confidence(B)|, where the confidence of an item is
    its largest probability and bin i covers (i/n_bins, (i+1)/n_bins].

    Parameters
    ----------
    probs, y : arrays of shapes (n, k) and (n,)
    n_bins : int
    """
    confidences, hits, n_bins = _checked_top_label(probs, y, n_bins)
    return _ece_of(confidences, hits, _bin_index(confidences, n_bins), n_bins)


def _equal_mass_bins(n: int, n_bins: int) -> _IntArray:
    """Bin of each position 0..n-1 of the sorted confidences (np.array_split's sizes)."""
    sizes = [len(part) for part in np.array_split(np.arange(n), n_bins)]
    return np.repeat(np.arange(n_bins), sizes).astype(np.int64)


def adaptive_ece(probs: ArrayLike, y: ArrayLike, n_bins: int = 15) -> float:
    """Top-label ECE with ``n_bins`` equal-mass bins (Nixon et al. 2019, "Measuring Calibration
    in Deep Learning").

    Items are sorted by confidence (stable, so ties keep their input order) and split into
    ``n_bins`` consecutive groups of near-equal size with ``np.array_split``; empty groups (when
    n < n_bins) contribute nothing.

    Parameters
    ----------
    probs, y : arrays of shapes (n, k) and (n,)
    n_bins : int
    """
    confidences, hits, n_bins = _checked_top_label(probs, y, n_bins)
    order = np.argsort(confidences, kind="stable")
    bins = _equal_mass_bins(len(order), n_bins)
    return _ece_of(confidences[order], hits[order], bins, n_bins)


def mce(probs: ArrayLike, y: ArrayLike, n_bins: int = 15) -> float:
    """Maximum calibration error: the largest |accuracy - confidence| over non-empty bins.

    Uses the same equal-width top-label bins as ``ece``.

    Parameters
    ----------
    probs, y : arrays of shapes (n, k) and (n,)
    n_bins : int
    """
    confidences, hits, n_bins = _checked_top_label(probs, y, n_bins)
    counts, sum_hits, sum_conf = _binned_sums(
        confidences, hits, _bin_index(confidences, n_bins), n_bins
    )
    filled = counts > 0
    return float(np.max(np.abs(sum_hits[filled] - sum_conf[filled]) / counts[filled]))


def classwise_ece(probs: ArrayLike, y: ArrayLike, n_bins: int = 15) -> float:
    """Class-wise ECE (Kull et al. 2019): for each choice k, the ECE of p_k against 1[y == k]
    over all items with ``n_bins`` equal-width bins; the mean over choices.

    Unlike top-label ECE it also sees miscalibration of the choices that are not the top one
    (e.g. a letter bias that inflates "A" everywhere).

    Parameters
    ----------
    probs, y : arrays of shapes (n, k) and (n,)
    n_bins : int
    """
    p, labels = check_probs_labels(probs, y)
    n_bins = check_int(n_bins, "n_bins", 1)
    k = p.shape[1]
    per_class = [
        _ece_of(p[:, c], (labels == c).astype(np.float64), _bin_index(p[:, c], n_bins), n_bins)
        for c in range(k)
    ]
    return float(np.mean(per_class))


def calibration_bins(
    probs: ArrayLike, y: ArrayLike, n_bins: int = 15
) -> tuple[_IntArray, _FloatArray, _FloatArray]:
    """Per-bin item counts, accuracy and mean confidence of the top-label reliability diagram.

    Parameters
    ----------
    probs, y : arrays of shapes (n, k) and (n,)
    n_bins : int

    Returns
    -------
    counts : int array of shape (n_bins,)
    accuracy : float array of shape (n_bins,), NaN in empty bins
    confidence : float array of shape (n_bins,), NaN in empty bins
    """
    confidences, hits, n_bins = _checked_top_label(probs, y, n_bins)
    counts, sum_hits, sum_conf = _binned_sums(
        confidences, hits, _bin_index(confidences, n_bins), n_bins
    )
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = np.where(counts > 0, sum_hits / counts, np.nan)
        conf = np.where(counts > 0, sum_conf / counts, np.nan)
    return counts.astype(np.int64), acc, conf


# ---------------------------------------------------------------------------------------------
# Sampling-noise reference and bootstrap.


def ece_noise_floor(
    confidences: ArrayLike, n_bins: int = 15, n_draws: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """ECE that a perfectly calibrated judge would show with exactly these confidences.

    Each draw makes every item correct with probability equal to its confidence (the definition
    of perfect calibration) and computes the equal-width-bin ECE; a measured ECE at or below
    this level is indistinguishable from sampling noise at this sample size.

    Parameters
    ----------
    confidences : array of shape (n,)
        Top-label confidences (the largest probability of each item), in [0, 1].
    n_bins, n_draws, seed : int

    Returns
    -------
    (mean, p95) : the mean and the 95th percentile of the simulated ECE over ``n_draws`` draws.
    """
    conf = check_confidences(confidences)
    n_bins = check_int(n_bins, "n_bins", 1)
    n_draws = check_int(n_draws, "n_draws", 1)
    seed = check_int(seed, "seed", 0)
    n = conf.shape[0]
    bins = _bin_index(conf, n_bins)
    # The bins depend only on the confidences, so one (n, n_bins) indicator matrix turns every
    # draw's correctness vector into its per-bin hit counts with a single matrix product.
    member = np.zeros((n, n_bins))
    member[np.arange(n), bins] = 1.0
    conf_sums = conf @ member
    rng = np.random.default_rng(seed)
    block = max(1, _BLOCK_CELLS // n)
    eces = np.empty(n_draws)
    for start in range(0, n_draws, block):
        stop = min(n_draws, start + block)
        hits = (rng.random((stop - start, n)) < conf).astype(np.float64)
        eces[start:stop] = np.abs(hits @ member - conf_sums).sum(axis=1) / n
    return float(eces.mean()), float(np.quantile(eces, 0.95))


class _BootstrapData:
    """Per-item quantities computed once, so each resample only gathers and bins them."""

    def __init__(self, p: _FloatArray, labels: _IntArray, n_bins: int) -> None:
        n, k = p.shape
        self.n = n
        self.n_bins = n_bins
        self.k = k
        self.conf, self.hits = _top_label(p, labels)
        self.conf_bins = _bin_index(self.conf, n_bins)
        self.item_nll = _item_nll(p, labels)
        self.item_brier = _item_brier(p, labels)
        self.class_p = p
        self.class_hits = (labels[:, None] == np.arange(k)[None, :]).astype(np.float64)
        self.class_bins = _bin_index(p, n_bins)
        # The sorted order of any resample is the global stable sort order with repeats, so a
        # resample is sorted by sorting the global ranks of its items.
        self.order = np.argsort(self.conf, kind="stable")
        self.rank = np.empty(n, dtype=np.int64)
        self.rank[self.order] = np.arange(n)
        self.mass_bins = _equal_mass_bins(n, n_bins)

    def _row_binned(
        self, bins: _IntArray, values: _FloatArray, hits: _FloatArray
    ) -> tuple[_FloatArray, _FloatArray, _FloatArray]:
        """Per-row, per-bin sums of an (r, n) block; each returned array is (r, n_bins)."""
        r = bins.shape[0]
        flat = (np.arange(r)[:, None] * self.n_bins + bins).ravel()
        size = r * self.n_bins
        counts = np.bincount(flat, minlength=size).reshape(r, self.n_bins)
        sum_hits = _weighted_bincount(flat, hits.ravel(), size).reshape(r, -1)
        sum_values = _weighted_bincount(flat, values.ravel(), size).reshape(r, -1)
        return counts.astype(np.float64), sum_hits, sum_values

    def metrics(self, idx: _IntArray) -> dict[str, _FloatArray]:
        """Every metric on each resample; ``idx`` is (r, n) item indices, results are (r,)."""
        n = self.n
        hits = self.hits[idx]
        conf = self.conf[idx]
        out = {
            "accuracy": hits.mean(axis=1),
            "nll": self.item_nll[idx].mean(axis=1),
            "brier": self.item_brier[idx].mean(axis=1),
        }
        counts, sum_hits, sum_conf = self._row_binned(self.conf_bins[idx], conf, hits)
        gaps = np.abs(sum_hits - sum_conf)
        out["ece"] = gaps.sum(axis=1) / n
        with np.errstate(invalid="ignore", divide="ignore"):
            out["mce"] = np.where(counts > 0, gaps / counts, -np.inf).max(axis=1)

        items = self.order[np.sort(self.rank[idx], axis=1)]
        mass_bins = np.broadcast_to(self.mass_bins, items.shape)
        _, sum_hits, sum_conf = self._row_binned(mass_bins, self.conf[items], self.hits[items])
        out["adaptive_ece"] = np.abs(sum_hits - sum_conf).sum(axis=1) / n

        classwise = np.zeros(idx.shape[0])
        for c in range(self.k):
            _, sum_hits, sum_p = self._row_binned(
                self.class_bins[:, c][idx], self.class_p[:, c][idx], self.class_hits[:, c][idx]
            )
            classwise += np.abs(sum_hits - sum_p).sum(axis=1) / n
        out["classwise_ece"] = classwise / self.k
        return out


_METRICS = ("accuracy", "nll", "brier", "ece", "adaptive_ece", "mce", "classwise_ece")


def evaluate(
    probs: ArrayLike, y: ArrayLike, *, n_bootstrap: int = 1000, seed: int = 0, n_bins: int = 15
) -> MetricReport:
    """All metrics with bootstrap 95% percentile intervals and the ECE noise floor.

    Point values are the metrics on the given items. Intervals come from ``n_bootstrap``
    resamples of the items with replacement; every metric is computed on the same resamples, so
    the intervals describe one joint sampling distribution.

    Binned ECE-type metrics are biased upward on small samples and under resampling, so their
    intervals are extended to include the point value (see ``Interval``); read them against
    ``ece_noise_floor`` rather than against 0.

    Parameters
    ----------
    probs, y : arrays of shapes (n, k) and (n,)
    n_bootstrap, seed, n_bins : int
    """
    p, labels = check_probs_labels(probs, y)
    n_bootstrap = check_int(n_bootstrap, "n_bootstrap", 1)
    seed = check_int(seed, "seed", 0)
    n_bins = check_int(n_bins, "n_bins", 1)
    n = p.shape[0]
    data = _BootstrapData(p, labels, n_bins)
    point = data.metrics(np.arange(n)[None, :])
    rng = np.random.default_rng(seed)
    samples: dict[str, list[_FloatArray]] = {name: [] for name in _METRICS}
    block = max(1, _BLOCK_CELLS // n)
    for start in range(0, n_bootstrap, block):
        rows = min(block, n_bootstrap - start)
        for name, values in data.metrics(rng.integers(0, n, size=(rows, n))).items():
            samples[name].append(values)
    intervals: dict[str, Interval] = {}
    for name in _METRICS:
        value = float(point[name][0])
        low, high = np.percentile(np.concatenate(samples[name]), [2.5, 97.5])
        intervals[name] = Interval(
            value=value, low=min(float(low), value), high=max(float(high), value)
        )
    floor, floor_p95 = ece_noise_floor(data.conf, n_bins=n_bins, n_draws=n_bootstrap, seed=seed)
    return MetricReport(
        n=int(n),
        accuracy=intervals["accuracy"],
        nll=intervals["nll"],
        brier=intervals["brier"],
        ece=intervals["ece"],
        adaptive_ece=intervals["adaptive_ece"],
        mce=intervals["mce"],
        classwise_ece=intervals["classwise_ece"],
        ece_noise_floor=floor,
        ece_noise_floor_p95=floor_p95,
    )
