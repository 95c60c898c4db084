"""Scores: the expected value and spread of a judgment over numeric choices.

A graded judgment ("rate 0-5") is a distribution over choices that stand for numbers. Its
probability-weighted mean tracks human ratings better than the most likely rating (G-Eval, Liu
et al. 2023), and its standard deviation says how unsure the judge is about the grade. Here
they are computed from calibrated probabilities, as arrays, for the policy and the fit.

``values`` maps each choice to its number; for choices that are all numerals ("0", "10",
"-1", "2.5"; not "one", "1e3" or "inf") the numerals themselves are the default. Those rules
are the engine's (``judge.scores``, torch-free): ``check_values`` and ``numeral_values`` are
its functions, imported here so that both layers apply one rule and raise one ``ValuesError``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from calibration.validation import _FloatArray
from judge.scores import check_values, numeral_values

__all__ = ["check_values", "numeral_values", "value_moments"]


def value_moments(
    probabilities: npt.ArrayLike, values: npt.ArrayLike
) -> tuple[_FloatArray, _FloatArray]:
    """Expected value and standard deviation per row.

    Parameters
    ----------
    probabilities : array of shape (n, k), rows summing to 1
    values : array of shape (k,), the number each column stands for

    Returns
    -------
    expected : (n,) sum_j p_j v_j
    std : (n,) sqrt(sum_j p_j (v_j - expected)^2)
    """
    p = np.asarray(probabilities, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    expected = p @ v  # (n,)
    variance = (p * (v[None, :] - expected[:, None]) ** 2).sum(axis=1)  # (n,)
    return expected, np.sqrt(np.maximum(variance, 0.0))
