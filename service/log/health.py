"""Is a profile still keeping its promise? Its health, from the decision log.

A profile certifies that the decisions it accepts are right at least ``target_precision`` of
the time, on traffic like its calibration data. Three things can break that in production, and
each is one check here (the statistics are ``calibration.monitoring.health``'s):

* **precision**: the audited decisions it accepted under its certified rule (``audit``:
  a uniform random share of all traffic, see ``calibration.Policy.audit_rate``), labeled by
  people (``POST /judgments/{id}/label``), in the order their labels arrived: the labels
  contradict the certificate once a bet against it has grown 1/``alpha_precision``-fold (a
  false alarm at most ``alpha_precision`` over the whole stream while the certificate holds,
  however often this runs);
* **drift**: the newest ``window`` decisions of the profile's current version against its
  reference (``CalibrationProfile.reference``, held-out calibration items): their calibrated
  confidence (Kolmogorov-Smirnov) and top choice (chi-square), no labels needed, a false
  alarm at most ``alpha_drift`` of the time per check when nothing changed;
* **prior**: the mix of the version's answers, in the order decided, against the reference's
  (``calibration.monitoring.label_shift.mix_shift``, a sequential test: a false alarm at most
  ``alpha_prior`` over the whole stream), and the live class prior estimated by EM from the
  calibrated probabilities of the newest ``window`` decisions made before any hold;
* **model**: the weights that made the logged decisions, and the server's (or ``judge
  check --model``'s), against the profile's fingerprint.

Decisions count for the profile's current version only (its ETag): a refit starts afresh.
``assess`` is the one place the three are put together; ``GET /profiles/{name}/health``,
``/metrics`` and ``judge check`` all call it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Literal

import msgspec
import numpy as np

from calibration.certificates.recertify import LabelsNeeded, labels_to_certify, next_look_delta
from calibration.limits import labels_wanted
from calibration.monitoring.health import (
    DriftTest,
    PrecisionCheck,
    ShareEstimate,
    audited_precision,
    drift_test,
    prediction_powered_shares,
)
from calibration.monitoring.label_shift import (
    MixShift,
    PriorEstimate,
    mix_shift,
    prior_estimate,
    source_prior,
)
from calibration.profile import CalibrationProfile
from service.log.decision_log import DecisionLog
from service.log.record import LoggedDecision

__all__ = [
    "DEFAULT_WINDOW",
    "ModelCheck",
    "ProfileHealth",
    "answers_mix",
    "assess",
    "labelled_precision",
    "live_prior",
    "probabilities_of",
    "profile_health",
    "traffic_shares",
]

DEFAULT_WINDOW = 1000  # the newest decisions the drift test reads
Alarm = Literal["precision", "drift", "prior", "model"]


class ModelCheck(msgspec.Struct, frozen=True, kw_only=True):
    """The weights behind the decisions against the profile's fingerprint."""

    profile_model_sha256: str | None  # the fingerprint's; None: the loader could not hash them
    logged_model_sha256: list[str]  # the distinct weights of the logged decisions
    current_model_sha256: str | None  # the server's (or --model's); None: not known here
    matches: bool
    reason: str


class ProfileHealth(msgspec.Struct, frozen=True, kw_only=True):
    """One profile version's health: each check, and the alarms that fired."""

    profile: str
    profile_etag: str
    checked_at: str  # ISO 8601, UTC
    n_decisions: int  # logged decisions of this version (within the log's retention)
    n_window: int  # of them, the newest the drift test read (at most ``window``)
    n_audited: int  # decisions marked audit
    n_audited_labeled: int  # of them, labeled
    precision: PrecisionCheck | None  # None: the profile certifies no threshold
    drift: DriftTest | None  # None: the profile keeps no reference (fitted before it did)
    shares: ShareEstimate | None  # each choice's share of the traffic; None: too few labels
    # The answers' mix against the reference's (None: no reference, or no decision yet), and
    # the live class prior (None: the reference kept no labels, or too few decisions).
    mix: MixShift | None = None
    prior: PriorEstimate | None = None
    model: ModelCheck
    # About how many labeled audit decisions would open the gate at the target, at the
    # precision and acceptance the labeled ones show; None: none are labeled yet.
    labels: LabelsNeeded | None
    alarms: list[Alarm]
    healthy: bool
    notes: list[str]


def profile_health(
    log: DecisionLog,
    profile: CalibrationProfile,
    etag: str,
    *,
    window: int = DEFAULT_WINDOW,
    alpha_drift: float = 0.01,
    alpha_precision: float = 0.05,
    alpha_prior: float = 0.01,
    current_model_sha256: str | None = None,
    since: float | None = None,
) -> ProfileHealth:
    """``assess`` on the log's decisions of ``profile`` at version ``etag``."""
    records = log.decisions(profile=profile.name, profile_etag=etag, since=since)
    return assess(
        profile,
        etag,
        records,
        window=window,
        alpha_drift=alpha_drift,
        alpha_precision=alpha_precision,
        alpha_prior=alpha_prior,
        current_model_sha256=current_model_sha256,
    )


def labelled_precision(
    profile: CalibrationProfile, labeled: Sequence[LoggedDecision], *, alpha: float
) -> PrecisionCheck | None:
    """The sequential precision check on the audited, labelled decisions ``labeled``; None
    where the profile certifies no threshold. The certificate is about the certified rule:
    decisions made under an override (a request's own threshold) carry no guarantee and are
    left out; the rest are taken in the order their labels arrived (the test bets one label
    at a time)."""
    if profile.threshold.threshold is None:
        return None
    graded = sorted(
        (r for r in labeled if r.decision == "accept" and r.certified),
        key=lambda r: (r.labeled_at or 0.0, r.created_at),
    )
    correct = np.array([r.label == r.choice for r in graded], dtype=bool)
    return audited_precision(correct, target=profile.threshold.target_precision, alpha=alpha)


def traffic_shares(
    profile: CalibrationProfile,
    labeled: Sequence[LoggedDecision],
    unlabeled: Sequence[LoggedDecision],
    *,
    alpha: float,
) -> ShareEstimate | None:
    """Each choice's share of the traffic from the audited, labelled decisions and the rest
    (``prediction_powered_shares``); None with fewer than 2 on either side."""
    if len(labeled) < 2 or len(unlabeled) < 2:
        return None
    index = {c: j for j, c in enumerate(profile.choices)}
    return prediction_powered_shares(
        profile.choices,
        probabilities_of(unlabeled, profile.choices),
        probabilities_of(labeled, profile.choices),
        np.array([index[r.label] for r in labeled if r.label is not None], dtype=np.int64),
        alpha=alpha,
    )


def answers_mix(
    profile: CalibrationProfile, records: Sequence[LoggedDecision], *, alpha: float = 0.01
) -> MixShift | None:
    """The answers' mix of a version's decisions (``records``, oldest first) against the
    profile's reference (``mix_shift``); None where it keeps no reference or there is no
    decision."""
    if profile.reference is None or not records:
        return None
    index = {c: j for j, c in enumerate(profile.choices)}
    answers = np.array([index[r.choice] for r in records])
    return mix_shift(profile.reference, answers, alpha=alpha, choices=profile.choices)


def live_prior(
    profile: CalibrationProfile,
    records: Sequence[LoggedDecision],
    *,
    alpha: float = 0.01,
    window: int = DEFAULT_WINDOW,
) -> PriorEstimate | None:
    """The live class prior from the newest ``window`` decisions made before any hold (later
    ones may carry probabilities moved to a prior already); None where the profile's
    reference kept no labels, or fewer than 2 such decisions."""
    source = None if profile.reference is None else source_prior(profile.reference)
    before = [r for r in records if "prior_shift" not in r.reason_codes][-window:]
    if source is None or len(before) < 2:
        return None
    probabilities = probabilities_of(before, profile.choices)
    assert profile.reference is not None  # the source is the reference's
    return prior_estimate(
        list(profile.choices),
        probabilities,
        source,
        source_n=profile.reference.n,
        alpha=alpha,
    )


def assess(
    profile: CalibrationProfile,
    etag: str,
    records: Sequence[LoggedDecision],
    *,
    window: int = DEFAULT_WINDOW,
    alpha_drift: float = 0.01,
    alpha_precision: float = 0.05,
    alpha_prior: float = 0.01,
    current_model_sha256: str | None = None,
) -> ProfileHealth:
    """The health of ``profile`` (version ``etag``) from its logged decisions, oldest first."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    records = [r for r in records if r.profile == profile.name and r.profile_etag == etag]
    notes: list[str] = []
    index = {c: j for j, c in enumerate(profile.choices)}
    audited = [r for r in records if r.audit]
    labeled = [r for r in audited if r.label is not None]

    precision = labelled_precision(profile, labeled, alpha=alpha_precision)
    if precision is None:
        notes.append("the profile certifies no threshold: there is no precision to check")

    newest = records[-window:]
    drift = None
    if profile.reference is None:
        notes.append(
            "the profile keeps no reference sample (fitted before profiles kept one): refit "
            "it to test for drift"
        )
    else:
        confidence = np.array([r.confidence for r in newest], dtype=np.float64)
        choice = np.array([index[r.choice] for r in newest], dtype=np.int64)
        drift = drift_test(profile.reference, confidence, choice, alpha=alpha_drift)

    # Every decision of the version, not the window: the shares' confidence sequences hold
    # as the version's samples grow, however often they are recomputed.
    unlabeled = [r for r in records if r.label is None or not r.audit]
    shares = traffic_shares(profile, labeled, unlabeled, alpha=alpha_precision)
    if len(labeled) < 2:
        notes.append("fewer than 2 audited decisions are labeled: no estimate of the shares")
    elif shares is None:
        notes.append(
            "no estimate of the shares: fewer than 2 decisions read are not audited and "
            "labeled, too few to estimate them for"
        )

    mix = answers_mix(profile, records, alpha=alpha_prior)
    prior = live_prior(profile, records, alpha=alpha_prior, window=window)
    taught = sum(r.label is not None and not r.audit for r in records)
    labels = _labels_needed(profile, labeled, taught)
    if labels is None:
        notes.append("no audited decision is labeled: no estimate of the labels the gate needs")
    model = _model_check(profile, records, current_model_sha256)
    alarms: list[Alarm] = []
    if precision is not None and precision.contradicts:
        alarms.append("precision")
    if drift is not None and drift.drifted:
        alarms.append("drift")
    if mix is not None and mix.shifted:
        alarms.append("prior")
    if not model.matches:
        alarms.append("model")
    return ProfileHealth(
        profile=profile.name,
        profile_etag=etag,
        checked_at=datetime.now(UTC).isoformat(timespec="seconds"),
        n_decisions=len(records),
        n_window=len(newest),
        n_audited=len(audited),
        n_audited_labeled=len(labeled),
        precision=precision,
        drift=drift,
        shares=shares,
        mix=mix,
        prior=prior,
        model=model,
        labels=labels,
        alarms=alarms,
        healthy=not alarms,
        notes=notes,
    )


# Reasons that are the threshold's own: a decision escalated for them alone passed every other
# gate, so it counts with its confidence (any other reason: confidence 0, as a fit counts it).
_THRESHOLD_REASONS = {"below_threshold", "no_certified_threshold"}


def _labels_needed(
    profile: CalibrationProfile, labeled: Sequence[LoggedDecision], taught: int
) -> LabelsNeeded | None:
    """``labels_to_certify`` on the labeled audit decisions, for the next refit from the log:
    its look's delta (``calibration.certificates.recertify``) and the audit labels that give
    its split the certify items, beside the ``taught`` labels (labelled, not audited) that
    fit it (``calibration.limits.allot``)."""
    if not labeled:
        return None
    confidence = np.array(
        [0.0 if set(r.reason_codes) - _THRESHOLD_REASONS else r.confidence for r in labeled]
    )
    correct = np.array([r.label == r.choice for r in labeled], dtype=bool)
    delta = next_look_delta(profile.recertification, profile.threshold.delta)
    probe = profile.calibration_map.method == "probe" or any(x.features for x in labeled)
    return labels_to_certify(
        confidence,
        correct,
        target_precision=profile.threshold.target_precision,
        delta=delta,
        **labels_wanted(taught, probe),
    )


def probabilities_of(records: Sequence[LoggedDecision], choices: Sequence[str]) -> np.ndarray:
    """(n, k) calibrated probabilities of ``records``, columns in ``choices`` order."""
    return np.array(
        [[r.probabilities[c] for c in choices] for r in records], dtype=np.float64
    ).reshape(len(records), len(choices))


def _model_check(
    profile: CalibrationProfile,
    records: Sequence[LoggedDecision],
    current: str | None,
) -> ModelCheck:
    expected = profile.fingerprint.model_sha256
    logged = sorted({r.model_sha256 for r in records if r.model_sha256})
    problems = []
    if expected is None:
        reason = "the profile's fingerprint holds no hash of the weights: nothing to compare"
    else:
        other = [sha for sha in logged if sha != expected]
        if other:
            problems.append(
                f"{len(other)} other weights made logged decisions ({', '.join(s[:12] for s in other)})"
            )
        if current is not None and current != expected:
            problems.append(f"the model now loaded has weights {current[:12]}")
        reason = (
            f"the profile was fitted on weights {expected[:12]}; " + "; ".join(problems)
            if problems
            else f"every decision and the model now loaded match the weights {expected[:12]}"
        )
    return ModelCheck(
        profile_model_sha256=expected,
        logged_model_sha256=logged,
        current_model_sha256=current,
        matches=not problems,
        reason=reason,
    )
