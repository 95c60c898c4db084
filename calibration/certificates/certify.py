"""Certified confidence thresholds: the lowest threshold whose precision on accepted items is
certified (a statistical guarantee) to reach a target, for accept/escalate decisions.

A judgment is accepted automatically when its confidence reaches a threshold and escalated
(to a person or a stronger model) otherwise. ``select_threshold`` picks the lowest threshold,
and so the most automation, whose precision on accepted items is certified to reach a target.
Each threshold t of a grid fixed in advance is a hypothesis test of H_t: "precision(t) <
target"; with k of the m accepted items correct, H_t is rejected (t is certified) when the
one-sided Clopper-Pearson lower bound on k / m at the test's level is >= target, which is the
exact binomial test (Clopper & Pearson 1934). Given m, the accepted items are an i.i.d. draw
from the items the threshold accepts, so k ~ Binomial(m, precision(t)) and each test is exact.

Certifying many thresholds at once needs a family-wise correction. Two are implemented, both
controlling the probability of certifying any threshold whose true precision is below target
at delta ("Learn then Test", Angelopoulos, Bates, Candes, Jordan & Lei 2021):

* ``"fixed_sequence"`` (the default): test the thresholds from the highest down, each at level
  delta, and stop at the first that fails. Fixed-sequence testing controls the family-wise
  error at delta for any order fixed before the data are seen (Maurer, Hothorn & Lehmacher
  1995; LTT section 4). Precision usually falls as the threshold falls, so the sequence
  follows the natural order, and every test runs at the full delta instead of delta / |grid|.
  Its weakness is the top of the grid, where few items are accepted and a test can fail for
  lack of data, ending the sequence; so the sequence starts at ``start``, a threshold chosen on
  data independent of the certification set (``sequence_start``: the highest threshold at
  which enough items are expected to be accepted for a test to possibly pass).
* ``"bonferroni"``: every grid threshold at level delta / |grid| (a union bound).

The guarantee is about the distribution the certification set was drawn from: it does not
survive a shift in the kind of items judged, or a change of model or calibration map. That is
why ``calibration.fitting`` certifies on items the map was not fitted on.

``risk_coverage`` describes the whole trade-off curve (selective classification, El-Yaniv &
Wiener 2010; AURC as in Geifman et al. 2019).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated

import msgspec
import numpy as np
from msgspec import Meta

from calibration.validation import (
    _FloatArray,
    _IntArray,
    check_confidences,
    check_correct,
    check_int,
    check_unit_open,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from numpy.typing import ArrayLike

__all__ = [
    "DEFAULT_GRID",
    "PROCEDURES",
    "RiskCoverage",
    "ThresholdResult",
    "clopper_pearson_lower",
    "minimum_accepted",
    "risk_coverage",
    "select_threshold",
    "sequence_start",
]

DEFAULT_GRID: tuple[float, ...] = (
    *(round(0.50 + 0.01 * i, 2) for i in range(50)),
    0.995,
    0.999,
)
"""Thresholds 0.50, 0.51, ..., 0.99, 0.995, 0.999.

Fixed in advance and never derived from the data: a family-wise correction is valid only for
hypotheses chosen before the certification set is seen. Thresholds placed at the observed
confidences would be a data-dependent family, and their lower bounds would be optimistic.
Below 0.5 a top choice is no better than its alternatives combined, so the grid starts there.
Under Bonferroni its 52 thresholds cost a factor of 52 in each test's level; fixed-sequence
testing pays nothing for the grid's size.
"""

PROCEDURES = ("fixed_sequence", "bonferroni")
_METHODS = {
    "fixed_sequence": "clopper-pearson, fixed-sequence testing (LTT)",
    "bonferroni": "clopper-pearson, bonferroni",
}


class ThresholdResult(msgspec.Struct, frozen=True, kw_only=True):
    """The certified threshold and the evidence for it (or why none qualifies)."""

    feasible: bool
    threshold: Annotated[float, Meta(ge=0.0, le=1.0)] | None  # accept at >= threshold; None: none
    target_precision: float
    delta: float  # the guarantee holds with probability >= 1 - delta
    # The fraction of the given items accepted at the threshold; 0 when infeasible.
    coverage: Annotated[float, Meta(ge=0.0, le=1.0)]
    precision: float | None  # empirical precision on the accepted items
    precision_lower_bound: float | None  # its corrected lower confidence bound
    n_accepted: Annotated[int, Meta(ge=0)]
    n: Annotated[int, Meta(ge=0)]
    best_certified_precision: float  # max over the tested thresholds of the corrected lower bound
    grid_size: int
    tested: int  # thresholds tested (fixed sequence: from ``start`` down to the first failure)
    start: float | None  # where the fixed sequence started; None for bonferroni
    procedure: str  # "fixed_sequence" | "bonferroni"
    method: str  # the procedure in words
    reason: str
    # The tested threshold with that best bound (the lowest of any tie); None where the result
    # was not computed by ``select_threshold`` (older profiles, or none tested).
    best_threshold: float | None = None


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
        from scipy import stats  # here: scipy is a server dependency, not the client's

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
    trials = check_int(trials, "trials", 0)
    successes = check_int(successes, "successes", 0)
    if successes > trials:
        raise ValueError(f"successes = {successes} exceeds trials = {trials}")
    alpha = check_unit_open(alpha, "alpha")
    if trials == 0 or successes == 0:
        return 0.0
    from scipy import stats

    return float(stats.beta.ppf(alpha, successes, trials - successes + 1))


def untested(
    *, target_precision: float, delta: float, procedure: str, method: str, reason: str
) -> ThresholdResult:
    """A result with no threshold because nothing could be tested (no labels; no item of a
    class), saying why."""
    return ThresholdResult(
        feasible=False,
        threshold=None,
        target_precision=target_precision,
        delta=delta,
        coverage=0.0,
        precision=None,
        precision_lower_bound=None,
        n_accepted=0,
        n=0,
        best_certified_precision=0.0,
        grid_size=len(DEFAULT_GRID),
        tested=0,
        start=None,
        procedure=procedure,
        method=method,
        reason=reason,
    )


def clopper_pearson_interval(successes: int, trials: int) -> list[float] | None:
    """The two-sided 95% Clopper-Pearson interval on a binomial proportion (Clopper & Pearson
    1934): the 0.025 and 0.975 quantiles of its two beta distributions, 0 and 1 at the ends;
    None for no trials."""
    if trials == 0:
        return None
    from scipy import stats

    k, n = successes, trials
    low = float(stats.beta.ppf(0.025, k, n - k + 1)) if k else 0.0
    high = float(stats.beta.ppf(0.975, k + 1, n - k)) if k < n else 1.0
    return [low, high]


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


def minimum_accepted(target_precision: float, delta: float) -> int:
    """The fewest accepted items for which a test at level delta can certify the target.

    With m items all correct the Clopper-Pearson bound is delta ** (1 / m), so certification is
    possible only when target ** m <= delta.
    """
    target_precision = check_unit_open(target_precision, "target_precision")
    delta = check_unit_open(delta, "delta")
    return max(1, math.ceil(math.log(delta) / math.log(target_precision) - 1e-9))


def sequence_start(
    confidences: ArrayLike,
    n_certify: int,
    *,
    target_precision: float = 0.9,
    delta: float = 0.1,
    grid: Sequence[float] = DEFAULT_GRID,
    margin: float = 2.0,
    correct: ArrayLike | None = None,
) -> float:
    """Where a fixed sequence should start, judged on data independent of the certification set.

    With ``correct`` (whether each independent item's answer was right), the start is the grid
    threshold whose test is most likely to pass: the one with the highest Clopper-Pearson
    bound expected on ``n_certify`` items, at the precision and acceptance rate the independent
    items show there (ties: the highest such threshold). A higher start passes less often for
    lack of items, a lower one for lack of precision, and the sequence only ever goes down.
    Without ``correct``:
    The highest grid threshold at which a certification set of ``n_certify`` items is expected
    to accept at least ``margin`` times ``minimum_accepted`` items, the expectation taken from
    ``confidences`` (items drawn like the certification set but not part of it). Above it a
    test would most likely fail for lack of accepted items and end the sequence. Falls back to
    the lowest grid threshold when none qualifies.

    Parameters
    ----------
    confidences : array of shape (m,)
        Confidences of items independent of the certification set (0 for items that other
        gates would escalate anyway).
    n_certify : int >= 1
    """
    conf = check_confidences(confidences)
    n_certify = check_int(n_certify, "n_certify", 1)
    thresholds = _check_grid(grid)
    accepted = conf[None, :] >= thresholds[:, None]  # (grid, m)
    expected = n_certify * accepted.mean(axis=1)  # (grid,)
    if correct is not None:
        right = check_correct(correct, conf.shape[0])
        hits = (accepted & right[None, :]).sum(axis=1)  # (grid,)
        precision = hits / np.maximum(accepted.sum(axis=1), 1)
        trials = np.round(expected).astype(np.int64)
        bound = _lower_bounds(np.round(trials * precision).astype(np.int64), trials, delta)
        if bound.max() > 0:
            return float(thresholds[int(np.flatnonzero(bound == bound.max())[-1])])
    needed = margin * minimum_accepted(target_precision, delta)
    ok = np.flatnonzero(expected >= needed)
    return float(thresholds[ok[-1]] if ok.size else thresholds[0])


def select_threshold(
    confidences: ArrayLike,
    correct: ArrayLike,
    *,
    target_precision: float = 0.9,
    delta: float = 0.1,
    grid: Sequence[float] = DEFAULT_GRID,
    procedure: str = "fixed_sequence",
    start: float | None = None,
) -> ThresholdResult:
    """The lowest certified grid threshold: precision on accepted items >= target, w.p. 1 - delta.

    An item is accepted at threshold t when its confidence is >= t (give 0 to an item that
    other gates escalate anyway, so that the certificate covers the rule as served). With
    probability >= 1 - delta over the draw of the items, every threshold this certifies has
    true precision >= ``target_precision`` on the distribution they were drawn from, so
    returning the certified threshold with the most coverage keeps the guarantee. A threshold
    that accepts nothing is never certified.

    Parameters
    ----------
    confidences : array of shape (n,)
        Confidence of each item's chosen answer, in [0, 1] (calibrated or not: the guarantee
        does not depend on calibration, only on the items being representative and unused by
        whatever produced the confidences).
    correct : array of shape (n,)
        Whether each chosen answer was correct (booleans or 0/1).
    target_precision, delta : float in (0, 1)
    grid : sequence of distinct thresholds in [0, 1], fixed before seeing the data.
    procedure : "fixed_sequence" (default) or "bonferroni"; see the module docstring.
    start : float, a grid threshold, for "fixed_sequence": test from it downwards. It must
        not depend on these items (``sequence_start`` on independent ones). None: the top.
    """
    conf = check_confidences(confidences)
    hits = check_correct(correct, conf.shape[0])
    target_precision = check_unit_open(target_precision, "target_precision")
    delta = check_unit_open(delta, "delta")
    thresholds = _check_grid(grid)
    if procedure not in PROCEDURES:
        raise ValueError(f"procedure must be one of {PROCEDURES}, got {procedure!r}")
    n = int(conf.shape[0])
    grid_size = int(thresholds.shape[0])

    accepted = conf[None, :] >= thresholds[:, None]  # (grid, n)
    n_acc = accepted.sum(axis=1)
    n_hits = (accepted & hits[None, :]).sum(axis=1)
    if procedure == "bonferroni":
        lower = _lower_bounds(n_hits, n_acc, delta / grid_size)
        passed = (n_acc > 0) & (lower >= target_precision)
        tested = np.ones(grid_size, dtype=bool)
        start = None
        how = f"Clopper-Pearson, Bonferroni over {grid_size} thresholds"
    else:
        top = grid_size - 1
        if start is not None:
            matches = np.flatnonzero(np.isclose(thresholds, start, rtol=0, atol=1e-12))
            if matches.size == 0:
                raise ValueError(f"start {start!r} is not a threshold of the grid")
            top = int(matches[0])
        lower = _lower_bounds(n_hits, n_acc, delta)
        ok = (n_acc > 0) & (lower >= target_precision)
        passed = np.zeros(grid_size, dtype=bool)
        tested = np.zeros(grid_size, dtype=bool)
        for i in range(top, -1, -1):  # from the highest threshold down, stop at the first failure
            tested[i] = True
            if not ok[i]:
                break
            passed[i] = True
        start = float(thresholds[top])
        how = f"Clopper-Pearson, fixed-sequence testing from {start:g} down (LTT)"
    best = float(lower[tested].max())
    best_at = float(thresholds[tested][int(np.argmax(lower[tested]))])
    if np.any(passed):
        i = int(np.argmax(passed))  # thresholds are sorted: the first is the lowest
        m, k = int(n_acc[i]), int(n_hits[i])
        threshold: float | None = float(thresholds[i])
        bound: float | None = float(lower[i])
        reason = (
            f"threshold {threshold:g} accepts {m} of {n} items with precision {k / m:.4f}; "
            f"its lower bound {bound:.4f} >= {target_precision:g} holds with probability "
            f">= {1 - delta:g} ({how})"
        )
    else:
        m, k, threshold, bound = 0, 0, None, None
        head = (
            f"no threshold certifies precision {target_precision:g} at delta {delta:g} "
            f"with n={n} ({how})"
        )
        reason = (
            f"{head}; the best lower bound is {best:.4f} (at threshold {best_at:g})"
            if best > 0
            else f"{head}: no tested threshold accepts a correct item"
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
        tested=int(tested.sum()),
        start=start,
        procedure=procedure,
        method=_METHODS[procedure],
        reason=reason,
        best_threshold=best_at,
    )


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
    conf = check_confidences(confidences)
    hits = check_correct(correct, conf.shape[0])
    n = conf.shape[0]
    order = np.argsort(-conf, kind="stable")
    counts = np.arange(1, n + 1, dtype=np.float64)
    risk = np.cumsum(~hits[order]) / counts
    return RiskCoverage(
        coverage=[float(c) for c in counts / n],
        risk=[float(r) for r in risk],
        aurc=float(risk.mean()),
    )
