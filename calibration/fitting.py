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

A learned head (``calibration.maps.probe``: hundreds of weights on the pass's hidden state) changes
the trade. Its accuracy grows with its fitting items well past 150 (on ag_news with the
default model, test accuracy over four seeds: 0.74 on average fitted on 150 items, 0.77 on
250), and the certificate
can only vouch for a rule as good as the head, so when a probe is among the candidates the
split is 5:1:4 instead: half fit the map (the probe and the scalar maps compete on it by
cross-validated NLL, so "auto" never chooses with data it is certified on), a tenth sets the
conformal quantile (at alpha 0.1 and 50 items the quantile is the 46th of 50 scores, still a
finite-sample-valid level), and 40% certify. Which split is used depends only on the candidate
methods and the number of examples, both fixed before any label is seen, so each guarantee
stays exact. Two consequences of the head's many weights are handled on the fit split itself:
its in-sample probabilities are sharper than on new items, so the start of the fixed sequence
is judged on its out-of-fold probabilities there (from the cross-validation that chose it) and
on the conformal split; and below ``MIN_PROBE_EXAMPLES`` it is not tried at all.

Every labeled profile also says whether the calibrated judge beats the label prior (the class
frequencies of split 1) on splits 2 and 3 (``calibration.certificates.signal``), and ``evaluate_policy``
says the same on held-out data. A label-free profile (``fit_label_free_profile``) has no
labels: it certifies nothing and reports no metrics, and says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec
import numpy as np
from numpy.typing import ArrayLike

from calibration.certificates.certify import (
    ThresholdResult,
    clopper_pearson_interval,
    select_threshold,
    sequence_start,
    untested,
)
from calibration.certificates.class_certify import certify_per_class
from calibration.certificates.conformal import conformal_quantile
from calibration.certificates.mass_check import choose_min_choice_mass
from calibration.certificates.per_class import ClassReport, class_evidence
from calibration.certificates.recertify import (
    LabelsNeeded,
    labels_to_certify,
    next_look_delta,
)
from calibration.certificates.signal import SignalReport, label_prior, signal_report
from calibration.errors import FitError
from calibration.fit_data import LabeledScores, Provenance
from calibration.fit_settings import AUTO_METHODS, DEFAULT_METHODS, DEFAULT_SETTINGS, FitSettings
from calibration.gate import Gate, Overrides
from calibration.limits import (
    MIN_EXAMPLES,
    PROBE_SPLIT,
    SPLIT,
    allot,
    certify_share,
    labels_wanted,
    uniform_to_certify,
)
from calibration.maps.label_free import LabelFree, estimate_prior, prior_correction
from calibration.maps.map_types import MAX_PROBE_WEIGHTS
from calibration.maps.probe import MIN_PROBE_EXAMPLES, check_features, map_features, probe_weights
from calibration.maps.scaling import (
    CalibrationFit,
    Identity,
    Probe,
    ProbeInputs,
    fit_calibrator,
    softmax,
)
from calibration.metrics import MetricReport, evaluate
from calibration.monitoring.health import reference_of
from calibration.policy import Checks, Policy
from calibration.profile import FORMAT_VERSION, Baseline, CalibrationProfile, DataSplit
from calibration.scored import check_max_std
from calibration.scores import check_values
from calibration.validation import (
    check_choice_mass,
    check_labels,
    check_logits,
    check_probability,
)
from judge.adapters import Adapter
from judge.fingerprint import Fingerprint

__all__ = [
    "AUTO_METHODS",
    "MIN_EXAMPLES",
    "FittedProfile",
    "FittedRule",
    "PolicyEvaluation",
    "checks_on_calibrated",
    "evaluate_policy",
    "fit_label_free_profile",
    "fit_profile",
    "fit_rule",
    "held_out_examples",
    "labels_for_next_look",
    "labels_needed",
    "profile_split",
    "resolve_methods",
    "served_checks",
    "split_examples",
    "split_with_taught",
]


def _shaped(log_probabilities: ArrayLike, choices: Sequence[str]) -> np.ndarray:
    """(n, k) log-probabilities as floats, one column per choice, else a ValueError."""
    z = np.asarray(log_probabilities, dtype=np.float64)
    if z.ndim != 2 or z.shape[1] != len(choices):
        raise ValueError(f"log_probabilities must have shape (n, {len(choices)}), got {z.shape}")
    return z


def _check(
    log_probabilities: ArrayLike, y: ArrayLike, choices: Sequence[str], minimum: int
) -> tuple[np.ndarray, np.ndarray]:
    z = _shaped(log_probabilities, choices)
    if z.shape[0] < minimum:
        raise FitError(f"need at least {minimum} labeled examples, got {z.shape[0]}")
    return z, check_labels(y, z.shape[0], z.shape[1])


def _check_classes(labels: np.ndarray, choices: Sequence[str] | None) -> None:
    if labels.shape[0] and np.unique(labels).shape[0] < 2:
        # A map fitted on one label learns to always answer it (T at its bound, P = 1), and a
        # certificate on such data vouches only for data where that answer is always right.
        label = int(labels[0])
        name = repr(choices[label]) if choices is not None else f"index {label}"
        raise FitError(
            f"all {labels.shape[0]} examples have label {name}; need at least two classes "
            "(examples of at least two different choices) to fit a profile"
        )


def split_examples(
    labels: np.ndarray, seed: int, probe: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices of the fit, conformal and certify splits (3:2:5, or 5:1:4 when a probe is
    among the candidates), stratified by label."""
    pattern = np.array(PROBE_SPLIT if probe else SPLIT)
    order = _stratified(labels, seed)
    part = pattern[np.arange(order.shape[0]) % pattern.shape[0]]
    return tuple(np.sort(order[part == s]) for s in range(3))  # type: ignore[return-value]


def _stratified(labels: np.ndarray, seed: int) -> np.ndarray:
    """The items in an order that deals each label's items out evenly: by label, and at
    random (from ``seed``) within a label."""
    order = np.random.default_rng(seed).permutation(labels.shape[0])
    return order[np.argsort(labels[order], kind="stable")]


def _dealt(counts: Sequence[int]) -> np.ndarray:
    """A sequence of part indices, part j ``counts[j]`` times, each part spread evenly along
    it (smooth weighted round robin: at each step the part furthest behind its share)."""
    total = sum(counts)
    weights = np.asarray(counts, dtype=np.int64)
    credit = np.zeros(len(counts), dtype=np.int64)
    out = np.empty(total, dtype=np.int64)
    for step in range(total):
        credit += weights
        j = int(np.argmax(credit))
        credit[j] -= total
        out[step] = j
    return out


def split_with_taught(
    labels: np.ndarray,
    seed: int,
    probe: bool,
    fit_only: ArrayLike | None,
    allotment: str = "by_role",
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The fit, conformal and certify splits of labels of which ``fit_only`` (booleans, or
    None: none) may only fit the map, and how many those are.

    Only the others (a uniform sample) set the quantile and certify. "by_role"
    (``calibration.limits.allot``): the fit split takes its pattern's share of all the labels,
    the fit-only ones first, and the uniform labels left set the quantile and certify in the
    pattern's ratio, each part dealt evenly over the labels (``_stratified``). "pattern" (how
    profiles were split before): ``split_examples`` on the uniform labels, the fit-only ones
    added to the fit split. With no fit-only labels both are ``split_examples``.
    """
    if allotment not in ("by_role", "pattern"):
        raise ValueError(f"allotment must be 'by_role' or 'pattern', got {allotment!r}")
    if fit_only is None:
        return (*split_examples(labels, seed, probe), 0)
    only = np.asarray(fit_only)
    if only.shape != labels.shape or only.dtype != np.bool_:
        raise ValueError(
            f"fit_only must be {labels.shape[0]} booleans, got {only.shape} {only.dtype}"
        )
    free, taught = np.flatnonzero(~only), int(only.sum())
    if allotment == "pattern" or taught == 0:
        fit_i, conformal_i, certify_i = split_examples(labels[free], seed, probe)
    else:
        fitting, quantile, certify = allot(taught, free.shape[0], probe)
        order = _stratified(labels[free], seed)
        held = _dealt([fitting, quantile + certify]) == 1
        fit_i, rest = np.sort(order[~held]), order[held]
        part = _dealt([quantile, certify])
        conformal_i, certify_i = np.sort(rest[part == 0]), np.sort(rest[part == 1])
    fit_idx = np.sort(np.concatenate([free[fit_i], np.flatnonzero(only)]))
    return fit_idx, free[conformal_i], free[certify_i], taught


def held_out_examples(
    labels: ArrayLike, split: DataSplit, fit_only: ArrayLike | None = None
) -> np.ndarray:
    """Sorted indices of the examples a profile's map was not fitted on (its conformal and
    certify splits), recomputed from the labels it was fitted on and its ``split``
    (``profile_split``)."""
    _, conformal_idx, certify_idx = profile_split(labels, split, fit_only)
    return np.sort(np.concatenate([conformal_idx, certify_idx]))


def profile_split(
    labels: ArrayLike, split: DataSplit, fit_only: ArrayLike | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The indices of a profile's fit, conformal and certify examples, recomputed from the
    labels it was fitted on, its ``split`` and the items that could only fit it
    (``fit_only``, as ``fit_rule`` was given it): the stratified split is a function of the
    labels, the seed, the pattern and the allotment the profile records, and the pattern
    (3:2:5, or 5:1:4 with a probe among the candidates) is the one whose counts the profile
    recorded. A ValueError where neither gives those counts (other labels than the fit's)."""
    y = np.asarray(labels)
    for probe in (False, True):
        fit_idx, conformal_idx, certify_idx, taught = split_with_taught(
            y, split.seed, probe, fit_only, split.allotment
        )
        counts = (fit_idx.shape[0], conformal_idx.shape[0], certify_idx.shape[0], taught)
        if counts == (split.fit, split.conformal, split.certify, split.taught):
            return fit_idx, conformal_idx, certify_idx
    raise ValueError(
        f"these {y.shape[0]} labels do not split into the profile's {split.fit} fit, "
        f"{split.conformal} conformal and {split.certify} certify examples: they are not the "
        "labels it was fitted on"
    )


@dataclass(frozen=True)
class FittedRule:
    """The outcome of the fitting procedure, before it is dressed up as a profile."""

    fit: CalibrationFit
    conformal_quantile: float
    threshold: ThresholdResult
    # Per class, in the choices' order, with ``settings.per_class``; else None.
    class_thresholds: list[ThresholdResult] | None
    min_choice_mass: (
        float  # the settings', or the one chosen (``calibration.certificates.mass_check``)
    )
    mass_note: str  # for the profile's note: which minimum was chosen and why; "" if given
    split: DataSplit
    probabilities: np.ndarray  # (n, k) calibrated probabilities of every example
    # (n, k) as ``probabilities``, but a probe's fit-split rows from the fold that did not see
    # them: each example as the map would judge a new one.
    out_of_sample: np.ndarray
    held_out: np.ndarray  # indices the map was not fitted on (conformal + certify)
    prior: np.ndarray  # (k,) label frequencies of the fit split: the prior predictor
    skipped: str = ""  # for the profile's note: why "auto" did not try the probe, if it did not


def fit_rule(
    scores: LabeledScores,
    *,
    settings: FitSettings = DEFAULT_SETTINGS,
    choices: Sequence[str] | None = None,
    num_layers: int | None = None,
    probe_split: bool | None = None,
    fitted: CalibrationFit | None = None,
) -> FittedRule:
    """The whole fitting procedure on ``scores``: their (n, k) log-probabilities, (n,) label
    indices and choice mass.

    See the module docstring for the split and why, and ``FitSettings`` for the settings;
    ``choices`` name the columns (for messages, and for the settings' ``values``); the
    settings' ``methods`` are resolved into ``fit_calibrator``'s candidates by
    ``resolve_methods`` (the rule's ``skipped`` says why "auto" did not try the probe). A
    "probe" candidate reads the scores' ``features`` (n, m, H), the hidden states of their
    ``feature_layers`` in a model of ``num_layers`` blocks (and may read ``span_features``, the
    same layers' means over each item's ``span``), and needs ``MIN_PROBE_EXAMPLES``.
    ``probe_split`` chooses the split (None: the probe's split exactly when "probe" is a
    candidate), so that a baseline can be fitted on the same items as a probe. The scores'
    ``fit_only`` (n,) marks items that may only fit the map (labels a teach stream chose, not
    a uniform sample): they join the fit split, and the split itself is drawn from the
    others, so that only those certify.
    """
    features, feature_layers = scores.features, scores.feature_layers
    span_features, span, fit_only = scores.span_features, scores.span, scores.fit_only
    z = check_logits(scores.log_probabilities, name="log_probabilities")
    labels = check_labels(scores.labels, z.shape[0], z.shape[1])
    _check_classes(labels, choices)
    if z.shape[0] < MIN_EXAMPLES:
        raise FitError(f"need at least {MIN_EXAMPLES} labeled examples, got {z.shape[0]}")
    f = None if features is None else check_features(features, z.shape[0], feature_layers)
    means = (
        None
        if span_features is None
        else check_features(span_features, z.shape[0], feature_layers, "span_features")
    )
    # An explicit probe's refusals (no features, too few examples, too many weights) are here.
    methods, skipped = resolve_methods(
        settings.methods, z.shape[0], None if f is None else probe_weights(z.shape[1], f.shape[2])
    )
    probe = "probe" in methods
    mass = check_choice_mass(scores.choice_mass, z.shape[0])
    chosen_mass = settings.min_choice_mass
    columns = [str(j) for j in range(z.shape[1])] if choices is None else list(choices)
    values = None if settings.values is None else check_values(settings.values, columns)
    max_std = None if settings.max_std is None else check_max_std(settings.max_std)
    seed = settings.seed
    fit_idx, conformal_idx, certify_idx, taught = split_with_taught(
        labels, seed, probe if probe_split is None else probe_split, fit_only, settings.allotment
    )
    if not (conformal_idx.shape[0] and certify_idx.shape[0]):
        raise FitError(
            f"of the {labels.shape[0]} labels, {labels.shape[0] - taught} are a uniform sample "
            "(the others were taught: chosen, not drawn at random), too few to hold any out to "
            "set the conformal quantile and certify on: label some of the audit stream"
        )

    states = (
        None
        if f is None or num_layers is None
        else ProbeInputs(f, feature_layers, num_layers, means, span).rows(fit_idx)
    )
    fit = fitted or fit_calibrator(
        z[fit_idx], labels[fit_idx], methods=methods, random_state=seed, probe=states
    )
    x = map_features(fit.map, f, feature_layers, means)  # (n, slots*H) for a probe, else None
    probs = fit.map.apply(z, x)  # (n, k)
    out_of_sample = probs.copy()
    if fit.heldout_probabilities is not None:
        out_of_sample[fit_idx] = np.asarray(fit.heldout_probabilities)
    q_hat = conformal_quantile(probs[conformal_idx], labels[conformal_idx], settings.alpha)
    best = probs.argmax(axis=1)
    correct = best == labels
    # Items the certify split does not depend on: they choose the mass check and the starts.
    # A map given with no out-of-fold probabilities for its fit items (an adapter's head,
    # trained on them: near-certain there, whatever it does on new items) leaves them out.
    blind = fitted is not None and fitted.heldout_probabilities is None
    independent = conformal_idx if blind else np.concatenate([fit_idx, conformal_idx])

    # The served rule accepts an item only if every gate passes; an item that another gate
    # escalates gets confidence 0 here, so the certificate covers exactly that rule. The gates
    # are the served policy's own, with the threshold left open.
    def open_at(min_choice_mass: float) -> Policy:
        return Policy(
            profile=None,
            choices=None,
            calibration_map=fit.map,
            threshold=0.0,
            threshold_source="uncertified_request",
            no_threshold_reason=None,
            min_choice_mass=min_choice_mass,
            conformal_quantile=q_hat,
            certified=False,
            values=values,
            max_std=max_std,
            max_std_source="profile",
        )

    mass_note = ""
    if chosen_mass == "auto":
        # Chosen on the fit and conformal splits: the certify split does not depend on it.
        ungated = open_at(0.0).checks(columns, z, mass, x)
        chosen_mass, mass_note = choose_min_choice_mass(
            np.where(ungated.accepted, ungated.confidence, 0.0)[independent],
            correct[independent],
            mass[independent],
            target_precision=settings.target_precision,
            delta=settings.delta,
        )
    min_choice_mass = check_probability(chosen_mass, "min_choice_mass")
    open_policy = open_at(min_choice_mass)
    gates = open_policy.checks(columns, z, mass, x)
    confidence = np.where(gates.accepted, gates.confidence, 0.0)
    start = None
    target_precision, delta = settings.target_precision, settings.delta
    starting: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    if settings.procedure == "fixed_sequence":
        start_confidence = confidence[independent]
        start_best = best[independent]
        start_correct = correct[independent]
        if fit.heldout_probabilities is not None:
            # A probe is sharper on the items it was fitted on than on new ones, so the start
            # is judged on its out-of-fold probabilities there (every gate applied to them).
            oof = np.log(np.clip(np.asarray(fit.heldout_probabilities), 1e-300, 1.0))
            g = msgspec.structs.replace(open_policy, calibration_map=Identity()).checks(
                columns, oof, mass[fit_idx]
            )
            start_confidence[: fit_idx.shape[0]] = np.where(g.accepted, g.confidence, 0.0)
            start_best[: fit_idx.shape[0]] = g.best
            start_correct[: fit_idx.shape[0]] = g.best == labels[fit_idx]
        starting = (start_confidence, start_best, start_correct)
        start = sequence_start(
            start_confidence,
            certify_idx.shape[0],
            target_precision=target_precision,
            delta=delta,
        )
    threshold = select_threshold(
        confidence[certify_idx],
        correct[certify_idx],
        target_precision=target_precision,
        delta=delta,
        procedure=settings.procedure,
        start=start,
    )
    per_class = None
    if settings.per_class:
        per_class = certify_per_class(
            confidence,
            best,
            correct,
            certify_idx,
            starting,
            list(columns),
            target_precision=target_precision,
            delta=delta,
            procedure=settings.procedure,
        )
    return FittedRule(
        fit=fit,
        conformal_quantile=q_hat,
        threshold=threshold,
        class_thresholds=per_class,
        min_choice_mass=min_choice_mass,
        mass_note=mass_note,
        split=DataSplit(
            fit=int(fit_idx.shape[0]),
            conformal=int(conformal_idx.shape[0]),
            certify=int(certify_idx.shape[0]),
            seed=seed,
            taught=taught,
            allotment=settings.allotment,
        ),
        probabilities=probs,
        out_of_sample=out_of_sample,
        held_out=np.sort(np.concatenate([conformal_idx, certify_idx])),
        prior=label_prior(labels[fit_idx], z.shape[1]),
        skipped=skipped,
    )


@dataclass(frozen=True)
class TrainedHead:
    """A probe head trained together with low-rank adapters (``calibration.tasks.adapter.training``): the map
    ``fit_profile`` is given, and the adapters the scores were judged under (the profile
    carries them). One value, since neither means anything without the other."""

    fit: CalibrationFit
    adapter: Adapter


@dataclass(frozen=True)
class FittedProfile:
    """What ``fit_profile`` returns: the profile, and its items as its map would judge new
    ones."""

    profile: CalibrationProfile
    # (n, k) calibrated probabilities of every item, a probe's fit split from the folds that
    # did not see them: a cascade orders its rules on these, a labelling queue times its looks.
    out_of_sample: np.ndarray


def fit_profile(
    name: str,
    scores: LabeledScores,
    choices: Sequence[str],
    provenance: Provenance,
    settings: FitSettings = DEFAULT_SETTINGS,
    *,
    probe_split: bool | None = None,
    trained: TrainedHead | None = None,
) -> FittedProfile:
    """Fit a profile named ``name`` on labelled ``scores`` (n >= 20 items; columns in
    ``choices`` order), recording their ``provenance``.

    ``scores`` (``LabeledScores``) are the (n, k) log-probabilities, the labels and the choice
    mass, with the (n, m, H) ``features`` of ``feature_layers`` a probe reads (and
    ``span_features``, the same layers' means over each item's tokens, which it may read
    instead or beside them), and ``fit_only``: items that may only fit the map (a teach
    stream's labels), the split drawn from the others (``split.taught`` counts them).
    ``provenance`` (``Provenance``) is stored in the profile: the engine's fingerprint, the
    data's name and hash, the prompt's template and, for a refit, the look it is (the
    settings' delta must be that look's share, ``recertification.spent``). ``settings``
    (``FitSettings``) are what to certify and how: the guarantees, a score's ``values`` and
    ``max_std``, the candidate ``methods`` ("auto": every method, the probe included where
    there are features and at least ``MIN_PROBE_EXAMPLES`` items; the note says when it was
    not tried), the split's seed and the metrics' resamples.

    When a probe wins, the scalar maps (temperature, or bias + temperature, by cross-validated
    NLL, as without a probe) are fitted and certified on the same split too, and kept as the
    profile's ``baseline``. ``probe_split`` (``split_examples``; None: the probe's split exactly
    when a probe is a candidate) lets scores from another classifier, trained on the probe
    split's fit items only, be certified on the items it never saw. ``trained``: a probe head
    trained with low-rank adapters on the probe split's fit items alone
    (``calibration.tasks.adapter.training``), and those adapters; the scores are the adapted engine's, the split
    is the probe's, and the profile carries the adapter. Nothing chooses the map here, so the
    conformal and certify splits, which neither saw, certify it exactly.

    Returns the profile and the (n, k) calibrated probabilities of every item as the map would
    judge a new one (``FittedProfile``).
    """
    if trained is not None:
        if probe_split is False:
            raise ValueError("an adapter's head is trained on the probe split: probe_split=False")
        probe_split = True
    fingerprint, dataset = provenance.fingerprint, provenance.dataset
    _check_fingerprint(fingerprint)
    z, labels, mass = scores.log_probabilities, scores.labels, scores.choice_mass
    if z.shape[1] != len(choices):
        raise ValueError(f"scores have {z.shape[1]} columns but there are {len(choices)} choices")
    _check_classes(labels, choices)
    if z.shape[0] < MIN_EXAMPLES:
        raise FitError(f"need at least {MIN_EXAMPLES} labeled examples, got {z.shape[0]}")
    rule = fit_rule(
        scores,
        settings=settings,
        choices=choices,
        num_layers=fingerprint.num_layers,
        probe_split=probe_split,
        fitted=None if trained is None else trained.fit,
    )
    held = rule.held_out
    evidence = {"seed": settings.seed, "n_bootstrap": settings.n_bootstrap}
    baseline = None
    if rule.fit.method == "probe":
        base = fit_rule(
            # The scalar maps read no hidden states.
            dataclasses.replace(
                scores, features=None, feature_layers=(), span_features=None, span=None
            ),
            # The same gate as the profile's: the baseline is served under the profile's mass.
            settings=msgspec.structs.replace(
                settings, methods=DEFAULT_METHODS, min_choice_mass=rule.min_choice_mass
            ),
            choices=choices,
            probe_split=True,
        )
        assert not isinstance(base.fit.map, Probe)
        baseline = Baseline(
            calibration_map=base.fit.map,
            note=base.fit.note,
            conformal_quantile=base.conformal_quantile,
            threshold=base.threshold,
            class_thresholds=base.class_thresholds,
            metrics_after=evaluate(base.probabilities[held], labels[held], **evidence),
        )
    label_free = None
    if rule.fit.prior is not None:
        label_free = LabelFree(
            method="batch",
            n_inputs=rule.split.fit,
            source=f"the {rule.split.fit} examples of the fit split of {dataset}, labels "
            "ignored, then a temperature fitted on their labels (batch_temperature)",
            prior=rule.fit.prior,
        )
    profile = _profile(
        name,
        choices,
        fingerprint,
        settings,
        dataset=dataset,
        dataset_sha256=provenance.dataset_sha256,
        template=provenance.template,
        n_examples=len(labels),
        calibration_map=rule.fit.map,
        cv_nll=rule.fit.cv_nll,
        note=rule.fit.note + rule.skipped + rule.mass_note,
        min_choice_mass=rule.min_choice_mass,
        threshold=rule.threshold,
        class_thresholds=rule.class_thresholds,
        conformal_quantile=rule.conformal_quantile,
        split=rule.split,
        metrics_before=evaluate(softmax(z), labels, **evidence),
        metrics_after=evaluate(rule.probabilities[held], labels[held], **evidence),
        label_free=label_free,
        signal=signal_report(
            rule.probabilities[held],
            labels[held],
            rule.prior,
            rule.fit.map.temperature,
            list(choices),
            **evidence,
        ),
        baseline=baseline,
        reference=reference_of(
            rule.probabilities[held],
            labels[held],
            source=f"the {held.shape[0]} held-out examples (conformal and certify splits) of "
            f"{dataset}",
            seed=settings.seed,
        ),
        recertification=provenance.recertification,
        adapter=None if trained is None else trained.adapter,
    )
    # Per class, on the items the map was not fitted on, under the rule as served (its own
    # gates on the calibrated probabilities): the evidence the report shows beside the metrics.
    g = checks_on_calibrated(profile, rule.probabilities[held], mass[held])
    evidence_by_class = class_evidence(list(choices), labels[held], g.best, g.accepted)
    # A head trained on its fit items has no out-of-sample probabilities there: its estimate
    # reads the held-out items alone.
    usable = None
    if trained is not None:
        usable = np.zeros(len(labels), dtype=bool)
        usable[held] = True
    needed = labels_needed(profile, rule.out_of_sample, scores, settings=settings, usable=usable)
    return FittedProfile(
        msgspec.structs.replace(profile, class_evidence=evidence_by_class, labels_needed=needed),
        rule.out_of_sample,
    )


def labels_for_next_look(
    profile: CalibrationProfile,
    log_probabilities: ArrayLike,
    y: ArrayLike,
    choice_mass: ArrayLike | None = None,
    features: ArrayLike | None = None,
    feature_layers: Sequence[int] = (),
    span_features: ArrayLike | None = None,
    fit_only: ArrayLike | None = None,
) -> LabelsNeeded:
    """About how many labels the next look of ``profile``'s lineage would need to certify its
    target (``calibration.certificates.recertify.labels_to_certify``), judged by the profile's own map on
    the examples it was fitted from but not fitted on (its conformal and certify splits, every
    gate but the threshold applied), at the next look's delta. The arguments are the arrays of
    the ``LabeledScores`` ``fit_profile`` was given."""
    labels = np.asarray(y)
    held = held_out_examples(labels, profile.split, fit_only)
    z = np.asarray(log_probabilities, dtype=np.float64)[held]
    mass = None if choice_mass is None else np.asarray(choice_mass)[held]
    f = None if features is None else np.asarray(features)[held]
    means = None if span_features is None else np.asarray(span_features)[held]
    x = map_features(profile.calibration_map, f, feature_layers, means)
    # Every gate but the threshold: the profile may have certified none, so the threshold is
    # opened on the resolved policy rather than overridden (an override needs a certificate),
    # and for every class alike (a per-class profile's own thresholds would stay in force).
    opened = msgspec.structs.replace(
        Gate(profile).policy, threshold=0.0, class_thresholds=None, class_reasons=None
    )
    gates = opened.checks(profile.choices, z, mass, x)
    return labels_to_certify(
        np.where(gates.accepted, gates.confidence, 0.0),
        gates.best == labels[held],
        target_precision=profile.threshold.target_precision,
        delta=next_look_delta(profile.recertification, profile.threshold.delta),
        **labels_wanted(profile.split.taught, isinstance(profile.calibration_map, Probe)),
        # Only the uniform labels certify: the taught ones are not counted as given.
        given=int(labels.shape[0]) - profile.split.taught,
    )


def _check_fingerprint(fingerprint: object) -> None:
    if not isinstance(fingerprint, Fingerprint):
        raise TypeError(
            "fingerprint must be a judge.Fingerprint (engine.fingerprint(...) for the template "
            f"the scores were judged with), got {type(fingerprint).__name__}"
        )


def _profile(
    name: str,
    choices: Sequence[str],
    fingerprint: Fingerprint,
    settings: FitSettings,
    *,
    dataset: str,
    dataset_sha256: str,
    **fitted: Any,
) -> CalibrationProfile:
    """A profile of this format, named, fingerprinted, dated, with the settings' rule
    (minimum mass, conformal alpha, a score's values and std bound, checked); ``fitted`` are
    the fields a fit computed (map, threshold, evidence)."""
    values, max_std = settings.values, settings.max_std
    return CalibrationProfile(
        format_version=FORMAT_VERSION,
        name=name,
        fingerprint=fingerprint,
        choices=list(choices),
        dataset=dataset,
        dataset_sha256=dataset_sha256,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        values=None if values is None else check_values(values, choices),
        max_std=None if max_std is None else check_max_std(max_std),
        conformal_alpha=settings.alpha,
        **fitted,
    )


def resolve_methods(
    methods: Sequence[str] | str, n: int, probe_weights: int | None
) -> tuple[tuple[str, ...], str]:
    """The candidate methods, and a note for the profile when "auto" could not try the probe.

    "auto" is every labeled method, the probe included where features were given (a probe on
    them would hold ``probe_weights`` weights; None: no features), within ``MAX_PROBE_WEIGHTS``,
    and there are at least ``MIN_PROBE_EXAMPLES``; otherwise it falls back to the scalar maps
    and says why. An explicit "probe" under any of those conditions is a FitError that says
    which: the one place these rules are written (``fit_rule`` and the service ask it too).
    """
    if isinstance(methods, str):
        if methods != "auto":
            raise ValueError(
                f"methods must be a sequence of method names or 'auto', got {methods!r}"
            )
        if probe_weights is None:
            return DEFAULT_METHODS, (
                "; probe not tried: no hidden-state features were given (judged here they "
                "are read with feature layers, and a decision log keeps them under "
                "--log-features; a model served over HTTP returns log-probabilities only)"
            )
        if n < MIN_PROBE_EXAMPLES:
            return DEFAULT_METHODS, (
                f"; probe not tried: {n} labeled examples, fewer than the {MIN_PROBE_EXAMPLES} "
                "it needs (temperature scaling instead)"
            )
        if probe_weights > MAX_PROBE_WEIGHTS:
            return DEFAULT_METHODS, (
                f"; probe not tried: it would hold {probe_weights} weights, over the limit of "
                f"{MAX_PROBE_WEIGHTS} a profile may hold (temperature scaling instead)"
            )
        return AUTO_METHODS, ""
    if "probe" in methods:
        if probe_weights is None:
            raise FitError(
                "method 'probe' needs the hidden-state features of the examples (judge them "
                "with feature_layers)"
            )
        if n < MIN_PROBE_EXAMPLES:
            raise FitError(
                f"method 'probe' needs at least {MIN_PROBE_EXAMPLES} labeled examples, got {n}: "
                "with fewer, its hundreds of weights are fitted on noise (use method auto, "
                "which falls back to temperature scaling, or give more examples)"
            )
        if probe_weights > MAX_PROBE_WEIGHTS:
            raise FitError(
                f"method 'probe' would hold {probe_weights} weights, over the "
                f"{MAX_PROBE_WEIGHTS} a profile may hold; use fewer choices or method temperature"
            )
    return tuple(methods), ""


def fit_label_free_profile(
    name: str,
    log_probabilities: ArrayLike,
    choices: Sequence[str],
    *,
    method: str,
    source: str,
    fingerprint: Fingerprint,
    dataset: str,
    dataset_sha256: str,
    settings: FitSettings = DEFAULT_SETTINGS,
) -> CalibrationProfile:
    """A profile that divides out the prior estimated from unlabeled (n, k) log-probabilities.

    ``method`` is "contextual" (the rows are content-free inputs) or "batch" (unlabeled items);
    ``source`` says in words what the rows were, and is stored. Without labels nothing is
    certified (every decision escalates unless the caller sets a threshold), there is no
    conformal set, and there are no metrics; the settings' ``target_precision``, ``delta`` and
    ``alpha`` are recorded only so that the profile reads like any other (their minimum mass
    and a score's ``values`` and ``max_std`` are served). ``fingerprint`` is the engine's,
    as for ``fit_profile``.
    """
    if method not in ("contextual", "batch"):
        raise ValueError(f"method must be 'contextual' or 'batch', got {method!r}")
    _check_fingerprint(fingerprint)
    if np.size(log_probabilities) == 0:
        what = "content-free inputs" if method == "contextual" else "unlabeled inputs"
        raise FitError(f"the set of {what} is empty: label-free calibration needs at least one")
    z = _shaped(log_probabilities, choices)
    prior = estimate_prior(z, name="log_probabilities")
    n = int(z.shape[0])
    no_labels = (
        f"label-free profile ({method} calibration on {n} unlabeled inputs): with no labels, "
        "no threshold can be certified"
    )
    threshold = untested(
        target_precision=settings.target_precision,
        delta=settings.delta,
        procedure="none",
        method="none: no labels",
        reason=no_labels,
    )
    shown = ", ".join(f"{c} {p:.4f}" for c, p in zip(choices, prior, strict=True))
    return _profile(
        name,
        choices,
        fingerprint,
        settings,
        dataset=dataset,
        dataset_sha256=dataset_sha256,
        n_examples=n,
        calibration_map=prior_correction(prior),
        cv_nll={},
        note=(
            f"{method} calibration (label-free): the model's prior over the choices, estimated "
            f"as the mean probability vector of {n} inputs ({shown}), is divided out; "
            "temperature 1. No labels were used, so nothing is certified and no accuracy is "
            "known: whether this judge beats the label prior is untested"
        ),
        threshold=threshold,
        conformal_quantile=None,
        split=DataSplit(fit=n, conformal=0, certify=0, seed=0),
        metrics_before=None,
        metrics_after=None,
        label_free=LabelFree(method=method, n_inputs=n, source=source, prior=prior),  # type: ignore[arg-type]
        # No labels to choose a gate by: the settings' minimum, none for "auto".
        min_choice_mass=0.0
        if settings.min_choice_mass == "auto"
        else check_probability(settings.min_choice_mass, "min_choice_mass"),
        signal=None,
        # The inputs the prior was estimated on: the map saw them, but only through their
        # mean, so their calibrated confidence is close to that of new inputs.
        reference=None
        if method == "contextual"  # content-free inputs are nothing like live traffic
        else reference_of(prior_correction(prior).apply(z), source=f"the {n} inputs: {source}"),
    )


class PolicyEvaluation(msgspec.Struct, frozen=True, kw_only=True):
    """How the served policy does on labeled data the profile was not fitted on."""

    profile: str
    n: int
    before: MetricReport  # raw probabilities
    after: MetricReport  # calibrated probabilities
    threshold: float | None  # the one threshold; None: none, or one per class
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
    conformal_coverage: float | None  # fraction of items whose set holds the label; None: no sets
    mean_set_size: float | None
    singleton_rate: float | None  # fraction of sets with exactly one choice
    # The calibrated judge against the label prior (the profile's, else these items' own
    # label frequencies: see ``signal_prior``).
    signal: SignalReport
    signal_prior: str  # where the prior predictor's frequencies came from
    method: str = ""  # the profile's calibration method
    # For a probe profile: its temperature-scaling baseline evaluated on the same items.
    baseline: PolicyEvaluation | None = None
    # Per choice: precision, recall and coverage of the accepted items, with intervals, and
    # the confusion matrices (``calibration.certificates.per_class``).
    classes: ClassReport | None = None
    # A threshold per class, where the served rule has one (the profile's choices' order).
    class_thresholds: list[float | None] | None = None


def checks_on_calibrated(
    profile: CalibrationProfile,
    probabilities: ArrayLike,
    choice_mass: ArrayLike | None = None,
    *,
    opened: bool = False,
) -> Checks:
    """``profile``'s served gates on n items' (n, k) probabilities already through its map
    (the threshold as served): what it decides of items whose calibrated probabilities are
    known, such as a probe's out-of-fold ones. ``opened``: every gate but the threshold, for
    every class alike (the profile may certify none: the threshold is opened on the resolved
    policy, since an override needs a certificate)."""
    served = msgspec.structs.replace(Gate(profile).policy, calibration_map=Identity())
    if opened:
        served = msgspec.structs.replace(
            served, threshold=0.0, class_thresholds=None, class_reasons=None
        )
    z = np.log(np.clip(np.asarray(probabilities, dtype=np.float64), 1e-300, 1.0))
    return served.checks(profile.choices, z, choice_mass)


def labels_needed(
    profile: CalibrationProfile,
    out_of_sample: ArrayLike,
    scores: LabeledScores,
    *,
    settings: FitSettings = DEFAULT_SETTINGS,
    alternating: bool = False,
    usable: ArrayLike | None = None,
    delta: float | None = None,
    calibrated: bool = False,
) -> LabelsNeeded | None:
    """About how many uniform labels a fit like ``profile``'s would need to certify its target
    at its delta, read from its map as it judges new items: ``labels_to_certify`` on
    ``out_of_sample`` (n, k), the calibrated probabilities ``fit_profile`` gave every example
    of ``scores`` (a probe's fit items from the folds that did not see them), of the uniform
    labels only (not the scores' ``fit_only``), every gate but the threshold applied. The labels to come are allotted
    as ``calibration.limits.allot`` allots them, beside the taught ones there are
    (``alternating``: a taught label comes with each uniform one, as a queue offering both
    streams in turn gives them); the split is a probe's where ``settings`` would try one on
    these scores (where they carry hidden states). ``usable`` (n,) booleans:
    the uniform labels whose ``out_of_sample`` rows are read (default: all). The delta is
    ``delta``, else the profile's, or for a refit its lineage's next look's. ``calibrated``:
    take each item's precision from the map's confidence in its answer instead of its label
    (``labels_to_certify``'s ``expected``), so that the estimate reads no label. None without
    a uniform label."""
    labels, fit_only = scores.labels, scores.fit_only
    only = np.zeros(labels.shape[0], dtype=bool) if fit_only is None else np.asarray(fit_only)
    taught, uniform = int(only.sum()), int((~only).sum())
    read = ~only if usable is None else ~only & np.asarray(usable)
    if not read.any():
        return None
    k = len(profile.choices)
    weights = None
    if scores.features is not None and profile.fingerprint.hidden_size is not None:
        weights = probe_weights(k, profile.fingerprint.hidden_size)
    try:
        methods, _ = resolve_methods(settings.methods, MIN_PROBE_EXAMPLES, weights)
    except FitError:  # a probe named without features: its fits fail, not this estimate
        methods = ()
    probe = "probe" in methods
    mass = scores.choice_mass[read]
    gates = checks_on_calibrated(profile, np.asarray(out_of_sample)[read], mass, opened=True)
    r = profile.recertification
    if delta is None:
        delta = profile.threshold.delta if r is None else next_look_delta(r, r.delta)
    return labels_to_certify(
        np.where(gates.accepted, gates.confidence, 0.0),
        None if calibrated else gates.best == labels[read],
        expected=gates.confidence if calibrated else None,
        target_precision=profile.threshold.target_precision,
        delta=delta,
        certify_share=certify_share(probe),
        # "pattern" certifies a fixed share of the uniform labels, whatever is taught.
        labels_for=None
        if settings.allotment == "pattern"
        else lambda certify: uniform_to_certify(
            certify, taught, probe, given=uniform, alternating=alternating
        ),
        given=uniform,
    )


def served_checks(
    profile: CalibrationProfile,
    log_probabilities: ArrayLike,
    choice_mass: ArrayLike | None = None,
    *,
    features: ArrayLike | None = None,
    span_features: ArrayLike | None = None,
    overrides: Overrides | None = None,
) -> tuple[Policy, Checks]:
    """The policy a gate on ``profile`` serves (under ``overrides``) and its gates on n items,
    as arrays: what ``decide`` decides, a probe reading the items' ``features`` (n, m, H) of
    ``profile.feature_layers`` and ``span_features``, the means over each item of its
    ``span_layers``, as it needs them. Log-probabilities (n, k) in ``profile.choices`` order."""
    z = np.asarray(log_probabilities, dtype=np.float64)
    x = None
    probe = profile.calibration_map
    if isinstance(probe, Probe):
        given = {"point": features, "mean": span_features}
        checked = {}
        for read, arr in given.items():
            if read not in probe.reads.split("+"):
                continue
            if arr is None:
                what = "features" if read == "point" else "span_features (means over the item)"
                raise ValueError(
                    f"profile {profile.name!r} is a probe on layer(s) {probe.layers}: pass the "
                    f"items' {what} for those layers"
                )
            checked[read] = check_features(arr, z.shape[0], probe.layers)
        x = map_features(probe, checked.get("point"), probe.layers, checked.get("mean"))
    policy = Gate(profile, overrides=overrides).policy
    return policy, policy.checks(profile.choices, z, choice_mass, x)


def evaluate_policy(
    profile: CalibrationProfile,
    log_probabilities: ArrayLike,
    y: ArrayLike,
    choice_mass: ArrayLike | None = None,
    *,
    threshold: float | None = None,
    min_choice_mass: float | None = None,
    max_std: float | None = None,
    n_bootstrap: int = 1000,
    features: ArrayLike | None = None,
    span_features: ArrayLike | None = None,
) -> PolicyEvaluation:
    """Metrics before and after calibration, and the policy exactly as served, on held-out data.

    ``log_probabilities`` is (n, k) with columns in ``profile.choices`` order; ``threshold``,
    ``min_choice_mass`` and ``max_std`` are overrides, as a request would give them.
    ``features`` (n, m, H) are the hidden states of ``profile.feature_layers``, and
    ``span_features`` the means over each item of ``profile.span_layers``, which a probe reads.
    A probe profile's baseline (the scalar maps) is evaluated on the same items too.
    """
    z, labels = _check(log_probabilities, y, profile.choices, 1)
    mass = check_choice_mass(choice_mass, z.shape[0])
    # An evaluation's threshold is the caller's what-if: an override where the profile certified
    # one, else the uncertified threshold (an override needs a certificate to override).
    certified = profile.threshold.threshold is not None
    overrides = Overrides(
        threshold=threshold if certified else None,
        uncertified_threshold=None if certified else threshold,
        min_choice_mass=min_choice_mass,
        max_std=max_std,
    )
    policy, g = served_checks(
        profile, z, mass, features=features, span_features=span_features, overrides=overrides
    )
    accepted = g.accepted
    correct = g.best == labels
    m, k = int(accepted.sum()), int(correct[accepted].sum())
    interval = clopper_pearson_interval(k, m)
    sizes = None if g.membership is None else g.membership.sum(axis=1)
    escalations = {
        "no_certified_threshold": int(np.isnan(g.thresholds).sum()),
        "below_threshold": int((g.below_threshold & ~np.isnan(g.thresholds)).sum()),
        "low_choice_mass": int(g.low_choice_mass.sum()),
        "ambiguous_set": 0 if sizes is None else int((sizes != 1).sum()),
        "high_std": int(g.high_std.sum()),
    }
    if profile.signal is not None:
        prior, prior_source = np.asarray(profile.signal.prior), "the profile's fit split"
    else:
        # A label-free or older profile knows no label frequencies; these items' own are the
        # strongest prior predictor there is, so beating it is the harder test.
        prior = label_prior(labels, z.shape[1])
        prior_source = "these items' own label frequencies (the profile records none)"
    return PolicyEvaluation(
        profile=profile.name,
        n=len(labels),
        before=evaluate(softmax(z), labels, n_bootstrap=n_bootstrap),
        after=evaluate(g.probabilities, labels, n_bootstrap=n_bootstrap),
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
        conformal_coverage=None
        if g.membership is None
        else float(g.membership[np.arange(len(labels)), labels].mean()),
        mean_set_size=None if sizes is None else float(sizes.mean()),
        singleton_rate=None if sizes is None else float((sizes == 1).mean()),
        signal=signal_report(
            g.probabilities,
            labels,
            prior,
            profile.calibration_map.temperature,
            list(profile.choices),
            n_bootstrap=n_bootstrap,
        ),
        signal_prior=prior_source,
        method=profile.calibration_map.method,
        classes=class_evidence(profile.choices, labels, g.best, accepted),
        class_thresholds=policy.class_thresholds,
        baseline=None
        if (base := profile.baseline_profile()) is None
        else evaluate_policy(
            base,
            z,
            labels,
            mass,
            threshold=threshold,
            min_choice_mass=min_choice_mass,
            max_std=max_std,
            n_bootstrap=n_bootstrap,
        ),
    )
