"""Scores: the expected value and spread of a judgment over numeric choices.

A graded judgment ("rate 0-5") is a distribution over choices that stand for numbers. Its
probability-weighted mean tracks human ratings better than the most likely rating (G-Eval, Liu
et al. 2023), and its standard deviation says how unsure the judge is about the grade. Here
they are computed from calibrated probabilities, as arrays, for the policy and the fit.

``values`` maps each choice to its number; for choices that are all numerals ("0", "10",
"-1", "2.5"; not "one", "1e3" or "inf") the numerals themselves are the default. The engine
has the same rules for raw probabilities (``judge.scores``); the two packages share no code
because neither may import the other.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from calibration.errors import ValuesError

__all__ = ["NUMERAL", "check_values", "numeral_values", "value_moments"]

NUMERAL = re.compile(r"[+-]?(?:\d+(?:\.\d+)?|\.\d+)")
"""A plain decimal numeral: optional sign, digits, optional fraction. No exponent, no words."""

_FloatArray = npt.NDArray[np.float64]


def numeral_values(choices: Sequence[str]) -> dict[str, float] | None:
    """Each choice's number when every choice is a numeral (surrounding spaces allowed), else
    None."""
    if not all(NUMERAL.fullmatch(c.strip()) for c in choices):
        return None
    return {c: float(c) for c in choices}


def check_values(values: object, choices: Sequence[str] | None = None) -> dict[str, float]:
    """``values`` as a dict of finite floats, keyed by exactly ``choices`` when given.

    Raises ValuesError (a ValueError) naming ``values`` and the first thing wrong with it.
    """
    if not isinstance(values, Mapping):
        raise ValuesError(f"values must map each choice to a number, got {type(values).__name__}")
    out: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            raise ValuesError(f"values[{key!r}] must be a number, got {value!r}")
        if not math.isfinite(float(value)):
            raise ValuesError(f"values[{key!r}] must be a finite number, got {value!r}")
        out[str(key)] = float(value)
    if choices is not None:
        missing = [c for c in choices if c not in out]
        extra = [k for k in out if k not in set(choices)]
        if missing or extra:
            raise ValuesError(
                f"values must give a number for exactly the choices {list(choices)!r}; "
                f"missing {missing!r}, not a choice {extra!r}"
            )
    elif len(out) < 2:
        raise ValuesError(f"values must give a number for at least 2 choices, got {out!r}")
    return out


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
