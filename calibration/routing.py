"""Confidence thresholds with a statistical precision guarantee, for accept/escalate routing.

A judgment is accepted automatically when its confidence reaches a threshold and escalated
(to a person or a stronger model) otherwise. ``select_threshold`` picks the lowest threshold,
and so the most automation, whose precision on accepted items is certified to reach a target:
for every threshold of a grid fixed in advance it computes a one-sided Clopper-Pearson lower
confidence bound on the precision of the items the threshold accepts, at level delta / |grid|
(Bonferroni). With probability at least 1 - delta over the draw of the calibration set, every
threshold it certifies has true precision >= the target on the distribution the calibration
set was drawn from (a "Learn then Test" style guarantee, Angelopoulos et al. 2021, here with
the simplest family-wise correction). The guarantee is about that distribution: it does not
survive a shift in the kind of items judged, or a change of model or calibration.

``risk_coverage`` describes the whole trade-off curve (selective classification, El-Yaniv &
Wiener 2010; AURC as in Geifman et al. 2019).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import numpy as np
import numpy.typing as npt
from scipy import stats

from calibration.metrics import (
    _check_confidences,
    _check_correct,
    _check_int,
    _check_unit_open,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from numpy.typing import ArrayLike

__all__ = [
    "DEFAULT_GRID",
    "RiskCoverage",
    "ThresholdResult",
    "clopper_pearson_lower",
    "risk_coverage",
    "route",
    "select_threshold",
]

DEFAULT_GRID: tuple[float, ...] = (
    *(round(0.50 + 0.01 * i, 2) for i in range(50)),
    0.995,
    0.999,
)
"""Thresholds 0.50, 0.51, ..., 0.99, 0.995, 0.999.

Fixed in advance and never derived from the data: the Bonferroni correction in
``select_threshold`` is valid only for a family of hypotheses chosen before the calibration set
is seen. Thresholds placed at the observed confidences would be a data-dependent family, and
their lower bounds would be optimistic. Below 0.5 a top choice is no better than its
alternatives combined, so the grid starts there; 52 thresholds cost a factor of 52 in the
per-threshold error level, i.e. only a few points of certified precision at n in the hundreds.
"""

_METHOD = "clopper-pearson+bonferroni"
_FloatArray = npt.NDArray[np.float64]
_IntArray = npt.NDArray[np.int64]


class ThresholdResult(msgspec.Struct, frozen=True, kw_only=True):
    """The chosen routing threshold and the evidence for it (or why none qualifies)."""

    feasible: bool
    threshold: float | None  # accept when confidence >= threshold; None when infeasible
    target_precision: float
    delta: float  # the guarantee holds with probability >= 1 - delta
    coverage: float  # fraction of the given items accepted at the threshold; 0 when infeasible
    precision: float | None  # empirical precision on the accepted items
    precision_lower_bound: float | None  # its corrected lower confidence bound
    n_accepted: int
    n: int
    best_certified_precision: float  # max over the grid of the corrected lower bound
    grid_size: int
    method: str
    reason: str


class RiskCoverage(msgspec.Struct, frozen=True, kw_only=True):
    """Selective risk at each coverage, accepting items in decreasing order of confidence."""

    coverage: list[float]  # i / n for i = 1..n
    risk: list[float]  # error rate among the i most confident items
    aurc: float  # area under the risk-coverage curve: mean of ``risk``


def _lower_bounds(successes: _IntArray, trials: _IntArray, alpha: float) -> _FloatArray:
    """Vectorized one-sided Clopper-Pearson lower bounds; 0 where successes == 0."""
    out = np.zeros(successes.shape, dtype=np.float64)
    ok = successes > 0
    if np.any(ok):
        k = successes[ok].astype(np.float64)
        out[ok] = stats.beta.ppf(alpha, k, trials[ok] - k + 1.0)
    return out


def clopper_pearson_lower(successes: int, trials: int, alpha: float) -> float:
    """One-sided Clopper-Pearson lower confidence bound on a binomial proportion.

    With probability at least 1 - alpha the true proportion is >= the bound: the bound is the
    alpha quantile of Beta(k, n - k + 1) (Clopper & Pearson 1934). It is 0 when there are no
    successes or no trials, and alpha ** (1 / n) when every trial succeeded.

    Parameters
    ----------
    successes : int, 0 <= successes <= trials
    trials : int >= 0
    alpha : float in (0, 1)
    """
    trials = _check_int(trials, "trials", 0)
    successes = _check_int(successes, "successes", 0)
    if successes > trials:
        raise ValueError(f"successes = {successes} exceeds trials = {trials}")
    alpha = _check_unit_open(alpha, "alpha")
    if trials == 0 or successes == 0:
        return 0.0
    return float(stats.beta.ppf(alpha, successes, trials - successes + 1))


def _check_grid(grid: Sequence[float]) -> _FloatArray:
    arr = np.asarray(grid, dtype=np.float64)
    if arr.ndim != 1 or arr.shape[0] == 0:
        raise ValueError(f"grid must be a non-empty 1-D sequence of thresholds, got {grid!r}")
    bad = ~np.isfinite(arr) | (arr < 0.0) | (arr > 1.0)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(f"grid[{i}] = {arr[i]} is not a threshold in [0, 1]")
    if np.unique(arr).shape[0] != arr.shape[0]:
        # A repeated threshold would silently inflate the Bonferroni family.
        raise ValueError("grid has repeated thresholds; list each threshold once")
    return np.sort(arr)


def select_threshold(
    confidences: ArrayLike,
    correct: ArrayLike,
    *,
    target_precision: float = 0.9,
    delta: float = 0.1,
    grid: Sequence[float] = DEFAULT_GRID,
) -> ThresholdResult:
    """The lowest grid threshold whose precision on accepted items is certified >= target.

    For each threshold t of ``grid``, the items with confidence >= t are accepted; with k of
    the m accepted items correct, the precision is certified when the Clopper-Pearson lower
    bound at level delta / len(grid) is >= ``target_precision``. With probability >= 1 - delta
    every certified threshold has true precision >= target on the distribution the items were
    drawn from (union bound over the fixed grid), so returning the certified threshold with
    the highest coverage keeps the guarantee. A threshold that accepts nothing is never
    certified.

    Parameters
    ----------
    confidences : array of shape (n,)
        Confidence of each item's chosen answer, in [0, 1] (calibrated or not: the guarantee
        does not depend on calibration, only on the items being representative).
    correct : array of shape (n,)
        Whether each chosen answer was correct (booleans or 0/1).
    target_precision, delta : float in (0, 1)
    grid : sequence of distinct thresholds in [0, 1], fixed before seeing the data.
    """
    conf = _check_confidences(confidences)
    hits = _check_correct(correct, conf.shape[0])
    target_precision = _check_unit_open(target_precision, "target_precision")
    delta = _check_unit_open(delta, "delta")
    thresholds = _check_grid(grid)
    n = int(conf.shape[0])

    accepted = conf[None, :] >= thresholds[:, None]  # (grid, n)
    n_acc = accepted.sum(axis=1)
    n_hits = (accepted & hits[None, :]).sum(axis=1)
    lower = _lower_bounds(n_hits, n_acc, delta / thresholds.shape[0])
    certified = (n_acc > 0) & (lower >= target_precision)
    best = float(lower.max())
    grid_size = int(thresholds.shape[0])
    if np.any(certified):
        i = int(np.argmax(certified))  # thresholds are sorted: the first is the lowest
        m, k = int(n_acc[i]), int(n_hits[i])
        threshold: float | None = float(thresholds[i])
        bound: float | None = float(lower[i])
        reason = (
            f"threshold {threshold:g} accepts {m} of {n} items with precision {k / m:.4f}; "
            f"its lower bound {bound:.4f} >= {target_precision:g} holds with probability "
            f">= {1 - delta:g} (Clopper-Pearson, Bonferroni over {grid_size} thresholds)"
        )
    else:
        m, k, threshold, bound = 0, 0, None, None
        head = (
            f"no threshold on the grid certifies precision {target_precision:g} at delta "
            f"{delta:g} with n={n}"
        )
        reason = (
            f"{head}; the best certified is {best:.4f} "
            f"(at threshold {float(thresholds[int(np.argmax(lower))]):g})"
            if best > 0
            else f"{head}: no threshold accepts a correct item"
        )
    return ThresholdResult(
        feasible=threshold is not None,
        threshold=threshold,
        target_precision=target_precision,
        delta=delta,
        coverage=m / n,
        precision=k / m if m else None,
        precision_lower_bound=bound,
        n_accepted=m,
        n=n,
        best_certified_precision=best,
        grid_size=grid_size,
        method=_METHOD,
        reason=reason,
    )


def route(confidence: float, threshold: float) -> str:
    """ "accept" when ``confidence`` >= ``threshold``, else "escalate"."""
    for name, value in (("confidence", confidence), ("threshold", threshold)):
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float | np.floating)
            or not 0.0 <= value <= 1.0
        ):
            raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return "accept" if confidence >= threshold else "escalate"


def risk_coverage(confidences: ArrayLike, correct: ArrayLike) -> RiskCoverage:
    """Risk-coverage curve and its area (AURC) for accepting the most confident items first.

    Items are sorted by confidence, descending (stable: ties keep input order). At coverage
    i / n the risk is the fraction of errors among the first i items; AURC is the mean of the
    n risks (lower is better; its floor for a given accuracy is reached when every error is
    less confident than every correct item).

    Parameters
    ----------
    confidences : array of shape (n,)
    correct : array of shape (n,), booleans or 0/1
    """
    conf = _check_confidences(confidences)
    hits = _check_correct(correct, conf.shape[0])
    n = conf.shape[0]
    order = np.argsort(-conf, kind="stable")
    counts = np.arange(1, n + 1, dtype=np.float64)
    risk = np.cumsum(~hits[order]) / counts
    return RiskCoverage(
        coverage=[float(c) for c in counts / n],
        risk=[float(r) for r in risk],
        aurc=float(risk.mean()),
    )
