"""Estimates for a whole dataset from a few labels and the judge's probabilities on the rest:
each choice's share, and the judge's accuracy, by prediction-powered inference with power
tuning (PPI++).

For a mean of Y (a choice's indicator, or "the judge was right") over a dataset of which n
items are labelled and N are not, with the judge's prediction Yhat of Y on every item:

    theta(lam) = mean(lam * Yhat over the unlabelled) + mean(Y - lam * Yhat over the labelled)

is unbiased for every lam when the labelled items are a uniform sample of the dataset
(Angelopoulos, Bates, Fannjiang, Jordan & Zrnic 2023, "Prediction-powered inference"): lam = 0
is the labels alone, lam = 1 plain PPI. PPI++ (Angelopoulos, Duchi & Zrnic 2023,
arXiv:2311.01453) takes the lam that minimises the estimate's variance,

    lam = Cov(Y, Yhat) / ((1 + n / N) Var(Yhat)),  clipped to [0, 1],

so that the interval is, to first order, never wider than the labels' own and narrower the
better the judge predicts Y. The interval is the CLT one, theta +- z sqrt(Var(lam Yhat_unl) / N
+ Var(Y - lam Yhat_lab) / n). ``ppi_mean`` computes exactly what the maintained library
(``ppi_py.ppi_mean_ci`` with ``lam=None``; tests/test_estimates.py compares them to 1e-9) does
for one mean: lam from the plain-PPI estimate's gradients, Var(Yhat) over both samples with
ddof 1, the variances of the interval with ddof 0.

Several means at once (the k shares) are tuned each on its own, and their intervals hold
together by Bonferroni (for two choices the shares are one number, so no correction).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import msgspec
import numpy as np
from numpy.typing import ArrayLike

from calibration.validation import check_labels, check_probs, check_unit_open

__all__ = [
    "DatasetEstimate",
    "MeanEstimate",
    "PPITerms",
    "ShareEstimates",
    "classical_mean",
    "dataset_estimate",
    "ppi_mean",
    "ppi_terms",
    "tuned_lambda",
]


class MeanEstimate(msgspec.Struct, frozen=True, kw_only=True):
    """One mean with its interval at the stated level."""

    estimate: float
    lower: float  # clipped to [0, 1]: every mean here is a share
    upper: float
    lam: float  # 0: the labels alone; 1: plain PPI
    std_error: float
    # Labels (in all, with the same unlabelled items) that would likely halve the interval's
    # width, at the same lam and variances; None where the unlabelled items' own variance
    # keeps it from halving however many are labelled.
    labels_to_halve: int | None


def _z(alpha: float, family: int) -> float:
    from scipy import stats  # a server dependency, not the client's

    return float(stats.norm.isf(alpha / (2 * family)))


def _halving(var_unlabeled: float, var_rectifier: float, n: int, big_n: int) -> int | None:
    """The labels n' with Var_r / n' + Var_u / N = (Var_r / n + Var_u / N) / 4."""
    now = var_rectifier / n + var_unlabeled / big_n
    room = now / 4 - var_unlabeled / big_n
    if var_rectifier == 0:
        return n  # labels add nothing to the width: it is the unlabelled items' alone
    if room <= 0:
        return None
    return math.ceil(var_rectifier / room)


def ppi_mean(
    y: ArrayLike,
    yhat: ArrayLike,
    yhat_unlabeled: ArrayLike,
    *,
    alpha: float = 0.05,
    lam: float | None = None,
    family: int = 1,
) -> MeanEstimate:
    """The PPI++ estimate of the mean of ``y`` over a dataset, from its ``n`` labelled items
    (``y`` and the judge's ``yhat`` of each, (n,)) and the judge's ``yhat_unlabeled`` (N,) on
    the rest; ``lam`` None: tuned (see the module docstring), else as given (0: the labels
    alone, 1: plain PPI). The interval holds with probability -> 1 - alpha / family as n and
    N grow (``family``: the number of intervals that must hold at once, Bonferroni)."""
    alpha = check_unit_open(alpha, "alpha")
    y_l = np.asarray(y, dtype=np.float64)
    f_l = np.asarray(yhat, dtype=np.float64)
    f_u = np.asarray(yhat_unlabeled, dtype=np.float64)
    if y_l.ndim != 1 or f_l.shape != y_l.shape or f_u.ndim != 1:
        raise ValueError(
            f"y and yhat must be (n,) alike and yhat_unlabeled (N,), got {y_l.shape}, "
            f"{f_l.shape} and {f_u.shape}"
        )
    n, big_n = y_l.shape[0], f_u.shape[0]
    if n < 2 or big_n < 2:
        raise ValueError(
            f"{n} labelled and {big_n} unlabelled items: PPI needs at least 2 of each to "
            "estimate a variance"
        )
    if not all(np.isfinite(a).all() for a in (y_l, f_l, f_u)):
        raise ValueError("y, yhat and yhat_unlabeled must be finite")
    terms = ppi_terms(y_l, f_l, f_u, lam)
    estimate, lam, var_u, var_r = terms.estimate, terms.lam, terms.var_unlabeled, terms.var_labeled
    se = math.sqrt(var_u / big_n + var_r / n)
    half = _z(alpha, family) * se
    return MeanEstimate(
        estimate=estimate,
        lower=min(1.0, max(0.0, estimate - half)),
        upper=min(1.0, max(0.0, estimate + half)),
        lam=float(lam),
        std_error=se,
        labels_to_halve=_halving(var_u, var_r, n, big_n),
    )


class PPITerms(NamedTuple):
    """A PPI++ estimate and what its interval is made of."""

    estimate: float
    lam: float
    var_unlabeled: float  # of lam * yhat over the unlabelled items (ddof 0, as ppi_py)
    var_labeled: float  # of y - lam * yhat over the labelled ones: the rectifier's


def ppi_terms(y: np.ndarray, f: np.ndarray, f_u: np.ndarray, lam: float | None = None) -> PPITerms:
    """The PPI++ estimate of a mean from labelled ``y`` (n,) with the judge's ``f`` on them
    and ``f_u`` (N,) on the rest, at ``lam`` (None: ``tuned_lambda``), and the two sample
    variances its interval (fixed-n, ``ppi_mean``, or time-uniform, the live shares) reads."""
    if lam is None:
        lam = tuned_lambda(y, f, f_u)
    imputed, rectifier = lam * f_u, y - lam * f
    return PPITerms(
        estimate=float(imputed.mean() + rectifier.mean()),
        lam=float(lam),
        var_unlabeled=float(imputed.var()),
        var_labeled=float(rectifier.var()),
    )


def tuned_lambda(y: np.ndarray, f: np.ndarray, f_u: np.ndarray) -> float:
    """PPI++'s variance-minimising lam for one mean, clipped to [0, 1]; 0 where the judge's
    predictions do not vary (they carry nothing)."""
    n, big_n = y.shape[0], f_u.shape[0]
    cov = float(((y - y.mean()) * (f - f.mean())).sum() / n)
    var = float(np.concatenate([f, f_u]).var(ddof=1))
    if var == 0:
        return 0.0
    return float(np.clip(cov / ((1 + n / big_n) * var), 0.0, 1.0))


def classical_mean(y: ArrayLike, *, alpha: float = 0.05, family: int = 1) -> MeanEstimate:
    """The labels alone: their mean and CLT interval (``ppi_mean`` at lam = 0)."""
    y_l = np.asarray(y, dtype=np.float64)
    # At lam 0 the unlabelled items count for nothing; two zeros stand in for them.
    return ppi_mean(y_l, np.zeros_like(y_l), np.zeros(2), alpha=alpha, lam=0.0, family=family)


class ShareEstimates(msgspec.Struct, frozen=True, kw_only=True):
    """One choice's share of the dataset three ways."""

    choice: str
    ppi: MeanEstimate  # PPI++: the labels and the judge together
    labels_only: MeanEstimate
    model_only: float  # the judge's mean probability over every item: no interval is valid


class DatasetEstimate(msgspec.Struct, frozen=True, kw_only=True):
    """What a dataset's labels and the judge's probabilities say of the whole dataset."""

    n_labeled: int
    n_unlabeled: int
    alpha: float  # all the shares' intervals hold at once with probability -> 1 - alpha
    shares: list[ShareEstimates]
    # The judge's accuracy (its top choice against the label), the judge's own prediction of
    # it being its confidence in that choice; the interval at level 1 - alpha on its own.
    accuracy: MeanEstimate
    accuracy_labels_only: MeanEstimate
    accuracy_model_only: float  # the mean confidence: what a calibrated judge expects
    warnings: list[str]


def dataset_estimate(
    choices: list[str],
    probabilities_unlabeled: ArrayLike,
    probabilities_labeled: ArrayLike,
    labels: ArrayLike,
    *,
    alpha: float = 0.05,
) -> DatasetEstimate:
    """Each choice's share and the judge's accuracy over a dataset, from the judge's
    probabilities (columns in ``choices`` order) on its unlabelled (N, k) and labelled (n, k)
    items and the labels (choice indices, (n,)) of the latter, which must be a uniform sample
    of the dataset; the probabilities must not have been fitted on them."""
    alpha = check_unit_open(alpha, "alpha")
    p_u = check_probs(probabilities_unlabeled, "probabilities_unlabeled")
    p_l = check_probs(probabilities_labeled, "probabilities_labeled")
    k = len(choices)
    if p_u.shape[1] != k or p_l.shape[1] != k:
        raise ValueError(f"the probabilities must have {k} columns, one per choice")
    y = check_labels(labels, p_l.shape[0], k, "labels")
    family = 1 if k == 2 else k
    onehot = np.eye(k)[y]
    shares = [
        ShareEstimates(
            choice=c,
            ppi=ppi_mean(onehot[:, j], p_l[:, j], p_u[:, j], alpha=alpha, family=family),
            labels_only=classical_mean(onehot[:, j], alpha=alpha, family=family),
            model_only=float(np.concatenate([p_l[:, j], p_u[:, j]]).mean()),
        )
        for j, c in enumerate(choices)
    ]
    right = (p_l.argmax(axis=1) == y).astype(np.float64)
    conf_l, conf_u = p_l.max(axis=1), p_u.max(axis=1)
    return DatasetEstimate(
        n_labeled=int(p_l.shape[0]),
        n_unlabeled=int(p_u.shape[0]),
        alpha=alpha,
        shares=shares,
        accuracy=ppi_mean(right, conf_l, conf_u, alpha=alpha),
        accuracy_labels_only=classical_mean(right, alpha=alpha),
        accuracy_model_only=float(np.concatenate([conf_l, conf_u]).mean()),
        warnings=_sampling_warnings(conf_l, conf_u, alpha),
    )


def _sampling_warnings(
    conf_labeled: np.ndarray, conf_unlabeled: np.ndarray, alpha: float
) -> list[str]:
    """A warning where the labelled items do not look like a uniform sample of the dataset:
    the judge's confidence on them and on the rest differ by a two-sample Kolmogorov-Smirnov
    test at level alpha. Silence proves nothing (a sample chosen by what the judge cannot
    see passes), but a failure means the estimates' premise is likely broken."""
    from scipy import stats

    test = stats.ks_2samp(conf_labeled, conf_unlabeled)
    if test.pvalue >= alpha:
        return []
    return [
        f"the labelled items do not look like a uniform sample of the dataset: the judge's "
        f"confidence on them differs from the rest (Kolmogorov-Smirnov p = {test.pvalue:.2g}); "
        "every estimate here assumes labels drawn uniformly at random (an audit sample), and "
        "chosen ones (the hardest, the first) bias them all"
    ]
