"""Certifying again and again from a growing decision log: one delta, spent over every look.

``judge calibrate --from-log`` refits a profile on the audited, labelled decisions of its log and
certifies the new threshold on those the new map was not fitted on. As labels keep coming it is
run again and again, and each run is a new look: a new map, certified on data that overlaps the
last look's. Each look's certificate fails with probability up to the delta it is tested at, so
k looks at the full delta each would fail somewhere in the sequence with probability up to
k * delta, and a user who re-certifies until the gate opens would be served a failed certificate
far more often than delta says.

The looks of one lineage (a profile and every profile refitted from it, under any name) spend
one delta between them instead: the k-th look is tested at

    delta_k = delta * 6 / (pi^2 k^2),            sum over k >= 1 of delta_k = delta,

since the sum of 1 / k^2 is pi^2 / 6. By the union bound, which needs no independence between
the looks (they reuse the same labels), the probability that any certificate of the sequence
fails, however many looks it has, is at most delta: each profile's claim holds jointly with every
earlier and later one's. The first look pays 0.61 delta, the fifth delta / 41, the tenth
delta / 164. The Clopper-Pearson bound depends on the level through log(1 / delta_k), so the
cost grows slowly, but it is real on a few hundred labels: on sst2 (benchmarks/RESULTS.md,
bench_log_features), five looks at 100, ..., 500 labels left the gate shut where one look at
500 certified half the test items. Look when the labels are likely enough
(``labels_to_certify``), not at every new one. The profile records its look
(``Recertification``), and the next refit reads it from the profile it refits.

What each look needs, besides: its certify items never seen by its own fit (``fit_profile``'s
split) and drawn like the traffic the certificate speaks about (the audit sample is a uniform
random share of decisions); and its time chosen without peeking at how the certify items came
out (nightly, or every N new labels, is fine; "again right after a lucky day" is not). An
anytime-valid confidence sequence would lift that last condition, at a price in coverage at
every look.

``labels_to_certify`` answers the other question a growing log asks: at the precision and
acceptance the labelled decisions show, about how many labels would open the gate.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated

import msgspec
import numpy as np
from msgspec import Meta

from calibration.certificates.certify import DEFAULT_GRID, _check_grid, _lower_bounds
from calibration.limits import FEW_LABELS
from calibration.validation import check_confidences, check_correct, check_int, check_unit_open

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import numpy.typing as npt
    from numpy.typing import ArrayLike

__all__ = [
    "LabelsNeeded",
    "Recertification",
    "labels_to_certify",
    "look_delta",
    "next_look_delta",
]

# Labels beyond which the estimate gives up: a gate that needs more is, in practice, shut.
MAX_LABELS = 1_000_000
# "Likely": the labels estimated would certify in this share of draws, were the precision and
# acceptance the labelled items show the truth.
POWER = 0.8


def look_delta(delta: float, look: int) -> float:
    """The delta the ``look``-th certification of a lineage is tested at: delta * 6/(pi k)^2."""
    delta = check_unit_open(delta, "delta")
    look = check_int(look, "look", 1)
    return delta * 6.0 / (math.pi * look) ** 2


class Recertification(msgspec.Struct, frozen=True, kw_only=True):
    """Where a profile stands in its lineage's looks: refitted from its decision log, or
    certified by the labelling queue on the labels so far."""

    look: Annotated[int, Meta(ge=1)]  # 1: the first look; k: the k-th
    # The whole sequence's delta: every look's certificate holds at once w.p. >= 1 - delta.
    delta: Annotated[float, Meta(gt=0.0, lt=1.0)]
    spent: Annotated[float, Meta(gt=0.0, lt=1.0)]  # this look's: look_delta(delta, look)
    # Where its labels came from: the decision log it was refitted from (a password masked),
    # or the split file the labelling queue wrote (``calibration.tasks.item_queue``).
    log: str

    @classmethod
    def after(cls, before: Recertification | None, delta: float, log: str) -> Recertification:
        """The next look of a lineage whose last refit was ``before`` (None: the first
        refit from a log), for a sequence spending ``delta``."""
        look = 1 if before is None else before.look + 1
        return cls(look=look, delta=delta, spent=look_delta(delta, look), log=log)


def next_look_delta(before: Recertification | None, delta: float) -> float:
    """The delta the next refit from the log certifies at, after a profile whose look is
    ``before`` (None: not refitted from a log yet; its lineage then spends ``delta``)."""
    return look_delta(
        delta if before is None else before.delta, 1 if before is None else before.look + 1
    )


class LabelsNeeded(msgspec.Struct, frozen=True, kw_only=True):
    """How many labelled decisions would likely open the gate, and the threshold that would."""

    given: int
    reason: str
    # None, each of them: no number of labels would (``reason`` says why).
    labels: int | None = None  # in all, certify and fit items together
    more: int | None = None  # beyond the ``given``; 0: enough already
    threshold: float | None = None  # the grid threshold that would open first
    precision: float | None = None  # estimated among the items it accepts, (hits + 1) / (n + 2)
    acceptance: float | None = None  # the share of items it accepts


def _certifies(
    trials: npt.NDArray[np.int64],
    precision: npt.NDArray[np.float64],
    target: float,
    delta: float,
) -> npt.NDArray[np.bool_]:
    """Whether ``trials`` accepted items of true ``precision`` (each pair of the two arrays)
    certify ``target`` at ``delta`` in ``POWER`` of draws: the bound at their hits' 1 - POWER
    quantile does. One array call: scipy's per-call overhead, not the arithmetic, is the cost."""
    from scipy import stats  # here: scipy is a server dependency, not the client's

    hits = stats.binom.ppf(1 - POWER, trials, precision).astype(np.int64)
    return _lower_bounds(hits, trials, delta) >= target


def _fewest_certify_items(
    rate: npt.NDArray[np.float64], precision: npt.NDArray[np.float64], target: float, delta: float
) -> npt.NDArray[np.int64]:
    """Per threshold (the rate it accepts, the precision it shows): the fewest certify items
    whose accepted ones certify, by bisection on 1..MAX_LABELS (the bound grows with them); -1
    where even MAX_LABELS would not. The thresholds' bisections run in lockstep, each with the
    steps it would take alone, so a fit pays about 21 array calls, not 21 per threshold."""

    def certifies(
        items: npt.NDArray[np.int64], where: npt.NDArray[np.bool_]
    ) -> npt.NDArray[np.bool_]:
        return _certifies(
            np.round(items * rate[where]).astype(np.int64), precision[where], target, delta
        )

    everywhere = np.ones(rate.shape, dtype=bool)
    feasible = certifies(np.full(rate.shape, MAX_LABELS, dtype=np.int64), everywhere)
    low = np.ones(rate.shape, dtype=np.int64)
    high = np.full(rate.shape, MAX_LABELS, dtype=np.int64)
    while True:
        active = feasible & (low < high)
        if not active.any():
            break
        mid = (low[active] + high[active]) // 2
        ok = certifies(mid, active)
        high[active] = np.where(ok, mid, high[active])
        low[active] = np.where(ok, low[active], mid + 1)
    return np.where(feasible, low, -1)


def labels_to_certify(
    confidences: ArrayLike,
    correct: ArrayLike | None,
    *,
    target_precision: float,
    delta: float,
    certify_share: float,
    given: int | None = None,
    grid: Sequence[float] = DEFAULT_GRID,
    labels_for: Callable[[int], int | None] | None = None,
    expected: ArrayLike | None = None,
) -> LabelsNeeded:
    """About how many labelled items would certify ``target_precision`` at ``delta``.

    For each grid threshold, take the precision the given items show there (with Laplace's
    rule of succession, (hits + 1) / (accepted + 2)) and their acceptance rate as the truth,
    and find the fewest certify items whose Clopper-Pearson bound (at ``delta``, on the
    expected accepted items) reaches the target in ``POWER`` (80%) of draws of their hits;
    divide by ``certify_share``, the certify split's share of a fit's items. The answer is the
    smallest over thresholds. It is an estimate ("likely"), not a promise: the precision is
    itself estimated (from a hundred items it can be off by several points, and the labels
    needed by a factor of several), a refit map may be sharper or duller than the one that
    made the confidences, and the fixed sequence must also start at or above the threshold
    found. Where no threshold qualifies on fewer than ``FEW_LABELS`` items, it says they are
    too few to tell, never that more labels will not help.

    Parameters
    ----------
    confidences : array of shape (n,)
        The served rule's confidence in each labelled item's answer (0 where another gate
        escalated it).
    correct : array of shape (n,)
        Whether each answer was right.
    certify_share : float in (0, 1]
        The share of labelled items a refit certifies on (0.5 for the scalar maps' split,
        0.4 for a probe's).
    given : the labelled items there are in all (default: n); ``more`` counts from it.
    labels_for : the labels that give a fit that many certify items, or None where none
        would (default: that many divided by ``certify_share``): where the certify split's
        share is not a constant (``calibration.limits.allot``, beside taught labels).
    expected : array of shape (n,), in place of ``correct`` (None)
        The probability that each answer is right, as a calibrated map says it (its
        confidence in the answer): an estimate that reads no label, for deciding when to
        certify without looking at the labels the certificate will rest on.
    """
    conf = check_confidences(confidences)
    if (correct is None) == (expected is None):
        raise ValueError("give correct or expected, not both and not neither")
    if expected is not None:
        hits = check_confidences(expected, "expected")
    else:
        assert correct is not None  # one of the two, checked above
        hits = check_correct(correct, conf.shape[0]).astype(np.float64)
    if hits.shape != conf.shape:
        raise ValueError(f"expected must have shape {conf.shape}, got {hits.shape}")
    target = check_unit_open(target_precision, "target_precision")
    delta = check_unit_open(delta, "delta")
    if not (isinstance(certify_share, int | float) and 0 < certify_share <= 1):
        raise ValueError(f"certify_share must be in (0, 1], got {certify_share!r}")
    shown = int(conf.shape[0])
    n = shown if given is None else check_int(given, "given", 0)
    thresholds, rates, precisions = [], [], []
    for t in _check_grid(grid):
        accepted = conf >= t
        if not accepted.any():
            continue
        # Laplace's rule of succession: a perfect record on a few items promises less than 1.
        precision = float((hits[accepted].sum() + 1) / (accepted.sum() + 2))
        if precision > target:
            thresholds.append(float(t))
            rates.append(float(accepted.mean()))
            precisions.append(precision)
    fewest = _fewest_certify_items(
        np.asarray(rates, dtype=np.float64), np.asarray(precisions, dtype=np.float64), target, delta
    )
    best: tuple[int, float, float, float] | None = None  # (labels, threshold, precision, rate)
    for t, rate, precision, items in zip(
        thresholds, rates, precisions, fewest.tolist(), strict=True
    ):
        if items < 0:
            continue
        labels = math.ceil(items / certify_share) if labels_for is None else labels_for(items)
        if labels is None:
            continue
        if best is None or labels < best[0]:
            best = (labels, t, precision, rate)
    read = (
        "items' calibrated confidence shows" if expected is not None else "labelled items read show"
    )
    if best is None and shown < FEW_LABELS:
        return LabelsNeeded(
            given=n,
            reason=f"at no threshold do the {shown} {read} a precision above {target:g} that "
            f"a certificate could confirm: too few to tell whether more labels would (from "
            f"about {FEW_LABELS} they say)",
        )
    if best is None:
        return LabelsNeeded(
            given=n,
            reason=f"at no threshold do the {shown} {read} a precision "
            f"above {target:g} that a certificate could confirm: at the precision they show, "
            "more labels will not open the gate for this map (a sharper one might: a probe "
            "fitted from the log with --log-features, a better model, a clearer prompt)",
        )
    labels, t, precision, rate = best
    more = max(0, labels - n)
    return LabelsNeeded(
        labels=labels,
        more=more,
        given=n,
        threshold=t,
        precision=precision,
        acceptance=rate,
        reason=f"at threshold {t:g} the {shown} {read} precision about "
        f"{precision:.3f} with {rate:.1%} accepted; about {labels} labels in all ({more} more "
        f"than the {n} there are) would certify {target:g} at delta {delta:.3g}, if the "
        "next map is as good as this one",
    )
