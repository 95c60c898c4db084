"""Calibration of choice probabilities, and the gate that turns a judgment into a decision.

Works on per-choice log-probabilities and labels; depends on neither the engine nor the
service (no torch). A pipeline reads::

    gate = Gate(load_profile("profiles/sms_spam.json"))
    verdict = gate.judge(judge, text)   # checks the profile, reads a probe's layers, decides
    if verdict.accepted: ...            # else verdict.reasons says why it escalated

The names below load on first use (PEP 562), so that ``import calibration.profile`` (the wire
types the client decodes) loads neither scipy nor scikit-learn: only fitting does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from judge.lazy import exports

if TYPE_CHECKING:
    from calibration.cascade import (
        Cascade,
        CascadeVerdict,
        StageResult,
    )
    from calibration.certificates.certify import (
        ThresholdResult,
        select_threshold,
    )
    from calibration.certificates.signal import (
        SignalReport,
        signal_report,
    )
    from calibration.errors import (
        CalibrationError,
        FitError,
        NoCertificateError,
        ProfileError,
        ProfileMismatchError,
        ProfileNotFoundError,
        RuleError,
        ValuesError,
    )
    from calibration.fit_data import (
        LabeledScores,
        Provenance,
    )
    from calibration.fit_settings import (
        FitSettings,
    )
    from calibration.fitting import (
        FittedProfile,
        PolicyEvaluation,
        TrainedHead,
        evaluate_policy,
        fit_label_free_profile,
        fit_profile,
        fit_rule,
    )
    from calibration.gate import (
        Gate,
        Overrides,
    )
    from calibration.limits import (
        MIN_EXAMPLES,
    )
    from calibration.maps.label_free import (
        CONTENT_FREE_INPUTS,
        LabelFree,
        estimate_prior,
        prior_correction,
    )
    from calibration.maps.probe import (
        MIN_PROBE_EXAMPLES,
        candidate_layers,
    )
    from calibration.maps.scaling import (
        BatchTemperatureScaler,
        BiasTemperature,
        BiasTemperatureScaler,
        CalibrationFit,
        CalibrationMap,
        Identity,
        Probe,
        ProbeInputs,
        Temperature,
        TemperatureScaler,
        fit_calibrator,
    )
    from calibration.metrics import (
        Interval,
        MetricReport,
        evaluate,
    )
    from calibration.policy import (
        REASON_CODES,
        Policy,
        PolicyDefaults,
        ReasonCode,
        ScoredJudgment,
        Verdict,
        make_policy,
    )
    from calibration.profile import (
        Baseline,
        CalibrationProfile,
        DataSplit,
        decode_profile,
        load_profile,
        save_profile,
    )
    from calibration.scores import (
        numeral_values,
        value_moments,
    )

# name -> the module that defines it
_EXPORTS = {
    "Baseline": "calibration.profile",
    "BatchTemperatureScaler": "calibration.maps.scaling",
    "BiasTemperature": "calibration.maps.scaling",
    "BiasTemperatureScaler": "calibration.maps.scaling",
    "CONTENT_FREE_INPUTS": "calibration.maps.label_free",
    "CalibrationError": "calibration.errors",
    "CalibrationFit": "calibration.maps.scaling",
    "CalibrationMap": "calibration.maps.scaling",
    "CalibrationProfile": "calibration.profile",
    "Cascade": "calibration.cascade",
    "CascadeVerdict": "calibration.cascade",
    "DataSplit": "calibration.profile",
    "FitError": "calibration.errors",
    "FitSettings": "calibration.fit_settings",
    "FittedProfile": "calibration.fitting",
    "Gate": "calibration.gate",
    "Identity": "calibration.maps.scaling",
    "Interval": "calibration.metrics",
    "LabelFree": "calibration.maps.label_free",
    "LabeledScores": "calibration.fit_data",
    "MIN_EXAMPLES": "calibration.limits",
    "MIN_PROBE_EXAMPLES": "calibration.maps.probe",
    "MetricReport": "calibration.metrics",
    "Overrides": "calibration.gate",
    "Policy": "calibration.policy",
    "PolicyDefaults": "calibration.policy",
    "PolicyEvaluation": "calibration.fitting",
    "Probe": "calibration.maps.scaling",
    "ProbeInputs": "calibration.maps.scaling",
    "ProfileError": "calibration.errors",
    "ProfileMismatchError": "calibration.errors",
    "NoCertificateError": "calibration.errors",
    "ProfileNotFoundError": "calibration.errors",
    "Provenance": "calibration.fit_data",
    "REASON_CODES": "calibration.policy",
    "ReasonCode": "calibration.policy",
    "RuleError": "calibration.errors",
    "ScoredJudgment": "calibration.policy",
    "Verdict": "calibration.policy",
    "SignalReport": "calibration.certificates.signal",
    "StageResult": "calibration.cascade",
    "Temperature": "calibration.maps.scaling",
    "TemperatureScaler": "calibration.maps.scaling",
    "ThresholdResult": "calibration.certificates.certify",
    "TrainedHead": "calibration.fitting",
    "ValuesError": "calibration.errors",
    "candidate_layers": "calibration.maps.probe",
    "decode_profile": "calibration.profile",
    "estimate_prior": "calibration.maps.label_free",
    "evaluate": "calibration.metrics",
    "evaluate_policy": "calibration.fitting",
    "fit_calibrator": "calibration.maps.scaling",
    "fit_label_free_profile": "calibration.fitting",
    "fit_profile": "calibration.fitting",
    "fit_rule": "calibration.fitting",
    "load_profile": "calibration.profile",
    "make_policy": "calibration.policy",
    "numeral_values": "calibration.scores",
    "prior_correction": "calibration.maps.label_free",
    "save_profile": "calibration.profile",
    "select_threshold": "calibration.certificates.certify",
    "signal_report": "calibration.certificates.signal",
    "value_moments": "calibration.scores",
}

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
    "Cascade",
    "CascadeVerdict",
    "DataSplit",
    "FitError",
    "FitSettings",
    "FittedProfile",
    "Gate",
    "Identity",
    "Interval",
    "LabelFree",
    "LabeledScores",
    "MetricReport",
    "NoCertificateError",
    "Overrides",
    "Policy",
    "PolicyDefaults",
    "PolicyEvaluation",
    "Probe",
    "ProbeInputs",
    "ProfileError",
    "ProfileMismatchError",
    "ProfileNotFoundError",
    "Provenance",
    "ReasonCode",
    "RuleError",
    "ScoredJudgment",
    "SignalReport",
    "StageResult",
    "Temperature",
    "TemperatureScaler",
    "ThresholdResult",
    "TrainedHead",
    "ValuesError",
    "Verdict",
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


__getattr__, __dir__ = exports(__name__, _EXPORTS)
