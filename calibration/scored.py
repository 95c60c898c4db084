"""What the calibration reads of a judgment, and the checks a policy and a profile share.

A judgment is anything with its ``choices``, their ``log_probs`` in that order and a
``choice_mass`` (the engine's ``Judgment`` qualifies), so calibration needs neither torch nor
the engine. A leaf module: ``policy`` and ``profile`` both import it, and it imports neither.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from calibration.errors import ValuesError

__all__ = ["ScoredJudgment", "check_max_std", "feature_row"]


def check_max_std(value: object) -> float:
    """A finite number >= 0, as a bound on a score's standard deviation must be."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValuesError(f"max_std must be a number >= 0, got {value!r}", field="max_std")
    out = float(value)
    if not (np.isfinite(out) and out >= 0):
        raise ValuesError(f"max_std must be a finite number >= 0, got {value!r}", field="max_std")
    return out


def feature_row(
    features: Mapping[int, Sequence[float]], layers: Sequence[int]
) -> npt.NDArray[np.float64]:
    """One judgment's hidden states of ``layers``, concatenated in that order: (m * H,), the
    row a probe map reads."""
    return np.concatenate([np.asarray(features[n], dtype=np.float64) for n in layers])


class ScoredJudgment(Protocol):
    """What a policy needs of a judgment.

    A probe's policy also reads ``features`` (layer -> hidden state), where the judgment has
    them; it is not part of the protocol so that judgments without features still qualify.
    """

    @property
    def choices(self) -> Sequence[str]: ...

    @property
    def log_probs(self) -> Sequence[float]: ...  # in ``choices`` order

    @property
    def choice_mass(self) -> float: ...
