"""Does a served profile's certificate still hold? Audits and drift tests on logged decisions.

A profile certifies that accepted items have precision >= its target, with probability >= 1 -
delta, on traffic like its calibration data. In production every decision is logged and a
uniform random share of them is audited (labeled by people). Three questions can then be asked
of the log, each with a stated false-alarm rate:

* ``audited_precision``: do the audited accepted items contradict the target? A bet against
  it, one label at a time (``calibration.monitoring.sequential``), whose capital reaching 1/alpha
  rejects: valid however often it is checked.
* ``drift_test``: has live traffic moved away from the calibration data? Live items are
  compared with a ``Reference`` (calibration items the map was not fitted on, kept in the
  profile) by their calibrated top confidence (two-sample Kolmogorov-Smirnov; Kolmogorov 1933,
  Smirnov 1939) and by their top choice (Pearson's chi-square test of homogeneity, Pearson
  1900). Drift needs no label, so it can fire long before enough audits accumulate; but drift
  is not failure (traffic can move where the judge is still right), and a failure the
  confidence does not show (the same inputs, new meanings) is visible only to the audits.
* ``prediction_powered_shares``: what share of live traffic belongs to each choice? The
  judge's probabilities on the items not audited, debiased by the audited ones
  (prediction-powered inference, Angelopoulos, Bates, Fannjiang, Jordan & Zrnic, Science
  2023, power-tuned as PPI++), with asymptotic confidence sequences: valid at every
  recomputation, and narrower than the audits alone when the judge is good.

Every guarantee assumes independent draws: the reference items from the calibration
distribution, the live items from live traffic, and the audit sample uniform over live items
and independent of them. The precision alarm and the shares hold over the whole stream (alpha
overall, however often they are checked); the drift test's alpha is per check: a monitor
that tests drift every hour, on overlapping windows, raises a false drift alarm at rate alpha
each time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import msgspec
import numpy as np
from msgspec import Meta

from calibration.errors import RuleError
from calibration.validation import (
    _FloatArray,
    _IntArray,
    check_correct,
    check_int,
    check_labels,
    check_probs,
    check_unit_open,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from numpy.typing import ArrayLike

__all__ = [
    "MAX_REFERENCE",
    "MIN_DRIFT_ITEMS",
    "DriftTest",
    "PrecisionCheck",
    "Reference",
    "ShareEstimate",
    "audited_precision",
    "drift_test",
    "prediction_powered_shares",
    "reference_of",
]

MAX_REFERENCE = 2000
"""Reference confidences kept in a profile: the KS test's power is then limited by the live
window (a few hundred to a few thousand items), not by the reference."""

MIN_DRIFT_ITEMS = 50
"""Below this many live items the drift test does not run: it could only catch gross shifts,
and a dashboard is better told "not yet" than "no drift"."""

_MIN_EXPECTED = 5.0  # Cochran's rule: below this expected count chi-square's p-value is unsafe
_MONTE_CARLO_TABLES = 9999


class Reference(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What live traffic is compared with: the calibrated top confidence and top choice of
    calibration items the map was not fitted on."""

    source: str  # in words: "the 600 held-out items (conformal + certify splits) of sst2"
    n: Annotated[int, Meta(ge=1)]  # items the counts are over
    confidence: list[float]  # (m,) top confidence of up to MAX_REFERENCE of them, m <= n
    choice_counts: list[int]  # (k,) how often each choice was the top one; sums to n
    label_counts: list[int] | None  # (k,) the labels of the same items; None: no labels
    # (k,) the items' mean calibrated probability of each choice: the class prior the map
    # itself implies on its source (what a label-shift correction starts from); None: a
    # profile fitted before references kept it.
    mean_probabilities: list[float] | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise RuleError(f"reference.n must be at least 1, got {self.n}")
        m = len(self.confidence)
        if not 1 <= m <= min(self.n, MAX_REFERENCE):
            raise RuleError(
                f"reference.confidence must hold 1 to min(n, {MAX_REFERENCE}) = "
                f"{min(self.n, MAX_REFERENCE)} values, got {m}"
            )
        conf = np.asarray(self.confidence, dtype=np.float64)
        if not np.all(np.isfinite(conf) & (conf >= 0.0) & (conf <= 1.0)):
            raise RuleError("reference.confidence must be finite numbers in [0, 1]")
        _check_counts(self.choice_counts, "choice_counts", self.n, None)
        if self.label_counts is not None:
            _check_counts(self.label_counts, "label_counts", self.n, len(self.choice_counts))
        if self.mean_probabilities is not None:
            means = np.asarray(self.mean_probabilities, dtype=np.float64)
            if means.shape != (len(self.choice_counts),) or not np.all(means >= 0):
                raise RuleError("reference.mean_probabilities must be k numbers >= 0")
            if abs(means.sum() - 1) > 1e-6:
                raise RuleError("reference.mean_probabilities must sum to 1")


def _check_counts(counts: list[int], name: str, n: int, k: int | None) -> None:
    if len(counts) < 2 or (k is not None and len(counts) != k):
        want = "at least 2" if k is None else f"{k} (one per choice)"
        raise RuleError(f"reference.{name} must have {want} entries, got {len(counts)}")
    if any(c < 0 for c in counts) or sum(counts) != n:
        raise RuleError(f"reference.{name} must be counts >= 0 that sum to n = {n}, got {counts}")


def reference_of(
    probabilities: ArrayLike,
    labels: ArrayLike | None = None,
    *,
    source: str,
    seed: int = 0,
    max_items: int = MAX_REFERENCE,
) -> Reference:
    """The reference a profile keeps, from calibrated probabilities of held-out items.

    The items must not have been used to fit the calibration map (its fit items look more
    confident than anything it will see later, which would make every live window "drift").
    The top choice is the first of the most probable ones, as ``argmax`` breaks ties.

    Parameters
    ----------
    probabilities : array of shape (n, k)
        Calibrated probabilities, in the profile's choice order.
    labels : array of shape (n,) of choice indices, or None
    source : str, where the items came from, in words
    seed : int, for the uniform subsample of confidences when n > max_items
    max_items : int >= 1, confidences kept
    """
    p = check_probs(probabilities, "probabilities")
    n, k = p.shape
    max_items = check_int(max_items, "max_items", 1)
    if max_items > MAX_REFERENCE:
        raise ValueError(f"max_items must be at most MAX_REFERENCE = {MAX_REFERENCE}")
    confidence = p.max(axis=1)  # (n,)
    if n > max_items:
        keep = np.sort(np.random.default_rng(seed).choice(n, size=max_items, replace=False))
        confidence = confidence[keep]
    label_counts = None
    if labels is not None:
        y = check_labels(labels, n, k, "labels")
        label_counts = [int(c) for c in np.bincount(y, minlength=k)]
    return Reference(
        source=source,
        n=n,
        confidence=[float(c) for c in confidence],
        choice_counts=[int(c) for c in np.bincount(p.argmax(axis=1), minlength=k)],
        label_counts=label_counts,
        mean_probabilities=[float(v) for v in p.mean(axis=0)],
    )


class DriftTest(msgspec.Struct, frozen=True, kw_only=True):
    """Live traffic against the reference: has it drifted? (Two tests, Bonferroni-combined.)"""

    n_live: int
    n_reference: int  # reference items behind the choice counts
    confidence_statistic: float | None  # KS distance between the two confidence distributions
    confidence_p: float | None
    choice_statistic: float | None  # chi-square of the 2 x k table of top-choice counts
    choice_p: float | None
    alpha: float  # false-alarm rate of this test, per check
    drifted: bool  # either p-value < alpha / 2
    reason: str


def _chi_square(table: _FloatArray) -> _FloatArray:
    """Pearson's statistic of (..., 2, k) tables with no empty column; shape (...)."""
    rows = table.sum(axis=-1, keepdims=True)  # (..., 2, 1)
    cols = table.sum(axis=-2, keepdims=True)  # (..., 1, k)
    expected = rows * cols / table.sum(axis=(-2, -1), keepdims=True)
    return (((table - expected) ** 2) / expected).sum(axis=(-2, -1))


def _homogeneity(live: _IntArray, reference: _IntArray) -> tuple[float, float, str]:
    """Chi-square test that two samples share one distribution over choices; (stat, p, how)."""
    keep = (live + reference) > 0
    table = np.stack([live[keep], reference[keep]]).astype(np.float64)  # (2, k')
    if table.shape[1] < 2:
        return 0.0, 1.0, "chi-square (every item has the same top choice)"
    statistic = float(_chi_square(table))
    rows, cols = table.sum(axis=1), table.sum(axis=0)
    if (np.outer(rows, cols) / table.sum()).min() >= _MIN_EXPECTED:
        from scipy import stats  # here: scipy is a server dependency, not the client's

        return statistic, float(stats.chi2.sf(statistic, table.shape[1] - 1)), "chi-square"
    # Small expected counts: compare with tables drawn given both margins (the multivariate
    # hypergeometric distribution of the live row under homogeneity). (1 + hits) / (1 + draws)
    # is a valid p-value for draws independent of the data (Davison & Hinkley 1997);
    # the seed is fixed, so the same counts always give the same p-value.
    rng = np.random.default_rng(0)
    drawn = rng.multivariate_hypergeometric(
        cols.astype(np.int64), int(rows[0]), size=_MONTE_CARLO_TABLES
    )  # (draws, k')
    null = _chi_square(np.stack([drawn, cols - drawn], axis=1).astype(np.float64))
    p = (1 + int(np.sum(null >= statistic - 1e-9))) / (1 + _MONTE_CARLO_TABLES)
    return statistic, p, f"Monte Carlo over {_MONTE_CARLO_TABLES} tables (small counts)"


def drift_test(
    reference: Reference, confidence: ArrayLike, choice: ArrayLike, *, alpha: float = 0.01
) -> DriftTest:
    """Do live items look like the reference? KS on top confidence, chi-square on top choice.

    Two tests, each at level alpha / 2 (Bonferroni), so when the live items and the reference
    items are independent draws from one distribution the test reports drift with probability
    at most alpha. The KS test (scipy's exact or asymptotic p-value; conservative when values
    are tied) compares the live confidences with the reference's. The chi-square test of
    homogeneity compares the live top-choice counts with the reference's over the choices
    either side chose; when an expected count is below 5 (Cochran's rule) its p-value comes
    from 9999 random tables with the same margins instead of the chi-square distribution.
    Below ``MIN_DRIFT_ITEMS`` live items nothing is tested: drifted is False, p-values None.

    Parameters
    ----------
    reference : Reference, from the profile
    confidence : array of shape (n,), calibrated top-choice confidence of each live item
    choice : array of shape (n,), index of each live item's top choice in the profile's order
    alpha : float in (0, 1), the false-alarm rate per check
    """
    alpha = check_unit_open(alpha, "alpha")
    conf = np.asarray(confidence, dtype=np.float64)
    if conf.ndim != 1:
        raise ValueError(f"confidence must be a 1-D array of shape (n,), got shape {conf.shape}")
    bad = ~np.isfinite(conf) | (conf < 0.0) | (conf > 1.0)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(f"confidence[{i}] = {conf[i]} is not a probability in [0, 1]")
    n, k = int(conf.shape[0]), len(reference.choice_counts)
    top = np.asarray(choice)
    if top.shape != (n,):
        raise ValueError(
            f"choice must have shape ({n},), one index per confidence, got {top.shape}"
        )
    top = check_labels(top, n, k, "choice")
    # One record either way: with too few live items the statistics stay None, nothing fires.
    ks_stat: float | None = None
    ks_p: float | None = None
    chi_stat: float | None = None
    chi_p: float | None = None
    fired = []
    if n < MIN_DRIFT_ITEMS:
        reason = f"not tested: {n} live items, fewer than the {MIN_DRIFT_ITEMS} needed"
    else:
        from scipy import stats

        ks = stats.ks_2samp(conf, np.asarray(reference.confidence, dtype=np.float64))
        ks_stat, ks_p = float(ks.statistic), float(ks.pvalue)
        chi_stat, chi_p, how = _homogeneity(
            np.bincount(top, minlength=k), np.asarray(reference.choice_counts, dtype=np.int64)
        )
        if ks_p < alpha / 2:
            fired.append(
                f"the confidence distribution moved (KS D = {ks_stat:.3f}, p = {ks_p:.2g})"
            )
        if chi_p < alpha / 2:
            fired.append(f"the top-choice shares moved ({how}, p = {chi_p:.2g})")
        tail = f"{n} live items against {reference.n} reference items, each test at {alpha / 2:g}"
        reason = (
            "drift: " + "; ".join(fired) + f" ({tail})"
            if fired
            else f"no drift detected (KS p = {ks_p:.2g}, {how} p = {chi_p:.2g}; {tail})"
        )
    return DriftTest(
        n_live=n,
        n_reference=reference.n,
        confidence_statistic=ks_stat,
        confidence_p=ks_p,
        choice_statistic=chi_stat,
        choice_p=chi_p,
        alpha=alpha,
        drifted=bool(fired),
        reason=reason,
    )


class PrecisionCheck(msgspec.Struct, frozen=True, kw_only=True):
    """The audited accepted items against the certified target precision, as a sequential
    test: valid however often it is checked (``audited_precision``)."""

    n: int  # audited accepted items with a label
    correct: int
    precision: float | None  # None when n == 0
    lower: float | None  # the confidence sequence at level 1 - alpha, after the last label
    upper: float | None
    target: float  # the certified target precision
    alpha: float
    contradicts: bool  # the bet against the target has reached 1 / alpha at some label
    reason: str
    # The most the bet against "precision >= target" has held at any label so far, starting
    # from 1 (1 / alpha or more rejects); None when n == 0.
    max_capital: float | None = None
    method: str = "betting confidence sequence (Waudby-Smith & Ramdas 2023), anytime-valid"


def audited_precision(correct: ArrayLike, *, target: float, alpha: float = 0.05) -> PrecisionCheck:
    """Do the audited accepted items contradict the certified precision? A test that holds
    however often it is run.

    ``correct`` are the audited accepted items' outcomes in the order their labels arrived.
    A gambler bets against "precision >= target" one label at a time (``calibration.monitoring.sequential
    .betting_capital``); the labels contradict the certificate once the capital has reached
    1 / alpha at any label. While the true precision of accepted live items is at least the
    target, that happens with probability at most alpha over the whole stream (Ville's
    inequality), so checking after every label, or from cron every minute, keeps the overall
    false-alarm rate at alpha; the price is a few more labels to catch a real drop than a
    one-off test at a fixed n would need (benchmarks/bench_monitoring.py). A contradiction
    stays: the profile's version must be refitted (a new version starts a new bet). This
    needs the audited items to be a uniform sample of the accepted ones, labelled in an order
    that does not depend on their correctness. ``lower`` and ``upper`` are the confidence
    sequence at 1 - alpha (alpha / 2 a side) after the last label. With n = 0 there is
    nothing to say: contradicts is False.

    Parameters
    ----------
    correct : array of shape (n,), booleans or 0/1: label == choice for each audited accepted
        item with a label, in the order the labels arrived
    target : float in (0, 1], the profile's target precision
    alpha : float in (0, 1)
    """
    from calibration.monitoring.sequential import betting_bounds, betting_capital

    arr = np.asarray(correct)
    hits = check_correct(arr, len(arr) if arr.ndim == 1 else 0, "correct")
    if isinstance(target, bool) or not isinstance(target, int | float | np.integer | np.floating):
        raise ValueError(f"target must be a number in (0, 1], got {target!r}")
    target = float(target)
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    alpha = check_unit_open(alpha, "alpha")
    n, k = int(hits.shape[0]), int(hits.sum())
    if n == 0:
        return PrecisionCheck(
            n=0,
            correct=0,
            precision=None,
            lower=None,
            upper=None,
            target=target,
            alpha=alpha,
            contradicts=False,
            reason="no audited accepted item has a label yet: nothing to check",
        )
    x = hits.astype(np.float64)
    capital = max(1.0, float(betting_capital(x, target).max()))  # it starts at 1
    lower, upper = betting_bounds(x, alpha)
    contradicts = capital >= 1 / alpha
    said = (
        f"{k} of {n} audited accepted items correct ({k / n:.3f}); the bet against precision "
        f">= {target:g} reached {capital:.3g} at most"
    )
    reason = (
        f"{said}, past 1/alpha = {1 / alpha:g}: the labels contradict the certificate (this "
        "version stays contradicted; refit it)"
        if contradicts
        else f"{said}, short of 1/alpha = {1 / alpha:g}: no contradiction"
    )
    return PrecisionCheck(
        n=n,
        correct=k,
        precision=k / n,
        lower=lower,
        upper=upper,
        target=target,
        alpha=alpha,
        contradicts=contradicts,
        reason=reason,
        max_capital=capital,
    )


class ShareEstimate(msgspec.Struct, frozen=True, kw_only=True):
    """The share of live traffic whose true answer is each choice, with confidence intervals."""

    choices: list[str]
    estimate: list[float]  # (k,) clipped to [0, 1]
    lower: list[float]  # (k,)
    upper: list[float]  # (k,)
    n_unlabeled: int
    n_labeled: int
    alpha: float  # all k intervals cover at once with probability >= 1 - alpha (asymptotically)
    method: str


def prediction_powered_shares(
    choices: Sequence[str],
    unlabeled_probabilities: ArrayLike,
    labeled_probabilities: ArrayLike,
    labels: ArrayLike,
    *,
    alpha: float = 0.05,
) -> ShareEstimate:
    """Each choice's share of the true labels of live traffic, by prediction-powered inference
    with power tuning (PPI++), with intervals that hold however often they are recomputed.

    For choice j, the estimate is lam * (the judge's mean probability of j over the
    unlabelled items) + the mean of onehot(y)_j - lam * p_j(x) over the labelled ones:
    unbiased for any lam however miscalibrated p is, as long as the labelled items are a
    uniform sample of the same traffic (the audit sample) and p was not fitted on them
    (Angelopoulos, Bates, Fannjiang, Jordan & Zrnic 2023); lam is PPI++'s variance-minimising
    one (Angelopoulos, Duchi & Zrnic 2023; ``calibration.monitoring.estimates``), so the interval is never
    much wider than the labels' own and narrower the better p predicts. Each of the two means
    gets an asymptotic confidence sequence (``calibration.monitoring.sequential.asymptotic_half_width``)
    rather than a fixed-n CLT interval: the interval holds at every recomputation at once, as
    the samples grow, so a dashboard refreshed after every label does not pay alpha each time.

    Coverage: all k intervals hold at all times at once with probability -> 1 - alpha
    (Bonferroni over the k choices and the two samples; for k = 2 the shares are one number,
    so no correction over choices). Pass every decision of the profile's version not audited
    (or audited and not yet labelled) as unlabelled, the audited labelled ones as labelled.

    Parameters
    ----------
    choices : sequence of k distinct names, in the probabilities' column order
    unlabeled_probabilities : array of shape (N, k), N >= 2
    labeled_probabilities : array of shape (n, k), n >= 2
    labels : array of shape (n,), choice indices of the labeled items

    Raises ValueError when there are fewer than 2 items on either side: no variance, so no
    interval (an interval of [0, 1] would only hide that).
    """
    from calibration.monitoring.estimates import ppi_terms
    from calibration.monitoring.sequential import asymptotic_half_width

    alpha = check_unit_open(alpha, "alpha")
    names = list(choices)
    if len(set(names)) != len(names) or not all(isinstance(c, str) for c in names):
        raise ValueError(f"choices must be distinct strings, got {names!r}")
    unlabeled = check_probs(unlabeled_probabilities, "unlabeled_probabilities")
    labeled = check_probs(labeled_probabilities, "labeled_probabilities")
    k = len(names)
    for name, p in (("unlabeled_probabilities", unlabeled), ("labeled_probabilities", labeled)):
        if p.shape[1] != k:
            raise ValueError(f"{name} has {p.shape[1]} columns but there are {k} choices")
        if p.shape[0] < 2:
            raise ValueError(
                f"{name} has {p.shape[0]} row(s); prediction-powered inference needs at least "
                "2 items on each side to estimate a variance"
            )
    y = check_labels(labels, labeled.shape[0], k, "labels")
    big_n, n = unlabeled.shape[0], labeled.shape[0]
    onehot = np.eye(k)[y]  # (n, k)
    family = 1 if k == 2 else k
    level = alpha / (2 * family)  # each choice, each of its two samples
    estimate, lower, upper = [], [], []
    for j in range(k):
        terms = ppi_terms(onehot[:, j], labeled[:, j], unlabeled[:, j])
        value = terms.estimate
        half = asymptotic_half_width(big_n, terms.var_unlabeled, level) + asymptotic_half_width(
            n, terms.var_labeled, level
        )
        estimate.append(min(1.0, max(0.0, value)))
        lower.append(min(1.0, max(0.0, value - half)))
        upper.append(min(1.0, max(0.0, value + half)))
    return ShareEstimate(
        choices=names,
        estimate=estimate,
        lower=lower,
        upper=upper,
        n_unlabeled=big_n,
        n_labeled=n,
        alpha=alpha,
        method=(
            "prediction-powered inference with power tuning (PPI++, Angelopoulos, Duchi & "
            "Zrnic 2023), asymptotic confidence sequences (Waudby-Smith et al. 2021): valid "
            "at every recomputation" + (f", Bonferroni over {k} choices" if family > 1 else "")
        ),
    )
