"""Calibration profiles: a fitted calibration saved as JSON, with the evidence behind it.

A profile is only valid for the model, weights, dtype, response template, system prompt and
choices it was fitted on; ``CalibrationProfile.check`` refuses anything else by name instead of
returning a silently wrong probability. A profile decides nothing itself: a
``calibration.Gate`` opened on it does (its map and gates, under a request's overrides and a
server's defaults). Files are written atomically (temporary file, fsync, rename), so a reader
never sees half a profile and a crash never leaves one.

Decoding validates everything a profile claims, so a file or an upload with a negative count,
a non-finite number or an out-of-range threshold is refused with the field named, instead of
being served. Fields added after format 2 (``values``, ``max_std``, ``label_free``,
``signal``) are optional, so older files still load. Format 3 keeps the engine's fingerprint
(``judge.Fingerprint``) as one nested value where format 2 spread its fields over the top
level; ``decode_profile`` reads a format-2 file into the format-3 shape.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta

from calibration.certificates.certify import ThresholdResult
from calibration.certificates.per_class import ClassReport
from calibration.certificates.recertify import LabelsNeeded, Recertification
from calibration.certificates.signal import SignalReport
from calibration.errors import (
    ProfileError,
    ProfileMismatchError,
    ProfileNotFoundError,
    RuleError,
)
from calibration.maps.label_free import LabelFree
from calibration.maps.map_types import BiasTemperature, CalibrationMap, Identity, Probe, Temperature
from calibration.metrics import MetricReport
from calibration.monitoring.health import Reference
from calibration.scored import ScoredJudgment, check_max_std, probe_row
from calibration.scores import check_values, numeral_values
from calibration.template import PromptTemplate
from judge import atomicio
from judge.adapters import Adapter
from judge.fingerprint import Fingerprint
from judge.scores import ValuesError

__all__ = [
    "FORMAT_VERSION",
    "NAME_PATTERN",
    "Baseline",
    "CalibrationProfile",
    "DataSplit",
    "certified_coverage",
    "decode_profile",
    "etag_of",
    "load_profile",
    "profile_bytes",
    "save_profile",
]

FORMAT_VERSION = 3
# The fingerprint's fields, which format 2 kept at the top level of a profile.
_FLAT_FINGERPRINT = Fingerprint.__struct_fields__
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"


# Single-field constraints are in the types, so msgspec checks them and the OpenAPI document
# shows them; rules across fields and finiteness are checked in __post_init__ (RuleError).
Count = Annotated[int, Meta(ge=0)]


class DataSplit(msgspec.Struct, frozen=True, kw_only=True):
    """How the labeled examples were divided, so that each guarantee rests on unused data."""

    fit: Count  # examples the calibration map was fitted on
    conformal: Count  # examples the conformal quantile was computed on
    certify: Count  # examples the threshold was certified on
    seed: int
    # Of the fit examples, those labelled because a teach stream chose them (not a uniform
    # sample): they fit the map, and the split of the others sets the quantile and certifies.
    taught: Count = 0
    # How the uniform labels were allotted beside the taught ones (``calibration.limits.allot``):
    # "by_role", the taught labels fill the fit split first and the uniform rest set the
    # quantile and certify; "pattern" (profiles written before it), every uniform label's part
    # from the split's pattern of ten, the taught ones added to the fit split. The same split
    # where nothing was taught.
    allotment: Literal["by_role", "pattern"] = "pattern"

    def __post_init__(self) -> None:
        for field in ("fit", "conformal", "certify", "taught"):
            if getattr(self, field) < 0:
                raise RuleError(f"split.{field} must be >= 0, got {getattr(self, field)}")
        if self.taught > self.fit:
            raise RuleError(f"split.taught ({self.taught}) counts fit examples: at most {self.fit}")


class Baseline(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The scalar maps (temperature, or bias + temperature), fitted and certified on the same
    split as the profile's probe.

    What a profile whose map is a learned head would be without it, kept so that a report or
    an evaluation shows what the probe bought on the same items.
    """

    calibration_map: Identity | Temperature | BiasTemperature
    note: str
    conformal_quantile: Annotated[float, Meta(ge=0.0, le=1.0)]
    threshold: ThresholdResult
    metrics_after: MetricReport  # on the items neither map was fitted on
    # Its threshold per class, where the profile was certified per class.
    class_thresholds: list[ThresholdResult] | None = None

    def __post_init__(self) -> None:
        problems = _threshold_problems(self.threshold)
        if problems:
            raise RuleError("; ".join(f"baseline.{p}" for p in problems))


class CalibrationProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything needed to apply a calibration and gate on it, and to know when not to."""

    format_version: int
    name: Annotated[str, Meta(pattern=f"^{NAME_PATTERN}$")]
    # What it was fitted on: a profile applies only where the engine's fingerprint and the
    # choices match (the hidden-state shape only for a probe, see ``check``).
    fingerprint: Fingerprint
    choices: Annotated[list[str], Meta(min_length=2, extra_json_schema={"uniqueItems": True})]
    # The fitted map, from per-choice log-probabilities to calibrated probabilities.
    calibration_map: CalibrationMap
    cv_nll: dict[str, float]  # empty for a label-free profile: nothing to cross-validate
    note: str
    # The certified rule: accept when the calibrated confidence reaches threshold.threshold,
    # the choice mass reaches min_choice_mass and the conformal set holds one choice. A
    # label-free profile certifies nothing (threshold.reason says so) and has no conformal
    # quantile.
    threshold: ThresholdResult
    min_choice_mass: Annotated[float, Meta(ge=0.0, le=1.0)]
    conformal_alpha: Annotated[float, Meta(gt=0.0, lt=1.0)]
    conformal_quantile: Annotated[float, Meta(ge=0.0, le=1.0)] | None
    split: DataSplit
    # Evidence: before = raw probabilities of every example; after = calibrated probabilities
    # of the examples the map was not fitted on. None for a label-free profile (no labels).
    metrics_before: MetricReport | None
    metrics_after: MetricReport | None
    n_examples: Annotated[
        int, Meta(ge=1)
    ]  # labeled examples; for a label-free profile, the inputs averaged
    dataset: str
    dataset_sha256: str
    created_at: str
    # A score: the number each choice stands for (None: the numerals, if the choices are), and
    # the bound on the calibrated std above which a decision escalates (high_std).
    values: dict[str, float] | None = None
    max_std: Annotated[float, Meta(ge=0.0)] | None = None
    # The label-free prior correction in the map, if any: alone (a label-free profile) or
    # under a labeled temperature (method batch_temperature).
    label_free: LabelFree | None = None
    # Whether the calibrated judge beats the label prior on held-out examples; None for a
    # label-free profile and for profiles written before it existed.
    signal: SignalReport | None = None
    # For a probe: the scalar maps fitted on the same split, for comparison; None otherwise.
    baseline: Baseline | None = None
    # What live traffic is compared with to detect drift (``calibration.monitoring.health``): the
    # calibrated confidence and top choice of items the map was not fitted on. None for
    # profiles written before it existed.
    reference: Reference | None = None
    # A profile refitted from its decision log: its look in its lineage's sequence of
    # certifications (``calibration.certificates.recertify``), whose threshold.delta is the look's share.
    recertification: Recertification | None = None
    # The prompt it was fitted on, with the item left out (``calibration.template``): a profile
    # fitted on a task carries it, so that a request sends only the item. None: fitted on
    # whole prompts (POST /profiles/{name}/fit, ``fit_profile``), which a caller sends as they
    # were.
    template: PromptTemplate | None = None
    # A threshold certified per predicted class (``calibration.certificates.class_certify``), in the
    # choices' order, each at threshold.delta / k so that every class holds at once with
    # probability 1 - threshold.delta. Where present the profile serves it: a decision of
    # class c is accepted at class_thresholds[c].threshold (None: never), instead of the pooled
    # ``threshold``, which is kept for comparison. None: the pooled rule.
    class_thresholds: list[ThresholdResult] | None = None
    # Per class, on the examples the map was not fitted on, under the rule as served: precision,
    # recall and coverage of the accepted ones and the confusion matrices
    # (``calibration.certificates.per_class``). None for a label-free profile and older files.
    class_evidence: ClassReport | None = None
    # Low-rank adapters the probe's layer is read under (``judge.adapters``; trained on the fit
    # split's items only, ``calibration.tasks.adapter.training``): a request under this profile is judged with
    # them merged into the model's blocks, in the same one pass. None: the model as loaded.
    adapter: Adapter | None = None
    # About how many uniform labels a fit like this one would need to certify its target at
    # its delta (a refit's: its lineage's next look), read from its map as it judges new items
    # (``calibration.fitting.labels_needed``): what to do when it certifies nothing. None for
    # a label-free profile and older files.
    labels_needed: LabelsNeeded | None = None

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
        problems += self._probe_problems()
        problems += self._adapter_problems()
        t = self.threshold.threshold
        if t is not None and not 0 <= t <= 1:
            problems.append(f"threshold must be in [0, 1], got {t!r}")
        if not 0 <= self.min_choice_mass <= 1:
            problems.append(f"min_choice_mass must be in [0, 1], got {self.min_choice_mass!r}")
        q = self.conformal_quantile
        if not 0 < self.conformal_alpha < 1 or (q is not None and not 0 <= q <= 1):
            problems.append("conformal_alpha must be in (0, 1) and conformal_quantile in [0, 1]")
        if self.n_examples < 1:
            problems.append(f"n_examples must be positive, got {self.n_examples}")
        s = self.split
        if s.fit + s.conformal + s.certify > self.n_examples:
            problems.append(
                f"split counts {s.fit} + {s.conformal} + {s.certify} exceed n_examples "
                f"{self.n_examples}"
            )
        problems += _threshold_problems(self.threshold)
        if self.class_thresholds is not None:
            if len(self.class_thresholds) != len(self.choices):
                problems.append(
                    f"class_thresholds has {len(self.class_thresholds)} entries for "
                    f"{len(self.choices)} choices"
                )
            for c, result in enumerate(self.class_thresholds):
                problems += [f"class_thresholds[{c}].{p}" for p in _threshold_problems(result)]
        for method, value in self.cv_nll.items():
            if not (math.isfinite(value) and value >= 0):
                problems.append(f"cv_nll[{method!r}] must be a finite number >= 0, got {value!r}")
        for field in ("metrics_before", "metrics_after"):
            report = getattr(self, field)
            if report is None and self.label_free is None:
                problems.append(f"{field} is missing; only a label-free profile has none")
            if report is not None and report.n > self.n_examples:
                problems.append(f"{field}.n {report.n} exceeds n_examples {self.n_examples}")
        labeled = self.label_free is None or self.metrics_after is not None
        if self.conformal_quantile is None and (labeled or self.threshold.threshold is not None):
            problems.append("conformal_quantile is missing; only a label-free profile has none")
        problems += self._score_problems()
        if self.label_free is not None and len(self.label_free.prior) != len(self.choices):
            problems.append(
                f"label_free.prior has {len(self.label_free.prior)} entries for "
                f"{len(self.choices)} choices"
            )
        if self.reference is not None and len(self.reference.choice_counts) != len(self.choices):
            problems.append(
                f"reference.choice_counts has {len(self.reference.choice_counts)} entries for "
                f"{len(self.choices)} choices"
            )
        if self.signal is not None and len(self.signal.prior) != len(self.choices):
            problems.append(
                f"signal.prior has {len(self.signal.prior)} entries for {len(self.choices)} choices"
            )
        r = self.recertification
        if r is not None and not math.isclose(r.spent, self.threshold.delta, rel_tol=1e-9):
            problems.append(
                f"recertification.spent {r.spent!r} is not the threshold's delta "
                f"{self.threshold.delta!r}: a look is certified at its share of the delta"
            )
        if problems:
            raise RuleError("; ".join(problems))

    def _probe_problems(self) -> list[str]:
        probe = self.calibration_map
        if not isinstance(probe, Probe):
            return []
        problems = []
        if len(probe.intercept) != len(self.choices):
            problems.append(
                f"calibration_map.intercept has {len(probe.intercept)} entries for "
                f"{len(self.choices)} choices"
            )
        for field, recorded, fitted in (
            ("num_layers", self.fingerprint.num_layers, probe.num_layers),
            ("hidden_size", self.fingerprint.hidden_size, probe.feature_dim),
        ):
            if recorded is not None and recorded != fitted:
                problems.append(
                    f"fingerprint.{field} is {recorded} but the probe was fitted on {fitted}"
                )
        return problems

    def _adapter_problems(self) -> list[str]:
        adapter, probe = self.adapter, self.calibration_map
        if adapter is None:
            return []
        # Any map may read the adapted pass (a probe profile's baseline reads its logits), but a
        # probe reads a layer the adapted blocks feed.
        problems = adapter.problems()
        if isinstance(probe, Probe) and adapter.blocks and adapter.blocks[-1] >= min(probe.layers):
            problems.append(
                f"adapter.blocks {adapter.blocks!r} must lie below the probe's layer(s) "
                f"{probe.layers!r}: the head reads what the adapted blocks feed"
            )
        if self.fingerprint.model_sha256 not in (None, adapter.model_sha256):
            problems.append(
                "adapter.model_sha256 is not the fingerprint's model_sha256: the adapter was "
                "trained on other weights"
            )
        return problems

    @property
    def etag(self) -> str:
        """This profile's version: the ETag of the bytes it is stored as (``profile_bytes``),
        which a profile store (``service.profiles``) serves with it. Kept for the last few
        profiles read: a probe's profile encodes to megabytes, and a pipeline decides with
        one profile object many times."""
        hit = _ETAGS.get(id(self))
        if hit is not None and hit[0] is self:
            return hit[1]
        tag = etag_of(profile_bytes(self))
        _ETAGS[id(self)] = (self, tag)  # the profile is held, so its id is not reused
        while len(_ETAGS) > _ETAGS_KEPT:
            _ETAGS.pop(next(iter(_ETAGS)), None)
        return tag

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The hidden-state layers a judgment needs for this profile (a probe's), else ()."""
        return self.calibration_map.feature_layers

    @property
    def span_layers(self) -> tuple[int, ...]:
        """The layers whose means over the item a judgment needs for this profile (a probe's
        that reads them), else ()."""
        return self.calibration_map.span_layers

    def baseline_profile(self) -> CalibrationProfile | None:
        """This profile with its scalar baseline in place of the probe, to compare."""
        b = self.baseline
        if b is None:
            return None
        # A Baseline's fields are the profile's own, by name.
        return msgspec.structs.replace(self, **msgspec.structs.asdict(b), baseline=None)

    def _score_problems(self) -> list[str]:
        problems = []
        if self.values is not None:
            try:
                check_values(self.values, self.choices)
            except ValuesError as exc:
                problems.append(str(exc))
        if self.max_std is not None:
            try:
                check_max_std(self.max_std)
            except ValuesError as exc:
                problems.append(str(exc))
            if self.values is None and numeral_values(self.choices) is None:
                problems.append(
                    "max_std needs values: the choices are not all numerals and values is null"
                )
        return problems

    def check(self, fingerprint: Fingerprint, *, choices: Sequence[str] | None = None) -> None:
        """Raise ProfileMismatchError naming the first field that differs from ``fingerprint``.

        ``fingerprint`` is the engine's for the call's template (``judge.fingerprint(system=,
        response_prefix=, response_suffix=)``, with the request's overrides). The shape of
        the hidden states counts only for a probe, which reads them. Check once, before
        judging, not per item.
        """
        fitted, given = self._required(), self._relevant(fingerprint)
        field = fitted.first_difference(given)
        if field is not None:
            expected, actual = getattr(fitted, field), getattr(given, field)
            if field == "system_sha256":
                field, shown = "system", "a different system prompt"
            else:
                shown = repr(actual)
            raise ProfileMismatchError(
                field,
                f"profile {self.name!r} was fitted with {field} {expected!r}, not {shown}; "
                "fit a profile for this configuration or drop the profile",
            )
        if choices is not None and sorted(choices) != sorted(self.choices):
            raise ProfileMismatchError(
                "choices",
                f"profile {self.name!r} was fitted for choices {self.choices!r}, "
                f"not {list(choices)!r}; the same choices are needed (in any order)",
            )

    def _required(self) -> Fingerprint:
        """The fingerprint an engine must have: a probe's own shape, no shape for other maps."""
        probe = self.calibration_map
        if isinstance(probe, Probe):
            # A different model fails on "model" first, unless renamed; then the shape tells.
            return msgspec.structs.replace(
                self.fingerprint, num_layers=probe.num_layers, hidden_size=probe.feature_dim
            )
        return self._relevant(self.fingerprint)

    def _relevant(self, fingerprint: Fingerprint) -> Fingerprint:
        """``fingerprint`` without the hidden-state shape, unless this profile reads it."""
        if isinstance(self.calibration_map, Probe):
            return fingerprint
        return msgspec.structs.replace(fingerprint, num_layers=None, hidden_size=None)

    def calibrate(self, judgment: ScoredJudgment) -> dict[str, float]:
        """Calibrated probabilities of one judgment, keyed in the judgment's choice order.

        A probe reads the judgment's ``features`` (layer -> hidden state).
        """
        order = list(judgment.choices)
        if sorted(order) != sorted(self.choices):
            raise ProfileMismatchError(
                "choices", f"profile {self.name!r} calibrates {self.choices!r}, not {order!r}"
            )
        index = {c: j for j, c in enumerate(order)}
        z = np.asarray(judgment.log_probs, dtype=np.float64)  # (k,) in the judgment's order
        row = z[[index[c] for c in self.choices]]  # (k,) in the profile's order
        probe = self.calibration_map
        x = None
        if isinstance(probe, Probe):
            x = probe_row(judgment, probe.reads, probe.layers, probe.span, self.name)
        probs = self.calibration_map.apply(row, x)  # (k,) in the profile's order
        calibrated = dict(zip(self.choices, probs.tolist(), strict=True))
        return {c: calibrated[c] for c in order}


def _threshold_problems(t: ThresholdResult) -> list[str]:
    problems = []
    if not 0 <= t.coverage <= 1:
        problems.append(f"threshold.coverage must be in [0, 1], got {t.coverage!r}")
    if not 0 < t.target_precision < 1 or not 0 < t.delta < 1:
        problems.append("threshold.target_precision and threshold.delta must be in (0, 1)")
    if not 0 <= t.n_accepted <= t.n:
        problems.append(f"threshold.n_accepted must be in [0, n={t.n}], got {t.n_accepted}")
    for field in ("precision", "precision_lower_bound", "best_certified_precision", "start"):
        value = getattr(t, field)
        if value is not None and not 0 <= value <= 1:
            problems.append(f"threshold.{field} must be in [0, 1], got {value!r}")
    if t.feasible != (t.threshold is not None):
        problems.append("threshold.feasible must be true exactly when a threshold is given")
    return problems


_ETAGS_KEPT = 8
_ETAGS: dict[int, tuple[CalibrationProfile, str]] = {}  # id -> (profile, its ETag), oldest first


def profile_bytes(profile: CalibrationProfile) -> bytes:
    """The bytes a profile is stored as, indented JSON: ``save_profile`` and a profile store
    write these, so its ETag (``CalibrationProfile.etag``) is the same wherever it is kept."""
    return msgspec.json.format(msgspec.json.encode(profile), indent=2)


def etag_of(data: bytes) -> str:
    """A strong ETag for these bytes, their quoted sha256: the same on every replica and host
    that stores them."""
    return f'"{hashlib.sha256(data).hexdigest()}"'


def certified_coverage(profile: CalibrationProfile) -> float:
    """The coverage ``profile`` certified at its target; 0 where it certified none."""
    t = profile.threshold
    return t.coverage if t.threshold is not None else 0.0


def save_profile(profile: CalibrationProfile, path: str | os.PathLike[str]) -> Path:
    """Write ``profile`` as JSON at ``path`` atomically (``profile_bytes``)."""
    return atomicio.write_bytes(path, profile_bytes(profile))


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


class _Version(msgspec.Struct):
    format_version: Any = None


def decode_profile(data: bytes | str, *, source: str = "profile") -> CalibrationProfile:
    """Validate JSON as a profile (for uploads as much as for files).

    A format-2 profile (the fingerprint's fields at the top level) is read as format 3.
    """
    try:
        return msgspec.json.decode(current_format(data), type=CalibrationProfile)
    except (msgspec.ValidationError, msgspec.DecodeError, RuleError) as exc:
        raise ProfileError(f"{source} is not a valid calibration profile: {exc}") from exc


def current_format(data: bytes | str) -> bytes:
    """A profile's JSON in this format: a format-2 profile is rewritten as format 3; anything
    else (this format, or not a profile at all) is returned as it is, for the decoder to judge.
    One place for files and uploads alike."""
    data = data.encode() if isinstance(data, str) else data
    try:
        if msgspec.json.decode(data, type=_Version).format_version == 2:
            old = msgspec.json.decode(data)
            # Format 2 kept the fingerprint's fields at the top level; a body that says 2 but
            # nests a fingerprint is not one, and is left for the version check to refuse
            # (rebuilding its fingerprint from absent fields named the wrong problem).
            if isinstance(old, dict) and "fingerprint" not in old:
                return msgspec.json.encode(_nest_fingerprint(old))
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    return data


def _nest_fingerprint(old: dict[str, Any]) -> dict[str, Any]:
    """A format-2 profile as format 3: its fingerprint fields gathered into one object."""
    fingerprint = {f: old[f] for f in _FLAT_FINGERPRINT if f in old}
    rest = {k: v for k, v in old.items() if k not in fingerprint}
    return {**rest, "format_version": FORMAT_VERSION, "fingerprint": fingerprint}
