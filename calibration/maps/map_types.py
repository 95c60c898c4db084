"""The calibration maps: fitted, typed functions from a judgment's scores to probabilities.

Each map is a frozen msgspec Struct tagged by ``method`` in JSON, so a profile stores exactly
one of them and cannot hold, say, a bias without its method. ``apply`` is a pure function for
serving time. The scalar maps read only the per-choice log-probabilities; ``Probe`` reads the
hidden state of the same forward pass as well (``features``), and refuses to apply without it.
The estimators that fit them live in ``calibration.maps.scaling`` and ``calibration.maps.probe``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec
import numpy as np
from msgspec import Meta

from calibration.errors import ProfileMismatchError, RuleError
from calibration.validation import _FloatArray, check_logits

if TYPE_CHECKING:
    from collections.abc import Sequence

    from numpy.typing import ArrayLike

__all__ = [
    "MAX_ABS_BIAS",
    "MAX_PROBE_WEIGHTS",
    "T_MAX",
    "T_MIN",
    "BiasTemperature",
    "CalibrationMap",
    "Identity",
    "Probe",
    "ProbeReads",
    "ProbeSpan",
    "Temperature",
    "softmax",
]


# T in [0.01, 100] spans every useful sharpening/flattening of log-probabilities.
T_MIN = 0.01
T_MAX = 100.0
MAX_ABS_BIAS = 1000.0
# A probe's weights: at most 2**18 numbers (about 5 MB of JSON), e.g. 8 choices on two layers
# of a 16,384-wide model, or 64 choices on the default model's 576-wide hidden state at
# seven layers. Larger heads belong in a model file, not a profile.
MAX_PROBE_WEIGHTS = 2**18
MAX_ABS_WEIGHT = 1e6

# The fitter's range, with the tolerance _check_temperature allows for the search's rounding.
TemperatureValue = Annotated[float, Meta(ge=T_MIN * (1 - 1e-9), le=T_MAX * (1 + 1e-9))]


class _Map(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="method"
):
    """What every calibration map shares: its JSON tag, "method", names it."""

    @property
    def method(self) -> str:
        return str(self.__struct_config__.tag)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The hidden-state layers ``apply`` reads at the decision point: none, except for a
        probe."""
        return ()

    @property
    def span_layers(self) -> tuple[int, ...]:
        """The layers whose mean over the item's tokens ``apply`` reads: none, except for a
        probe on them."""
        return ()


class Identity(_Map, frozen=True, tag="none"):
    """No scaling: the model's own probabilities, softmax(logits)."""

    @property
    def temperature(self) -> float:
        return 1.0

    def apply(self, logits: ArrayLike, features: ArrayLike | None = None) -> _FloatArray:
        """Probabilities of the same shape as ``logits`` ((n, k) or (k,)); no features read."""
        return _scaled(logits, 1.0, None)


class Temperature(_Map, frozen=True, tag="temperature"):
    """Temperature scaling: softmax(logits / temperature)."""

    temperature: TemperatureValue

    def __post_init__(self) -> None:
        _check_temperature(self.temperature)

    def apply(self, logits: ArrayLike, features: ArrayLike | None = None) -> _FloatArray:
        """Probabilities of the same shape as ``logits`` ((n, k) or (k,)); no features read."""
        return _scaled(logits, self.temperature, None)


class BiasTemperature(_Map, frozen=True, tag="bias_temperature"):
    """Bias + temperature scaling: softmax(logits / temperature + bias), bias per choice."""

    temperature: TemperatureValue
    bias: Annotated[
        list[Annotated[float, Meta(ge=-MAX_ABS_BIAS, le=MAX_ABS_BIAS)]], Meta(min_length=2)
    ]

    def __post_init__(self) -> None:
        _check_temperature(self.temperature)
        if len(self.bias) < 2 or not all(
            math.isfinite(b) and abs(b) <= MAX_ABS_BIAS for b in self.bias
        ):
            raise RuleError(
                f"bias must be at least 2 finite numbers within +-{MAX_ABS_BIAS:g}, "
                f"got {self.bias!r}"
            )

    def apply(self, logits: ArrayLike, features: ArrayLike | None = None) -> _FloatArray:
        """Probabilities of the same shape as ``logits``; its width must match ``bias``."""
        return _scaled(logits, self.temperature, self.bias)


# What a probe reads of each of its layers: the hidden state at the decision point, its mean
# over the item's own tokens (``Query.span_layers``), or both, in that order.
ProbeReads = Literal["point", "mean", "point+mean"]
# Over which tokens a probe's means were taken when it was fitted, and so must be when it is
# served: the item marked in each prompt (``Query.item_span``), or the whole prompt.
ProbeSpan = Literal["item", "prompt"]


class Probe(_Map, frozen=True, tag="probe", omit_defaults=True):
    """A learned head: softmax(W [h_1 ... h_m, z] + b).

    ``h_i`` is what the probe ``reads`` of layer ``layers[i]`` (``feature_dim`` values each) of
    the very pass that scored the choices: the hidden state at the decision point after that
    many decoder blocks ("point"), its mean over the item's tokens ("mean", over the ``span``
    it was fitted on), or both (the points of every layer, then the means); ``z`` the choices'
    log-probabilities, normalised over the choices; ``weights`` is (k, width), ``intercept``
    (k,). Fitted by ``calibration.maps.probe`` (standardisation folded into the weights). It applies
    only to a model with ``num_layers`` blocks of width ``feature_dim``. The defaults are left
    out of its JSON, so a probe from before means were read keeps its encoding (and sha256).
    """

    layers: Annotated[list[Annotated[int, Meta(ge=1)]], Meta(min_length=1)]
    num_layers: Annotated[int, Meta(ge=1)]
    feature_dim: Annotated[int, Meta(ge=1)]
    weights: Annotated[list[list[float]], Meta(min_length=2)]
    intercept: Annotated[list[float], Meta(min_length=2)]
    l2: Annotated[float, Meta(gt=0)]  # the inverse regularisation strength C it was fitted with
    reads: ProbeReads = "point"
    span: ProbeSpan | None = None  # set exactly when it reads means

    def __post_init__(self) -> None:
        k, width = len(self.intercept), self.width
        problems = []
        if (self.span is None) != (self.reads == "point"):
            problems.append(
                f"calibration_map.span must name the tokens the means were taken over (item or "
                f"prompt) exactly when the probe reads means; it reads {self.reads!r} and has "
                f"span {self.span!r}"
            )
        # The types' bounds hold for a decoded probe; these recheck them for one built in code.
        if (
            not self.layers
            or min(self.layers) < 1
            or len(set(self.layers)) != len(self.layers)
            or max(self.layers) > self.num_layers
        ):
            problems.append(
                f"calibration_map.layers {self.layers!r} must be distinct layers of the "
                f"{self.num_layers} the probe was fitted on (1 to {self.num_layers})"
            )
        if self.feature_dim < 1:
            problems.append(f"calibration_map.feature_dim must be >= 1, got {self.feature_dim}")
        if k < 2:
            problems.append(
                f"calibration_map.intercept must hold one number per choice (at least 2), got {k}"
            )
        elif len(self.weights) != k or any(len(row) != width for row in self.weights):
            problems.append(
                f"calibration_map.weights must be {k} rows (one per entry of "
                f"calibration_map.intercept) of {width} numbers ({self.slots} states x "
                f"{self.feature_dim} + {k} log-probabilities); got {len(self.weights)} rows of "
                f"{sorted({len(r) for r in self.weights})} numbers"
            )
        elif k * width > MAX_PROBE_WEIGHTS:
            problems.append(
                f"calibration_map.weights holds {k * width} numbers, over the limit of "
                f"{MAX_PROBE_WEIGHTS}; fit the probe on fewer layers"
            )
        else:
            w = np.asarray(self.weights, dtype=np.float64)
            b = np.asarray(self.intercept, dtype=np.float64)
            for name, arr in (("weights", w), ("intercept", b)):
                if not np.all(np.isfinite(arr)) or np.abs(arr).max() > MAX_ABS_WEIGHT:
                    problems.append(
                        f"calibration_map.{name} must be finite numbers within +-{MAX_ABS_WEIGHT:g}"
                    )
        if not (math.isfinite(self.l2) and self.l2 > 0):
            problems.append(f"calibration_map.l2 must be a positive number, got {self.l2!r}")
        if problems:
            raise RuleError("; ".join(problems))

    @property
    def temperature(self) -> float:
        return 1.0

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.layers) if self.reads != "mean" else ()

    @property
    def span_layers(self) -> tuple[int, ...]:
        return tuple(self.layers) if self.reads != "point" else ()

    @property
    def slots(self) -> int:
        """Hidden-state vectors per item: one per layer, twice over for "point+mean"."""
        return len(self.layers) * len(self.reads.split("+"))

    @property
    def width(self) -> int:
        """Inputs per item: the hidden states it reads, then the k log-probabilities."""
        return self.slots * self.feature_dim + len(self.intercept)

    def apply(self, logits: ArrayLike, features: ArrayLike | None = None) -> _FloatArray:
        """Probabilities of the same shape as ``logits`` ((n, k) or (k,)).

        ``features`` is (n, slots * feature_dim) or (slots * feature_dim,) for a single row:
        what it ``reads`` of ``layers``, concatenated in that order
        (``calibration.scored.probe_row`` builds it from a judgment).
        """
        z = check_logits(logits, allow_1d=True)
        k = len(self.intercept)
        if z.shape[1] != k:
            raise ValueError(f"the probe scores {k} choices, but the logits have {z.shape[1]}")
        if features is None:
            raise ProfileMismatchError(
                "features",
                f"this probe reads the hidden state of layer(s) {self.layers}: judge with "
                f"feature_layers={self.layers} and pass the judgment's features",
            )
        x = np.asarray(features, dtype=np.float64)
        x = x[None, :] if x.ndim == 1 else x  # (n, m*H)
        if x.ndim != 2 or x.shape[0] != z.shape[0]:
            # Reshaping instead would silently deal one item's features out to several rows.
            raise ValueError(
                f"features must be ({z.shape[0]}, m * H), one row per row of the logits, "
                f"got shape {np.shape(features)}"
            )
        if x.shape[1] != self.slots * self.feature_dim:
            raise ProfileMismatchError(
                "hidden_size",
                f"the probe was fitted on {self.slots} hidden state(s) of width "
                f"{self.feature_dim}, but the features have {x.shape[1]} values per item",
            )
        if not np.all(np.isfinite(x)):
            raise ValueError("features must be finite numbers")
        w = np.asarray(self.weights, dtype=np.float64)  # (k, m*H + k)
        # The log-probabilities normalised over the choices, as the head was fitted on them.
        inputs = np.concatenate([x, _log_softmax(z)], axis=1)  # (n, m*H + k)
        s = inputs @ w.T + np.asarray(self.intercept)  # (n, k)
        p = _softmax(s)
        return p[0] if np.ndim(logits) == 1 else p


CalibrationMap = Identity | Temperature | BiasTemperature | Probe
"""A fitted map from a judgment's scores to calibrated probabilities.

One typed value, tagged by ``method`` in JSON ({"method": "temperature", "temperature": 2.1}),
so that a profile cannot hold a bias without its method or a temperature for "none".
"""


def _check_temperature(temperature: float) -> None:
    # The fitter searches 1/T in [1/T_MAX, 1/T_MIN]; a stored value outside that range did not
    # come from a fit, and values like 1e-300 would turn every probability into 0 or 1.
    if not (math.isfinite(temperature) and T_MIN * (1 - 1e-9) <= temperature <= T_MAX * (1 + 1e-9)):
        raise RuleError(f"temperature must be in [{T_MIN:g}, {T_MAX:g}], got {temperature!r}")


def _scaled(logits: ArrayLike, temperature: float, bias: Sequence[float] | None) -> _FloatArray:
    z = check_logits(logits, allow_1d=True)
    s = z / temperature
    if bias is not None:
        b = np.asarray(bias, dtype=np.float64)
        if b.shape != (z.shape[1],):
            raise ValueError(
                f"the map has {b.shape[0]} per-choice offsets but the logits have "
                f"{z.shape[1]} choices per row"
            )
        s = s + b
    p = _softmax(s)
    return p[0] if np.ndim(logits) == 1 else p


# ---------------------------------------------------------------------------------------------
# Softmax and validation.


def _log_softmax(s: _FloatArray) -> _FloatArray:
    shifted = s - s.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _softmax(s: _FloatArray) -> _FloatArray:
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def softmax(logits: ArrayLike) -> _FloatArray:
    """Row-wise softmax, stable for any finite log-scores.

    Parameters
    ----------
    logits : array of shape (n, k) or (k,)

    Returns
    -------
    probs : float64 array of the same shape; each row sums to 1.
    """
    z = check_logits(logits, allow_1d=True)
    p = _softmax(z)
    return p[0] if np.ndim(logits) == 1 else p
