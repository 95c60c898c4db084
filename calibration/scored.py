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

from calibration.errors import ProfileMismatchError, ValuesError

__all__ = ["ScoredJudgment", "check_max_std", "feature_row", "probe_row"]


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


# What a probe reads of a judgment, by kind (``Probe.reads``), in the row's order: the
# judgment's attribute, the field a refusal names, the query's field that asks for it, and what
# it is.
_READS = {
    "point": ("features", "features", "feature_layers", "the hidden state"),
    "mean": ("span_features", "span_layers", "span_layers", "the mean hidden state over the item"),
}


def probe_row(
    judgment: object, reads: str, layers: Sequence[int], span: str | None, profile: str
) -> npt.NDArray[np.float64]:
    """The row a probe that ``reads`` ``layers`` (``calibration.maps.map_types.Probe``) takes from one
    judgment: the hidden states at the decision point (``features``), then the means over the
    item (``span_features``), as far as it reads each. A judgment that lacks them, or whose
    means were taken over other tokens than the probe's ``span`` ("item": a marked
    ``item_span``; "prompt": the whole prompt), is a ProfileMismatchError naming the field
    to set on the query."""
    parts = []
    kinds = reads.split("+")
    for kind, (attribute, field, asks, what) in _READS.items():
        if kind not in kinds:
            continue
        read = getattr(judgment, attribute, None)
        if not read or any(n not in read for n in layers):
            raise ProfileMismatchError(
                field,
                f"profile {profile!r} is a probe on {what} of layer(s) {list(layers)}, and the "
                f"judgment carries none of them: judge with {asks}={list(layers)} "
                f"(profile.{asks})",
            )
        if kind == "mean" and (getattr(judgment, "item_span", None) is not None) != (
            span == "item"
        ):
            raise ProfileMismatchError(
                "item_span",
                f"profile {profile!r} was fitted on means over the item marked in each prompt: "
                "mark the item's characters with item_span"
                if span == "item"
                else f"profile {profile!r} was fitted on means over the whole prompt: send no "
                "item_span",
            )
        parts.append(feature_row(read, layers))
    return np.concatenate(parts)


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
