"""One certificate for a cascade's whole rule: the stages' thresholds chosen and certified together.

A cascade of S stages decides an item at the first stage whose gates accept it: stage s accepts
when its other gates pass (choice mass, a single-choice conformal set, ...; ``StageView.eligible``)
and its calibrated confidence reaches its threshold t_s, or never, where t_s is None. What the
last stage escalates goes to a person. The *rule* is the tuple (t_1, ..., t_S); its precision is
that of every item the cascade accepts, whichever stage accepted it.

``certify_rules`` certifies rules with one family-wise guarantee: with probability at least
1 - delta over the certification items, every rule it certifies has true precision >= target.

* **The family, fixed before the certification items are seen.** Every tuple over a grid fixed
  in advance (``DEFAULT_GRID`` for two stages, ``COARSE_GRID`` beyond, plus None), all None
  left out. "Stage s alone" (every other threshold None) is among them, so the method never
  forces the chosen rule below a single stage's.
* **A sequence from independent items.** On the *ordering* items (labeled items the
  certification does not use), each rule's precision and coverage are measured and the rules on
  the precision-coverage frontier are kept, ordered by falling precision (rising coverage). The
  sequence starts at the rule whose test is most likely to pass on the certification items (the
  highest Clopper-Pearson lower bound expected at the ordering items' precision and acceptance
  rate, as ``certify.sequence_start`` picks a single threshold's start).
* **Fixed-sequence testing at the full delta.** Along the sequence, H_r: "precision(r) <
  target" is rejected when the one-sided Clopper-Pearson lower bound at level delta of the
  certification items r accepts is >= target (exact: given the count accepted, the correct ones
  are binomial); the first failure ends the sequence. The order depends on the ordering items
  only, so it is fixed given them, and fixed-sequence testing then controls the family-wise
  error at delta (Maurer, Hothorn & Lehmacher 1995; "Learn then Test", Angelopoulos et al.
  2021, section 4). Every rule certified holds together, so choosing among them keeps the
  guarantee.
* **The choice.** Among certified rules, the one with the most certification coverage, and
  among those the least expected cost per item: every stage up to the deciding one runs, each
  at its cost, and none after the rule's last stage that may accept (a stage at None past it
  would only pass every item on: leave it out of the served cascade).

What must hold for the argument: the stages' maps, conformal quantiles and gates were fitted
without the certification items, and those are drawn like the items served. ``fit_cascade``
certifies on the items every stage's own fit held out for its certificate.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from calibration.certificates.certify import DEFAULT_GRID, clopper_pearson_lower, minimum_accepted

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    from calibration.policy import Checks

__all__ = [
    "COARSE_GRID",
    "CascadeCertificate",
    "CascadeRule",
    "StageView",
    "certify_rules",
    "measure_rule",
    "rule_decisions",
]

# Beyond two stages the tuples of DEFAULT_GRID are too many to measure (52^3): 0.50, 0.55, ...,
# 0.95 and 0.99.
COARSE_GRID: tuple[float, ...] = (*(round(0.50 + 0.05 * i, 2) for i in range(10)), 0.99)

METHOD = "clopper-pearson, fixed-sequence testing over the stages' threshold tuples (LTT)"


@dataclass(frozen=True)
class StageView:
    """What one stage's gates say about n items: its top choice, that choice's calibrated
    confidence, and whether every gate but the threshold passes."""

    best: np.ndarray  # (n,) int
    confidence: np.ndarray  # (n,) float
    eligible: np.ndarray  # (n,) bool

    @classmethod
    def of(cls, gates: Checks) -> StageView:
        return cls(gates.best, gates.confidence, gates.eligible)

    def rows(self, index: np.ndarray) -> StageView:
        return StageView(self.best[index], self.confidence[index], self.eligible[index])


class CascadeRule(msgspec.Struct, frozen=True, kw_only=True):
    """A rule and what it does on a set of items."""

    thresholds: list[float | None]  # per stage; None: the stage never accepts
    n: int
    n_accepted: int
    n_correct: int  # accepted items whose decided choice is the label
    coverage: float  # share of the items accepted, by any stage
    stage_coverage: list[float]  # share of the items each stage decides
    precision: float | None  # accuracy on the accepted items; None where none is accepted
    # Every stage up to the deciding one runs, each at its cost, none past the last that may
    # accept.
    cost_per_item: float


class CascadeCertificate(msgspec.Struct, frozen=True, kw_only=True):
    """The chosen rule on the certification items, and the evidence for it."""

    rule: CascadeRule | None  # None: no rule certified (every item goes to a person)
    precision_lower_bound: float | None  # the chosen rule's, at level delta
    target_precision: float
    delta: float
    candidates: int  # tuples in the family
    sequence: int  # rules on the ordering items' frontier
    tested: int  # tested from the start down to the first failure
    certified: int
    method: str
    reason: str


def rule_decisions(
    stages: Sequence[StageView], thresholds: Sequence[float | None]
) -> tuple[np.ndarray, np.ndarray]:
    """Which stage decides each item under ``thresholds`` (its index; -1: a person) and the
    decided choice (-1 where none), as the cascade serves them."""
    n = stages[0].best.shape[0]
    decided_by = np.full(n, -1, dtype=np.int64)
    choice = np.full(n, -1, dtype=np.int64)
    for s, (view, t) in enumerate(zip(stages, thresholds, strict=True)):
        if t is None:
            continue
        takes = (decided_by < 0) & view.eligible & (view.confidence >= t)
        decided_by[takes] = s
        choice[takes] = view.best[takes]
    return decided_by, choice


def measure_rule(
    stages: Sequence[StageView],
    labels: np.ndarray,
    thresholds: Sequence[float | None],
    costs: Sequence[float],
) -> CascadeRule:
    """What the rule ``thresholds`` does on the items the stages view: coverage, each stage's
    share, precision against ``labels`` and the expected cost per item."""
    decided_by, choice = rule_decisions(stages, thresholds)
    n = labels.shape[0]
    accepted = decided_by >= 0
    n_accepted = int(accepted.sum())
    n_correct = int((choice[accepted] == labels[accepted]).sum())
    shares = [float((decided_by == s).mean()) if n else 0.0 for s in range(len(stages))]
    # Stage s runs for every item no earlier stage decided, up to the last stage that may
    # accept: the stages after it would only pass every item on (the first always runs: a
    # request is judged once however it is decided).
    last = max((s for s, t in enumerate(thresholds) if t is not None), default=0)
    reached = 1.0
    cost = 0.0
    for s, c in enumerate(costs[: last + 1]):
        cost += reached * c
        reached -= shares[s]
    return CascadeRule(
        thresholds=list(thresholds),
        n=n,
        n_accepted=n_accepted,
        n_correct=n_correct,
        coverage=n_accepted / n if n else 0.0,
        stage_coverage=shares,
        precision=n_correct / n_accepted if n_accepted else None,
        cost_per_item=cost,
    )


def _expected_bound(rule: CascadeRule, n_certify: int, delta: float) -> float:
    """The Clopper-Pearson lower bound a certification set of ``n_certify`` items is expected to
    give ``rule``, at the acceptance rate and precision it shows on the ordering items."""
    m = round(rule.coverage * n_certify)
    if m == 0 or rule.precision is None:
        return 0.0
    return clopper_pearson_lower(round(rule.precision * m), m, delta)


def certify_rules(
    ordering: Sequence[StageView],
    ordering_labels: ArrayLike,
    certify: Sequence[StageView],
    certify_labels: ArrayLike,
    *,
    target_precision: float,
    delta: float,
    costs: Sequence[float] | None = None,
    grid: Sequence[float] | None = None,
) -> CascadeCertificate:
    """The cascade rule to serve, certified as the module says: ``ordering`` and ``certify`` are
    the stages' views of two disjoint sets of labeled items (the first orders the family, the
    second certifies it), ``costs`` each stage's cost per item (None: 1 each)."""
    y_order = np.asarray(ordering_labels, dtype=np.int64)
    y_cert = np.asarray(certify_labels, dtype=np.int64)
    n_stages = len(certify)
    costs = list(costs) if costs is not None else [1.0] * n_stages
    if len(ordering) != n_stages or len(costs) != n_stages:
        raise ValueError("ordering, certify and costs must give one entry per stage")
    steps = list(grid if grid is not None else DEFAULT_GRID if n_stages <= 2 else COARSE_GRID)
    family = [t for t in itertools.product([None, *steps], repeat=n_stages) if any(t)]

    measured = [measure_rule(ordering, y_order, t, costs) for t in family]
    # The frontier: by falling precision (ties: more coverage, then less cost first), keep a
    # rule only where it covers more than every rule before it.
    ranked = sorted(
        (r for r in measured if r.precision is not None),
        key=lambda r: (-(r.precision or 0.0), -r.coverage, r.cost_per_item),
    )
    sequence: list[CascadeRule] = []
    for r in ranked:
        if not sequence or r.coverage > sequence[-1].coverage:
            sequence.append(r)
    n_cert = y_cert.shape[0]
    certified: list[tuple[CascadeRule, float]] = []
    tested = 0
    reason = "no rule accepts any of the ordering items"
    if sequence:
        bounds = [_expected_bound(r, n_cert, delta) for r in sequence]
        start = int(np.argmax(bounds))  # the first of the highest: the most precise of them
        reason = ""
        for r in sequence[start:]:
            tested += 1
            on_cert = measure_rule(certify, y_cert, r.thresholds, costs)
            k = on_cert.n_correct
            bound = clopper_pearson_lower(k, on_cert.n_accepted, delta) if k else 0.0
            if bound < target_precision:
                needed = minimum_accepted(target_precision, delta)
                reason = (
                    f"the sequence ended at thresholds {r.thresholds}: {on_cert.n_accepted} "
                    f"certification items accepted, precision "
                    f"{on_cert.precision if on_cert.precision is not None else 0:.3f}, lower "
                    f"bound {bound:.3f} < target {target_precision}"
                    + (f" (a test needs at least {needed} accepted)" if k < needed else "")
                )
                break
            certified.append((on_cert, bound))
    chosen = (
        max(certified, key=lambda rb: (rb[0].coverage, -rb[0].cost_per_item)) if certified else None
    )
    return CascadeCertificate(
        rule=chosen[0] if chosen else None,
        precision_lower_bound=chosen[1] if chosen else None,
        target_precision=target_precision,
        delta=delta,
        candidates=len(family),
        sequence=len(sequence),
        tested=tested,
        certified=len(certified),
        method=METHOD,
        reason=reason if chosen is None else "certified",
    )
