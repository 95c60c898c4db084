"""Prior correction without labels: contextual and batch calibration.

A language model judging between choices carries a prior over them that has nothing to do
with the item: on trec the default model answers "description" for almost everything (raw
accuracy 0.02). Two published corrections estimate that prior without a single label and
divide it out, log p(y|x) - log p_prior(y):

* contextual calibration (Zhao et al. 2021, "Calibrate Before Use"): the prior is the mean
  probability vector of content-free inputs ("N/A", "", "[MASK]") put where the item's text
  goes in the task's prompt;
* batch calibration (Zhou et al. 2023, "Batch Calibration"): the prior is the mean probability
  vector over a set of unlabeled items, p_prior = mean_i p(y|x_i).

Either correction is softmax(z - log p_prior), which is a ``BiasTemperature`` map with T = 1
and bias -log p_prior (centred: adding a constant to every bias changes nothing), so a
label-free profile is served by the same code as a labeled one. ``LabelFree`` records which
correction, on how many inputs and on what data; a profile carries it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np
import numpy.typing as npt
from msgspec import Meta

from calibration.errors import FitError, RuleError
from calibration.maps.map_types import MAX_ABS_BIAS, BiasTemperature, softmax
from calibration.validation import check_logits

__all__ = [
    "CONTENT_FREE_INPUTS",
    "LABEL_FREE_METHODS",
    "LabelFree",
    "estimate_prior",
    "prior_correction",
]

LABEL_FREE_METHODS = ("contextual", "batch")
CONTENT_FREE_INPUTS: tuple[str, ...] = ("N/A", "", "[MASK]")
"""Zhao et al. 2021's content-free inputs, averaged: each alone has its own quirks."""

# A prior entry below this is treated as this: its bias -log p stays far inside MAX_ABS_BIAS
# (the bound a profile enforces), and no real prior is this small.
_PRIOR_FLOOR = 1e-300


class LabelFree(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a prior correction was estimated without labels."""

    method: Literal["contextual", "batch"]
    n_inputs: Annotated[
        int, Meta(ge=1)
    ]  # content-free inputs (contextual) or unlabeled items (batch) averaged
    source: str  # in words: which inputs, from which data
    prior: list[float]  # the estimated prior, in the profile's choice order; sums to 1

    def __post_init__(self) -> None:
        if self.n_inputs < 1:
            raise RuleError(f"label_free.n_inputs must be at least 1, got {self.n_inputs}")
        p = np.asarray(self.prior, dtype=np.float64)
        if p.ndim != 1 or p.shape[0] < 2 or not np.all(np.isfinite(p)) or np.any(p < 0):
            raise RuleError(
                f"label_free.prior must be at least 2 finite numbers >= 0, got {self.prior!r}"
            )
        if abs(float(p.sum()) - 1.0) > 1e-6:
            raise RuleError(f"label_free.prior must sum to 1, got {float(p.sum())!r}")


def estimate_prior(log_probabilities: npt.ArrayLike, *, name: str = "inputs") -> list[float]:
    """The mean probability vector of (n, k) per-choice log-probabilities, n >= 1.

    Raises FitError naming ``name`` when there is no input to average.
    """
    z = np.asarray(log_probabilities, dtype=np.float64)
    if z.ndim != 2 or z.shape[0] == 0:
        raise FitError(f"{name} is empty: label-free calibration needs at least one input")
    p = softmax(check_logits(z, name=name)).mean(axis=0)  # (k,)
    return [float(v) for v in p / p.sum()]


def prior_correction(prior: npt.ArrayLike, temperature: float = 1.0) -> BiasTemperature:
    """The map softmax(z / T - log prior / T): the prior divided out, then temperature T.

    With T = 1 it is contextual or batch calibration; with a fitted T it is that correction
    followed by temperature scaling, ((z - log prior) / T), still one ``BiasTemperature``.
    """
    p = np.asarray(prior, dtype=np.float64)
    if p.ndim != 1 or p.shape[0] < 2 or not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError(f"prior must be at least 2 finite numbers >= 0, got {prior!r}")
    bias = -np.log(np.maximum(p / p.sum(), _PRIOR_FLOOR)) / temperature
    bias = np.clip(bias - bias.mean(), -MAX_ABS_BIAS, MAX_ABS_BIAS)
    return BiasTemperature(temperature=float(temperature), bias=[float(b) for b in bias])
