"""Fit a cascade's profiles on labeled items, with one guarantee end to end.

A cascade of S stages (judges, cheapest first) decides an item at the first stage whose gate
accepts it; what the last stage escalates goes to a person. ``fit_cascade`` fits one
profile per stage so that the precision of everything the cascade accepts is at least the
target with probability at least 1 - delta:

* **Delta split by the union bound.** Stage s certifies its threshold at delta / S. Let E_s
  be the event that stage s's accepted items fall below the target precision; each
  P(E_s) <= delta / S, so P(any E_s) <= delta. Outside every E_s each stage's accepted
  items reach the target, and the cascade's accepted items are the disjoint union of the
  stages' accepted items, so their precision (a weighted mean of the stages') does too.
* **Each stage certified on the items that reach it.** The labeled items are shuffled (with
  the settings' seed) and cut into S disjoint folds. Stage s is fitted only on the items of
  fold s that stages 1..s-1, already fitted on the folds before it, escalate. Given those
  folds the earlier gates are fixed, so fold s's escalated items are an independent sample
  of the items stage s will see in service, which is what its certificate needs; fitting it
  on the items that also fitted the earlier gates would not be. (Within a fold, the profile's
  own fit splits its items again: its certificate is on items its map was not fitted on.)

The guarantee is about items drawn like the labeled ones, as a single profile's is. The
cost of it: stage s learns from about 1/S of the labels, and only from those the stages
before it escalate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from calibration.errors import FitError
from calibration.fit_settings import DEFAULT_SETTINGS, FitSettings
from calibration.limits import MIN_EXAMPLES
from calibration.tasks.labeled import LabeledScores, fit_labeled
from judge import Fingerprint

if TYPE_CHECKING:
    from calibration import CalibrationProfile
    from calibration.policy import Gates

__all__ = ["CascadeStageData", "cascade_decisions", "cascade_folds", "fit_cascade"]


@dataclass(frozen=True)
class CascadeStageData:
    """One stage's model on the labeled items: its name, its scores (the same items in the
    same order for every stage, columns in the cascade's choice order) and its fingerprint."""

    name: str
    scores: LabeledScores
    fingerprint: Fingerprint


def cascade_folds(n: int, stages: int, seed: int) -> list[np.ndarray]:
    """n items' indices shuffled with ``seed`` and cut into ``stages`` near-equal folds."""
    order = np.random.default_rng(seed).permutation(n)
    return [np.sort(fold) for fold in np.array_split(order, stages)]


def _gates(profile: CalibrationProfile, scores: LabeledScores) -> Gates:
    """A gate on ``profile``'s gates on the items of ``scores``, as served."""
    from calibration.fitting import served_gates  # the fitters load scipy: here, not above

    _, gates = served_gates(
        profile,
        scores.log_probabilities,
        scores.choice_mass,
        features=scores.features_of(profile.feature_layers),
        span_features=scores.span_features_of(profile.span_layers),
    )
    return gates


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
        gates = _gates(profile, scores.rows(rows))
        decided_by[rows[gates.accepted]] = s
        choice[rows[gates.accepted]] = gates.best[gates.accepted]
    return decided_by, choice


def fit_cascade(
    name: str,
    stages: Sequence[CascadeStageData],
    choices: Sequence[str],
    *,
    dataset: str,
    dataset_sha256: str,
    settings: FitSettings = DEFAULT_SETTINGS,
) -> list[CalibrationProfile]:
    """One profile per stage, fitted as the module says: stage s on the items of fold s that
    the stages before it escalate, its threshold certified at ``settings.delta`` / S. The
    first is named ``name``, each later one ``<name>-<stage name>``: what ``judge serve
    --cascade`` looks up for a request's profile ``name``. FitError when a stage is left
    fewer than ``MIN_EXAMPLES``."""
    if len(stages) < 1:
        raise FitError("a cascade needs at least one stage")
    labels = stages[0].scores.labels
    for stage in stages[1:]:
        if not np.array_equal(stage.scores.labels, labels):
            raise FitError(
                f"stage {stage.name!r} scored other items than stage {stages[0].name!r}: "
                "every stage must score the same labeled items in the same order"
            )
    per_stage = msgspec.structs.replace(settings, delta=settings.delta / len(stages))
    folds = cascade_folds(len(labels), len(stages), settings.seed)
    profiles: list[CalibrationProfile] = []
    for s, (stage, fold) in enumerate(zip(stages, folds, strict=True)):
        reach = fold
        for profile, earlier in zip(profiles, stages, strict=False):
            reach = reach[~_gates(profile, earlier.scores.rows(reach)).accepted]
        if len(reach) < MIN_EXAMPLES:
            raise FitError(
                f"stage {s + 1} ({stage.name!r}) is left {len(reach)} labeled items that the "
                f"stages before it escalate, of its fold's {len(fold)}; it needs at least "
                f"{MIN_EXAMPLES}: label more items, or cascade fewer stages"
            )
        profiles.append(
            fit_labeled(
                name if s == 0 else f"{name}-{stage.name}",
                stage.scores.rows(reach),
                choices,
                stage.fingerprint,
                dataset=dataset,
                dataset_sha256=dataset_sha256,
                settings=per_stage,
            )
        )
    return profiles
