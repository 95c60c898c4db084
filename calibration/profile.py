"""Calibration profiles: a fitted calibration saved as JSON, with the evidence behind it.

A profile is only valid for the model, weights, dtype, response template, system prompt and
choices it was fitted on; ``CalibrationProfile.check`` refuses anything else by name instead of
returning a silently wrong probability. ``profile.decide(judgment)`` applies its map and gates
(see ``calibration.policy``). Files are written atomically (temporary file, fsync, rename), so a
reader never sees half a profile and a crash never leaves one.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec
import numpy as np

import atomicio
from calibration.errors import ProfileError, ProfileMismatchError, ProfileNotFoundError
from calibration.metrics import MetricReport
from calibration.policy import Decision, Policy, PolicyDefaults, ScoredJudgment, make_policy
from calibration.routing import ThresholdResult
from calibration.scaling import CalibrationMap

__all__ = [
    "FORMAT_VERSION",
    "NAME_PATTERN",
    "CalibrationProfile",
    "Configured",
    "DataSplit",
    "decode_profile",
    "load_profile",
    "save_profile",
    "sha256_text",
]

FORMAT_VERSION = 2
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"


def sha256_text(text: str | None) -> str | None:
    """Hash of a system prompt; None stands for the model's default system prompt."""
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


class DataSplit(msgspec.Struct, frozen=True, kw_only=True):
    """How the labeled examples were divided, so that each guarantee rests on unused data."""

    fit: int  # examples the calibration map was fitted on
    conformal: int  # examples the conformal quantile was computed on
    certify: int  # examples the threshold was certified on
    seed: int


class CalibrationProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything needed to apply a calibration and gate on it, and to know when not to."""

    format_version: int
    name: str
    # What it was fitted on: a profile applies only where all of these match.
    model: str
    model_sha256: str | None
    dtype: str
    response_prefix: str
    response_suffix: str
    system_sha256: str | None
    choices: list[str]
    # The fitted map, from per-choice log-probabilities to calibrated probabilities.
    calibration_map: CalibrationMap
    cv_nll: dict[str, float]
    note: str
    # The certified rule: accept when the calibrated confidence reaches threshold.threshold,
    # the choice mass reaches min_choice_mass and the conformal set holds one choice.
    threshold: ThresholdResult
    min_choice_mass: float
    conformal_alpha: float
    conformal_quantile: float
    split: DataSplit
    # Evidence: before = raw probabilities of every example; after = calibrated probabilities
    # of the examples the map was not fitted on.
    metrics_before: MetricReport
    metrics_after: MetricReport
    n_examples: int
    dataset: str
    dataset_sha256: str
    created_at: str

    def __post_init__(self) -> None:
        problems = []
        if self.format_version != FORMAT_VERSION:
            problems.append(
                f"format_version is {self.format_version}, expected {FORMAT_VERSION} "
                "(refit the profile with this version)"
            )
        if not re.fullmatch(NAME_PATTERN, self.name):
            problems.append(f"name {self.name!r} must match {NAME_PATTERN}")
        if len(self.choices) < 2 or len(set(self.choices)) != len(self.choices):
            problems.append(f"choices must be at least 2 distinct strings, got {self.choices!r}")
        bias = getattr(self.calibration_map, "bias", None)
        if bias is not None and len(bias) != len(self.choices):
            problems.append(
                f"the map's bias has {len(bias)} entries for {len(self.choices)} choices"
            )
        t = self.threshold.threshold
        if t is not None and not 0 <= t <= 1:
            problems.append(f"threshold must be in [0, 1], got {t!r}")
        if not 0 <= self.min_choice_mass <= 1:
            problems.append(f"min_choice_mass must be in [0, 1], got {self.min_choice_mass!r}")
        if not 0 < self.conformal_alpha < 1 or not 0 <= self.conformal_quantile <= 1:
            problems.append("conformal_alpha must be in (0, 1) and conformal_quantile in [0, 1]")
        if self.n_examples < 1:
            problems.append(f"n_examples must be positive, got {self.n_examples}")
        if problems:
            raise msgspec.ValidationError("; ".join(problems))

    def check(
        self,
        engine: Configured,
        *,
        system: str | None = None,
        response_prefix: str | None = None,
        response_suffix: str | None = None,
        choices: Sequence[str] | None = None,
    ) -> None:
        """Raise ProfileMismatchError naming the first property that differs from ``engine``'s.

        ``engine`` is anything with ``configuration(system=, response_prefix=,
        response_suffix=)`` (a ``judge.Judge``); the keyword arguments are the per-call
        overrides a request makes. Check once, before judging, not per item.
        """
        given = engine.configuration(
            system=system, response_prefix=response_prefix, response_suffix=response_suffix
        )
        expected = {
            "model": (self.model, given["model"]),
            "model_sha256": (self.model_sha256, given["model_sha256"]),
            "dtype": (self.dtype, given["dtype"]),
            "response_prefix": (self.response_prefix, given["response_prefix"]),
            "response_suffix": (self.response_suffix, given["response_suffix"]),
            "system": (self.system_sha256, sha256_text(given["system"])),
        }
        for field, (fitted, actual) in expected.items():
            if fitted != actual:
                shown = "a different system prompt" if field == "system" else repr(actual)
                raise ProfileMismatchError(
                    field,
                    f"profile {self.name!r} was fitted with {field} {fitted!r}, not {shown}; "
                    "fit a profile for this configuration or drop the profile",
                )
        if choices is not None and sorted(choices) != sorted(self.choices):
            raise ProfileMismatchError(
                "choices",
                f"profile {self.name!r} was fitted for choices {self.choices!r}, "
                f"not {list(choices)!r}; the same choices are needed (in any order)",
            )

    def calibrate(self, log_probabilities: Mapping[str, float]) -> dict[str, float]:
        """Calibrated probabilities for per-choice log-probabilities, in the given order."""
        order = list(log_probabilities)
        if sorted(order) != sorted(self.choices):
            raise ProfileMismatchError(
                "choices", f"profile {self.name!r} calibrates {self.choices!r}, not {order!r}"
            )
        row = np.array([log_probabilities[c] for c in self.choices], dtype=np.float64)  # (k,)
        probs = self.calibration_map.apply(row)
        index = {c: i for i, c in enumerate(self.choices)}
        return {c: float(probs[index[c]]) for c in order}

    def policy(
        self,
        *,
        threshold: float | None = None,
        min_choice_mass: float | None = None,
        defaults: PolicyDefaults | None = None,
    ) -> Policy:
        """This profile's policy, with the caller's overrides (see ``make_policy``)."""
        return make_policy(
            self, threshold=threshold, min_choice_mass=min_choice_mass, defaults=defaults
        )

    def decide(
        self,
        judgment: ScoredJudgment,
        *,
        threshold: float | None = None,
        min_choice_mass: float | None = None,
    ) -> Decision:
        """Accept or escalate one judgment made with this profile's choices."""
        return self.policy(threshold=threshold, min_choice_mass=min_choice_mass).decide(judgment)

    def decide_many(
        self,
        judgments: Sequence[ScoredJudgment],
        *,
        threshold: float | None = None,
        min_choice_mass: float | None = None,
    ) -> list[Decision]:
        """``decide`` for many judgments at once."""
        policy = self.policy(threshold=threshold, min_choice_mass=min_choice_mass)
        return policy.decide_many(judgments)


class Configured(Protocol):
    """What ``CalibrationProfile.check`` needs of an engine."""

    def configuration(
        self,
        *,
        system: str | None = None,
        response_prefix: str | None = None,
        response_suffix: str | None = None,
    ) -> Mapping[str, Any]: ...


def save_profile(profile: CalibrationProfile, path: str | os.PathLike[str]) -> Path:
    """Write ``profile`` as JSON at ``path`` atomically."""
    return atomicio.write_bytes(path, msgspec.json.format(msgspec.json.encode(profile), indent=2))


def load_profile(path: str | os.PathLike[str]) -> CalibrationProfile:
    """Read and validate a profile; ProfileError says what is wrong with the file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ProfileNotFoundError(f"no calibration profile at {str(path)!r}") from None
    except OSError as exc:
        raise ProfileError(f"cannot read calibration profile {str(path)!r}: {exc}") from exc
    return decode_profile(data, source=str(path))


def decode_profile(data: bytes | str, *, source: str = "profile") -> CalibrationProfile:
    """Validate JSON as a profile (for uploads as much as for files)."""
    try:
        return msgspec.json.decode(data, type=CalibrationProfile)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProfileError(f"{source} is not a valid calibration profile: {exc}") from exc
