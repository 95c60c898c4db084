"""Calibration profiles: a fitted calibration saved as JSON, with the evidence behind it.

A profile is only valid for the model, response template, system prompt and choices it was
fitted on; ``CalibrationProfile.check`` refuses anything else by name instead of returning a
silently wrong probability. Files are written atomically (temporary file, fsync, rename), so a
reader never sees half a profile and a crash never leaves one.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec
import numpy as np

from calibration.errors import ProfileError, ProfileMismatchError, ProfileNotFoundError
from calibration.metrics import MetricReport
from calibration.routing import ThresholdResult
from calibration.scaling import apply_calibration

__all__ = [
    "FORMAT_VERSION",
    "NAME_PATTERN",
    "CalibrationProfile",
    "decode_profile",
    "load_profile",
    "save_profile",
    "sha256_text",
]

FORMAT_VERSION = 1
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_METHODS = ("none", "temperature", "bias_temperature")


def sha256_text(text: str | None) -> str | None:
    """Hash of a system prompt; None stands for the model's default system prompt."""
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


class CalibrationProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything needed to apply a calibration, and to know when not to."""

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
    # The fitted map: probabilities = softmax(logits / temperature + bias).
    method: str
    temperature: float
    bias: list[float] | None
    cv_nll: dict[str, float]
    note: str
    # Routing: accept when the calibrated confidence is at least threshold.threshold.
    threshold: ThresholdResult
    conformal_alpha: float
    conformal_quantile: float
    # Evidence, on the calibration data.
    metrics_before: MetricReport
    metrics_after: MetricReport
    n_examples: int
    dataset: str
    dataset_sha256: str
    created_at: str

    def __post_init__(self) -> None:
        problems = []
        if self.format_version != FORMAT_VERSION:
            problems.append(f"format_version is {self.format_version}, expected {FORMAT_VERSION}")
        if not re.fullmatch(NAME_PATTERN, self.name):
            problems.append(f"name {self.name!r} must match {NAME_PATTERN}")
        if len(self.choices) < 2 or len(set(self.choices)) != len(self.choices):
            problems.append(f"choices must be at least 2 distinct strings, got {self.choices!r}")
        if self.method not in _METHODS:
            problems.append(f"method {self.method!r} is not one of {_METHODS}")
        if not (np.isfinite(self.temperature) and self.temperature > 0):
            problems.append(f"temperature must be a positive number, got {self.temperature!r}")
        if self.bias is not None and (
            len(self.bias) != len(self.choices) or not np.all(np.isfinite(self.bias))
        ):
            problems.append(f"bias must be {len(self.choices)} finite numbers, got {self.bias!r}")
        if not 0 < self.conformal_alpha < 1 or not 0 <= self.conformal_quantile <= 1:
            problems.append("conformal_alpha must be in (0, 1) and conformal_quantile in [0, 1]")
        if problems:
            raise msgspec.ValidationError("; ".join(problems))

    def check(
        self,
        *,
        model: str,
        model_sha256: str | None,
        response_prefix: str,
        response_suffix: str,
        system: str | None,
        choices: Sequence[str],
    ) -> None:
        """Raise ProfileMismatchError naming the first property that differs."""
        expected = {
            "model": (self.model, model),
            "model_sha256": (self.model_sha256, model_sha256),
            "response_prefix": (self.response_prefix, response_prefix),
            "response_suffix": (self.response_suffix, response_suffix),
            "system": (self.system_sha256, sha256_text(system)),
        }
        for field, (fitted, given) in expected.items():
            if fitted != given:
                shown = "a different system prompt" if field == "system" else repr(given)
                raise ProfileMismatchError(
                    field,
                    f"profile {self.name!r} was fitted with {field} {fitted!r}, not {shown}; "
                    "fit a profile for this configuration or drop the profile",
                )
        if sorted(choices) != sorted(self.choices):
            raise ProfileMismatchError(
                "choices",
                f"profile {self.name!r} was fitted for choices {self.choices!r}, "
                f"not {list(choices)!r}; the same choices are needed (in any order)",
            )

    def calibrate(self, logits: Mapping[str, float]) -> dict[str, float]:
        """Calibrated probabilities for per-choice logits keyed by choice, in the given order."""
        order = list(logits)
        index = {c: i for i, c in enumerate(self.choices)}
        row = np.array([[logits[c] for c in self.choices]], dtype=np.float64)  # (1, k)
        probs = apply_calibration(row, self.method, self.temperature, self.bias)[0]
        return {c: float(probs[index[c]]) for c in order}


def save_profile(profile: CalibrationProfile, path: str | os.PathLike[str]) -> Path:
    """Write ``profile`` as JSON at ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = msgspec.json.format(msgspec.json.encode(profile), indent=2)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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
