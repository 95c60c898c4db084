"""Calibration of choice probabilities: fitted scaling, honest metrics, routing thresholds.

Works on arrays of per-choice log-scores and labels; depends on neither the engine nor the
service (no torch).
"""

from calibration.errors import (
    CalibrationError,
    ProfileError,
    ProfileMismatchError,
    ProfileNotFoundError,
)
from calibration.fitting import ProfileEvaluation, evaluate_profile, fit_profile
from calibration.metrics import Interval, MetricReport, evaluate
from calibration.profile import CalibrationProfile, decode_profile, load_profile, save_profile
from calibration.routing import ThresholdResult, route, select_threshold
from calibration.scaling import (
    BiasTemperatureScaler,
    CalibrationFit,
    TemperatureScaler,
    apply_calibration,
    fit_calibrator,
)

__all__ = [
    "BiasTemperatureScaler",
    "CalibrationError",
    "CalibrationFit",
    "CalibrationProfile",
    "Interval",
    "MetricReport",
    "ProfileError",
    "ProfileEvaluation",
    "ProfileMismatchError",
    "ProfileNotFoundError",
    "TemperatureScaler",
    "ThresholdResult",
    "apply_calibration",
    "decode_profile",
    "evaluate",
    "evaluate_profile",
    "fit_calibrator",
    "fit_profile",
    "load_profile",
    "route",
    "save_profile",
    "select_threshold",
]
