"""Per-class evidence (calibration.certificates.per_class): each choice's precision, recall and coverage of
the accepted items, with intervals, and the confusion matrices."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from calibration.certificates.per_class import class_evidence
from calibration.report import class_markdown


def test_a_small_case_by_hand() -> None:
    # Accepted: (ham, ham), (ham, decided spam), (spam, spam), (spam, decided ham).
    report = class_evidence(
        ["ham", "spam"],
        labels=[0, 0, 1, 1, 1, 0],
        best=[0, 1, 1, 1, 0, 0],
        accepted=[True, True, True, False, True, False],
    )
    assert report.confusion == [[2, 1], [1, 2]]
    assert report.confusion_accepted == [[1, 1], [1, 1]]
    ham, spam = report.classes
    assert (ham.support, ham.accepted, ham.precision) == (3, 2, 0.5)
    assert ham.recall == pytest.approx(1 / 3) and ham.coverage == pytest.approx(2 / 3)
    # The exact two-sided 95% Clopper-Pearson interval for 1 of 2.
    assert ham.precision_interval == pytest.approx(
        [stats.beta.ppf(0.025, 1, 2), stats.beta.ppf(0.975, 2, 1)]
    )
    assert spam.precision == 0.5


def test_counts_agree_with_a_direct_count() -> None:
    rng = np.random.default_rng(3)
    n, k = 400, 3
    labels = rng.integers(0, k, n)
    best = np.where(rng.random(n) < 0.7, labels, rng.integers(0, k, n))
    accepted = rng.random(n) < 0.6
    report = class_evidence(["a", "b", "c"], labels, best, accepted)
    assert int(np.sum(report.confusion)) == n
    assert int(np.sum(report.confusion_accepted)) == int(accepted.sum())
    for c, evidence in enumerate(report.classes):
        decided = accepted & (best == c)
        assert evidence.accepted == int(decided.sum())
        assert evidence.precision == pytest.approx((labels[decided] == c).mean())
        assert evidence.recall == pytest.approx(
            (decided & (labels == c)).sum() / (labels == c).sum()
        )
        assert evidence.coverage == pytest.approx(accepted[labels == c].mean())
        assert evidence.precision is not None and evidence.precision_interval is not None
        low, high = evidence.precision_interval
        assert low <= evidence.precision <= high


def test_a_class_never_accepted_has_no_precision() -> None:
    report = class_evidence(["ham", "spam"], [0, 1, 1], [0, 0, 0], [True, False, True])
    spam = report.classes[1]
    assert spam.accepted == 0 and spam.precision is None and spam.precision_interval is None
    assert spam.recall == 0.0 and spam.coverage == 0.5
    assert "| spam | 2 | 0 | n/a |" in class_markdown(report)


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="best must be indices"):
        class_evidence(["a", "b"], [0, 1], [0, 2], [True, True])
    with pytest.raises(ValueError, match="alike"):
        class_evidence(["a", "b"], [0, 1], [0], [True, True])


def test_a_fitted_profile_and_its_report_carry_the_evidence_per_class() -> None:
    from fakes import FINGERPRINT

    from calibration import LabeledScores, Provenance, fit_profile
    from calibration.report import profile_markdown

    rng = np.random.default_rng(5)
    z = rng.normal(0, 3, size=(300, 2))
    y = (rng.random(300) > np.exp(z[:, 0]) / np.exp(z).sum(1)).astype(int)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    profile = fit_profile(
        "p",
        LabeledScores(logp, np.ones(len(y)), y),
        ["ham", "spam"],
        Provenance(fingerprint=FINGERPRINT, dataset="d", dataset_sha256="0"),
    ).profile
    evidence = profile.class_evidence
    assert evidence is not None
    held = profile.split.conformal + profile.split.certify  # the examples not fitted on
    assert sum(c.support for c in evidence.classes) == held
    assert sum(map(sum, evidence.confusion)) == held
    assert "### Per class" in profile_markdown(profile)
