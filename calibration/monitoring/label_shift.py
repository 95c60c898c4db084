"""Label shift: the class mix of live traffic moving away from the one a certificate was
measured on, seen without labels, estimated, and corrected for.

Under label shift the inputs of each class look as they always did; only how often each
class comes changes (p_t(x | y) = p_s(x | y), pi_t != pi_s). A certificate measured on the
source mix then speaks for other traffic: the precision of accepted items is a mix of the
classes' precisions, weighted anew. Three tools:

* ``mix_shift``: has the mix moved? A test that holds however often it is run: for each
  choice, the share of live decisions whose answer it is, bet against (``calibration
  .sequential``) being inside the Clopper-Pearson interval of its share among the profile's
  reference items (held-out calibration items: the source mix, as the map answers it). Under
  no shift of any kind the answers' mix is the reference's; a label shift moves it (and so
  does a covariate shift strong enough to move the answers: either way the certificate's
  premise is broken). alpha is split: half for the reference intervals, half for the bets,
  each Bonferroni over the choices.
* ``em_prior``: the live class prior, estimated from the calibrated probabilities of
  unlabelled decisions by expectation-maximisation (Saerens, Latinne & Decaestecker 2002,
  "Adjusting the outputs of a classifier to new a priori probabilities"): the maximum
  likelihood prior under label shift, for a map calibrated on the source. ``prior_estimate``
  adds a bootstrap interval.
* ``correct``: the probabilities under the new prior, p_t(y | x) proportional to
  p_s(y | x) pi_t(y) / pi_s(y) (the same paper): what a user who opts in is served.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
from numpy.typing import ArrayLike

from calibration.monitoring.health import Reference
from calibration.validation import check_probs, check_unit_open

__all__ = [
    "MixShift",
    "PriorEstimate",
    "correct",
    "em_prior",
    "mix_shift",
    "prior_estimate",
    "prior_weights",
    "reweighted",
    "source_prior",
]

EM_STEPS = 500
EM_TOLERANCE = 1e-6
RESAMPLES = 100  # bootstrap resamples of the prior's interval


def em_prior(probabilities: ArrayLike, source_prior: ArrayLike) -> np.ndarray:
    """The class prior (k,) of the items whose calibrated probabilities (n, k) are given,
    by EM from ``source_prior`` (k,), the prior the map was calibrated under."""
    p = check_probs(probabilities, "probabilities")
    source = _prior(source_prior, p.shape[1])
    prior = source.copy()
    for _ in range(EM_STEPS):
        weighted = p * (prior / source)  # (n, k)
        new = (weighted / weighted.sum(axis=1, keepdims=True)).mean(axis=0)
        done = np.abs(new - prior).max() < EM_TOLERANCE
        prior = new
        if done:
            break
    return prior


def correct(
    probabilities: ArrayLike, source_prior: ArrayLike, target_prior: ArrayLike
) -> np.ndarray:
    """``probabilities`` (n, k) calibrated under ``source_prior``, moved to ``target_prior``."""
    p = check_probs(probabilities, "probabilities")
    return reweighted(p, prior_weights(source_prior, target_prior))


def prior_weights(source_prior: ArrayLike, target_prior: ArrayLike) -> np.ndarray:
    """Each class's weight (k,) under the move from ``source_prior`` to ``target_prior``."""
    source = np.asarray(source_prior, dtype=np.float64)
    return _prior(target_prior, source.shape[0]) / _prior(source, source.shape[0])


def reweighted(probabilities: np.ndarray, weights: ArrayLike) -> np.ndarray:
    """Probabilities (n, k) times each class's ``weights``, renormalised: Bayes' rule when
    the class prior moves and nothing else does (what ``calibration.policy.Hold`` serves)."""
    moved = probabilities * np.asarray(weights, dtype=np.float64)
    return moved / moved.sum(axis=1, keepdims=True)


def _prior(prior: ArrayLike, k: int) -> np.ndarray:
    arr = np.asarray(prior, dtype=np.float64)
    if arr.shape != (k,) or not np.all(arr > 0) or abs(arr.sum() - 1) > 1e-6:
        raise ValueError(f"a prior must be {k} positive numbers summing to 1, got {arr}")
    return arr


class PriorEstimate(msgspec.Struct, frozen=True, kw_only=True):
    """The live class prior, estimated without labels, beside the source's."""

    choices: list[str]
    source: list[float]  # the prior the map implies on its source (``source_prior``)
    estimate: list[float]  # EM on the live decisions' calibrated probabilities
    lower: list[float]  # bootstrap percentile interval, each at level 1 - alpha
    upper: list[float]
    n: int  # live decisions read
    alpha: float
    method: str = "EM (Saerens et al. 2002) on calibrated probabilities, bootstrap interval"


def source_prior(reference: Reference) -> np.ndarray | None:
    """The class prior a profile's map implies on its source: its reference items' mean
    calibrated probabilities (the prior the map is calibrated to, with far less noise than
    the labels' shares), else those items' label shares, Laplace-smoothed; no share is 0, so
    every class keeps a weight. None where the reference kept neither."""
    if reference.mean_probabilities is not None:
        means = np.maximum(np.asarray(reference.mean_probabilities, dtype=np.float64), 1e-6)
        return means / means.sum()
    if reference.label_counts is None:
        return None
    counts = np.asarray(reference.label_counts, dtype=np.float64) + 1.0
    return counts / counts.sum()


def prior_estimate(
    choices: list[str],
    probabilities: ArrayLike,
    source: ArrayLike,
    *,
    source_n: int | None = None,
    alpha: float = 0.05,
    seed: int = 0,
) -> PriorEstimate:
    """``em_prior`` with a bootstrap percentile interval (``RESAMPLES`` resamples of the
    decisions, seeded). ``source_n``: how many items ``source`` was measured on; each
    resample then draws the source prior too (Dirichlet, as the shares of that many labels
    would scatter: EM's answer moves with the prior it starts from), so that the interval
    owns the source's uncertainty as well as the live sample's."""
    alpha = check_unit_open(alpha, "alpha")
    p = check_probs(probabilities, "probabilities")
    src = _prior(source, p.shape[1])
    estimate = em_prior(p, src)
    rng = np.random.default_rng(seed)

    def resample() -> np.ndarray:
        drawn = src if source_n is None else np.maximum(rng.dirichlet(src * source_n + 1), 1e-6)
        return em_prior(p[rng.integers(0, p.shape[0], p.shape[0])], drawn / drawn.sum())

    draws = np.array([resample() for _ in range(RESAMPLES)])
    lower, upper = np.quantile(draws, [alpha / 2, 1 - alpha / 2], axis=0)
    return PriorEstimate(
        choices=list(choices),
        source=[float(v) for v in src],
        estimate=[float(v) for v in estimate],
        lower=[float(v) for v in lower],
        upper=[float(v) for v in upper],
        n=int(p.shape[0]),
        alpha=alpha,
    )


class MixShift(msgspec.Struct, frozen=True, kw_only=True):
    """Whether the live answers' mix has left the reference's: a sequential test."""

    shifted: bool
    n: int  # live decisions read, in order
    # Per choice: its share of the live answers, the reference's interval for it, and the
    # most the bet against that interval has held (k / (alpha / 2) or more: shifted).
    live: list[float]
    reference_lower: list[float]
    reference_upper: list[float]
    max_capital: list[float]
    # The live decision (1-based) at which the bet first crossed; None: it has not.
    detected_at: int | None
    alpha: float
    reason: str
    method: str = (
        "betting confidence sequence (Waudby-Smith & Ramdas 2023) on each choice's share of "
        "the answers, against the reference's Clopper-Pearson interval: anytime-valid"
    )


def mix_shift(
    reference: Reference,
    answers: ArrayLike,
    *,
    alpha: float = 0.01,
    choices: Sequence[str] | None = None,
) -> MixShift:
    """Has the mix of live answers (each decision's top choice index, in the order decided)
    left the reference's? See the module docstring; the overall false-alarm rate while
    nothing shifts is at most ``alpha``, however often this is run on the growing stream.
    ``choices``: their names, for the reason (else their indices)."""
    from scipy import stats

    from calibration.monitoring.sequential import betting_capital

    alpha = check_unit_open(alpha, "alpha")
    top = np.asarray(answers)
    k = len(reference.choice_counts)
    if top.ndim != 1 or (top.size and (top.min() < 0 or top.max() >= k)):
        raise ValueError(f"answers must be a 1-d array of choice indices in [0, {k})")
    n_ref = reference.n
    counts = np.asarray(reference.choice_counts)
    side = alpha / 2 / k  # the reference intervals' share of alpha, per choice, two-sided
    lower = np.where(counts > 0, stats.beta.ppf(side / 2, counts, n_ref - counts + 1), 0.0)
    upper = np.where(counts < n_ref, stats.beta.ppf(1 - side / 2, counts + 1, n_ref - counts), 1.0)
    lower, upper = np.nan_to_num(lower), np.nan_to_num(upper, nan=1.0)
    bar = k / (alpha / 2)  # the bets' share of alpha, Bonferroni over the choices
    capital = np.ones(k)
    first: int | None = None
    live = np.zeros(k)
    if top.size:
        for j in range(k):
            x = (top == j).astype(np.float64)
            # Two bets on one choice, averaged: its share below the interval, or above it.
            path = 0.5 * (
                betting_capital(x, lower[j])[:, 0] + betting_capital(1 - x, 1 - upper[j])[:, 0]
            )
            capital[j] = max(1.0, float(path.max()))
            crossed = np.flatnonzero(path >= bar)
            if crossed.size and (first is None or crossed[0] + 1 < first):
                first = int(crossed[0]) + 1
        live = np.bincount(top, minlength=k) / top.size
    shifted = first is not None
    worst = int(np.argmax(capital))
    named = repr(choices[worst]) if choices is not None else str(worst)
    reason = (
        f"the answers' mix left the reference's after {first} of {top.size} live decisions "
        f"(choice {named}: {live[worst]:.3f} live against [{lower[worst]:.3f}, "
        f"{upper[worst]:.3f}] in the reference); the certificate was measured on another mix"
        if shifted
        else f"the {top.size} live answers' mix is within the reference's (no bet reached {bar:g})"
    )
    return MixShift(
        shifted=shifted,
        n=int(top.size),
        live=[float(v) for v in live],
        reference_lower=[float(v) for v in lower],
        reference_upper=[float(v) for v in upper],
        max_capital=[float(v) for v in capital],
        detected_at=first,
        alpha=alpha,
        reason=reason,
    )
