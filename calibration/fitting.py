"""From labeled logits to a profile, and a profile's report card on held-out data.

The fitted map, the routing threshold and the conformal quantile all come from the
calibration split. The "after" metrics stored in a profile are out-of-fold: each item is
calibrated by a map fitted without it, so they are not flattered by fitting and scoring on
the same items. ``evaluate_profile`` then measures everything on a split the profile never saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import msgspec
import numpy as np
from numpy.typing import ArrayLike
from sklearn.model_selection import KFold

from calibration.conformal import conformal_quantile, prediction_set
from calibration.metrics import MetricReport, evaluate
from calibration.profile import FORMAT_VERSION, CalibrationProfile, sha256_text
from calibration.routing import select_threshold
from calibration.scaling import apply_calibration, fit_calibrator, softmax

__all__ = ["ProfileEvaluation", "evaluate_profile", "fit_profile", "out_of_fold_probabilities"]


def _check(
    logits: ArrayLike, y: ArrayLike, choices: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    z = np.asarray(logits, dtype=np.float64)
    labels = np.asarray(y)
    if z.ndim != 2 or z.shape[1] != len(choices):
        raise ValueError(f"logits must have shape (n, {len(choices)}), got {z.shape}")
    if labels.shape != (z.shape[0],):
        raise ValueError(f"y must have shape ({z.shape[0]},), got {labels.shape}")
    if z.shape[0] < 10:
        raise ValueError(f"need at least 10 labeled examples to calibrate, got {z.shape[0]}")
    return z, labels.astype(np.int64)


def out_of_fold_probabilities(
    logits: np.ndarray, y: np.ndarray, method: str, *, folds: int = 5, seed: int = 0
) -> np.ndarray:
    """(n, k) probabilities where each row's map was fitted on the other folds."""
    if method == "none":
        return softmax(logits)
    out = np.empty_like(logits)
    splitter = KFold(n_splits=min(folds, len(y)), shuffle=True, random_state=seed)
    for train, held in splitter.split(logits):
        fit = fit_calibrator(logits[train], y[train], methods=(method,))
        out[held] = apply_calibration(logits[held], fit.method, fit.temperature, fit.bias)
    return out


def fit_profile(
    name: str,
    logits: ArrayLike,
    y: ArrayLike,
    choices: Sequence[str],
    *,
    model: str,
    model_sha256: str | None,
    dtype: str,
    response_prefix: str,
    response_suffix: str,
    system: str | None,
    dataset: str,
    dataset_sha256: str,
    target_precision: float = 0.9,
    delta: float = 0.1,
    alpha: float = 0.1,
    seed: int = 0,
) -> CalibrationProfile:
    """Fit a calibration profile on (n, k) per-choice ``logits`` and labels ``y`` (indices)."""
    z, labels = _check(logits, y, choices)
    fit = fit_calibrator(z, labels, random_state=seed)
    calibrated = apply_calibration(z, fit.method, fit.temperature, fit.bias)
    threshold = select_threshold(
        calibrated.max(axis=1),
        calibrated.argmax(axis=1) == labels,
        target_precision=target_precision,
        delta=delta,
    )
    return CalibrationProfile(
        format_version=FORMAT_VERSION,
        name=name,
        model=model,
        model_sha256=model_sha256,
        dtype=dtype,
        response_prefix=response_prefix,
        response_suffix=response_suffix,
        system_sha256=sha256_text(system),
        choices=list(choices),
        method=fit.method,
        temperature=fit.temperature,
        bias=fit.bias,
        cv_nll=fit.cv_nll,
        note=fit.note,
        threshold=threshold,
        conformal_alpha=alpha,
        conformal_quantile=conformal_quantile(calibrated, labels, alpha),
        metrics_before=evaluate(softmax(z), labels, seed=seed),
        metrics_after=evaluate(
            out_of_fold_probabilities(z, labels, fit.method, seed=seed), labels, seed=seed
        ),
        n_examples=len(labels),
        dataset=dataset,
        dataset_sha256=dataset_sha256,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )


class ProfileEvaluation(msgspec.Struct, frozen=True, kw_only=True):
    """How a profile does on labeled data it was not fitted on."""

    profile: str
    n: int
    before: MetricReport
    after: MetricReport
    threshold: float | None
    target_precision: float
    coverage: float  # fraction of items accepted at the threshold
    precision: float | None  # accuracy among accepted items
    n_accepted: int
    conformal_alpha: float
    conformal_coverage: float  # fraction of items whose prediction set holds the label
    mean_set_size: float
    singleton_rate: float  # fraction of sets with exactly one choice


def evaluate_profile(
    profile: CalibrationProfile, logits: ArrayLike, y: ArrayLike
) -> ProfileEvaluation:
    """Metrics before and after calibration, and routing results, on held-out data.

    ``logits`` columns follow ``profile.choices``.
    """
    z, labels = _check(logits, y, profile.choices)
    calibrated = apply_calibration(z, profile.method, profile.temperature, profile.bias)
    confidence = calibrated.max(axis=1)
    correct = calibrated.argmax(axis=1) == labels
    t = profile.threshold.threshold
    accepted = confidence >= t if t is not None else np.zeros(len(labels), dtype=bool)
    sets = [prediction_set(row, profile.conformal_quantile) for row in calibrated]
    return ProfileEvaluation(
        profile=profile.name,
        n=len(labels),
        before=evaluate(softmax(z), labels),
        after=evaluate(calibrated, labels),
        threshold=t,
        target_precision=profile.threshold.target_precision,
        coverage=float(accepted.mean()),
        precision=float(correct[accepted].mean()) if accepted.any() else None,
        n_accepted=int(accepted.sum()),
        conformal_alpha=profile.conformal_alpha,
        conformal_coverage=float(
            np.mean([int(y_) in s for y_, s in zip(labels, sets, strict=True)])
        ),
        mean_set_size=float(np.mean([len(s) for s in sets])),
        singleton_rate=float(np.mean([len(s) == 1 for s in sets])),
    )
