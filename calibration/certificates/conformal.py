"""Split conformal prediction sets over the choices, with the LAC score.

Instead of a single answer, a conformal judge returns the set of choices it cannot rule out.
With the least-ambiguous-set-valued (LAC) score, score = 1 - p(correct choice) (Sadinle, Lei &
Wasserman 2019, "Least Ambiguous Set-Valued Classifiers with Bounded Error Levels"), and the
threshold q_hat taken as the ceil((n + 1)(1 - alpha)) / n empirical quantile of the scores of
n labelled calibration items, a new item exchangeable with them has its correct choice in its
set {j : 1 - p_j <= q_hat} with probability >= 1 - alpha (Vovk et al. 2005; Angelopoulos &
Bates 2021, "A Gentle Introduction to Conformal Prediction"). The guarantee is marginal (on
average over items), holds for any probabilities, calibrated or not, and needs only
exchangeability; better probabilities give smaller sets, not better coverage.
"""

from __future__ import annotations

import fractions
import math
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from calibration.validation import _FloatArray, check_probs, check_probs_labels, check_unit_open

if TYPE_CHECKING:
    from typing import Self

    from numpy.typing import ArrayLike

__all__ = [
    "ConformalClassifier",
    "conformal_quantile",
    "prediction_set",
    "set_membership",
]


def _rank(n: int, alpha: float) -> int:
    # Exact rational arithmetic on the given float alpha: in floats, (n + 1) * (1 - alpha) can
    # land a hair above an integer and make ceil() one rank too conservative, or a hair below
    # it and break the guarantee.
    return math.ceil((n + 1) * (1 - fractions.Fraction(alpha)))


def conformal_quantile(probs: ArrayLike, y: ArrayLike, alpha: float) -> float:
    """The split-conformal threshold q_hat on LAC scores 1 - p(correct choice).

    q_hat is the ceil((n + 1)(1 - alpha)) / n empirical quantile of the n scores, i.e. their
    ceil((n + 1)(1 - alpha))-th smallest value (the "inverted CDF" quantile). When that rank
    exceeds n, too few items were given for level 1 - alpha, and q_hat is 1.0: every choice is
    in every set. (numpy's ``method="higher"`` interpolates at position (n - 1) * level and can
    select the next order statistic, which is valid but needlessly conservative.)

    Parameters
    ----------
    probs : array of shape (n, k)
    y : array of shape (n,)
    alpha : float in (0, 1), the allowed miscoverage.

    Returns
    -------
    q_hat : float in [0, 1]
    """
    p, labels = check_probs_labels(probs, y)
    alpha = check_unit_open(alpha, "alpha")
    n = p.shape[0]
    rank = _rank(n, alpha)
    if rank > n:
        return 1.0
    scores = 1.0 - p[np.arange(n), labels]
    return float(np.partition(scores, rank - 1)[rank - 1])


def _check_q_hat(q_hat: float) -> float:
    if (
        isinstance(q_hat, bool)
        or not isinstance(q_hat, int | float | np.floating)
        or not 0.0 <= q_hat <= 1.0
    ):
        raise ValueError(f"q_hat must be a number in [0, 1], got {q_hat!r}")
    return float(q_hat)


def _membership(p: _FloatArray, q_hat: float) -> npt.NDArray[np.bool_]:
    # Compare scores rather than p >= 1 - q_hat: 1 - (1 - p) need not round back to p, and the
    # set must contain exactly the choices whose score is within the threshold.
    member = (1.0 - p) <= q_hat
    empty = ~member.any(axis=1)
    # An empty set can only happen when q_hat is below every score of the row; adding the most
    # probable choice can only add coverage, so the guarantee is kept.
    member[empty, p[empty].argmax(axis=1)] = True
    return member


def _sets(p: _FloatArray, q_hat: float) -> list[list[int]]:
    return [[int(j) for j in np.flatnonzero(row)] for row in _membership(p, q_hat)]


def prediction_set(probs_row: ArrayLike, q_hat: float) -> list[int]:
    """Indices of the choices j with 1 - p_j <= q_hat (equivalently p_j >= 1 - q_hat).

    Never empty: if no choice qualifies, the set is the most probable choice alone, which only
    adds coverage.

    Parameters
    ----------
    probs_row : array of shape (k,), one item's probabilities
    q_hat : float in [0, 1], from ``conformal_quantile``
    """
    row = np.asarray(probs_row, dtype=np.float64)
    if row.ndim != 1:
        raise ValueError(f"probs_row must be a 1-D array of shape (k,), got shape {row.shape}")
    p = check_probs(row[None, :], name="probs_row")
    return _sets(p, _check_q_hat(q_hat))[0]


def set_membership(probs: ArrayLike, q_hat: float) -> npt.NDArray[np.bool_]:
    """(n, k) booleans: whether choice j is in row i's prediction set (never an empty row)."""
    return _membership(check_probs(probs), _check_q_hat(q_hat))


class ConformalClassifier:
    """Split conformal prediction sets with the LAC score, fitted on held-out labelled items.

    The items passed to ``fit`` must not have been used to fit the probabilities' calibration
    (or the model), or the coverage guarantee does not hold.

    Attributes
    ----------
    quantile_ : float, the threshold q_hat
    alpha_ : float
    n_classes_ : int
    """

    quantile_: float
    alpha_: float
    n_classes_: int

    def fit(self, probs: ArrayLike, y: ArrayLike, alpha: float = 0.1) -> Self:
        """Fit q_hat on probabilities of shape (n, k) and correct choice indices of shape (n,)."""
        p, labels = check_probs_labels(probs, y)
        self.quantile_ = conformal_quantile(p, labels, alpha)
        self.alpha_ = float(alpha)
        self.n_classes_ = int(p.shape[1])
        return self

    def predict_sets(self, probs: ArrayLike) -> list[list[int]]:
        """One non-empty prediction set (sorted choice indices) per row of (n, k) probs."""
        if not hasattr(self, "quantile_"):
            from sklearn import exceptions  # here: a server dependency, not the client's

            raise exceptions.NotFittedError(
                "this ConformalClassifier is not fitted yet; call fit(probs, y) first"
            )
        p = check_probs(probs)
        if p.shape[1] != self.n_classes_:
            raise ValueError(
                f"probs have {p.shape[1]} choices per row but the classifier was fitted on "
                f"{self.n_classes_}"
            )
        return _sets(p, self.quantile_)
