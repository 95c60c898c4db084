"""Where a fit's labels go (issue 66): taught labels fill the fit split first and the uniform
labels go where the certificate needs them; the profile records the allotment, and the split is
recomputed from it."""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np
from fakes import FINGERPRINT

from calibration import CalibrationProfile, FitSettings, LabeledScores, Provenance, fit_profile
from calibration.fitting import profile_split, split_examples, split_with_taught
from calibration.limits import allot, certify_share, uniform_to_certify
from calibration.profile import DataSplit


def test_taught_labels_fill_the_fit_split_first() -> None:
    # 200 taught and 200 uniform labels, a probe's split (5:1:4): the taught ones are the
    # fit split's half, so every uniform label sets the quantile (1) or certifies (4).
    assert allot(200, 200, probe=True) == (0, 40, 160)
    # Fewer taught than the fit split's share: uniform labels make up the rest.
    assert allot(100, 300, probe=True) == (100, 40, 160)
    # None taught: the pattern's shares of the uniform labels.
    assert allot(0, 400, probe=True) == (200, 40, 160)
    assert allot(0, 400, probe=False) == (120, 80, 200)
    # More taught than the fit split wants: still every uniform label certifies or sets q.
    assert allot(300, 100, probe=True) == (0, 20, 80)


def test_the_uniform_labels_a_certificate_needs() -> None:
    # 160 certify items beside 200 taught: 200 uniform labels (1:4 with the quantile).
    assert uniform_to_certify(160, 200, probe=True) == 200
    # None taught: the fit split takes half of them too.
    assert uniform_to_certify(160, 0, probe=True) == 400
    # A queue alternating its streams: every uniform label comes with a taught one, so past
    # the taught ones given, none of the new uniform labels is needed to fit.
    assert uniform_to_certify(160, 0, probe=True, alternating=True) == 200
    assert certify_share(True) == 0.4 and certify_share(False) == 0.5


def labels_and_taught(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n)
    taught = rng.random(n) < 0.5
    return labels, taught


def test_by_role_keeps_taught_labels_out_of_the_held_out_splits() -> None:
    labels, taught = labels_and_taught(400)
    fit, quantile, certify, n_taught = split_with_taught(labels, 7, True, taught)
    assert n_taught == taught.sum()
    assert set(np.flatnonzero(taught)) <= set(fit)  # every taught label fits
    held = np.concatenate([quantile, certify])
    assert not taught[held].any()
    counts = allot(int(taught.sum()), int((~taught).sum()), True)
    assert (fit.shape[0] - n_taught, quantile.shape[0], certify.shape[0]) == counts
    assert np.intersect1d(fit, held).size == 0 and fit.size + held.size == labels.size
    # Each part dealt out evenly over the labels: the certify split's label shares are the
    # uniform labels' own, within one item of each.
    share = np.bincount(labels[~taught], minlength=3) / (~taught).sum()
    assert np.abs(np.bincount(labels[certify], minlength=3) - share * certify.size).max() <= 1.5


def test_a_profile_records_its_allotment_and_the_split_is_recomputed_from_it() -> None:
    labels, taught = labels_and_taught(300, seed=2)
    allotments: tuple[Literal["by_role", "pattern"], ...] = ("by_role", "pattern")
    for allotment in allotments:
        fit, quantile, certify, n = split_with_taught(labels, 5, True, taught, allotment)
        recorded = DataSplit(
            fit=fit.size,
            conformal=quantile.size,
            certify=certify.size,
            seed=5,
            taught=n,
            allotment=allotment,
        )
        again = profile_split(labels, recorded, taught)
        assert all(
            np.array_equal(a, b) for a, b in zip(again, (fit, quantile, certify), strict=True)
        )
    # A profile written before the field existed split the uniform labels by the pattern:
    # that is what it reads as.
    old = msgspec.json.decode(
        b'{"fit": 1, "conformal": 1, "certify": 1, "seed": 0, "taught": 1}', type=DataSplit
    )
    assert old.allotment == "pattern"
    # With nothing taught, both allotments are the split there always was.
    plain = split_with_taught(labels, 5, True, None)[:3]
    assert all(
        np.array_equal(a, b) for a, b in zip(plain, split_examples(labels, 5, True), strict=True)
    )


def synthetic(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Log-probabilities that carry the label: right about 85% of the time."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, k, n)
    z = rng.normal(0, 1, (n, k))
    z[np.arange(n), labels] += 2.5
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True)), labels


def fitted(
    k: int, taught: np.ndarray | None = None, n: int = 400
) -> tuple[CalibrationProfile, np.ndarray]:
    z, labels = synthetic(n, k)
    choices = [f"c{j}" for j in range(k)]
    settings = FitSettings(n_bootstrap=20, methods=["temperature"])
    return fit_profile(
        "p",
        LabeledScores(z, np.ones(len(labels)), labels, fit_only=taught),
        choices,
        Provenance(fingerprint=FINGERPRINT, dataset="d", dataset_sha256="0"),
        settings,
    ).profile, z


def test_taught_labels_fit_and_the_uniform_ones_certify() -> None:
    rng = np.random.default_rng(4)
    taught = rng.random(400) < 0.5
    profile, _ = fitted(3, taught)
    s = profile.split
    assert s.taught == taught.sum() and s.allotment == "by_role"
    fit_u, quantile, certify = allot(s.taught, 400 - s.taught, probe=False)
    assert (s.fit, s.conformal, s.certify) == (s.taught + fit_u, quantile, certify)
    # The uniform labels the old allotment would have fitted on now certify.
    assert s.certify > 0.5 * (400 - s.taught)
    # The estimate of labels to come counts uniform labels, beside the taught ones there are.
    assert profile.labels_needed is not None
    assert profile.labels_needed.given == 400 - s.taught
