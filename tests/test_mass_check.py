"""The choice-mass check chosen from the labels (calibration.certificates.mass_check), and the certificate with it."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from fakes import FINGERPRINT
from scipy import stats

from calibration import FitSettings, LabeledScores, Provenance, fit_profile
from calibration.certificates.mass_check import choose_min_choice_mass
from calibration.gate import Gate

CHOICES = ["a", "b"]
TARGET, DELTA = 0.9, 0.1


def massy_world(
    n: int, rng: np.random.Generator
) -> tuple[
    npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.float64], npt.NDArray[np.float64]
]:
    """(log-probabilities, labels, choice mass, true probabilities): a quarter of the items are
    ones the model wanted to answer otherwise (mass about 0.01), and on those its confident
    answers are coin flips; on the rest (mass about 0.6) it sees the truth."""
    u = rng.normal(0.0, 3.0, size=(n, 2))
    p = np.exp(u) / np.exp(u).sum(axis=1, keepdims=True)
    off = rng.random(n) < 0.25
    p[off] = 0.5
    y = (rng.random(n) > p[:, 0]).astype(np.int64)
    s = 2.0 * u
    z = s - np.log(np.exp(s).sum(axis=1, keepdims=True))
    mass = np.where(off, rng.uniform(0.005, 0.02, n), rng.uniform(0.3, 0.9, n))
    return z, y, mass, p


def test_a_gate_is_chosen_where_low_mass_items_are_wrong() -> None:
    z, y, mass, _ = massy_world(600, np.random.default_rng(1))
    confidence = np.exp(z).max(axis=1)
    correct = z.argmax(axis=1) == y
    chosen, note = choose_min_choice_mass(
        confidence, correct, mass, target_precision=TARGET, delta=DELTA
    )
    assert chosen > 0.02 and "raised the coverage certified" in note  # above the low band


def test_no_gate_where_the_mass_says_nothing() -> None:
    z, y, _, _ = massy_world(600, np.random.default_rng(2))
    mass = np.random.default_rng(3).uniform(0.3, 0.9, 600)  # unrelated to being right
    confidence = np.exp(z).max(axis=1)
    chosen, note = choose_min_choice_mass(
        confidence, z.argmax(axis=1) == y, mass, target_precision=TARGET, delta=DELTA
    )
    assert chosen == 0.0 and "choice-mass check: none" in note
    same, _ = choose_min_choice_mass(
        confidence, z.argmax(axis=1) == y, np.ones(600), target_precision=TARGET, delta=DELTA
    )
    assert same == 0.0


def test_the_certificate_covers_the_rule_with_the_chosen_gate() -> None:
    """In simulation: 100 calibration sets of 500 items; the served rule (the chosen gate in it)
    keeps its precision on a fresh sample in all but delta of them, and the gate is chosen."""
    fresh_z, _, fresh_mass, fresh_p = massy_world(20_000, np.random.default_rng(0))
    failures, gated = 0, 0
    resamples = 100
    for r in range(resamples):
        z, y, mass, _ = massy_world(500, np.random.default_rng(500 + r))
        profile = fit_profile(
            "sim",
            LabeledScores(z, mass, y),
            CHOICES,
            Provenance(fingerprint=FINGERPRINT, dataset="synthetic", dataset_sha256="0"),
            FitSettings(seed=r, n_bootstrap=10, methods=["temperature"], target_precision=TARGET),
        ).profile
        gated += profile.min_choice_mass > 0
        assert "choice-mass check" in profile.note
        gates = Gate(profile).policy.checks(CHOICES, fresh_z, fresh_mass)
        chosen = fresh_p[np.arange(fresh_z.shape[0]), gates.best]
        if gates.accepted.any() and chosen[gates.accepted].mean() < TARGET:
            failures += 1
    bound = float(stats.beta.ppf(0.95, failures + 1, resamples - failures))
    print(f"\nmass check chosen in {gated} of {resamples}; {failures} failures (bound {bound:.3f})")
    assert bound <= DELTA and gated >= 0.8 * resamples


@pytest.mark.parametrize("given", [0.0, 0.05])
def test_a_given_minimum_is_kept(given: float) -> None:
    z, y, mass, _ = massy_world(300, np.random.default_rng(9))
    profile = fit_profile(
        "given",
        LabeledScores(z, mass, y),
        CHOICES,
        Provenance(fingerprint=FINGERPRINT, dataset="synthetic", dataset_sha256="0"),
        FitSettings(n_bootstrap=10, min_choice_mass=given),
    ).profile
    assert profile.min_choice_mass == given and "choice-mass check" not in profile.note
