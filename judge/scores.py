"""Scores: a judgment over numeric choices as an expected value, a spread and a distribution.

A graded judgment ("rate 0-5") is a distribution over choices that stand for numbers. Its
probability-weighted mean tracks human ratings better than the most likely grade (G-Eval, Liu
et al. 2023); other tools estimate it by sampling or from single-token logprobs, which cannot
see "10". The engine has the exact distribution over every choice, multi-token numerals
included, so the mean and standard deviation here are exact for the model.

``values`` maps each choice to its number; for choices that are all numerals ("0", "10",
"-1", "2.5"; not "one", "1e3" or "inf") the numerals themselves are the default. Anything
else is a ``ValuesError`` that names the field ``values``. The rules are written once, here:
``calibration`` (no torch) imports this module for the same checks on calibrated
probabilities, and ``calibration.ValuesError`` is this class.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping, Sequence

import msgspec

from judge.errors import InvalidQueryError

__all__ = [
    "Score",
    "ValuesError",
    "check_values",
    "default_values",
    "numeral_values",
    "score_of",
]

_NUMERAL = re.compile(r"[+-]?(?:\d+(?:\.\d+)?|\.\d+)")


class ValuesError(InvalidQueryError, ValueError):
    """``values`` is missing for non-numeric choices, misses or adds a choice, or is not finite;
    or a score's ``max_std`` is not a finite number >= 0 (``field`` says which)."""

    def __init__(self, message: str = "", *, field: str | None = "values") -> None:
        super().__init__(message)
        self.field = field  # "values" or "max_std": the request field at fault


class Score(msgspec.Struct, frozen=True, kw_only=True):
    """A judgment read as a score. Plain data."""

    expected_value: float  # sum over choices of p * value
    std: float  # sqrt(sum of p * (value - expected_value)^2)
    most_likely_value: float  # the value of the most probable choice
    most_likely_choice: str
    distribution: dict[str, float]  # probability of each choice, in the judgment's order
    values: dict[str, float]  # the number each choice stands for, same order


def numeral_values(choices: Sequence[str]) -> dict[str, float] | None:
    """Each choice's own number when every choice is a plain decimal numeral (surrounding
    spaces allowed), else None."""
    if not all(_NUMERAL.fullmatch(c.strip()) for c in choices):
        return None
    return {c: float(c) for c in choices}


def default_values(choices: Sequence[str]) -> dict[str, float]:
    """Each choice's own number, when every choice is a plain decimal numeral.

    Raises ValuesError naming the first choice that is not one.
    """
    values = numeral_values(choices)
    if values is None:
        choice = next(c for c in choices if not _NUMERAL.fullmatch(c.strip()))
        raise ValuesError(
            f"choice {choice!r} is not a numeral, so it has no default value; give values "
            "mapping every choice to a number"
        )
    return values


def check_values(values: object, choices: Sequence[str] | None = None) -> dict[str, float]:
    """``values`` as finite floats, for exactly ``choices`` (in their order) when given.

    None with ``choices`` means the default (``default_values``). Without ``choices`` (values
    given before the choices are known), any two or more choices will do. Raises ValuesError
    (a ValueError) naming ``values`` and the first thing wrong with it.
    """
    if values is None and choices is not None:
        return default_values(choices)
    if not isinstance(values, Mapping):
        raise ValuesError(f"values must map each choice to a number, got {type(values).__name__}")
    if choices is None:
        if len(values) < 2:
            raise ValuesError(f"values must give a number for at least 2 choices, got {values!r}")
        choices = list(values)
        if not all(isinstance(c, str) for c in choices):
            raise ValuesError(f"values must map each choice (a string) to a number, got {values!r}")
    missing = [c for c in choices if c not in values]
    if missing:
        raise ValuesError(
            f"values is missing {missing!r}: give a number for each of the choices "
            f"{list(choices)!r}"
        )
    extra = [k for k in values if k not in set(choices)]
    if extra:
        raise ValuesError(
            f"values names {extra!r}, which are not among the choices {list(choices)!r}"
        )
    out: dict[str, float] = {}
    for choice in choices:
        value = values[choice]
        # numbers.Real: Python's and numpy's numbers alike (a bool is not a number here)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValuesError(f"values[{choice!r}] must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValuesError(f"values[{choice!r}] must be a finite number, got {value!r}")
        out[choice] = float(value)
    return out


def score_of(
    probabilities: Mapping[str, float], values: Mapping[str, float] | None = None
) -> Score:
    """The score of a distribution over choices (``Judgment.probabilities``).

    ``values`` maps every choice to a number; None: the choices' own numerals.
    """
    choices = list(probabilities)
    v = check_values(values, choices)
    expected = math.fsum(probabilities[c] * v[c] for c in choices)
    variance = math.fsum(probabilities[c] * (v[c] - expected) ** 2 for c in choices)
    best = max(choices, key=probabilities.__getitem__)  # ties: the first, as the engine's choice
    return Score(
        expected_value=expected,
        std=math.sqrt(max(variance, 0.0)),
        most_likely_value=v[best],
        most_likely_choice=best,
        distribution={c: float(probabilities[c]) for c in choices},
        values=v,
    )
