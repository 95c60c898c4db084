"""Fit a cascade's profiles on labeled items, with one guarantee for the whole rule.

A cascade of S stages (judges, cheapest first) decides an item at the first stage whose gate
accepts it; what the last stage escalates goes to a person. ``fit_cascade`` fits it so that
the precision of everything the cascade accepts is at least the target with probability at
least 1 - delta:

* **Every stage judges every labeled item** and fits its profile on all of them as a single
  profile would (``fit_labeled``: the map and the conformal set on the fit and conformal
  splits, the choice-mass check chosen there). The split is a function of the labels and the
  seed, so stages that fit the same kind of map hold out the same certify split.
* **One certificate for the thresholds together.** The items every stage's fit held out for
  its certificate certify the tuple of thresholds as one rule, at the full delta
  (``calibration.certificates.cascade_certify``: fixed-sequence testing along the precision-coverage
  frontier of the tuples, ordered on the other labeled items, each stage's probabilities there
  as its map judges new items: a probe's from the folds that did not fit them). "Stage s alone" is one of the
  tuples, so the cascade is never held below a single stage by the method; a stage the chosen
  rule never lets accept escalates everything to the next.
* Each stage's profile is served with its threshold from the chosen rule and a certificate
  that says so (``method``, ``reason``): its own pooled certificate is replaced.

This replaces a union bound over stages certified on disjoint folds (each at delta / S, on
about 1/S of the labels), which held the cascade of two stages below either stage alone on
sst2 and could not fit sms_spam (benchmarks/RESULTS.md, "Cascade").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from calibration.certificates.cascade_certify import (
    CascadeCertificate,
    CascadeRule,
    StageView,
    certify_rules,
    measure_rule,
)
from calibration.certificates.certify import ThresholdResult
from calibration.errors import FitError
from calibration.fit_data import Provenance
from calibration.fit_settings import DEFAULT_SETTINGS, FitSettings
from calibration.limits import MIN_EXAMPLES
from calibration.tasks.labeled import LabeledScores, checks_on_scores, fit_labeled
from judge import Fingerprint

if TYPE_CHECKING:
    from calibration import CalibrationProfile

__all__ = [
    "CascadeStageData",
    "FittedCascade",
    "cascade_decisions",
    "cascade_rule_on",
    "fit_cascade",
]


@dataclass(frozen=True)
class CascadeStageData:
    """One stage's model on the labeled items: its name, its scores (the same items in the
    same order for every stage, columns in the cascade's choice order) and its fingerprint."""

    name: str
    scores: LabeledScores
    fingerprint: Fingerprint


def cascade_rule_on(
    profiles: Sequence[CalibrationProfile],
    stages: Sequence[LabeledScores],
    costs: Sequence[float] | None = None,
) -> CascadeRule:
    """What the cascade of ``profiles`` (their thresholds, as served) does on each stage's
    scores of the same labeled items: coverage, each stage's share, precision and the expected
    cost per item (``costs`` per stage; None: 1 each)."""
    views = [StageView.of(checks_on_scores(p, s)) for p, s in zip(profiles, stages, strict=True)]
    thresholds = [p.threshold.threshold for p in profiles]
    return measure_rule(views, stages[0].labels, thresholds, costs or [1.0] * len(profiles))


def cascade_decisions(
    profiles: Sequence[CalibrationProfile], stages: Sequence[LabeledScores]
) -> tuple[np.ndarray, np.ndarray]:
    """Which stage decides each item (its index; -1: escalated past the last, to a person)
    and the decided choice's column (-1 where none), for each stage's scores on the items."""
    n = len(stages[0])
    decided_by = np.full(n, -1, dtype=np.int64)
    choice = np.full(n, -1, dtype=np.int64)
    for s, (profile, scores) in enumerate(zip(profiles, stages, strict=True)):
        rows = np.flatnonzero(decided_by < 0)
        gates = checks_on_scores(profile, scores.rows(rows))
        decided_by[rows[gates.accepted]] = s
        choice[rows[gates.accepted]] = gates.best[gates.accepted]
    return decided_by, choice


@dataclass(frozen=True)
class FittedCascade:
    """A cascade's profiles, in stage order, and the certificate of their rule."""

    profiles: list[CalibrationProfile]
    certificate: CascadeCertificate


def fit_cascade(
    name: str,
    stages: Sequence[CascadeStageData],
    choices: Sequence[str],
    *,
    dataset: str,
    dataset_sha256: str,
    settings: FitSettings = DEFAULT_SETTINGS,
    costs: Sequence[float] | None = None,
) -> FittedCascade:
    """The stages' profiles with the thresholds of one certified rule, as the module says;
    ``costs`` per stage (ms per item, or any unit; None: 1 each) break ties in coverage
    toward the cheaper rule. The first is named ``name``, each later one
    ``<name>-<stage name>``: what ``judge serve --cascade`` looks up for a request's profile
    ``name``. FitError when the stages scored other items or too few are held out."""
    from calibration.fitting import checks_on_calibrated, profile_split

    if len(stages) < 1:
        raise FitError("a cascade needs at least one stage")
    labels = stages[0].scores.labels
    for stage in stages[1:]:
        if not np.array_equal(stage.scores.labels, labels):
            raise FitError(
                f"stage {stage.name!r} scored other items than stage {stages[0].name!r}: "
                "every stage must score the same labeled items in the same order"
            )
    pooled = msgspec.structs.replace(settings, per_class=False)  # one threshold per stage
    fits = [
        fit_labeled(
            name if s == 0 else f"{name}-{stage.name}",
            stage.scores,
            choices,
            Provenance(
                fingerprint=stage.fingerprint, dataset=dataset, dataset_sha256=dataset_sha256
            ),
            pooled,
        )
        for s, stage in enumerate(stages)
    ]
    profiles = [fitted.profile for fitted in fits]
    # Each stage's items as its map judges new ones.
    out_of_sample = [fitted.out_of_sample for fitted in fits]
    held = np.ones(len(labels), dtype=bool)  # held out by every stage's own fit
    for profile in profiles:
        mask = np.zeros(len(labels), dtype=bool)
        mask[profile_split(labels, profile.split)[2]] = True
        held &= mask
    if held.sum() < MIN_EXAMPLES:
        raise FitError(
            f"the stages' fits hold out {int(held.sum())} labeled items in common, fewer than "
            f"{MIN_EXAMPLES} to certify their rule on: label more items"
        )
    order, certify = np.flatnonzero(~held), np.flatnonzero(held)
    # The rules are ordered on each stage's out-of-sample probabilities: a probe is nearly
    # exact on the items it was fitted on, and ordered there the sequence starts at rules
    # too aggressive for new items (benchmarks/RESULTS.md, "Cascade"). They are certified on
    # the items as served.
    ordering = [
        StageView.of(checks_on_calibrated(p, honest[order], stage.scores.choice_mass[order]))
        for p, honest, stage in zip(profiles, out_of_sample, stages, strict=True)
    ]
    served = [
        StageView.of(checks_on_scores(p, stage.scores.rows(certify)))
        for p, stage in zip(profiles, stages, strict=True)
    ]
    certificate = certify_rules(
        ordering,
        labels[order],
        served,
        labels[certify],
        target_precision=settings.target_precision,
        delta=settings.delta,
        costs=costs,
    )
    fitted = [
        msgspec.structs.replace(p, threshold=_stage_threshold(certificate, s, p.threshold))
        for s, p in enumerate(profiles)
    ]
    return FittedCascade(fitted, certificate)


def _stage_threshold(
    certificate: CascadeCertificate, stage: int, own: ThresholdResult
) -> ThresholdResult:
    """Stage ``stage``'s share of the cascade's certified rule, as its profile serves it."""
    rule = certificate.rule
    t = None if rule is None else rule.thresholds[stage]
    if rule is None:
        why = f"no rule of the cascade's stages was certified: {certificate.reason}"
    elif t is None and all(u is None for u in rule.thresholds[stage:]):
        why = (
            "the cascade's certified rule accepts nothing from here on: every item that "
            "reaches this stage goes to a person (the stage need not be served)"
        )
    elif t is None:
        why = "the cascade's certified rule sends every item on from this stage"
    else:
        why = (
            f"the cascade's rule {rule.thresholds} is certified as a whole: every item it "
            f"accepts, at any stage, is at least {certificate.target_precision} precise"
        )
    return ThresholdResult(
        feasible=t is not None,
        threshold=t,
        target_precision=certificate.target_precision,
        delta=certificate.delta,
        coverage=0.0 if rule is None else rule.stage_coverage[stage],
        precision=None if rule is None else rule.precision,
        precision_lower_bound=certificate.precision_lower_bound,
        n_accepted=0 if rule is None else round(rule.stage_coverage[stage] * rule.n),
        n=own.n if rule is None else rule.n,
        best_certified_precision=certificate.precision_lower_bound or 0.0,
        grid_size=certificate.candidates,
        tested=certificate.tested,
        start=None,
        procedure="fixed_sequence",
        method=certificate.method,
        reason=why,
    )
