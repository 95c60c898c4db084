"""A profile's next version, fitted from its decision log's labels: one look of its lineage.

``refit_from_log`` is what ``judge calibrate --from-log`` and the server's background refit
(``service.web.background_refit``) both run. It reads the profile's labelled decisions (every
version's, made with the same weights): the audited ones (a uniform sample of the traffic) are
split as a fit's labels are and alone set the quantile and certify; the others (a teach
stream's picks, or any a person chose) join the fit split only (``LabeledScores.fit_only``).
Where the log kept hidden states (``--log-features``) a probe may read them. The refit is
the next look of the profile's lineage and certifies at its share of the lineage's delta
(``calibration.certificates.recertify``), so that refitting again and again as labels arrive keeps every
look's certificate at once. The refit keeps the profile's prompt template and adapter: the
logged decisions were judged under them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from calibration import MIN_EXAMPLES, CalibrationProfile, FitSettings, Provenance
from calibration.certificates.recertify import Recertification
from calibration.maps.probe import MIN_PROBE_EXAMPLES
from calibration.tasks import LabeledScores, fit_labeled
from service.log.decision_log import DecisionLog
from service.log.record import LoggedDecision

__all__ = ["LogRefit", "RefitError", "labelled_decisions", "refit_from_log", "refit_settings"]


class RefitError(ValueError):
    """The log cannot refit the profile (too few labels, other weights, ...): says why."""


@dataclass(frozen=True)
class LogRefit:
    """A refit profile (not stored) and what it was fitted on."""

    profile: CalibrationProfile
    recertification: Recertification
    audited: int  # labelled audit decisions: split, and certify
    taught: int  # other labelled decisions: fit only
    notes: list[str]  # what was read or left out, for a person
    # What the profile was fitted on (its map may read the hidden states, and a retrained
    # adapter's means over each item), for ``labels_for_next_look``; ``fit_only``: the
    # labelled decisions outside the audit sample (None: none).
    scores: LabeledScores
    fit_only: np.ndarray | None


def refit_settings(profile: CalibrationProfile) -> FitSettings:
    """The settings a refit keeps from the profile it refits: its target precision, its
    lineage's delta, its conformal level, a score's values and std bound, and "auto"."""
    before = profile.recertification
    return FitSettings(
        target_precision=profile.threshold.target_precision,
        delta=before.delta if before is not None else profile.threshold.delta,
        alpha=profile.conformal_alpha,
        values=profile.values,
        max_std=profile.max_std,
    )


def refit_from_log(
    log: DecisionLog,
    profile: CalibrationProfile,
    settings: FitSettings,
    *,
    name: str,
    log_name: str,
) -> LogRefit:
    """The next version of ``profile`` (named ``name``) from the labelled decisions of
    ``log`` (``log_name``: how the profile names it, a password masked), under ``settings``
    (their delta the lineage's: this look certifies at its share)."""
    records = labelled_decisions(log, profile)
    notes = []
    labeled = len(records)
    records, features, layers, why = _with_features(records, settings.methods, profile)
    if why:
        notes.append(why)
    if len(records) < labeled:
        notes.append(
            f"read {len(records)} of the {labeled} labeled decisions: those that kept "
            f"the hidden states of layers {list(layers)}, which a probe reads"
        )
    fit_only = np.array([not r.audit for r in records], dtype=bool)
    audited, taught = int((~fit_only).sum()), int(fit_only.sum())
    if audited < MIN_EXAMPLES:
        raise RefitError(
            f"the log holds {audited} audited, labeled decisions of {profile.name!r}; a "
            f"profile needs at least {MIN_EXAMPLES} (raise --audit-rate, or label more)"
        )
    if taught:
        notes.append(
            f"{taught} labeled decisions outside the audit sample fit the map only; the "
            f"{audited} audited ones certify"
        )
    index = {c: j for j, c in enumerate(profile.choices)}
    z = np.array(
        [
            [dict(zip(r.choices, r.log_probs, strict=True))[c] for c in profile.choices]
            for r in records
        ]
    )
    y = np.array([index[r.label] for r in records if r.label is not None])
    digest = hashlib.sha256(
        msgspec.json.encode([[r.judgment_id, r.label] for r in records])
    ).hexdigest()
    mass = np.array([r.choice_mass for r in records])
    recertification = Recertification.after(profile.recertification, settings.delta, log_name)
    only = fit_only if taught else None
    scores = LabeledScores(z, mass, y, features=features, feature_layers=layers, fit_only=only)
    # What the refit map reads is what the logged decisions were judged under: the profile's
    # prompt (an item sent alone is placed in it) and its adapter (the logged scores and
    # states are the adapted model's), so the refit carries both.
    provenance = Provenance(
        fingerprint=profile.fingerprint,
        dataset=f"decision log {recertification.log}: {audited} audited decisions of "
        f"{profile.name}"
        + (f" and {taught} others labeled (fit only)" if taught else "")
        + (f", with the hidden states of layers {list(layers)}" if layers else ""),
        dataset_sha256=digest,
        template=profile.template,
        recertification=recertification,
    )
    settings = msgspec.structs.replace(settings, delta=recertification.spent)
    fitted = fit_labeled(name, scores, profile.choices, provenance, settings)
    refit = msgspec.structs.replace(fitted.profile, adapter=profile.adapter)
    return LogRefit(refit, recertification, audited, taught, notes, scores, only)


def labelled_decisions(log: DecisionLog, profile: CalibrationProfile) -> list[LoggedDecision]:
    """Every labelled decision of ``profile`` (all its versions), the audited ones first; a
    RefitError where some were made with other weights than the profile's."""
    records = log.decisions(profile=profile.name, audit=True, labeled=True)
    records += log.decisions(profile=profile.name, audit=False, labeled=True)
    weights = profile.fingerprint.model_sha256
    other = {r.model_sha256 for r in records} - {weights}
    if weights is not None and other:
        raise RefitError(
            f"the labeled decisions of {profile.name!r} were made with other weights too "
            f"({', '.join(sorted(s[:12] for s in other))}) than the profile's ({weights[:12]}): "
            "their log-probabilities are not comparable; refit with judge calibrate --task"
        )
    return records


def _with_features(
    records: list[LoggedDecision], methods: Sequence[str] | str, profile: CalibrationProfile
) -> tuple[list[LoggedDecision], np.ndarray | None, tuple[int, ...], str | None]:
    """The records a refit reads, their hidden states (n, m, H) and the m layers, or None,
    and why a probe is not tried where the log kept states ("auto" with too few of them).

    A probe is fitted on the records that kept hidden states (``--log-features``), on the
    layers every one of them kept (else the newest one's, and only the records with those):
    with "auto" when there are enough of them (``MIN_PROBE_EXAMPLES``), else on every record
    without features; an explicit probe refuses when there are too few."""
    wanted = "probe" in methods if not isinstance(methods, str) else methods == "auto"
    kept = [r for r in records if r.features is not None]
    if not wanted or not kept:
        if wanted and methods != "auto":
            raise RefitError(
                f"calibrate --from-log --method probe: none of the {len(records)} labeled "
                "decisions kept hidden states; serve with --log-features (or choose "
                "--method temperature)"
            )
        return records, None, (), None
    shared = set.intersection(*(set(r.features.layers) for r in kept if r.features))
    newest = kept[-1].features
    assert newest is not None
    layers = tuple(sorted(shared)) or tuple(newest.layers)
    kept = [r for r in kept if r.features is not None and set(layers) <= set(r.features.layers)]
    if len(kept) < MIN_PROBE_EXAMPLES:
        if methods != "auto":
            raise RefitError(
                f"calibrate --from-log --method probe: {len(kept)} labeled decisions "
                f"kept the hidden states of layers {list(layers)}, and a probe needs "
                f"{MIN_PROBE_EXAMPLES}: label more, or choose --method temperature"
            )
        why = (
            f"probe not tried: {len(kept)} labeled decisions kept the hidden states of layers "
            f"{list(layers)}, fewer than the {MIN_PROBE_EXAMPLES} a probe needs; the scalar "
            "maps fit on the log-probabilities of all of them (label more for a probe)"
        )
        return records, None, (), why
    width = profile.fingerprint.hidden_size
    rows = []
    for r in kept:
        assert r.features is not None
        if width is not None and r.features.width != width:
            raise RefitError(
                f"decision {r.judgment_id} kept hidden states {r.features.width} wide, and "
                f"the profile's model is {width} wide"
            )
        states = r.features.array()
        rows.append(states[[r.features.layers.index(n) for n in layers]])
    return kept, np.stack(rows), layers, None
