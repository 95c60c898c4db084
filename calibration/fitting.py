"""From labeled log-probabilities to a profile with a valid guarantee, and a policy's report card.

The guarantees a profile claims (the conformal set covers the label with probability 1 - alpha;
the accepted items' precision reaches the target with probability 1 - delta) hold only for
probabilities from a map that was not fitted on the items they are measured on. Fitting the map
and certifying on the same items voids both, because the map has already adapted to those
items' noise. So the labeled examples are split three ways, stratified by label, by sample
splitting (the "split" in split conformal prediction: Vovk et al. 2005; Angelopoulos & Bates
2021, section 1; Learn then Test, Angelopoulos et al. 2021, section 2):

1. ``fit`` (30%): the calibration map is chosen and fitted here (``fit_calibrator``);
2. ``conformal`` (20%): the conformal quantile, from probabilities of that fixed map;
3. ``certify`` (50%): the threshold, certified for the rule exactly as served (threshold,
   minimum choice mass and single-choice conformal set, with the map and quantile of 1 and 2).

Conditional on splits 1 and 2 the map and the quantile are fixed functions, and the items of
split 3 are fresh i.i.d. draws, so each test in ``select_threshold`` is exact; likewise split 2
is exchangeable with future items given the map. The start of the fixed-sequence test is chosen
on splits 1 and 2, which split 3 does not depend on. Cross-fitting would use every item for
every step, but the served map would then differ from the maps the certificate was computed
with, and its guarantee would be approximate (cross-conformal: 1 - 2 alpha, Barber et al.
2021); sample splitting gives up data for an exact statement. The map has at most k + 1
parameters and needs few items; the certificate's bound tightens with the square root of its
items, so it gets the largest share. The map is served as fitted on split 1, not refitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec
import numpy as np
from numpy.typing import ArrayLike
from scipy import stats

from calibration.conformal import conformal_quantile
from calibration.errors import FitError
from calibration.metrics import MetricReport, evaluate
from calibration.policy import Policy
from calibration.profile import FORMAT_VERSION, CalibrationProfile, DataSplit, sha256_text
from calibration.routing import ThresholdResult, select_threshold, sequence_start
from calibration.scaling import CalibrationFit, fit_calibrator, softmax
from calibration.validation import (
    check_choice_mass,
    check_labels,
    check_logits,
    check_probability,
)

__all__ = [
    "MIN_EXAMPLES",
    "FittedRule",
    "PolicyEvaluation",
    "evaluate_policy",
    "fit_profile",
    "fit_rule",
    "split_examples",
]

MIN_EXAMPLES = 20
# Of every ten examples (per label, in random order): three fit the map, two set the conformal
# quantile, five certify the threshold.
_PATTERN = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])


def _check(
    log_probabilities: ArrayLike, y: ArrayLike, choices: Sequence[str], minimum: int
) -> tuple[np.ndarray, np.ndarray]:
    z = np.asarray(log_probabilities, dtype=np.float64)
    if z.ndim != 2 or z.shape[1] != len(choices):
        raise ValueError(f"log_probabilities must have shape (n, {len(choices)}), got {z.shape}")
    if z.shape[0] < minimum:
        raise FitError(f"need at least {minimum} labeled examples, got {z.shape[0]}")
    return z, check_labels(y, z.shape[0], z.shape[1])


def split_examples(labels: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices of the fit, conformal and certify splits (3:2:5), stratified by label."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(labels.shape[0])
    order = order[np.argsort(labels[order], kind="stable")]  # by label, random within a label
    part = _PATTERN[np.arange(order.shape[0]) % _PATTERN.shape[0]]
    return tuple(np.sort(order[part == s]) for s in range(3))  # type: ignore[return-value]


@dataclass(frozen=True)
class FittedRule:
    """The outcome of the fitting procedure, before it is dressed up as a profile."""

    fit: CalibrationFit
    conformal_quantile: float
    threshold: ThresholdResult
    split: DataSplit
    probabilities: np.ndarray  # (n, k) calibrated probabilities of every example
    held_out: np.ndarray  # indices the map was not fitted on (conformal + certify)


def fit_rule(
    log_probabilities: ArrayLike,
    y: ArrayLike,
    choice_mass: ArrayLike | None = None,
    *,
    target_precision: float = 0.9,
    delta: float = 0.1,
    alpha: float = 0.1,
    min_choice_mass: float = 0.0,
    seed: int = 0,
    procedure: str = "fixed_sequence",
) -> FittedRule:
    """The whole fitting procedure on (n, k) log-probabilities and (n,) label indices.

    See the module docstring for the split and why. ``procedure`` is the multiple-testing
    procedure of ``select_threshold``.
    """
    z = check_logits(log_probabilities, name="log_probabilities")
    if z.shape[0] < MIN_EXAMPLES:
        raise FitError(f"need at least {MIN_EXAMPLES} labeled examples, got {z.shape[0]}")
    labels = check_labels(y, z.shape[0], z.shape[1])
    if np.unique(labels).shape[0] < 2:
        # A map fitted on one label learns to always answer it, and a certificate on such
        # data vouches only for data where that answer is always right.
        raise FitError(
            f"every labeled example has the same label (choice {int(labels[0])}); a profile "
            "needs examples of at least two different choices"
        )
    mass = check_choice_mass(choice_mass, z.shape[0])
    min_choice_mass = check_probability(min_choice_mass, "min_choice_mass")
    fit_idx, conformal_idx, certify_idx = split_examples(labels, seed)

    fit = fit_calibrator(z[fit_idx], labels[fit_idx], random_state=seed)
    probs = fit.map.apply(z)  # (n, k)
    q_hat = conformal_quantile(probs[conformal_idx], labels[conformal_idx], alpha)
    # The served rule accepts an item only if every gate passes; an item that another gate
    # escalates gets confidence 0 here, so the certificate covers exactly that rule. The gates
    # are the served policy's own, with the threshold left open.
    gates = Policy(
        profile=None,
        choices=None,
        calibration_map=fit.map,
        threshold=0.0,
        threshold_source="request",
        no_threshold_reason=None,
        min_choice_mass=min_choice_mass,
        conformal_quantile=q_hat,
        certified=False,
    ).gates([str(j) for j in range(z.shape[1])], z, mass)
    confidence = np.where(gates.accepted, gates.confidence, 0.0)
    correct = probs.argmax(axis=1) == labels
    start = None
    if procedure == "fixed_sequence":
        independent = np.concatenate([fit_idx, conformal_idx])
        start = sequence_start(
            confidence[independent],
            certify_idx.shape[0],
            target_precision=target_precision,
            delta=delta,
        )
    threshold = select_threshold(
        confidence[certify_idx],
        correct[certify_idx],
        target_precision=target_precision,
        delta=delta,
        procedure=procedure,
        start=start,
    )
    return FittedRule(
        fit=fit,
        conformal_quantile=q_hat,
        threshold=threshold,
        split=DataSplit(
            fit=int(fit_idx.shape[0]),
            conformal=int(conformal_idx.shape[0]),
            certify=int(certify_idx.shape[0]),
            seed=seed,
        ),
        probabilities=probs,
        held_out=np.sort(np.concatenate([conformal_idx, certify_idx])),
    )


def fit_profile(
    name: str,
    log_probabilities: ArrayLike,
    y: ArrayLike,
    choices: Sequence[str],
    *,
    choice_mass: ArrayLike | None = None,
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
    min_choice_mass: float = 0.0,
    seed: int = 0,
    n_bootstrap: int = 1000,
    procedure: str = "fixed_sequence",
) -> CalibrationProfile:
    """Fit a profile on (n, k) per-choice log-probabilities and label indices ``y`` (n >= 20).

    The keyword arguments from ``model`` to ``system`` are an engine's ``configuration()``;
    ``n_bootstrap`` sets the resamples behind the metrics' intervals (evidence only: the map,
    quantile and threshold do not depend on it); ``procedure`` is ``select_threshold``'s.
    """
    z, labels = _check(log_probabilities, y, choices, MIN_EXAMPLES)
    rule = fit_rule(
        z,
        labels,
        choice_mass,
        target_precision=target_precision,
        delta=delta,
        alpha=alpha,
        min_choice_mass=min_choice_mass,
        seed=seed,
        procedure=procedure,
    )
    held = rule.held_out
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
        calibration_map=rule.fit.map,
        cv_nll=rule.fit.cv_nll,
        note=rule.fit.note,
        threshold=rule.threshold,
        min_choice_mass=min_choice_mass,
        conformal_alpha=alpha,
        conformal_quantile=rule.conformal_quantile,
        split=rule.split,
        metrics_before=evaluate(softmax(z), labels, seed=seed, n_bootstrap=n_bootstrap),
        metrics_after=evaluate(
            rule.probabilities[held], labels[held], seed=seed, n_bootstrap=n_bootstrap
        ),
        n_examples=len(labels),
        dataset=dataset,
        dataset_sha256=dataset_sha256,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )


class PolicyEvaluation(msgspec.Struct, frozen=True, kw_only=True):
    """How the served policy does on labeled data the profile was not fitted on."""

    profile: str
    n: int
    before: MetricReport  # raw probabilities
    after: MetricReport  # calibrated probabilities
    threshold: float | None
    min_choice_mass: float
    certified: bool  # the profile's certified rule, no overrides
    target_precision: float
    delta: float
    coverage: float  # fraction of items accepted by the policy (every gate)
    n_accepted: int
    precision: float | None  # accuracy among accepted items; None when none was accepted
    precision_interval: list[float] | None  # its two-sided 95% Clopper-Pearson interval
    escalations: dict[str, int]  # items escalated for each reason code (an item may have several)
    conformal_alpha: float
    conformal_coverage: float  # fraction of items whose prediction set holds the label
    mean_set_size: float
    singleton_rate: float  # fraction of sets with exactly one choice


def evaluate_policy(
    profile: CalibrationProfile,
    log_probabilities: ArrayLike,
    y: ArrayLike,
    choice_mass: ArrayLike | None = None,
    *,
    threshold: float | None = None,
    min_choice_mass: float | None = None,
) -> PolicyEvaluation:
    """Metrics before and after calibration, and the policy exactly as served, on held-out data.

    ``log_probabilities`` is (n, k) with columns in ``profile.choices`` order; ``threshold`` and
    ``min_choice_mass`` are overrides, as a request would give them.
    """
    z, labels = _check(log_probabilities, y, profile.choices, 1)
    mass = check_choice_mass(choice_mass, z.shape[0])
    policy = profile.policy(threshold=threshold, min_choice_mass=min_choice_mass)
    g = policy.gates(profile.choices, z, mass)  # what decide() decides, as arrays
    accepted = g.accepted
    correct = g.best == labels
    m, k = int(accepted.sum()), int(correct[accepted].sum())
    interval = None
    if m:
        low = float(stats.beta.ppf(0.025, k, m - k + 1)) if k else 0.0
        high = float(stats.beta.ppf(0.975, k + 1, m - k)) if k < m else 1.0
        interval = [low, high]
    assert g.membership is not None  # a profile's policy always has conformal sets
    sizes = g.membership.sum(axis=1)
    escalations = {
        "no_certified_threshold": len(labels) if policy.threshold is None else 0,
        "below_threshold": 0 if policy.threshold is None else int(g.below_threshold.sum()),
        "low_choice_mass": int(g.low_choice_mass.sum()),
        "ambiguous_set": int((sizes != 1).sum()),
    }
    return PolicyEvaluation(
        profile=profile.name,
        n=len(labels),
        before=evaluate(softmax(z), labels),
        after=evaluate(g.probabilities, labels),
        threshold=policy.threshold,
        min_choice_mass=policy.min_choice_mass,
        certified=policy.certified,
        target_precision=profile.threshold.target_precision,
        delta=profile.threshold.delta,
        coverage=m / len(labels),
        n_accepted=m,
        precision=k / m if m else None,
        precision_interval=interval,
        escalations={code: count for code, count in escalations.items() if count},
        conformal_alpha=profile.conformal_alpha,
        conformal_coverage=float(g.membership[np.arange(len(labels)), labels].mean()),
        mean_set_size=float(sizes.mean()),
        singleton_rate=float((sizes == 1).mean()),
    )
