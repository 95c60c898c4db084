"""The policy: one rule turns a judgment into a decision, accept or escalate, with its reasons.

Every caller that decides (the HTTP service, the MCP tools, ``judge ask``, ``judge evaluate``,
a Python pipeline) opens a ``calibration.gate.Gate``, whose one ``make_policy`` call builds
this rule, so the rule that is evaluated is the rule that is served. A decision accepts only when every check passes:

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
  (``decide(judgment, order_spread=...)``); a judgment without one passes this check. The bound
  only ever adds escalations, and is the caller's: it leaves ``certified`` as it is;
* for a pair (``judge.answers``: two candidates judged in both orders; ``decide(...,
  pair=True)``), the same spread is how far the two orders disagreed on the winner's
  probability, and above the bound the code is ``position_inconsistent``: the place a
  candidate was read in, not the candidate, swayed the judge. A pair is bounded even when the
  caller sets nothing, by ``DEFAULT_MAX_POSITION_SPREAD``: position bias is the main failure
  of pairwise judging (Zheng et al. 2023, "Judging LLM-as-a-judge"), so the check is on unless
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

This module resolves the rule and makes the verdicts; the checks themselves run over arrays
in ``calibration.policy_checks`` (``Policy.checks``), where each reason code and its words are
made.

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
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from calibration.carry import carry
from calibration.errors import NoCertificateError, ProfileMismatchError, ValuesError
from calibration.maps.map_types import CalibrationMap, Identity, Probe
from calibration.policy_checks import (
    REASON_CODES,
    Checks,
    Hold,
    ReasonCode,
    Rows,
    checked,
    failures,
)
from calibration.scored import ScoredJudgment, check_max_std, probe_row
from calibration.scores import check_values, numeral_values
from calibration.validation import check_probability

if TYPE_CHECKING:
    from calibration.profile import CalibrationProfile

# REASON_CODES, Checks, Hold and ReasonCode are calibration.policy_checks', named here too: the
# policy's callers import them with it.
__all__ = [
    "DEFAULT_MAX_POSITION_SPREAD",
    "REASON_CODES",
    "Checks",
    "Hold",
    "Policy",
    "PolicyDefaults",
    "ReasonCode",
    "ScoredJudgment",
    "Verdict",
    "is_audited",
    "make_policy",
]

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
    decision log's row (``service.log.record.LoggedDecision.of``). Probabilities are arrays
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


class Policy(msgspec.Struct, frozen=True, kw_only=True):
    """A resolved rule: a calibration map and its checks. Build it with ``make_policy``."""

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
        for order, members in groups.items():
            choices, columns = self._columns(order)
            group = [judgments[i] for i in members]
            z = np.array([j.log_probs for j in group], dtype=np.float64)  # (n, k)
            rows = Rows(
                choices,
                z[:, columns],
                choice_mass=np.array([j.choice_mass for j in group], dtype=np.float64),
                features=self._features(group),
                order_spread=None if order_spreads is None else [order_spreads[i] for i in members],
                pair=pair,
            )
            decisions = self._verdicts(rows, group, _raw_probs(group, columns), sha256)
            for i, d in zip(members, decisions, strict=True):
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

    def _verdicts(
        self,
        rows: Rows,
        judgments: Sequence[ScoredJudgment],
        raw_probs: npt.NDArray[np.float64] | None,
        sha256: str,
    ) -> list[Verdict]:
        """The verdicts on ``rows``, made from the judgments in order, whose ids and hashes
        they carry, with this policy's ``sha256`` read once by the caller. ``raw_probs``
        (n, k): the model's probabilities as the judgments carry them (None: the exponentials
        of ``rows.log_probs``)."""
        z = rows.log_probs  # (n, k)
        g = checked(self, rows)
        raw = np.exp(z) if raw_probs is None else raw_probs
        spreads = (
            None if rows.order_spread is None else np.asarray(rows.order_spread, dtype=np.float64)
        )
        bound = self.spread_bound(rows.pair)
        method, temperature, layers = self._map_record()
        decisions = []
        for i, judgment in enumerate(judgments):
            unknown = float(getattr(judgment, "unknown_mass", 0.0) or 0.0)
            codes, reasons, members = failures(self, g, rows, i, unknown)
            held_to = float(g.thresholds[i])
            scored = g.expected_value is not None and g.std is not None
            judgment_id = _carried(judgment, "judgment_id")
            decisions.append(
                Verdict(
                    decision="escalate" if codes else "accept",
                    choice=rows.choices[int(g.best[i])],
                    confidence=float(g.confidence[i]),
                    choices=list(rows.choices),
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

    def checks(
        self,
        choices: Sequence[str],
        log_probabilities: npt.ArrayLike,
        choice_mass: npt.ArrayLike | None = None,
        features: npt.ArrayLike | None = None,
        order_spread: npt.ArrayLike | None = None,
        *,
        pair: bool = False,
    ) -> Checks:
        """Every check of the policy for (n, k) log-probabilities, as arrays
        (``calibration.policy_checks.checked``).

        ``features`` (n, m * H) are the hidden states a probe map reads; other maps ignore them.
        ``order_spread`` (n,) is each judgment's spread across listings of its options;
        ``pair``: across a pair's two orders (``spread_bound``).

        ``decide_many`` turns these into decisions; for large evaluations, ``Checks.accepted``
        and ``Checks.best`` are the decisions without building an object per item.
        """
        z = np.asarray(log_probabilities, dtype=np.float64)
        rows = Rows(choices, z, choice_mass, features, order_spread=order_spread, pair=pair)
        return checked(self, rows)

    def values_for(self, choices: Sequence[str]) -> npt.NDArray[np.float64] | None:
        """The number of each of ``choices`` (k,), or None when the judgment is not a score. A
        ``max_std`` that the request or the profile set needs values: without them it is a
        ValuesError, not a silently skipped check. A server default applies to scores only."""
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
