"""The gate: one policy turns a judgment into a decision, accept or escalate, with its reasons.

Every caller that decides (the HTTP service, the MCP tools, ``judge ask``, ``judge evaluate``,
a Python pipeline) opens a ``calibration.gate.Gate``, whose one ``make_policy`` call builds
this rule, so the rule that is evaluated is the rule that is served. A decision accepts only when every gate passes:

* the calibrated confidence of the top choice reaches the threshold (``below_threshold``), and
  a threshold exists at all. No accept without a certificate: a judgment with no profile
  escalates (``uncalibrated``), and so does one whose profile certified no threshold
  (``no_certified_threshold``). The one way around it is the loudly named opt-in
  ``uncertified_threshold`` (a request's, else the server's ``--uncertified-threshold``): where
  no certified threshold exists, accept at that confidence, with ``certified`` false. A request's
  ``threshold`` overrides a certified threshold and nothing else: without one it is refused
  (``NoCertificateError``), since it would turn raw confidence into accepts under a name that
  does not say so;
* the choices' share of the model's full next-token distribution reaches the minimum choice
  mass (``low_choice_mass``): a low mass means the model wanted to say something else;
* with a profile, the conformal prediction set holds one choice (``ambiguous_set``);
* for a score (choices that stand for numbers, see ``calibration.scores``), the standard
  deviation of the calibrated distribution over the values is at most ``max_std``
  (``high_std``): a judge torn between "1" and "5" has not given a grade;
* for a question asked under several listings of its options (``judge.answers``,
  ``order="invariant"``), the listings' disagreement, its ``order_spread``, is at most
  ``max_order_spread`` (``order_sensitive``): an answer that moves with the order in which
  the options were read is the order's, not the model's judgment. The caller passes the spread
  (``decide(judgment, order_spread=...)``); a judgment without one passes this gate. The bound
  only ever adds escalations, and is the caller's: it leaves ``certified`` as it is;
* for a pair (``judge.answers``: two candidates judged in both orders; ``decide(...,
  pair=True)``), the same spread is how far the two orders disagreed on the winner's
  probability, and above the bound the code is ``position_inconsistent``: the place a
  candidate was read in, not the candidate, swayed the judge. A pair is bounded even when the
  caller sets nothing, by ``DEFAULT_MAX_POSITION_SPREAD``: position bias is the main failure
  of pairwise judging (Zheng et al. 2023, "Judging LLM-as-a-judge"), so the gate is on unless
  the caller loosens it (``max_order_spread=1`` turns it off);
* for a judgment whose probabilities are partly unknown (a served model read from its top
  next tokens, ``judge.server_engine``: ``unknown_mass`` bounds the share of the choices'
  probability that was not read), the decision holds at the bound's extremes, the unknown
  share given all to the runner-up or spread over every other choice (``partial_logprobs``):
  what was not read cannot turn an escalation into an accept.

Which threshold, minimum mass, values and maximum std apply is decided in one place,
``make_policy``: the request's value, else the profile's, else the server's default (for
values: the numerals themselves when every choice is one; for the threshold: none, unless the
server opted in to an uncertified one). A decision is ``certified`` when it used
the profile's certified threshold, minimum mass and maximum std unchanged, the rule whose precision
``calibration.fitting`` certified; an override is the caller's own choice and carries no
guarantee.

A judgment is anything with its ``choices``, their ``log_probs`` in that order and a
``choice_mass`` (the engine's ``Judgment`` qualifies), so this module needs neither torch nor
the engine.
"""

from __future__ import annotations

import functools
import hashlib
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args

import msgspec
import numpy as np
import numpy.typing as npt

from calibration.carry import carry
from calibration.certificates.conformal import set_membership
from calibration.errors import NoCertificateError, ProfileMismatchError, ValuesError
from calibration.maps.map_types import CalibrationMap, Identity, Probe
from calibration.monitoring.label_shift import reweighted
from calibration.scored import ScoredJudgment, check_max_std, probe_row
from calibration.scores import check_values, numeral_values, value_moments
from calibration.validation import check_choice_mass, check_probability

if TYPE_CHECKING:
    from calibration.profile import CalibrationProfile

__all__ = [
    "DEFAULT_MAX_POSITION_SPREAD",
    "REASON_CODES",
    "Gates",
    "Hold",
    "Policy",
    "PolicyDefaults",
    "ReasonCode",
    "ScoredJudgment",
    "Verdict",
    "is_audited",
    "make_policy",
]

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
ThresholdSource = Literal["request", "profile", "default"]
# Where a policy's threshold came from: the profile's certificate, a request's override of it,
# or the opt-in uncertified threshold (the request's, else the server's); "none": no threshold,
# so nothing is accepted.
ThresholdOrigin = Literal[
    "profile", "request", "uncertified_request", "uncertified_default", "none"
]

# A record a verdict is carried into (``Verdict.carried``): a response, a stage's answer.
_Record = TypeVar("_Record", bound=msgspec.Struct)

# The bound on a pair's order spread when the caller sets none: how far apart the two orders'
# probabilities of one candidate may be. 0.2 is the spread a threshold of 0.9 already
# allows on raw probabilities (a mean of 0.9 needs both orders at 0.8 or more), so it changes
# no raw decision at that threshold; it binds where a profile's calibration sharpens the mean,
# or a lower threshold accepts it, while the two orders disagree by more.
DEFAULT_MAX_POSITION_SPREAD = 0.2


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """Accept or escalate, and everything that went into it: the one record of a decision.

    What ``Gate.decide`` gives in Python, and what every wire form is made from: the
    ``/judge`` response (``service.schemas.JudgeResponse.of``), a System One answer's
    extension fields (``service.systemone.wire_answer``), ``judge ask``'s JSONL lines and the
    decision log's row (``service.log.decision_log.LoggedDecision.of``). Probabilities are arrays
    in ``choices`` order; ``probabilities`` and ``raw_probabilities`` are their dict views.
    Plain data.
    """

    decision: Literal["accept", "escalate"]
    choice: str  # the most probable choice after calibration
    confidence: float  # its calibrated probability
    choices: list[str]  # the profile's order (else the judgment's): the order of every array
    probs: list[float]  # calibrated, in ``choices`` order
    raw_probs: list[float]  # the model's own, before calibration, in ``choices`` order
    raw_log_probs: list[float]  # their logarithms, as the engine computed them
    prediction_set: list[str] | None  # the conformal set; None without a profile
    reasons: list[str]  # why it escalated, in words; empty when accepted
    reason_codes: list[ReasonCode]  # one code per reason, for counting
    threshold: float | None  # None: no certified threshold and none given
    min_choice_mass: float
    choice_mass: float
    certified: bool  # the profile's certified rule, unchanged, made this decision
    profile: str | None
    # For a score (the choices have values): the calibrated distribution's mean and standard
    # deviation over the values, and the bound on the std in force. None otherwise.
    expected_value: float | None = None
    std: float | None = None
    max_std: float | None = None
    # A question asked under several listings (judge.answers; a pair's two orders): how far
    # they disagreed, and the bound in force. None when not given.
    order_spread: float | None = None
    max_order_spread: float | None = None
    # Chosen for the audit sample (``Policy.audit_rate``): a person should label it, whatever
    # the decision. The decision itself is unchanged.
    audit: bool = False
    # What pins this decision: the judgment's id and the sha256 of its tokens and of the
    # weights (``judge.Judgment``; None for a judgment that does not carry them), the sha256
    # of the policy in force (``Policy.sha256``) and the profile's version, its ETag (None
    # without a profile).
    judgment_id: str | None = None
    tokens_sha256: str | None = None
    model_sha256: str | None = None
    policy_sha256: str | None = None
    profile_etag: str | None = None
    # The low-rank adapter the judgment ran under (``judge.adapters``; a profile's); None: none.
    adapter_sha256: str | None = None
    # A full prompt sent to a profile that carries its template (``calibration.template``), and
    # not that template around its item: the certificate was measured on other prompts.
    outside_template: bool = False
    # The profile's calibration map that made ``probs`` (None without a profile): its method,
    # a scalar map's temperature (a probe has none: it reads hidden states rather than
    # rescaling) and the layers a probe reads. A response is built from this record alone.
    calibration_method: str | None = None
    temperature: float | None = None
    feature_layers: list[int] | None = None

    @property
    def accepted(self) -> bool:
        return self.decision == "accept"

    @property
    def probabilities(self) -> dict[str, float]:
        """Calibrated probabilities by choice, in ``choices`` order."""
        return dict(zip(self.choices, self.probs, strict=True))

    @property
    def raw_probabilities(self) -> dict[str, float]:
        """The model's own probabilities by choice, in ``choices`` order."""
        return dict(zip(self.choices, self.raw_probs, strict=True))

    def carried(self, target: type[_Record], order: Sequence[str], /, **given: Any) -> _Record:
        """A ``target`` record of this verdict (``carry``: its fields of the same names, and
        ``given``), with the calibrated and raw probabilities by choice in ``order`` (these
        choices, as a request listed them): read from the verdict's lists once, in that order."""
        column = {c: i for i, c in enumerate(self.choices)}
        return carry(
            self,
            target,
            probabilities={c: self.probs[column[c]] for c in order},
            raw_probabilities={c: self.raw_probs[column[c]] for c in order},
            **given,
        )


@dataclass(frozen=True)
class Gates:
    """A policy's gates over n items, as arrays (see ``Policy.gates``)."""

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
    # (n,) order_spread above the bound in force (``Policy.spread_bound``); False everywhere
    # without a spread or a bound
    order_sensitive: npt.NDArray[np.bool_]
    accepted: npt.NDArray[np.bool_]  # (n,) every gate passed

    @property
    def eligible(self) -> npt.NDArray[np.bool_]:
        """(n,) every gate passed but the threshold: what another threshold would accept
        at or above it (a cascade's thresholds are chosen together, ``calibration.certificates.cascade_certify``)."""
        return _other_gates_pass(
            self.low_choice_mass, self.membership, self.high_std, self.order_sensitive
        )


def _held(hold: Hold | None) -> tuple[list[ReasonCode], list[str]]:
    """A decision's first reason code and reason: its policy's hold, if it has one."""
    return (["prior_shift"], [hold.reason]) if hold is not None else ([], [])


def _at_live_prior(probs: npt.NDArray[np.float64], hold: Hold | None) -> npt.NDArray[np.float64]:
    """Calibrated probabilities moved to the live class prior where a hold carries one: Bayes'
    rule under label shift (``calibration.monitoring.label_shift.correct``)."""
    if hold is None or hold.prior_weights is None:
        return probs
    return reweighted(probs, hold.prior_weights)


def _other_gates_pass(
    low_choice_mass: npt.NDArray[np.bool_],
    membership: npt.NDArray[np.bool_] | None,
    high_std: npt.NDArray[np.bool_],
    order_sensitive: npt.NDArray[np.bool_],
    hold: Hold | None = None,
) -> npt.NDArray[np.bool_]:
    """(n,) every gate but the threshold passes: enough choice mass, a single-choice conformal
    set (where there are sets), the std and order-spread bounds, and no ``hold``."""
    ambiguous = (
        np.zeros(low_choice_mass.shape, dtype=bool)
        if membership is None
        else membership.sum(axis=1) != 1
    )
    return ~(low_choice_mass | ambiguous | high_std | order_sensitive) & (hold is None)


class PolicyDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """What applies when neither the request nor a profile says otherwise.

    ``uncertified_threshold``: the server's opt-in to accepting where no certified threshold
    exists (no profile, or one that certified none), at this raw or calibrated confidence and
    with no guarantee; None (the default): such judgments escalate.
    """

    uncertified_threshold: float | None = None
    min_choice_mass: float = 0.0
    max_std: float | None = None  # no bound on a score's std

    def __post_init__(self) -> None:
        if self.uncertified_threshold is not None:
            check_probability(self.uncertified_threshold, "uncertified_threshold")
        check_probability(self.min_choice_mass, "min_choice_mass")
        if self.max_std is not None:
            check_max_std(self.max_std)


class Hold(msgspec.Struct, frozen=True, kw_only=True):
    """What a server's monitor found that the certificate does not cover
    (``calibration.monitoring.label_shift``): every decision escalates with reason code ``prior_shift``
    and ``reason``, until the profile is re-certified (a new version is a new policy); with
    ``prior_weights`` (the estimated live prior over the source's, per choice) the served
    probabilities are moved to the live prior (the server's opt-in)."""

    reason: str
    prior_weights: list[float] | None = None


class Policy(msgspec.Struct, frozen=True, kw_only=True):
    """A resolved rule: a calibration map and the gates. Build it with ``make_policy``."""

    profile: str | None
    # The profile's version: its ETag where it is stored (``CalibrationProfile.etag``).
    profile_etag: str | None = None
    choices: list[str] | None  # the profile's choices; None: any choices
    calibration_map: CalibrationMap
    threshold: float | None
    threshold_source: ThresholdOrigin
    no_threshold_reason: str | None  # why there is no threshold: no profile, or no certificate
    min_choice_mass: float
    conformal_quantile: float | None
    certified: bool
    # A number per choice (request, else profile); None: the numerals themselves, if the
    # choices are numerals, else no score.
    values: dict[str, float] | None = None
    max_std: float | None = None
    max_std_source: ThresholdSource = "default"
    # Escalate a judgment whose order_spread (given to decide) is above this; None: no bound.
    max_order_spread: float | None = None
    # A threshold per class (the profile's choices' order), certified per predicted class
    # (``calibration.certificates.class_certify``): a decision of class c is held to class_thresholds[c]
    # (None: that class certified none, and its decisions escalate, each with its class's
    # ``class_reasons`` entry). None: the one ``threshold`` for every class.
    class_thresholds: list[float | None] | None = None
    class_reasons: list[str | None] | None = None
    # The share of decisions marked ``audit`` (see ``is_audited``): a uniform random sample of
    # all traffic, accepted and escalated alike, for people to label. Without it only
    # escalated items ever get labels, and the precision of accepted items goes unobserved.
    audit_rate: float = 0.0
    hold: Hold | None = None  # a server's monitor found the live mix moved (``Hold``)

    @property
    def sha256(self) -> str:
        """The sha256 (hex) of this policy: the JSON of its fields, with the calibration map
        stood for by the profile's ETag where the policy has one (the map is the profile's,
        and a probe's map runs to megabytes of JSON), else by the map's own JSON. The audit
        rate is left out: it picks which decisions people label, not what is decided.
        Computed on each read (a frozen Struct keeps no cache); ``decide_many`` reads it
        once per call."""
        pinned = (
            self.profile_etag
            if self.profile_etag is not None
            else hashlib.sha256(msgspec.json.encode(self.calibration_map)).hexdigest()
        )
        fields = {
            f: getattr(self, f)
            for f in self.__struct_fields__
            if f not in ("calibration_map", "audit_rate")
        }
        return hashlib.sha256(msgspec.json.encode([pinned, fields])).hexdigest()

    def decide(
        self,
        judgment: ScoredJudgment,
        *,
        order_spread: float | None = None,
        pair: bool = False,
    ) -> Verdict:
        """The decision for one judgment; ``order_spread``: how far its listings disagreed;
        ``pair``: the listings were a pair's two orders."""
        spreads = None if order_spread is None else [order_spread]
        return self.decide_many([judgment], order_spreads=spreads, pair=pair)[0]

    def decide_many(
        self,
        judgments: Sequence[ScoredJudgment],
        *,
        order_spreads: Sequence[float] | None = None,
        pair: bool = False,
    ) -> list[Verdict]:
        """Decisions for many judgments, in order, computed together per set of choices.

        ``order_spreads``: one per judgment (see ``order_sensitive`` in the module docstring);
        ``pair``: every judgment is a pair's (``position_inconsistent``).
        """
        if order_spreads is not None and len(order_spreads) != len(judgments):
            raise ValueError(f"{len(order_spreads)} order spreads for {len(judgments)} judgments")
        sha256 = self.sha256
        groups: dict[tuple[str, ...], list[int]] = {}
        for i, j in enumerate(judgments):
            groups.setdefault(tuple(j.choices), []).append(i)
        out: list[Verdict | None] = [None] * len(judgments)
        for order, rows in groups.items():
            choices, columns = self._columns(order)
            z = np.array([judgments[i].log_probs for i in rows], dtype=np.float64)  # (n, k)
            mass = np.array([judgments[i].choice_mass for i in rows], dtype=np.float64)
            features = self._features([judgments[i] for i in rows])
            spread = None if order_spreads is None else [order_spreads[i] for i in rows]
            decisions = self._decide(
                choices,
                z[:, columns],
                mass,
                features,
                spread,
                sha256=sha256,
                pair=pair,
                judgments=[judgments[i] for i in rows],
                raw_probs=_raw_probs([judgments[i] for i in rows], columns),
            )
            for i, d in zip(rows, decisions, strict=True):
                out[i] = d
        return [d for d in out if d is not None]

    def spread_bound(self, pair: bool = False) -> float | None:
        """The bound on an order spread in force: the caller's, else for a pair the default
        (``DEFAULT_MAX_POSITION_SPREAD``), else none."""
        if self.max_order_spread is not None or not pair:
            return self.max_order_spread
        return DEFAULT_MAX_POSITION_SPREAD

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The hidden-state layers a judgment must carry for this policy: a probe's, else none.

        Ask the engine for them (``Query.feature_layers``) when judging for this policy.
        """
        return self.calibration_map.feature_layers

    @property
    def span_layers(self) -> tuple[int, ...]:
        """The layers whose means over the item a judgment must carry: a probe's that reads
        them, else none (``Query.span_layers``; the probe's ``span`` says whether the query
        marks its item)."""
        return self.calibration_map.span_layers

    @property
    def probe_layers(self) -> tuple[int, ...]:
        """The layers the map's probe reads, at the decision point or averaged over the item
        (what a response names); none without a probe."""
        return tuple(sorted({*self.feature_layers, *self.span_layers}))

    def _features(self, judgments: Sequence[ScoredJudgment]) -> npt.NDArray[np.float64] | None:
        """(n, slots * H): what the map's probe reads of each judgment; None if no probe."""
        probe = self.calibration_map
        if not isinstance(probe, Probe):
            return None
        name = str(self.profile)
        return np.stack(
            [probe_row(j, probe.reads, probe.layers, probe.span, name) for j in judgments]
        )

    def _decide(
        self,
        choices: Sequence[str],
        log_probabilities: npt.ArrayLike,
        choice_mass: npt.ArrayLike | None,
        features: npt.ArrayLike | None,
        order_spread: npt.ArrayLike | None,
        *,
        sha256: str,
        pair: bool = False,
        judgments: Sequence[ScoredJudgment] | None = None,
        raw_probs: npt.NDArray[np.float64] | None = None,
    ) -> list[Verdict]:
        """Decisions for (n, k) log-probabilities whose columns follow ``choices``, with this
        policy's ``sha256`` read once by the caller, and the judgments the rows come from
        (None: not known), whose ids and hashes the decisions carry. ``choice_mass`` (n,),
        ``features`` and ``order_spread`` (n,) are ``gates``'s. ``raw_probs`` (n, k): the model's probabilities as the judgments carry them
        (None: the exponentials of ``log_probabilities``)."""
        z = np.asarray(log_probabilities, dtype=np.float64)
        g = self.gates(choices, z, choice_mass, features, order_spread, pair=pair)
        raw = np.exp(z) if raw_probs is None else raw_probs
        spreads = None if order_spread is None else np.asarray(order_spread, dtype=np.float64)
        bound = self.spread_bound(pair)
        method, temperature, layers = self._map_record()
        decisions = []
        for i in range(g.probabilities.shape[0]):
            codes, reasons = _held(self.hold)
            held_to = float(g.thresholds[i])
            if math.isnan(held_to):
                codes.append("uncalibrated" if self.profile is None else "no_certified_threshold")
                reasons.append(self._no_threshold_reason(int(g.best[i])))
            elif g.below_threshold[i]:
                codes.append("below_threshold")
                reasons.append(
                    f"confidence {g.confidence[i]:.4f} is below the threshold {held_to:.4f}"
                )
            if g.low_choice_mass[i]:
                codes.append("low_choice_mass")
                reasons.append(
                    f"choice mass {g.choice_mass[i]:.4f} is below the minimum "
                    f"{self.min_choice_mass:.4f}"
                )
            members = None
            if g.membership is not None:
                members = [choices[int(j)] for j in np.flatnonzero(g.membership[i])]
                if len(members) != 1:
                    codes.append("ambiguous_set")
                    reasons.append(
                        f"the conformal prediction set holds {len(members)} choices "
                        f"({', '.join(members)}), not one"
                    )
            if g.high_std[i]:
                assert g.std is not None and self.max_std is not None
                codes.append("high_std")
                reasons.append(
                    f"the score's standard deviation {g.std[i]:.4f} is above the maximum "
                    f"{self.max_std:.4f}"
                )
            if g.order_sensitive[i]:
                assert spreads is not None and bound is not None
                # One gate; a pair's listings are its candidates' two orders.
                codes.append("position_inconsistent" if pair else "order_sensitive")
                moved = "swapping the candidates" if pair else "the order of the options"
                reasons.append(
                    f"{moved} moved a probability by {spreads[i]:.4f}, above the maximum "
                    f"order spread {bound:.4f}"
                )
            judgment = None if judgments is None else judgments[i]
            unknown = float(getattr(judgment, "unknown_mass", 0.0) or 0.0)
            if unknown > 0 and not codes:
                changed = _moved_by_unread(
                    self,
                    choices,
                    z[i],
                    int(g.best[i]),
                    unknown,
                    i,
                    pair=pair,
                    choice_mass=choice_mass,
                    features=features,
                    order_spread=order_spread,
                    sha256=sha256,
                )
                if changed:
                    codes.append("partial_logprobs")
                    reasons.append(
                        f"up to {unknown:.4f} of the choices' probability was not read (the "
                        f"server's top next tokens left some out), and at that bound {changed}"
                    )
            scored = g.expected_value is not None and g.std is not None
            judgment_id = _carried(judgment, "judgment_id")
            decisions.append(
                Verdict(
                    decision="escalate" if codes else "accept",
                    choice=choices[int(g.best[i])],
                    confidence=float(g.confidence[i]),
                    choices=list(choices),
                    probs=[float(p) for p in g.probabilities[i]],
                    raw_probs=[float(p) for p in raw[i]],
                    raw_log_probs=[float(v) for v in z[i]],
                    prediction_set=members,
                    reasons=reasons,
                    reason_codes=codes,
                    threshold=None if math.isnan(held_to) else held_to,
                    min_choice_mass=self.min_choice_mass,
                    choice_mass=float(g.choice_mass[i]),
                    certified=self.certified,
                    profile=self.profile,
                    expected_value=float(g.expected_value[i]) if scored else None,  # type: ignore[index]
                    std=float(g.std[i]) if scored else None,  # type: ignore[index]
                    max_std=self.max_std if scored else None,
                    order_spread=None if spreads is None else float(spreads[i]),
                    max_order_spread=None if spreads is None else bound,
                    audit=is_audited(judgment_id, self.audit_rate),
                    judgment_id=judgment_id,
                    tokens_sha256=_carried(judgment, "tokens_sha256"),
                    model_sha256=_carried(judgment, "model_sha256"),
                    adapter_sha256=_carried(judgment, "adapter_sha256"),
                    policy_sha256=sha256,
                    profile_etag=self.profile_etag,
                    calibration_method=method,
                    temperature=temperature,
                    feature_layers=layers,
                )
            )
        return decisions

    def _map_record(self) -> tuple[str | None, float | None, list[int] | None]:
        """What a verdict says of the map: its method, a scalar map's temperature and a
        probe's layers; all None without a profile (the identity map is no calibration)."""
        if self.profile is None:
            return None, None, None
        method = self.calibration_map.method
        temperature = None if method == "probe" else self.calibration_map.temperature
        return method, temperature, list(self.probe_layers) or None

    def _no_threshold_reason(self, best: int) -> str:
        """Why a decision of class ``best`` has no threshold to be held to."""
        if self.class_reasons is not None:
            return f"profile {self.profile!r} certifies no threshold for {self.class_reasons[best]}"
        return str(self.no_threshold_reason)

    def gates(
        self,
        choices: Sequence[str],
        log_probabilities: npt.ArrayLike,
        choice_mass: npt.ArrayLike | None = None,
        features: npt.ArrayLike | None = None,
        order_spread: npt.ArrayLike | None = None,
        *,
        pair: bool = False,
    ) -> Gates:
        """Every gate of the policy for (n, k) log-probabilities, as arrays.

        ``features`` (n, m * H) are the hidden states a probe map reads; other maps ignore them.
        ``order_spread`` (n,) is each judgment's spread across listings of its options;
        ``pair``: across a pair's two orders (``spread_bound``).

        ``decide_many`` turns these into decisions; for large evaluations, ``Gates.accepted``
        and ``Gates.best`` are the decisions without building an object per item.
        """
        if self.choices is not None and list(choices) != self.choices:
            raise ProfileMismatchError(
                "choices",
                f"profile {self.profile!r} decides between {self.choices!r}, not {list(choices)!r}",
            )
        z = np.asarray(log_probabilities, dtype=np.float64)
        probs = _at_live_prior(self.calibration_map.apply(z, features), self.hold)
        if probs.ndim != 2 or probs.shape[1] != len(choices):
            raise ValueError(
                f"log_probabilities must have shape (n, {len(choices)}), got {probs.shape}"
            )
        n = probs.shape[0]
        mass = check_choice_mass(choice_mass, n)
        best = probs.argmax(axis=1)  # (n,)
        confidence = probs[np.arange(n), best]  # (n,)
        thresholds = self._item_thresholds(best)
        below = ~(confidence >= thresholds)  # NaN, no threshold: below every confidence
        low_mass = mass < self.min_choice_mass
        membership = (
            None
            if self.conformal_quantile is None
            else set_membership(probs, self.conformal_quantile)
        )  # (n, k)
        expected = std = None
        high_std = np.zeros(n, dtype=bool)
        values = self.values_for(choices)
        if values is not None:
            expected, std = value_moments(probs, values)  # (n,), (n,)
            if self.max_std is not None:
                high_std = std > self.max_std
        order_sensitive = np.zeros(n, dtype=bool)
        if order_spread is not None:
            spreads = np.asarray(order_spread, dtype=np.float64)
            if spreads.shape != (n,):
                raise ValueError(f"order_spread must have shape ({n},), got {spreads.shape}")
            bound = self.spread_bound(pair)
            if bound is not None:
                order_sensitive = spreads > bound
        return Gates(
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
            & _other_gates_pass(low_mass, membership, high_std, order_sensitive, self.hold),
        )

    def _item_thresholds(self, best: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        """(n,) each item's threshold: its top choice's class's where the policy has one per
        class (columns in the profile's order), else the one threshold; NaN for none."""
        if self.class_thresholds is not None:
            per_class = np.array(
                [np.nan if t is None else t for t in self.class_thresholds], dtype=np.float64
            )
            return per_class[best]
        one = np.nan if self.threshold is None else self.threshold
        return np.full(best.shape, one, dtype=np.float64)

    def values_for(self, choices: Sequence[str]) -> npt.NDArray[np.float64] | None:
        """The number of each of ``choices`` (k,), or None when the judgment is not a score. A
        ``max_std`` that the request or the profile set needs values: without them it is a
        ValuesError, not a silently skipped gate. A server default applies to scores only."""
        if self.values is not None:
            values = check_values(self.values, choices)
            return np.array([values[c] for c in choices], dtype=np.float64)
        numerals = _numerals(tuple(choices))
        if numerals is None:
            if self.max_std is not None and self.max_std_source != "default":
                raise ValuesError(
                    f"max_std {self.max_std:g} needs a number per choice, and the choices "
                    f"{list(choices)!r} are not all numerals; give values"
                )
            return None
        return np.array(numerals, dtype=np.float64)

    def _columns(self, order: Sequence[str]) -> tuple[list[str], list[int]]:
        """The choices a decision is made over (the profile's, else the judgment's own order)
        and, for each, its column in a judgment made in ``order``."""
        if self.choices is None:
            return list(order), list(range(len(order)))
        if sorted(order) != sorted(self.choices):
            raise ProfileMismatchError(
                "choices",
                f"profile {self.profile!r} was fitted for choices {self.choices!r}, not "
                f"{list(order)!r}; judge with the profile's choices (any order)",
            )
        index = {c: j for j, c in enumerate(order)}
        return list(self.choices), [index[c] for c in self.choices]


def is_audited(judgment_id: str | None, rate: float) -> bool:
    """Whether a decision belongs to the audit sample at ``rate``: a uniform draw per decision,
    independent of its content and outcome, so the audited decisions are exchangeable with all
    traffic.

    The draw is the sha256 of the judgment's id (a UUID version 7, whose 74 random bits make
    the hash uniform) read as a number in [0, 1): the same decision is in the sample on every
    replay, and every replica draws alike. A judgment without an id draws from the system's
    random source.
    """
    if rate <= 0:
        return False
    if judgment_id is None:
        return secrets.randbelow(2**53) / 2**53 < rate
    draw = int.from_bytes(hashlib.sha256(judgment_id.encode()).digest()[:8], "big") / 2**64
    return draw < rate


@functools.lru_cache(maxsize=1024)  # bounded: choices come from requests
def _numerals(choices: tuple[str, ...]) -> tuple[float, ...] | None:
    """Each choice's own number, in order, when all are numerals (``numeral_values``); else
    None. The same answer for every judgment over these choices, so worked out once."""
    values = numeral_values(choices)
    return None if values is None else tuple(values[c] for c in choices)


def _raw_probs(
    judgments: Sequence[ScoredJudgment], columns: Sequence[int]
) -> npt.NDArray[np.float64] | None:
    """(n, k) the judgments' own probabilities (``probs``, as the engine computed them) in
    ``columns`` order; None when any judgment carries none (then they are exp(log_probs))."""
    rows = [getattr(j, "probs", None) for j in judgments]
    if any(r is None or len(r) != len(columns) for r in rows):
        return None
    return np.asarray(rows, dtype=np.float64)[:, columns]


def _moved_by_unread(
    policy: Policy,
    choices: Sequence[str],
    z: npt.NDArray[np.float64],
    best: int,
    unknown: float,
    row: int,
    *,
    pair: bool,
    choice_mass: npt.ArrayLike | None,
    features: npt.ArrayLike | None,
    order_spread: npt.ArrayLike | None,
    sha256: str,
) -> str | None:
    """How ``policy``'s decision of row ``row`` (log-probabilities ``z``, best choice ``best``)
    changes when the ``unknown`` share of probability not read goes all to the runner-up,
    or evenly to every other choice; None where it holds at both."""
    p = np.exp(z) * (1 - unknown)
    others = [j for j in range(len(p)) if j != best]
    runner_up, spread = p.copy(), p.copy()
    runner_up[max(others, key=lambda j: p[j])] += unknown
    spread[others] += unknown / len(others)
    pick = slice(row, row + 1)

    def sliced(values: npt.ArrayLike | None) -> npt.ArrayLike | None:
        return None if values is None else np.asarray(values)[pick]

    for worst in (runner_up, spread):
        logs = np.log(np.maximum(worst, np.finfo(np.float64).tiny))[None, :]
        (verdict,) = policy._decide(
            choices,
            logs,
            sliced(choice_mass),
            sliced(features),
            sliced(order_spread),
            sha256=sha256,
            pair=pair,
        )
        if verdict.decision == "escalate":
            return f"it escalates ({', '.join(verdict.reason_codes)})"
        if verdict.choice != choices[best]:
            return f"it picks {verdict.choice!r}"
    return None


def _carried(judgment: object, field: str) -> str | None:
    """The judgment's ``field`` (an id or a hash), where it carries one: not every
    ``ScoredJudgment`` does, and a Judgment built by hand has it empty."""
    value = getattr(judgment, field, None)
    return value if isinstance(value, str) and value else None


def make_policy(
    profile: CalibrationProfile | None,
    *,
    threshold: float | None = None,
    uncertified_threshold: float | None = None,
    min_choice_mass: float | None = None,
    max_std: float | None = None,
    values: Mapping[str, float] | None = None,
    defaults: PolicyDefaults | None = None,
    max_order_spread: float | None = None,
    profile_etag: str | None = None,
    audit_rate: float = 0.0,
) -> Policy:
    """The policy in force: the request's settings over the profile's over the defaults.

    This is the only place where that precedence is written. ``threshold`` and
    ``min_choice_mass`` are the caller's overrides (None: not set); they must be in [0, 1].
    ``threshold`` overrides a certified threshold only: where there is none (no profile, or a
    profile that certified none) it raises ``NoCertificateError``. ``uncertified_threshold``
    (else ``defaults.uncertified_threshold``) is the opt-in that accepts there anyway, with no
    guarantee; where a certified threshold exists it does not apply. Without either, a policy
    with no certified threshold escalates every judgment (``uncalibrated`` without a profile,
    ``no_certified_threshold`` with one).
    ``values`` (a number per choice) and ``max_std`` (>= 0) are a score's; see
    ``Policy.values_for``. ``max_order_spread`` (in [0, 1]) bounds a judgment's spread across
    listings of its options (``Policy.decide(..., order_spread=...)``); it is the caller's own
    bound, so it does not change ``certified``. ``profile_etag`` is the profile's version
    where the caller read it from a store (its ETag); None: ``profile.etag``, the same for a
    profile stored as ``save_profile`` or a store's ``put`` writes it. ``audit_rate`` (in
    [0, 1]) is the share of decisions marked ``audit`` (``is_audited``).
    """
    audit_rate = check_probability(audit_rate, "audit_rate")
    if max_order_spread is not None:
        max_order_spread = check_probability(max_order_spread, "max_order_spread")
    if threshold is not None:
        threshold = check_probability(threshold, "threshold")
    if uncertified_threshold is not None:
        uncertified_threshold = check_probability(uncertified_threshold, "uncertified_threshold")
    if min_choice_mass is not None:
        min_choice_mass = check_probability(min_choice_mass, "min_choice_mass")
    if max_std is not None:
        max_std = check_max_std(max_std)
    checked_values = None if values is None else check_values(values)
    defaults = defaults or PolicyDefaults()
    certified_threshold = None if profile is None else profile.threshold.threshold
    per_class = None if profile is None else profile.class_thresholds
    if per_class is not None:
        # A profile certified per class serves that rule, where any class certified.
        has_certificate = any(r.threshold is not None for r in per_class)
    else:
        has_certificate = certified_threshold is not None
    if not has_certificate and threshold is not None:
        what = "no profile" if profile is None else f"profile {profile.name!r} certified none"
        raise NoCertificateError(
            "threshold",
            f"threshold {threshold:g} overrides a certified threshold, and there is none "
            f"({what}); to accept on uncertified confidence anyway, with no guarantee, set "
            "uncertified_threshold instead",
        )
    by_class = (
        per_class if per_class is not None and has_certificate and threshold is None else None
    )
    chosen_threshold, origin, missing = _threshold_in_force(
        profile, threshold, uncertified_threshold, defaults, has_certificate
    )
    if profile is None:
        return Policy(
            profile=None,
            choices=None,
            calibration_map=Identity(),
            threshold=chosen_threshold,
            threshold_source=origin,
            no_threshold_reason=missing,
            min_choice_mass=defaults.min_choice_mass
            if min_choice_mass is None
            else min_choice_mass,
            conformal_quantile=None,
            certified=False,
            values=checked_values,
            max_std=defaults.max_std if max_std is None else max_std,
            max_std_source="default" if max_std is None else "request",
            max_order_spread=max_order_spread,
            audit_rate=audit_rate,
        )
    if checked_values is not None:
        checked_values = check_values(checked_values, profile.choices)
    profile_values = profile.values
    chosen_values = profile_values if checked_values is None else checked_values
    std_source: ThresholdSource
    chosen_std: float | None
    if max_std is not None:
        chosen_std, std_source = max_std, "request"
    elif profile.max_std is not None:
        chosen_std, std_source = profile.max_std, "profile"
    else:
        chosen_std, std_source = defaults.max_std, "default"
    chosen_mass = profile.min_choice_mass if min_choice_mass is None else min_choice_mass
    return Policy(
        profile=profile.name,
        profile_etag=profile.etag if profile_etag is None else profile_etag,
        choices=list(profile.choices),
        calibration_map=profile.calibration_map,
        threshold=chosen_threshold,
        threshold_source=origin,
        no_threshold_reason=missing,
        min_choice_mass=chosen_mass,
        conformal_quantile=profile.conformal_quantile,
        certified=(
            (by_class is not None or chosen_threshold == certified_threshold is not None)
            and chosen_mass == profile.min_choice_mass
            and chosen_std == profile.max_std
            and (profile.max_std is None or chosen_values == profile_values)
        ),
        values=chosen_values,
        max_std=chosen_std,
        max_std_source=std_source,
        max_order_spread=max_order_spread,
        audit_rate=audit_rate,
        class_thresholds=None if by_class is None else [r.threshold for r in by_class],
        class_reasons=None
        if by_class is None
        else [None if r.threshold is not None else r.reason for r in by_class],
    )


def _threshold_in_force(
    profile: CalibrationProfile | None,
    threshold: float | None,
    uncertified_threshold: float | None,
    defaults: PolicyDefaults,
    has_certificate: bool,
) -> tuple[float | None, ThresholdOrigin, str | None]:
    """The one threshold a policy applies (None where it serves a threshold per class, or has
    none), where it came from, and, when there is none at all, why (the reason an escalation
    gives). ``threshold`` is only ever a certified threshold's override (``make_policy``
    refuses it otherwise)."""
    if has_certificate:
        assert profile is not None
        if threshold is not None:
            return threshold, "request", None
        if profile.class_thresholds is not None:
            return None, "profile", None  # one per class: Policy.class_thresholds
        return profile.threshold.threshold, "profile", None
    if uncertified_threshold is not None:
        return uncertified_threshold, "uncertified_request", None
    if defaults.uncertified_threshold is not None:
        return defaults.uncertified_threshold, "uncertified_default", None
    if profile is None:
        why = (
            "no calibration profile, so no certified threshold: fit one on labeled examples "
            "(judge calibrate) and send its name, or opt in to accepting uncertified "
            "confidence with uncertified_threshold"
        )
    else:
        why = f"profile {profile.name!r} certifies no threshold: {profile.threshold.reason}"
    return None, "none", why
