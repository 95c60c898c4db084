"""Calibration of choice probabilities, and the gate that turns a judgment into a decision.

Works on per-choice log-probabilities and labels; depends on neither the engine nor the
service (no torch). A pipeline reads::

    profile = load_profile("profiles/sms_spam.json")
    profile.check(judge)                      # once: model, weights, dtype, template, system
    judgment = judge.judge(text, choices=profile.choices, feature_layers=profile.feature_layers)
    decision = profile.decide(judgment)       # a probe reads the hidden state of its layers
    if decision.accepted: ...                 # else decision.reasons says why it escalated
"""

from calibration.errors import (
    CalibrationError,
    FitError,
    ProfileError,
    ProfileMismatchError,
    ProfileNotFoundError,
    RuleError,
    ValuesError,
)
from calibration.fitting import (
    MIN_EXAMPLES,
    PolicyEvaluation,
    evaluate_policy,
    fit_label_free_profile,
    fit_profile,
    fit_rule,
)
from calibration.label_free import CONTENT_FREE_INPUTS, LabelFree, estimate_prior, prior_correction
from calibration.metrics import Interval, MetricReport, evaluate
from calibration.policy import (
    REASON_CODES,
    Decision,
    Policy,
    PolicyDefaults,
    ReasonCode,
    ScoredJudgment,
    make_policy,
)
from calibration.probe import MIN_PROBE_EXAMPLES, candidate_layers
from calibration.profile import (
    Baseline,
    CalibrationProfile,
    DataSplit,
    decode_profile,
    load_profile,
    save_profile,
)
from calibration.routing import ThresholdResult, select_threshold
from calibration.scaling import (
    BatchTemperatureScaler,
    BiasTemperature,
    BiasTemperatureScaler,
    CalibrationFit,
    CalibrationMap,
    Identity,
    Probe,
    Temperature,
    TemperatureScaler,
    fit_calibrator,
)
from calibration.scores import numeral_values, value_moments
from calibration.signal import SignalReport, signal_report

__all__ = [
    "CONTENT_FREE_INPUTS",
    "MIN_EXAMPLES",
    "MIN_PROBE_EXAMPLES",
    "REASON_CODES",
    "Baseline",
    "BatchTemperatureScaler",
    "BiasTemperature",
    "BiasTemperatureScaler",
    "CalibrationError",
    "CalibrationFit",
    "CalibrationMap",
    "CalibrationProfile",
    "DataSplit",
    "Decision",
    "FitError",
    "Identity",
    "Interval",
    "LabelFree",
    "MetricReport",
    "Policy",
    "PolicyDefaults",
    "PolicyEvaluation",
    "Probe",
    "ProfileError",
    "ProfileMismatchError",
    "ProfileNotFoundError",
    "ReasonCode",
    "RuleError",
    "ScoredJudgment",
    "SignalReport",
    "Temperature",
    "TemperatureScaler",
    "ThresholdResult",
    "ValuesError",
    "candidate_layers",
    "decode_profile",
    "estimate_prior",
    "evaluate",
    "evaluate_policy",
    "fit_calibrator",
    "fit_label_free_profile",
    "fit_profile",
    "fit_rule",
    "load_profile",
    "make_policy",
    "numeral_values",
    "prior_correction",
    "save_profile",
    "select_threshold",
    "signal_report",
    "value_moments",
]
