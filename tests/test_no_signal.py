"""A calibrated judge that is only a prior predictor must say so, in fields and in words."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fakes import FINGERPRINT
from sklearn.metrics import roc_auc_score

from calibration import (
    FitSettings,
    LabeledScores,
    Provenance,
    evaluate_policy,
    fit_profile,
    signal_report,
)
from calibration.certificates.signal import auroc, label_prior
from calibration.maps.scaling import T_MAX
from calibration.report import evaluation_markdown, profile_markdown

CHOICES = ["entailment", "not_entailment"]


def noise(n: int, seed: int, p_first: float = 0.7) -> tuple[Any, Any]:
    """Scores unrelated to imbalanced labels: a model with no signal, like rte's."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 2, size=(n, 2))
    y = (rng.random(n) > p_first).astype(int)
    return z - np.log(np.exp(z).sum(1, keepdims=True)), y


def signal(n: int, seed: int) -> tuple[Any, Any]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, size=n)
    z = rng.normal(0, 1, size=(n, 2))
    z[np.arange(n), y] += 1.5
    return z - np.log(np.exp(z).sum(1, keepdims=True)), y


def test_a_prior_predictor_is_called_one() -> None:
    z, y = noise(600, seed=0)
    profile = fit_profile(
        "rte",
        LabeledScores(z, np.ones(len(y)), y),
        CHOICES,
        Provenance(fingerprint=FINGERPRINT, dataset="d", dataset_sha256="0"),
        FitSettings(n_bootstrap=200),
    ).profile
    s = profile.signal
    assert s is not None
    # The fit flattens the scores (T at its bound) and lets the bias carry the prior.
    assert profile.calibration_map.temperature >= 0.99 * T_MAX and s.temperature_at_bound
    assert not s.beats_prior
    assert s.accuracy_gain.low <= 0 <= s.accuracy_gain.high or s.accuracy_gain.high <= 0
    assert s.nll_gain.low <= 0
    assert s.verdict.startswith("NO SIGNAL") and "'entailment'" in s.verdict
    assert "upper bound" in s.verdict
    assert "**signal: NO SIGNAL**" in profile_markdown(profile)
    # Held out, too: judge evaluate says it.
    z2, y2 = noise(400, seed=1)
    evaluation = evaluate_policy(profile, z2, y2)
    assert not evaluation.signal.beats_prior and evaluation.signal.temperature_at_bound
    assert evaluation.signal.prior == s.prior
    assert "NO SIGNAL" in evaluation_markdown(evaluation)


def test_a_judge_with_signal_beats_the_prior() -> None:
    z, y = signal(600, seed=2)
    profile = fit_profile(
        "sst",
        LabeledScores(z, np.ones(len(y)), y),
        CHOICES,
        Provenance(fingerprint=FINGERPRINT, dataset="d", dataset_sha256="0"),
        FitSettings(n_bootstrap=200),
    ).profile
    s = profile.signal
    assert s is not None and s.beats_prior and not s.temperature_at_bound
    assert s.accuracy_gain.low > 0 and s.nll_gain.low > 0
    assert s.auroc is not None and s.auroc > 0.7
    assert s.verdict.startswith("the judge beats the label prior")


def test_the_comparison_is_on_held_out_items_against_fit_split_frequencies() -> None:
    z, y = signal(600, seed=3)
    profile = fit_profile(
        "s",
        LabeledScores(z, np.ones(len(y)), y),
        CHOICES,
        Provenance(fingerprint=FINGERPRINT, dataset="d", dataset_sha256="0"),
    ).profile
    s = profile.signal
    assert s is not None
    assert s.n == profile.split.conformal + profile.split.certify
    # A stratified 3:2:5 split keeps the frequencies, so the prior is close to the labels'.
    assert s.prior == pytest.approx(label_prior(y, 2).tolist(), abs=0.02)
    assert s.prior_accuracy == pytest.approx(max(np.mean(y == 0), np.mean(y == 1)), abs=0.05)


def test_gains_are_paired_differences_with_a_bootstrap_interval() -> None:
    probs = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    y = np.array([0, 1, 1, 1])
    prior = [0.5, 0.5]
    s = signal_report(probs, y, prior, 1.0, CHOICES, n_bootstrap=500, seed=0)
    judge_nll = -np.log([0.9, 0.8, 0.4, 0.7]).mean()
    assert s.nll == pytest.approx(judge_nll) and s.prior_nll == pytest.approx(np.log(2))
    assert s.nll_gain.value == pytest.approx(np.log(2) - judge_nll)
    # Ties in the prior go to the first class: always "entailment", right once in four.
    assert s.prior_accuracy == 0.25 and s.accuracy == 0.75
    assert s.accuracy_gain.value == pytest.approx(0.5)
    assert s.accuracy_gain.low <= 0.5 <= s.accuracy_gain.high


def test_auroc_agrees_with_scikit_learn() -> None:
    rng = np.random.default_rng(4)
    scores = np.round(rng.random(300), 2)  # with ties
    positive = rng.random(300) < scores
    assert auroc(scores, positive) == pytest.approx(roc_auc_score(positive, scores))
    assert auroc(scores, np.ones(300, bool)) is None


def test_temperature_at_the_lower_bound_is_flagged_too() -> None:
    probs = np.array([[0.9, 0.1], [0.2, 0.8]])
    s = signal_report(probs, np.array([0, 1]), [0.5, 0.5], 0.01, CHOICES, n_bootstrap=10)
    assert s.temperature_at_bound and "lower bound" in s.verdict
