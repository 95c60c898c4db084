"""Input validation shared by the calibration package.

Every public function of the package checks its arrays and numbers here, so that a bad
input is refused with the same message wherever it enters: the message names the argument,
the offending value and, where it helps, what to pass instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

__all__ = [
    "check_choice_mass",
    "check_confidences",
    "check_correct",
    "check_int",
    "check_labels",
    "check_logits",
    "check_probability",
    "check_probs",
    "check_probs_labels",
    "check_unit_open",
]

# The array types of the whole package, named once here where its inputs are checked.
_FloatArray = npt.NDArray[np.float64]
_IntArray = npt.NDArray[np.int64]
_BoolArray = npt.NDArray[np.bool_]

# float32 probabilities from an engine can miss 1 by a few ulps per choice; anything further
# off is a caller error (log-probabilities passed as probabilities, a missing softmax, ...).
_ROW_SUM_TOL = 1e-5


def _first_bad(mask: npt.NDArray[np.bool_]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def check_probs(probs: ArrayLike, name: str = "probs") -> _FloatArray:
    arr = check_logits(probs, name)  # the same shape and finiteness rules
    if np.any((arr < 0.0) | (arr > 1.0)):
        i, j = _first_bad((arr < 0.0) | (arr > 1.0))
        raise ValueError(f"{name}[{i}, {j}] = {arr[i, j]} is not a probability in [0, 1]")
    sums = arr.sum(axis=1)
    off = np.abs(sums - 1.0) > _ROW_SUM_TOL
    if np.any(off):
        i = int(np.argmax(off))
        raise ValueError(
            f"row {i} of {name} sums to {sums[i]}, not 1; pass probabilities (softmax of the "
            "logits), not log-probabilities"
        )
    return arr


def check_labels(y: ArrayLike, n: int, k: int, name: str = "y") -> _IntArray:
    arr = np.asarray(y)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of shape (n,), got shape {arr.shape}")
    if arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} labels but there are {n} rows of scores")
    if arr.dtype == np.bool_ or not (
        np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    ):
        raise ValueError(f"{name} must hold integer choice indices, got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.floating):
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if np.any(bad):
            i = int(np.argmax(bad))
            raise ValueError(f"{name}[{i}] = {arr[i]} is not an integer choice index")
    out = arr.astype(np.int64)
    bad = (out < 0) | (out >= k)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}] = {out[i]} is out of range: choice indices are 0..{k - 1}")
    return out


def check_confidences(confidences: ArrayLike, name: str = "confidences") -> _FloatArray:
    arr = np.asarray(confidences, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of shape (n,), got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError(f"{name} is empty; need at least one item")
    bad = ~np.isfinite(arr) | (arr < 0.0) | (arr > 1.0)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}] = {arr[i]} is not a probability in [0, 1]")
    return arr


def check_correct(correct: ArrayLike, n: int, name: str = "correct") -> _BoolArray:
    arr = np.asarray(correct)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of shape (n,), got shape {arr.shape}")
    if arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} entries but there are {n} confidences")
    if arr.dtype == np.bool_:
        return arr
    if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ValueError(f"{name} must be booleans or 0/1, got dtype {arr.dtype}")
    bad = (arr != 0) & (arr != 1)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}] = {arr[i]} is not 0/1 (or a boolean)")
    return arr == 1


def check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_unit_open(value: object, name: str) -> float:
    """A float strictly inside (0, 1), as alpha, delta and target precisions must be."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name} must be a number in (0, 1), got {value!r}")
    out = float(value)
    if not (0.0 < out < 1.0):
        raise ValueError(f"{name} must be in the open interval (0, 1), got {value!r}")
    return out


def check_probs_labels(probs: ArrayLike, y: ArrayLike) -> tuple[_FloatArray, _IntArray]:
    p = check_probs(probs)
    return p, check_labels(y, p.shape[0], p.shape[1])


def check_probability(value: object, name: str) -> float:
    """A number in the closed interval [0, 1], as thresholds and choice masses are."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    out = float(value)
    if not 0.0 <= out <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return out


def check_choice_mass(choice_mass: ArrayLike | None, n: int) -> _FloatArray:
    """(n,) choice masses in [0, 1]; None counts as 1 for every item (nothing known against the
    choices)."""
    if choice_mass is None:
        return np.ones(n)
    mass = np.asarray(choice_mass, dtype=np.float64)
    if mass.shape != (n,) or not np.all((mass >= 0) & (mass <= 1)):
        raise ValueError(f"choice_mass must be {n} numbers in [0, 1], got shape {mass.shape}")
    return mass


def check_logits(logits: ArrayLike, name: str = "logits", allow_1d: bool = False) -> _FloatArray:
    """Per-choice log-scores as a float64 (n, k) array; ``allow_1d`` takes one (k,) row too."""
    arr = np.asarray(logits, dtype=np.float64)
    if arr.ndim == 1 and allow_1d:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array of shape (n, k), got shape {arr.shape}")
    n, k = arr.shape
    if n == 0:
        raise ValueError(f"{name} is empty (shape {arr.shape}); need at least one item")
    if k < 2:
        raise ValueError(f"{name} must have at least 2 choices per row, got k={k}")
    if not np.all(np.isfinite(arr)):
        i, j = _first_bad(~np.isfinite(arr))
        raise ValueError(f"{name}[{i}, {j}] = {arr[i, j]} is not finite")
    return arr
