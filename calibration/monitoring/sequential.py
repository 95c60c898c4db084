"""Tests and intervals that hold however often they are looked at: confidence sequences.

A monitor that runs a fixed-n test after every label raises a false alarm at rate alpha each
time, so far more often than alpha overall. The tools here hold uniformly over time: with
probability >= 1 - alpha, at no moment of the whole stream does the test reject a true
hypothesis or an interval miss the truth, so a monitor may check after every label, from cron
every minute, forever.

* ``betting_capital``: a test of "the mean of X in [0, 1] is >= m" by betting against it
  (Waudby-Smith & Ramdas 2023, "Estimating means of bounded random variables by betting",
  JRSS-B). A gambler starts with 1 and before each observation stakes a fraction lambda_i,
  chosen from the past alone, on X_i < m: capital K_t = prod (1 + lambda_i (m - X_i)). While
  the mean is >= m that is a nonnegative supermartingale, so by Ville's inequality (1939) it
  ever reaches 1/alpha with probability <= alpha: reject once it does. The stakes follow
  aGRAPA (the same paper: the Kelly-optimal bet for the running mean and variance,
  (m - mu) / (sigma^2 + (m - mu)^2), here on the recent observations' mean and variance),
  clipped to [0, c / (1 - m)] so that one observation never costs more than a share c of
  the capital.
* ``betting_bounds``: the confidence sequence those tests make, on a grid: the means not yet
  rejected at any time so far, each side at alpha / 2.
* ``asymptotic_half_width``: the Gaussian-mixture boundary of an asymptotic confidence
  sequence for a mean with finite variance (Robbins 1970; Waudby-Smith, Arbour, Sinha,
  Kennedy & Ramdas 2021, "Time-uniform central limit theory and asymptotic confidence
  sequences"): time-uniform as the CLT is fixed-n, for means that are not bounded tests.

Every guarantee needs the observations in the order they arrived, each independent of how
the next stake is chosen: labels in the order they were given, not re-sorted afterwards.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "CAP",
    "GRID",
    "MEMORY",
    "asymptotic_half_width",
    "betting_bounds",
    "betting_capital",
]

CAP = 0.5  # the largest share of the capital one observation may cost
MEMORY = 200  # about how many recent observations size each bet
GRID = np.linspace(0.0, 1.0, 1001)  # the means the confidence sequence tests


def _observations(x: ArrayLike) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1 or not np.all((arr >= 0) & (arr <= 1)):
        raise ValueError("observations must be a 1-d array of numbers in [0, 1]")
    return arr


def betting_capital(x: ArrayLike, m: ArrayLike) -> np.ndarray:
    """The capital (n, G) after each of the ``n`` observations ``x`` (in [0, 1], in arrival
    order) of a gambler betting that the mean is below each of the G means ``m`` (a number,
    or an array); above 1/alpha at any time rejects "mean >= m" at alpha. For m = 1 any
    observation below 1 rejects at once (the capital is infinite)."""
    obs = _observations(x)
    means = np.atleast_1d(np.asarray(m, dtype=np.float64))
    if not np.all((means >= 0) & (means <= 1)):
        raise ValueError("the means tested must be in [0, 1]")
    mu, var = _recent_moments(obs)
    gap = means[None, :] - mu[:, None]  # (n, G)
    with np.errstate(divide="ignore"):
        cap = np.where(means < 1, CAP / (1 - means), np.inf)  # (G,)
    stake = np.clip(gap / (var[:, None] + gap**2), 0.0, cap[None, :])
    stake = np.where(np.isinf(stake), 0.0, stake)
    factor = 1 + stake * (means[None, :] - obs[:, None])
    capital = np.cumprod(factor, axis=0)
    # Testing m = 1: one observation below 1 refutes it.
    ones = means == 1
    if ones.any():
        wrong = np.cumsum(obs < 1) > 0
        capital[:, ones] = np.where(wrong[:, None], np.inf, 1.0)
    return capital


def _recent_moments(obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mean and variance of the observations before each one, weighted toward the recent
    (each older one counts (1 - 1/MEMORY) as much) and regularised toward 1/2 and 1/4 with
    the weight of one observation: what each bet is sized on. A bet may be sized on anything
    already seen; forgetting lets it turn soon after the precision drops, where a mean over
    every label since the version began would be slow to move."""
    from scipy.signal import lfilter  # a server dependency, not the client's

    keep = 1 - 1 / MEMORY
    n = obs.shape[0]
    # The state after i observations, for i = 0..n: each sum decays by ``keep`` per step
    # (a first-order recursion: lfilter), starting from the prior's one observation.
    decay = keep ** np.arange(n + 1)
    weight = decay + (1 - decay) / (1 - keep)
    total = 0.5 * decay + np.concatenate([[0.0], lfilter([1.0], [1.0, -keep], obs)])
    deviation = (obs - total[1:] / weight[1:]) ** 2  # each observation from the mean after it
    squares = 0.25 * decay + np.concatenate([[0.0], lfilter([1.0], [1.0, -keep], deviation)])
    # Before observation i: the state after i - 1 of them.
    return total[:n] / weight[:n], squares[:n] / weight[:n]


def betting_bounds(x: ArrayLike, alpha: float) -> tuple[float, float]:
    """The confidence sequence for the mean of ``x`` (in [0, 1], in arrival order) after the
    last observation: the grid means no bet has rejected at any time so far, alpha / 2 each
    side, widened to the first rejected grid point (so conservative by at most 0.001). Where
    every mean has been rejected at some time (observations far from exchangeable: a run of
    ones, then of zeros), the means the bets reject now, at the last observation, instead."""
    obs = _observations(x)
    if obs.shape[0] == 0:
        return 0.0, 1.0
    bar = 2 / alpha

    def upper(values: np.ndarray, ever: bool) -> float:
        capital = betting_capital(values, GRID)
        rejected = (capital.max(axis=0) if ever else capital[-1]) >= bar
        first = np.flatnonzero(rejected)
        return float(GRID[first[0]]) if first.size else 1.0

    lower, high = 1.0 - upper(1.0 - obs, True), upper(obs, True)
    if lower <= high:
        return lower, high
    lower, high = 1.0 - upper(1.0 - obs, False), upper(obs, False)
    return min(lower, high), max(lower, high)


def asymptotic_half_width(n: int, variance: float, alpha: float, tuned_for: int = 500) -> float:
    """The half-width after ``n`` observations of a two-sided asymptotic confidence sequence
    for a mean whose variance is ``variance`` (the running estimate), at level 1 - alpha
    uniformly over time: sigma * sqrt(2 (n rho^2 + 1) / (n^2 rho^2) log(sqrt(n rho^2 + 1) /
    alpha)), the Gaussian-mixture boundary, rho tuned to be tightest near ``tuned_for``
    observations (Waudby-Smith, Arbour, Sinha, Kennedy & Ramdas 2021, Theorem 2.2)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if variance < 0 or not math.isfinite(variance):
        raise ValueError(f"variance must be finite and >= 0, got {variance}")
    log_a = -2 * math.log(alpha)
    rho2 = (log_a + math.log(log_a + 1)) / tuned_for
    spread = n * rho2 + 1
    return math.sqrt(variance * 2 * spread / (n**2 * rho2) * math.log(math.sqrt(spread) / alpha))
