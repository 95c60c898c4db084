"""A policy's checks run over n judgments at once, and the words for each check that fails.

``calibration.policy`` resolves the rule (``make_policy``) and makes its verdicts; its module
docstring lists the checks. This module runs them over (n, k) log-probabilities in numpy
(``checked``: the calibrated probabilities and each check's outcome per item, as ``Checks``),
says which failed for one item and why (``failures``: a reason code and a reason for each),
and whether the share of probability a served model did not read could change that item's
decision (``partial_logprobs``, asked of the same checks at the share's two extremes).

It reads a policy through ``Rule``, what the checks need of one, so it sits below
``calibration.policy`` and imports nothing of it: the policy asks the checks, never the other
way round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol, get_args

import msgspec
import numpy as np
import numpy.typing as npt

from calibration.certificates.conformal import set_membership
from calibration.errors import ProfileMismatchError
from calibration.maps.map_types import CalibrationMap
from calibration.monitoring.label_shift import reweighted
from calibration.scores import value_moments
from calibration.validation import check_choice_mass

__all__ = [
    "REASON_CODES",
    "Checks",
    "Failed",
    "Hold",
    "ReasonCode",
    "Rows",
    "Rule",
    "checked",
    "failures",
]

# One code per check, in the order the checks run, for counting escalations.
ReasonCode = Literal[
    "uncalibrated",
    "no_certified_threshold",
    "below_threshold",
    "low_choice_mass",
    "ambiguous_set",
    "high_std",
    "order_sensitive",
    "position_inconsistent",
    "partial_logprobs",
    "prior_shift",
]
REASON_CODES: tuple[str, ...] = get_args(ReasonCode)


class Hold(msgspec.Struct, frozen=True, kw_only=True):
    """What a server's monitor found that the certificate does not cover
    (``calibration.monitoring.label_shift``): every decision escalates with reason code ``prior_shift``
    and ``reason``, until the profile is re-certified (a new version is a new policy); with
    ``prior_weights`` (the estimated live prior over the source's, per choice) the served
    probabilities are moved to the live prior (the server's opt-in)."""

    reason: str
    prior_weights: list[float] | None = None


class Rule(Protocol):
    """What the checks read of a policy (``calibration.policy.Policy`` is one): its settings as
    ``make_policy`` resolved them, and the two answers it gives per judgment's choices."""

    @property
    def profile(self) -> str | None: ...
    @property
    def choices(self) -> list[str] | None: ...
    @property
    def calibration_map(self) -> CalibrationMap: ...
    @property
    def threshold(self) -> float | None: ...
    @property
    def no_threshold_reason(self) -> str | None: ...
    @property
    def class_thresholds(self) -> list[float | None] | None: ...
    @property
    def class_reasons(self) -> list[str | None] | None: ...
    @property
    def min_choice_mass(self) -> float: ...
    @property
    def conformal_quantile(self) -> float | None: ...
    @property
    def max_std(self) -> float | None: ...
    @property
    def hold(self) -> Hold | None: ...

    def values_for(self, choices: Sequence[str]) -> npt.NDArray[np.float64] | None: ...

    def spread_bound(self, pair: bool = False) -> float | None: ...


@dataclass(frozen=True)
class Rows:
    """n judgments as the checks read them. None: not given."""

    choices: Sequence[str]  # (k,) the order of every column
    log_probs: npt.NDArray[np.float64]  # (n, k)
    choice_mass: npt.ArrayLike | None = None  # (n,)
    features: npt.ArrayLike | None = None  # (n, m * H): the hidden states a probe reads
    order_spread: npt.ArrayLike | None = None  # (n,): each one's spread across listings
    pair: bool = False  # the listings were a pair's two orders (``Rule.spread_bound``)

    def alone(self, i: int, log_probs: npt.NDArray[np.float64]) -> Rows:
        """Row ``i`` alone, with ``log_probs`` (k,) in place of its own."""
        row = slice(i, i + 1)

        def cut(values: npt.ArrayLike | None) -> npt.ArrayLike | None:
            return None if values is None else np.asarray(values)[row]

        return Rows(
            self.choices,
            log_probs[None, :],  # (1, k)
            choice_mass=cut(self.choice_mass),
            features=cut(self.features),
            order_spread=cut(self.order_spread),
            pair=self.pair,
        )


@dataclass(frozen=True)
class Checks:
    """A policy's checks over n items, as arrays (see ``checked``)."""

    probabilities: npt.NDArray[np.float64]  # (n, k) calibrated
    best: npt.NDArray[np.int64]  # (n,) index of the top choice
    confidence: npt.NDArray[np.float64]  # (n,) its probability
    choice_mass: npt.NDArray[np.float64]  # (n,)
    below_threshold: npt.NDArray[np.bool_]  # (n,) True where there is no threshold
    # (n,) the threshold each item is held to: the policy's, or its top choice's class's;
    # NaN where there is none (so it escalates)
    thresholds: npt.NDArray[np.float64]
    low_choice_mass: npt.NDArray[np.bool_]  # (n,)
    membership: npt.NDArray[np.bool_] | None  # (n, k) conformal sets; None without a profile
    expected_value: npt.NDArray[np.float64] | None  # (n,) for a score; None without values
    std: npt.NDArray[np.float64] | None  # (n,) for a score; None without values
    high_std: npt.NDArray[np.bool_]  # (n,) std above max_std; False everywhere without a bound
    # (n,) order_spread above the bound in force (``Rule.spread_bound``); False everywhere
    # without a spread or a bound
    order_sensitive: npt.NDArray[np.bool_]
    accepted: npt.NDArray[np.bool_]  # (n,) every check passed

    @property
    def eligible(self) -> npt.NDArray[np.bool_]:
        """(n,) every check passed but the threshold: what another threshold would accept
        at or above it (a cascade's thresholds are chosen together, ``calibration.certificates.cascade_certify``)."""
        return _other_checks_pass(
            self.low_choice_mass, self.membership, self.high_std, self.order_sensitive
        )


def checked(rule: Rule, rows: Rows) -> Checks:
    """Every check of ``rule`` over ``rows``, as arrays: what ``Policy.checks`` gives, and what
    its verdicts are made from."""
    choices = rows.choices
    if rule.choices is not None and list(choices) != rule.choices:
        raise ProfileMismatchError(
            "choices",
            f"profile {rule.profile!r} decides between {rule.choices!r}, not {list(choices)!r}",
        )
    probs = _at_live_prior(rule.calibration_map.apply(rows.log_probs, rows.features), rule.hold)
    if probs.ndim != 2 or probs.shape[1] != len(choices):
        raise ValueError(
            f"log_probabilities must have shape (n, {len(choices)}), got {probs.shape}"
        )
    n = probs.shape[0]
    mass = check_choice_mass(rows.choice_mass, n)
    best = probs.argmax(axis=1)  # (n,)
    confidence = probs[np.arange(n), best]  # (n,)
    thresholds = _thresholds(rule, best)
    below = ~(confidence >= thresholds)  # NaN, no threshold: below every confidence
    low_mass = mass < rule.min_choice_mass
    membership = (
        None if rule.conformal_quantile is None else set_membership(probs, rule.conformal_quantile)
    )  # (n, k)
    expected = std = None
    high_std = np.zeros(n, dtype=bool)
    values = rule.values_for(choices)
    if values is not None:
        expected, std = value_moments(probs, values)  # (n,), (n,)
        if rule.max_std is not None:
            high_std = std > rule.max_std
    order_sensitive = np.zeros(n, dtype=bool)
    if rows.order_spread is not None:
        spreads = np.asarray(rows.order_spread, dtype=np.float64)
        if spreads.shape != (n,):
            raise ValueError(f"order_spread must have shape ({n},), got {spreads.shape}")
        bound = rule.spread_bound(rows.pair)
        if bound is not None:
            order_sensitive = spreads > bound
    return Checks(
        probabilities=probs,
        best=best,
        confidence=confidence,
        choice_mass=mass,
        below_threshold=below,
        thresholds=thresholds,
        low_choice_mass=low_mass,
        membership=membership,
        expected_value=expected,
        std=std,
        high_std=high_std,
        order_sensitive=order_sensitive,
        accepted=~below
        & _other_checks_pass(low_mass, membership, high_std, order_sensitive, rule.hold),
    )


class Failed(NamedTuple):
    """The checks one item failed: a code and a reason each, in the order the checks run, and
    its conformal set (None without one)."""

    codes: list[ReasonCode]
    reasons: list[str]
    prediction_set: list[str] | None


def failures(rule: Rule, g: Checks, rows: Rows, i: int, unknown: float = 0.0) -> Failed:
    """What item ``i`` of ``rows`` failed of ``g``, ``rule``'s checks over them. ``unknown``
    (in [0, 1)): the share of its choices' probability that was not read; where every other
    check passes, the decision must hold at that share's extremes (``partial_logprobs``)."""
    codes: list[ReasonCode] = []
    reasons: list[str] = []
    if rule.hold is not None:
        codes.append("prior_shift")
        reasons.append(rule.hold.reason)
    held_to = float(g.thresholds[i])
    if math.isnan(held_to):
        codes.append("uncalibrated" if rule.profile is None else "no_certified_threshold")
        reasons.append(_no_threshold_reason(rule, int(g.best[i])))
    elif g.below_threshold[i]:
        codes.append("below_threshold")
        reasons.append(f"confidence {g.confidence[i]:.4f} is below the threshold {held_to:.4f}")
    if g.low_choice_mass[i]:
        codes.append("low_choice_mass")
        reasons.append(
            f"choice mass {g.choice_mass[i]:.4f} is below the minimum {rule.min_choice_mass:.4f}"
        )
    members = None
    if g.membership is not None:
        members = [rows.choices[int(j)] for j in np.flatnonzero(g.membership[i])]
        if len(members) != 1:
            codes.append("ambiguous_set")
            reasons.append(
                f"the conformal prediction set holds {len(members)} choices "
                f"({', '.join(members)}), not one"
            )
    if g.high_std[i]:
        assert g.std is not None and rule.max_std is not None
        codes.append("high_std")
        reasons.append(
            f"the score's standard deviation {g.std[i]:.4f} is above the maximum {rule.max_std:.4f}"
        )
    if g.order_sensitive[i]:
        bound = rule.spread_bound(rows.pair)
        assert rows.order_spread is not None and bound is not None
        spread = float(np.asarray(rows.order_spread, dtype=np.float64)[i])
        # One check; a pair's listings are its candidates' two orders.
        codes.append("position_inconsistent" if rows.pair else "order_sensitive")
        moved = "swapping the candidates" if rows.pair else "the order of the options"
        reasons.append(
            f"{moved} moved a probability by {spread:.4f}, above the maximum order spread "
            f"{bound:.4f}"
        )
    if unknown > 0 and not codes:
        changed = _moved_by_unread(rule, rows, int(g.best[i]), i, unknown)
        if changed:
            codes.append("partial_logprobs")
            reasons.append(
                f"up to {unknown:.4f} of the choices' probability was not read (the "
                f"server's top next tokens left some out), and at that bound {changed}"
            )
    return Failed(codes, reasons, members)


def _moved_by_unread(rule: Rule, rows: Rows, best: int, i: int, unknown: float) -> str | None:
    """How the decision of row ``i`` (best choice ``best``) changes when the ``unknown`` share
    of probability not read goes all to the runner-up, or evenly to every other choice; None
    where it holds at both. Each extreme is decided by the same checks, with nothing left
    unread (an item held, ``Rule.hold``, escalates before it gets here)."""
    p = np.exp(rows.log_probs[i]) * (1 - unknown)  # (k,)
    others = [j for j in range(len(p)) if j != best]
    runner_up, spread = p.copy(), p.copy()
    runner_up[max(others, key=lambda j: p[j])] += unknown
    spread[others] += unknown / len(others)
    for worst in (runner_up, spread):
        alone = rows.alone(i, np.log(np.maximum(worst, np.finfo(np.float64).tiny)))
        g = checked(rule, alone)
        codes = failures(rule, g, alone, 0).codes
        if codes:
            return f"it escalates ({', '.join(codes)})"
        if int(g.best[0]) != best:
            return f"it picks {rows.choices[int(g.best[0])]!r}"
    return None


def _thresholds(rule: Rule, best: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
    """(n,) each item's threshold: its top choice's class's where the rule has one per class
    (columns in the profile's order), else the one threshold; NaN for none."""
    if rule.class_thresholds is not None:
        per_class = np.array(
            [np.nan if t is None else t for t in rule.class_thresholds], dtype=np.float64
        )
        return per_class[best]
    one = np.nan if rule.threshold is None else rule.threshold
    return np.full(best.shape, one, dtype=np.float64)


def _no_threshold_reason(rule: Rule, best: int) -> str:
    """Why a decision of class ``best`` has no threshold to be held to."""
    if rule.class_reasons is not None:
        return f"profile {rule.profile!r} certifies no threshold for {rule.class_reasons[best]}"
    return str(rule.no_threshold_reason)


def _at_live_prior(probs: npt.NDArray[np.float64], hold: Hold | None) -> npt.NDArray[np.float64]:
    """Calibrated probabilities moved to the live class prior where a hold carries one: Bayes'
    rule under label shift (``calibration.monitoring.label_shift.correct``)."""
    if hold is None or hold.prior_weights is None:
        return probs
    return reweighted(probs, hold.prior_weights)


def _other_checks_pass(
    low_choice_mass: npt.NDArray[np.bool_],
    membership: npt.NDArray[np.bool_] | None,
    high_std: npt.NDArray[np.bool_],
    order_sensitive: npt.NDArray[np.bool_],
    hold: Hold | None = None,
) -> npt.NDArray[np.bool_]:
    """(n,) every check but the threshold passes: enough choice mass, a single-choice conformal
    set (where there are sets), the std and order-spread bounds, and no ``hold``."""
    ambiguous = (
        np.zeros(low_choice_mass.shape, dtype=bool)
        if membership is None
        else membership.sum(axis=1) != 1
    )
    return ~(low_choice_mass | ambiguous | high_std | order_sensitive) & (hold is None)
