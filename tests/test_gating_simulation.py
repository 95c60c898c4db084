"""The certificate holds for the whole fitting procedure, map fitting included, in simulation.

A synthetic world with a known truth: each item has true choice probabilities p = softmax(u),
its label is drawn from p, and the "model" reports miscalibrated log-probabilities
log_softmax(2.5 u + b), overconfident and biased towards the first choice. Each resample draws
a fresh calibration set, fits a profile on it (map, conformal quantile, certified threshold),
and the served policy, the profile's own ``Policy.gates``, is then measured on a large fresh
sample by its expected precision (the mean true probability of the chosen answer over the
accepted items, which has far less noise than sampled labels). The guarantee says that
precision falls below the target in at most delta of the resamples; the policy must also
accept a real fraction of items, since the oracle could accept about 65% at this precision.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from calibration import fit_profile

K = 3
TARGET, DELTA = 0.9, 0.1
RESAMPLES, N_CALIBRATION, N_FRESH = 500, 500, 20_000
CHOICES = ["a", "b", "c"]
CONFIGURATION: dict[str, Any] = {
    "model": "synthetic",
    "model_sha256": None,
    "dtype": "float64",
    "response_prefix": "",
    "response_suffix": "",
    "system": None,
}


def world(
    n: int, rng: np.random.Generator
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """(log-probabilities the model reports, labels, true probabilities), n items."""
    u = rng.normal(0.0, 2.5, size=(n, K))
    p = np.exp(u) / np.exp(u).sum(axis=1, keepdims=True)
    y = (rng.random(n)[:, None] > np.cumsum(p, axis=1)).sum(axis=1)
    s = 2.5 * u + np.array([0.8, 0.0, -0.8])
    z = s - np.log(np.exp(s).sum(axis=1, keepdims=True))
    return z, y.astype(np.int64), p


def simulate(
    resamples: int,
    n: int,
    *,
    target: float = TARGET,
    delta: float = DELTA,
    procedure: str = "fixed_sequence",
) -> tuple[list[float], list[float]]:
    """Per resample of ``n`` calibration items: the served policy's true precision on the fresh
    sample (nan if it accepts nothing) and its coverage. benchmarks/bench_gating.py runs this
    too, once per multiple-testing procedure."""
    fresh_z, _, fresh_p = world(N_FRESH, np.random.default_rng(0))
    precision, coverage = [], []
    for r in range(resamples):
        z, y, _ = world(n, np.random.default_rng(1000 + r))
        profile = fit_profile(
            "sim",
            z,
            y,
            CHOICES,
            **CONFIGURATION,
            dataset="synthetic",
            dataset_sha256="0",
            target_precision=target,
            delta=delta,
            seed=r,
            n_bootstrap=10,  # the metrics are evidence only; the rule does not depend on them
            procedure=procedure,
        )
        gates = profile.policy().gates(CHOICES, fresh_z)
        accepted = gates.accepted
        coverage.append(float(accepted.mean()))
        chosen = fresh_p[np.arange(N_FRESH), gates.best]
        precision.append(float(chosen[accepted].mean()) if accepted.any() else float("nan"))
    return precision, coverage


@pytest.fixture(scope="module")
def outcomes() -> tuple[list[float], list[float]]:
    return simulate(RESAMPLES, N_CALIBRATION)


def test_precision_falls_below_target_in_at_most_delta_of_resamples(
    outcomes: tuple[list[float], list[float]],
) -> None:
    precision, _ = outcomes
    failures = sum(1 for p in precision if p < TARGET)  # nan (nothing accepted) is no failure
    print(f"\n{failures} of {RESAMPLES} resamples below precision {TARGET} (delta {DELTA})")
    assert failures <= DELTA * RESAMPLES


def test_the_policy_is_not_vacuous(outcomes: tuple[list[float], list[float]]) -> None:
    precision, coverage = outcomes
    certified = sum(1 for p in precision if p == p)
    print(f"\ncertified in {certified} of {RESAMPLES}; mean coverage {np.mean(coverage):.3f}")
    assert certified >= 0.8 * RESAMPLES
    assert np.mean(coverage) >= 0.25
