"""Which items a person should label next: two streams, kept apart.

A labelling queue serves two purposes that want different items:

* **teach**: labels that improve the map fastest. Uncertainty sampling by margin (Scheffer,
  Decomain & Wrobel 2001): the items whose top two calibrated probabilities are closest, the
  ones the map is least sure how to answer. Taken alone, the most uncertain items of a pool
  crowd together (near-duplicates, one confusing topic), so the picks are spread out: among
  the ``widen`` times as many most uncertain items, a greedy k-center choice in the map's
  feature space (the core-set idea of Sener & Savarese 2018), each pick the item farthest
  from those already picked.
* **audit**: a uniform random sample, in a seeded order. Only these items may certify a
  threshold: a certificate speaks for the distribution its items were drawn from, and the
  teach stream is drawn, on purpose, from the hardest items. Taught labels may only fit a map.

Both orders are pure functions of their inputs and a seed; the queue (``service``) and the
benchmark (``benchmarks/bench_labelling.py``) call them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Sized
from typing import TypeVar

import numpy as np
import numpy.typing as npt

S = TypeVar("S", bound=str)

__all__ = [
    "TEACH_ROUND",
    "audit_order",
    "margins",
    "next_stream",
    "teach_order",
    "teach_rounds",
]

TEACH_ROUND = 10  # teach picks spread at a time, among the ``widen`` x as many most uncertain


def margins(probabilities: npt.ArrayLike) -> np.ndarray:
    """Each row's top probability minus its second: 0 is a coin toss between two choices,
    1 a certain answer. ``probabilities``: (n, k), k >= 2."""
    p = np.asarray(probabilities, dtype=np.float64)
    if p.ndim != 2 or p.shape[1] < 2:
        raise ValueError(f"probabilities must be (n, k) with k >= 2, got shape {p.shape}")
    top2 = np.sort(p, axis=1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def teach_order(
    probabilities: npt.ArrayLike,
    count: int,
    *,
    features: npt.ArrayLike | None = None,
    widen: int = 4,
) -> np.ndarray:
    """Indices of ``count`` items to label next to teach the map, from a pool of unlabeled
    items with the map's calibrated ``probabilities`` (n, k): the smallest margins, spread
    over ``features`` (n, d) where given (standardised; the greedy k-center choice among the
    ``widen * count`` smallest margins, starting from the smallest). Without features, the
    smallest margins in order. Ties break by index, so the order is reproducible."""
    m = margins(probabilities)
    n = m.shape[0]
    if not (isinstance(count, int) and count >= 0):
        raise ValueError(f"count must be an integer >= 0, got {count!r}")
    if not (isinstance(widen, int) and widen >= 1):
        raise ValueError(f"widen must be an integer >= 1, got {widen!r}")
    count = min(count, n)
    by_margin = np.argsort(m, kind="stable")
    if features is None or count <= 1:
        return by_margin[:count]
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] != n:
        raise ValueError(f"features must be ({n}, d), got shape {x.shape}")
    candidates = by_margin[: min(n, widen * count)]
    xc = x[candidates]
    scale = xc.std(axis=0)
    xc = (xc - xc.mean(axis=0)) / np.where(scale > 0, scale, 1.0)
    picked = [0]  # the most uncertain candidate first
    nearest = np.linalg.norm(xc - xc[0], axis=1)  # each candidate's distance to the picks
    for _ in range(count - 1):
        nearest[picked] = -1.0
        far = int(np.argmax(nearest))
        picked.append(far)
        nearest = np.minimum(nearest, np.linalg.norm(xc - xc[far], axis=1))
    return candidates[np.asarray(picked)]


def teach_rounds(
    probabilities: npt.ArrayLike,
    *,
    features: npt.ArrayLike | None = None,
    round_size: int = TEACH_ROUND,
    count: int | None = None,
) -> np.ndarray:
    """Every item of a pool in the order to label it to teach the map: ``teach_order`` in
    rounds of ``round_size``, each spread among the most uncertain of what is left (one spread
    over the whole pool would order it by distance alone). ``count``: the first ``count`` of
    that order only, for a caller that shows the next few: the same items, since a round reads
    only what the rounds before it left, at the cost of a few rounds instead of a round per
    ``round_size`` items of the pool (each as long as the pool: the whole order of thousands
    took seconds)."""
    p = np.asarray(probabilities, dtype=np.float64)
    x = None if features is None else np.asarray(features, dtype=np.float64)
    if not (isinstance(round_size, int) and round_size >= 1):
        raise ValueError(f"round_size must be an integer >= 1, got {round_size!r}")
    if count is not None and not (isinstance(count, int) and count >= 0):
        raise ValueError(f"count must be an integer >= 0, got {count!r}")
    left = np.arange(p.shape[0])
    order: list[int] = []
    while left.shape[0] and (count is None or len(order) < count):
        chosen = teach_order(
            p[left], min(round_size, left.shape[0]), features=None if x is None else x[left]
        )
        picks = left[chosen]
        order.extend(picks.tolist())
        left = np.setdiff1d(left, picks)
    return np.asarray(order[:count], dtype=np.int64)


def audit_order(n: int, seed: int) -> np.ndarray:
    """The audit stream's order of ``n`` pool items: a uniform random permutation from
    ``seed``, so that every prefix is a uniform sample without replacement."""
    if not (isinstance(n, int) and n >= 0):
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    return np.random.default_rng(seed).permutation(n)


def next_stream(
    streams: Sequence[S], pending: Mapping[S, Sized], turn: int
) -> tuple[S, int] | None:
    """Which of ``streams``, taking turns from the ``turn``-th, gives the next item (an empty
    one passes its turn on), and the turn after it; None when every one is empty. A queue
    keeps the turn and its streams' pending items (``pending``)."""
    for step in range(len(streams)):
        stream = streams[(turn + step) % len(streams)]
        if len(pending[stream]):
            return stream, (turn + step + 1) % len(streams)
    return None
