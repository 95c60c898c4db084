"""Qualify a model before it is trusted as a stage: a fixed suite of criteria, per task.

A stage of a cascade, or a model behind a served profile, should first show that its
confidence means something on the kind of items it will see. ``qualify_task`` measures one
task's items, judged four ways by the caller (``calibration.tasks.qualify_runs``):

* **accuracy at confidence**: among the items whose top probability is at least
  ``criteria.confidence`` (0.9), the share answered right, at least ``min_accuracy`` (0.9);
  where no item gets that sure the model decides nothing there, and the criterion is missed;
* **ECE** (15 equal-width bins, ``calibration.metrics.ece``) at most ``max_ece`` (0.15);
* **flip rate**: decisions that change when the same items are judged again in another batch
  arrangement, at most ``max_flip_rate`` (0.02). Under judge's batch-invariant arithmetic it
  is 0 by construction, and so is the largest change of a probability; measured all the same;
* **order flips**: decisions that change when the prompt lists the allowed answers in the
  reverse order, at most ``max_order_flips`` (0.10): a model that answers by place rather than
  by meaning is not judging;
* **choice mass**: the mean share of the full next-token distribution that the choices' first
  tokens hold, at least ``min_choice_mass`` (0.5): below it the model mostly wanted to say
  something else at the decision point (a template or response prefix that does not fit it),
  and its probabilities among the choices are renormalised from a minority of its belief;
* **signal**: the temperature-scaled judge beats the label prior on the task's items
  (``calibration.certificates.signal``; the temperature and the prior are fitted on the task's other split).

Accuracy and ECE read the model's own probabilities, or with ``calibrated`` the temperature
-scaled ones: a model whose raw confidence is off can still serve behind a profile, and the
second reading says whether it would. The criteria come from Hunch's ``qualify`` (>= 90%
accuracy at p >= 0.9, ECE <= 0.15, <= 2% flips between identical runs); order and mass are
judge's own.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np
import numpy.typing as npt
from msgspec import Meta

from calibration.certificates.signal import label_prior, signal_report
from calibration.metrics import ece
from calibration.validation import check_logits, check_probability, check_probs_labels
from judge.fingerprint import Fingerprint

__all__ = ["Criteria", "Qualification", "TaskQualification", "misses", "qualify_task"]

_Probability = Annotated[float, Meta(ge=0.0, le=1.0)]


class Criteria(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a model must reach on every task to qualify (the defaults are stated above)."""

    confidence: _Probability = 0.9
    min_accuracy: _Probability = 0.9
    max_ece: _Probability = 0.15
    max_flip_rate: _Probability = 0.02
    max_order_flips: _Probability = 0.10
    min_choice_mass: _Probability = 0.5
    require_signal: bool = True
    calibrated: bool = False  # accuracy and ECE on temperature-scaled probabilities

    def __post_init__(self) -> None:  # msgspec checks the Meta bounds on decode only
        for name in self.__struct_fields__[:6]:
            check_probability(getattr(self, name), f"criteria.{name}")


class TaskQualification(msgspec.Struct, frozen=True, kw_only=True):
    """One task's measurements, and the criteria it missed (empty: it qualifies)."""

    task: str
    n: int  # items measured
    accuracy: float  # of the most probable choice, every item
    confident_share: float  # items at or above the criteria's confidence
    accuracy_at_confidence: float | None  # among those; None when there are none
    ece: float
    flip_rate: float  # decisions changed between two runs of the same items
    max_rerun_change: float  # the largest change of any probability between them
    order_flips: float  # decisions changed with the allowed answers listed in reverse
    order_shift: float  # mean over items of the largest change of a probability
    choice_mass: float  # mean
    beats_prior: bool
    signal: str  # calibration.certificates.signal's verdict in words
    temperature: float  # fitted on the task's other split, for the signal (and ``calibrated``)
    misses: list[str]

    @property
    def qualifies(self) -> bool:
        return not self.misses


class Qualification(msgspec.Struct, frozen=True, kw_only=True):
    """A model's qualification over a suite of tasks: it qualifies when no task misses."""

    fingerprint: Fingerprint  # the model, its weights, dtype and response template
    arithmetic: str  # which arithmetic its passes ran (``Judge.arithmetic``)
    criteria: Criteria
    tasks: list[TaskQualification]
    qualifies: bool


def _decisions_changed(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]) -> float:
    return float(np.mean(a.argmax(axis=1) != b.argmax(axis=1)))


def _softmax(z: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def qualify_task(
    task: str,
    log_probs: npt.ArrayLike,
    labels: npt.ArrayLike,
    choice_mass: npt.ArrayLike,
    *,
    rerun_log_probs: npt.ArrayLike,
    reordered_log_probs: npt.ArrayLike,
    fit_log_probs: npt.ArrayLike,
    fit_labels: npt.ArrayLike,
    choices: list[str],
    criteria: Criteria | None = None,
) -> TaskQualification:
    """Measure one task and check it against ``criteria`` (default: ``Criteria()``).

    Parameters
    ----------
    log_probs : array of shape (n, k)
        log P(choice) of each item, columns in ``choices`` order.
    labels : array of shape (n,)
        Each item's correct column.
    choice_mass : array of shape (n,)
    rerun_log_probs : array of shape (n, k)
        The same items judged again (another batch arrangement), rows and columns as above.
    reordered_log_probs : array of shape (n, k)
        The same items with the allowed answers listed in another order, columns as above.
    fit_log_probs, fit_labels : arrays of shapes (m, k) and (m,)
        Other items of the task, for the temperature and the label prior.
    """
    # Here: fitting needs scipy, and the command line's parser imports this module without it.
    from calibration.maps.scaling import TemperatureScaler

    rule = Criteria() if criteria is None else criteria
    z = check_logits(log_probs)
    raw, y = check_probs_labels(_softmax(z), labels)
    n, k = raw.shape
    if len(choices) != k:
        raise ValueError(f"got {len(choices)} choices for {k} columns")
    rerun = _softmax(check_logits(rerun_log_probs))
    reordered = _softmax(check_logits(reordered_log_probs))
    mass = np.asarray(choice_mass, dtype=np.float64)
    if rerun.shape != raw.shape or reordered.shape != raw.shape or mass.shape != (n,):
        raise ValueError(f"every run must have the first's shape ({n}, {k}) and mass ({n},)")
    fit_z = check_logits(fit_log_probs)
    scaler = TemperatureScaler().fit(fit_z, fit_labels)
    scaled = scaler.predict_proba(z)
    signal = signal_report(
        scaled, y, label_prior(fit_labels, k), scaler.temperature_, choices, n_bootstrap=500
    )
    p = scaled if rule.calibrated else raw
    confident = p.max(axis=1) >= rule.confidence
    hit = p.argmax(axis=1) == y
    result = TaskQualification(
        task=task,
        n=n,
        accuracy=float(hit.mean()),
        confident_share=float(confident.mean()),
        accuracy_at_confidence=float(hit[confident].mean()) if confident.any() else None,
        ece=ece(p, y),
        flip_rate=_decisions_changed(raw, rerun),
        max_rerun_change=float(np.abs(raw - rerun).max()),
        order_flips=_decisions_changed(raw, reordered),
        order_shift=float(np.abs(raw - reordered).max(axis=1).mean()),
        choice_mass=float(mass.mean()),
        beats_prior=signal.beats_prior,
        signal=signal.verdict,
        temperature=float(scaler.temperature_),
        misses=[],
    )
    return msgspec.structs.replace(result, misses=misses(result, rule))


def misses(result: TaskQualification, rule: Criteria) -> list[str]:
    """Each criterion ``result`` misses, in words with its measured value."""
    found: list[str] = []
    at = f"confidence >= {rule.confidence:g}"
    if result.accuracy_at_confidence is None:
        found.append(f"no item reached {at}: the model decides nothing there")
    elif result.accuracy_at_confidence < rule.min_accuracy:
        found.append(
            f"accuracy at {at} {result.accuracy_at_confidence:.3f} < {rule.min_accuracy:g} "
            f"({result.confident_share:.0%} of items)"
        )
    if result.ece > rule.max_ece:
        found.append(f"ECE {result.ece:.3f} > {rule.max_ece:g}")
    if result.flip_rate > rule.max_flip_rate:
        found.append(f"flip rate {result.flip_rate:.3f} > {rule.max_flip_rate:g}")
    if result.order_flips > rule.max_order_flips:
        found.append(f"order flips {result.order_flips:.3f} > {rule.max_order_flips:g}")
    if result.choice_mass < rule.min_choice_mass:
        found.append(f"choice mass {result.choice_mass:.3f} < {rule.min_choice_mass:g}")
    if rule.require_signal and not result.beats_prior:
        found.append("no signal: the calibrated judge does not beat the label prior")
    return found
