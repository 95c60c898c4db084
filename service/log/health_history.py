"""A profile version's health over time, for a chart: at evenly spaced points of its decision
stream, what the monitor said then (``GET /profiles/{name}/health/history``, the playground's
Traffic panel).

Each point reads the decisions up to it and the labels given by then: each choice's share
(``prediction_powered_shares``: its confidence sequence holds at every point at once, which is
what makes a line of intervals honest to read), the live class prior EM estimates from them
(a point estimate: the interval is ``/health``'s), and which alarms had fired (the precision
bet on the labels given by then, the mix test on the decisions so far; both sequential, so a
point's alarm is what a check at that moment would have said).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from calibration.monitoring.health import ShareEstimate
from calibration.monitoring.label_shift import em_prior, source_prior
from calibration.profile import CalibrationProfile
from service.log.health import (
    answers_mix,
    labelled_precision,
    probabilities_of,
    traffic_shares,
)
from service.log.record import LoggedDecision

__all__ = ["MAX_POINTS", "HealthHistory", "HealthPoint", "health_history"]

MAX_POINTS = 50


class HealthPoint(msgspec.Struct, frozen=True, kw_only=True):
    """The monitor's view after the first ``n_decisions`` decisions of the version."""

    n_decisions: int
    at: float  # the last of them's time (unix seconds)
    n_labeled: int  # audited decisions among them labelled by then (the last point: by now)
    shares: ShareEstimate | None  # None: fewer than 2 labelled, or nothing left unlabelled
    prior: list[float] | None  # EM's live prior; None: the reference keeps no prior
    alarms: list[str]  # "precision", "prior": fired by then


class HealthHistory(msgspec.Struct, frozen=True, kw_only=True):
    profile: str
    profile_etag: str
    choices: list[str]
    source_prior: list[float] | None  # what the certificate's mix was (the reference's)
    points: list[HealthPoint]


def health_history(
    profile: CalibrationProfile,
    etag: str,
    records: Sequence[LoggedDecision],
    *,
    points: int = 20,
    alpha_precision: float = 0.05,
    alpha_prior: float = 0.01,
) -> HealthHistory:
    """``points`` (at most ``MAX_POINTS``) views of version ``etag``'s decisions (``records``,
    oldest first)."""
    if not 1 <= points <= MAX_POINTS:
        raise ValueError(f"points must be in [1, {MAX_POINTS}], got {points}")
    records = [r for r in records if r.profile == profile.name and r.profile_etag == etag]
    choices = list(profile.choices)
    source = None if profile.reference is None else source_prior(profile.reference)
    mix = answers_mix(profile, records, alpha=alpha_prior)
    ends = sorted({round(len(records) * (i + 1) / points) for i in range(points)} - {0})
    out = []
    for end in ends:
        seen, at = records[:end], records[end - 1].created_at
        # Labels given by then; the last point is now, every label given so far.
        cutoff = at if end < len(records) else float("inf")
        labeled = [
            r for r in seen if r.audit and r.label is not None and (r.labeled_at or 0.0) <= cutoff
        ]
        ids = {r.judgment_id for r in labeled}
        unlabeled = [r for r in seen if r.judgment_id not in ids]
        shares = traffic_shares(profile, labeled, unlabeled, alpha=alpha_precision)
        alarms = []
        precision = labelled_precision(profile, labeled, alpha=alpha_precision)
        if precision is not None and precision.contradicts:
            alarms.append("precision")
        if mix is not None and mix.detected_at is not None and mix.detected_at <= end:
            alarms.append("prior")
        before = [r for r in seen if "prior_shift" not in r.reason_codes]
        prior = None
        if source is not None and len(before) >= 2:
            prior = [float(v) for v in em_prior(probabilities_of(before, choices), source)]
        out.append(
            HealthPoint(
                n_decisions=end,
                at=at,
                n_labeled=len(labeled),
                shares=shares,
                prior=prior,
                alarms=alarms,
            )
        )
    return HealthHistory(
        profile=profile.name,
        profile_etag=etag,
        choices=choices,
        source_prior=None if source is None else [float(v) for v in source],
        points=out,
    )
