"""The gate: the one object every route decides through.

A gate is opened once per profile and set of settings, and then decides any number of
judgments::

    gate = Gate(profile, etag=etag, overrides=Overrides(threshold=0.95), defaults=server)
    gate.check_engine(engine, system=..., choices=choices)        # once, before judging
    verdict = gate.decide(judgment)                                # accept or escalate

or, in Python, in one step that checks the profile and reads a probe's hidden-state layers
without the caller naming them::

    verdict = Gate(profile).judge(engine, "Is this spam? ...")

Opening a gate is the gate protocol every caller used to write out for itself: the request's
settings (``Overrides``) over the profile's over the server's (``PolicyDefaults``), resolved by
``make_policy`` into a ``Policy`` whose sha256 pins the rule; the audit rate; the profile's
version (its ETag); the hidden-state layers the engine must read (a probe's). ``POST /judge``,
batch items, shared questions, ``POST /v1/systemone``, the MCP tools, ``judge ask``, ``judge
decide``, ``judge replay`` and the client's ``gate()`` (through the server) all decide here, so a
decision made on one route is the decision every other route makes on the same judgment.

``Overrides`` is also what the decision log keeps of a request, beside the server's defaults,
so that ``judge replay`` reopens the very gate a decision was made through.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, TypeVar, Unpack

import msgspec

from calibration.errors import ProfileMismatchError
from calibration.policy import Hold, Policy, PolicyDefaults, ScoredJudgment, Verdict, make_policy
from judge.adapters import Adapter

if TYPE_CHECKING:
    from calibration.profile import CalibrationProfile
    from calibration.template import PromptTemplate
    from judge.fingerprint import Fingerprint

__all__ = ["Gate", "JudgingEngine", "Overrides", "TypedAnswer", "fitted_template"]

# Passed engine checks a gate remembers (``Gate.check_engine``); past this it forgets them all.
PASSED_CHECKS = 64

# The engine's Query, which calibration does not import: any struct with its fields.
_Query = TypeVar("_Query", bound=msgspec.Struct)


class JudgingEngine(Protocol):
    """What ``Gate.judge`` needs of an engine (``judge.Judge`` qualifies); calibration knows
    the engine only by this shape. The template's keywords (``system``, ``response_prefix``,
    ``response_suffix``) and ``feature_layers`` are passed through, not restated here: the
    engine's own signature is the one that says what they are and checks them."""

    def fingerprint(self, *args: Any, **template: Any) -> Fingerprint: ...

    def judge(
        self, prompt: str, choices: Sequence[str], *args: Any, **options: Any
    ) -> ScoredJudgment: ...


class TypedAnswer(Protocol):
    """What ``Gate.decide_answer`` reads of a typed answer (``judge.answers.Answer``)."""

    @property
    def judgment(self) -> ScoredJudgment: ...

    @property
    def order_spread(self) -> float: ...

    @property
    def pair(self) -> bool: ...


class Overrides(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A request's own settings, over its profile's and the server's defaults. None: not set.

    ``threshold`` (a certified threshold's override), ``uncertified_threshold`` (the opt-in to
    accepting without one) and ``min_choice_mass`` in [0, 1]; ``max_std`` >= 0 and ``values`` (a
    number per choice) for a score; ``max_order_spread`` in [0, 1] bounds how far the listings
    of a question's options may disagree. Checked when the gate opens (``make_policy``).
    """

    threshold: float | None = None
    # The opt-in to accepting where no certified threshold exists (see ``make_policy``).
    uncertified_threshold: float | None = None
    min_choice_mass: float | None = None
    max_std: float | None = None
    values: dict[str, float] | None = None
    max_order_spread: float | None = None

    @classmethod
    def of(cls, source: object) -> Overrides:
        """The overrides an object carries as attributes of these names (a request body)."""
        return cls(**{f: getattr(source, f, None) for f in cls.__struct_fields__})


def fitted_template(profile: CalibrationProfile | None) -> PromptTemplate:
    """The prompt template ``profile`` was fitted on: what a request that sends only the item
    is judged in. A profile fitted on whole prompts, or none, has none: ProfileMismatchError
    naming ``item``."""
    if profile is not None and profile.template is not None:
        return profile.template
    what = (
        "no profile"
        if profile is None
        else f"profile {profile.name!r} was fitted on whole prompts, not a task's"
    )
    raise ProfileMismatchError(
        "item",
        f"an item alone needs a profile that carries its prompt template ({what}); send the "
        "whole prompt and its choices instead",
    )


def _flagged(verdict: Verdict, outside_template: bool) -> Verdict:
    """``verdict``, saying its prompt lay outside the profile's fitted template where it did."""
    return msgspec.structs.replace(verdict, outside_template=True) if outside_template else verdict


class AskedFor(TypedDict, total=False):
    """What ``Gate.judge`` takes beside the prompt and its choices (``Gate.judged``'s)."""

    item: str | None
    system: str | None
    response_prefix: str | None
    response_suffix: str | None
    item_span: tuple[int, int] | None


class Gate:
    """A profile (or none) under a request's overrides and a server's defaults, ready to decide.

    Parameters
    ----------
    profile : the calibration profile, or None: the raw probabilities, which escalate unless
        the caller opts in to an uncertified threshold.
    etag : the profile's version where it was read from a store (what its decisions carry);
        None: ``profile.etag``.
    overrides : the request's settings (``Overrides``); None: none.
    defaults : the server's (``PolicyDefaults``); None: the built-in defaults.
    audit_rate : the share of decisions marked for a person to label (``is_audited``).
    log_layers : hidden-state layers the decision log keeps of each judgment (a server's
        ``--log-features``), read by the same pass as the probe's; default none.
    hold : what a server's monitor found the certificate does not cover (``Hold``): every
        decision escalates; None: nothing.
    """

    def __init__(
        self,
        profile: CalibrationProfile | None = None,
        *,
        etag: str | None = None,
        overrides: Overrides | None = None,
        defaults: PolicyDefaults | None = None,
        audit_rate: float = 0.0,
        log_layers: Sequence[int] = (),
        hold: Hold | None = None,
    ) -> None:
        self.profile = profile
        self.overrides = overrides or Overrides()
        self.defaults = defaults or PolicyDefaults()
        self.policy: Policy = make_policy(
            profile,
            threshold=self.overrides.threshold,
            uncertified_threshold=self.overrides.uncertified_threshold,
            min_choice_mass=self.overrides.min_choice_mass,
            max_std=self.overrides.max_std,
            values=self.overrides.values,
            max_order_spread=self.overrides.max_order_spread,
            defaults=self.defaults,
            profile_etag=etag,
            audit_rate=audit_rate,
        )
        if hold is not None:
            self.policy = msgspec.structs.replace(self.policy, hold=hold)
        # The hidden-state layers a judgment must carry for this gate: a probe's and those
        # the log keeps. Ask the engine for them (``Query.feature_layers``) when judging for
        # this gate; the probe's alone are ``policy.feature_layers``.
        self.log_layers: tuple[int, ...] = tuple(int(n) for n in log_layers)
        self.feature_layers: tuple[int, ...] = tuple(
            sorted(set(self.policy.feature_layers) | set(self.log_layers))
        )
        # The layers whose means over the item a probe reads (``Query.span_layers``).
        self.span_layers: tuple[int, ...] = self.policy.span_layers
        # The engine checks this gate has passed (``check_engine``), each with its engine, so
        # that the engine's id stays its own while the key is held.
        self._passed: dict[tuple[Any, ...], JudgingEngine] = {}

    def asks(self, query: _Query) -> _Query:
        """``query`` (the engine's ``Query``) asking for the hidden states this gate reads (its
        probe's) and the log keeps; its own item span is left as it is."""
        adapter = self.adapter
        if not (self.feature_layers or self.span_layers or adapter):
            return query
        return msgspec.structs.replace(
            query,
            feature_layers=self.feature_layers,
            span_layers=self.span_layers,
            adapter=adapter,
        )

    def plan(self, query: _Query, *, shared: bool = False) -> tuple[_Query, bool]:
        """``query`` (the engine's ``Query``) planned for this gate, before any model work:
        the query asking for what the gate reads (``asks``), and whether its prompt lies
        outside the profile's template, which the verdict says (``decide``'s
        ``outside_template``). A whole prompt is checked against the template around its item
        (``outside_template``: one that is not must mark its item); a question about a shared
        context is outside it wherever the profile has one."""
        prompt, span = getattr(query, "prompt"), getattr(query, "item_span")  # noqa: B009
        outside = self.template is not None if shared else self.outside_template(prompt, span)
        return self.asks(query), outside

    @property
    def adapter(self) -> Adapter | None:
        """The low-rank adapter a judgment for this gate is made under: its profile's."""
        return None if self.profile is None else self.profile.adapter

    @property
    def sha256(self) -> str:
        """The sha256 of the policy in force (``Policy.sha256``): what its verdicts carry.
        Computed when read, not when the gate opens: a request's gate is read once, when it
        decides."""
        return self.policy.sha256

    def __repr__(self) -> str:
        name = None if self.profile is None else self.profile.name
        return f"Gate(profile={name!r}, policy_sha256={self.sha256[:12]})"

    @property
    def choices(self) -> list[str] | None:
        """The profile's choices (any order will do); None: any choices."""
        return None if self.profile is None else list(self.profile.choices)

    def check(
        self,
        fingerprint: Fingerprint,
        *,
        choices: Sequence[str] | None = None,
        field: str | None = None,
    ) -> None:
        """Refuse an engine (its ``fingerprint`` for the call's template) or ``choices`` the
        profile was not fitted for: ProfileMismatchError, naming ``field`` when given (the
        request's own name for the profile), else the property that differs. Check before
        judging; without a profile there is nothing to check."""
        if self.profile is None:
            return
        try:
            self.profile.check(fingerprint, choices=choices)
        except ProfileMismatchError as exc:
            if field is not None:
                exc.field = field
            raise

    def check_engine(
        self,
        engine: JudgingEngine,
        *,
        system: str | None = None,
        response_prefix: str | None = None,
        response_suffix: str | None = None,
        choices: Sequence[str] | None = None,
        field: str | None = None,
    ) -> None:
        """``check`` against ``engine``'s fingerprint for this template, read only where there
        is a profile to check (a gate without one reads nothing of the engine). A check passed
        is not made again (an engine, like a profile, does not change): a gate kept open
        (``service.gate_context``) checks once per template and choices, not per request."""
        if self.profile is None:
            return
        adapter = self.profile.adapter
        if adapter is not None and not getattr(engine, "serves_adapters", False):
            model = getattr(engine, "model_id", type(engine).__name__)
            raise ProfileMismatchError(
                field or "adapter",
                f"profile {self.profile.name!r} reads its probe under a low-rank adapter "
                f"({adapter.short}) merged into the model's blocks, and this engine ({model}) "
                "cannot merge one: judge with the model loaded here (not served elsewhere), "
                "or use a profile without an adapter",
            )
        key = (
            id(engine),
            system,
            response_prefix,
            response_suffix,
            None if choices is None else tuple(choices),
        )
        if key in self._passed:  # the same engine, template and choices passed before
            return
        fingerprint = engine.fingerprint(
            system=system, response_prefix=response_prefix, response_suffix=response_suffix
        )
        self.check(fingerprint, choices=choices, field=field)
        if len(self._passed) >= PASSED_CHECKS:  # bounded: templates come from requests
            self._passed.clear()
        self._passed[key] = engine

    @property
    def template(self) -> PromptTemplate | None:
        """The prompt the profile was fitted on, with the item left out; None: no profile, or
        one fitted on whole prompts."""
        return None if self.profile is None else self.profile.template

    def render(self, item: str) -> tuple[str, tuple[int, int] | None]:
        """The prompt the profile was fitted on, around ``item``, and the item's characters in
        it (``fitted_template``)."""
        return fitted_template(self.profile).render(item)

    def outside_template(self, prompt: str, item_span: tuple[int, int] | None) -> bool:
        """Whether ``prompt``, sent whole, lies outside the template the profile was fitted on
        (False where the profile has none). Such a prompt must mark its item: without
        ``item_span`` it is refused (ProfileMismatchError naming ``item_span``), since the
        certificate's prompts all had one."""
        template = self.template
        if template is None:
            return False
        if item_span is None:
            assert self.profile is not None
            raise ProfileMismatchError(
                "item_span",
                f"profile {self.profile.name!r} was fitted on a task's prompts: send only the "
                "item (it is put in the fitted prompt), or mark the item's characters in the "
                "prompt with item_span",
            )
        return not template.fits(prompt, item_span)

    def decide(
        self,
        judgment: ScoredJudgment,
        *,
        order_spread: float | None = None,
        pair: bool = False,
        outside_template: bool = False,
    ) -> Verdict:
        """The verdict on one judgment; ``order_spread``: how far its listings disagreed (a
        question asked under several listings of its options); ``pair``: they were a pair's
        two orders; ``outside_template``: its prompt was not the profile's template around
        its item (``outside_template``), which the verdict says."""
        verdict = self.policy.decide(judgment, order_spread=order_spread, pair=pair)
        return _flagged(verdict, outside_template)

    def decide_answer(self, answer: TypedAnswer) -> Verdict:
        """The verdict on a typed answer (``judge.answers``): its judgment, bounded by how far
        its listings disagreed; a pair's by its two orders (``position_inconsistent``). What
        every route that answers typed questions decides with.

        Under a profile fitted on a task the verdict says ``outside_template``: a typed
        question is asked in its own prompt (``judge.answers``), never the task's, so the
        certificate was measured on other prompts."""
        verdict = self.policy.decide(
            answer.judgment, order_spread=answer.order_spread, pair=answer.pair
        )
        return _flagged(verdict, self.template is not None)

    def decide_many(
        self,
        judgments: Sequence[ScoredJudgment],
        *,
        order_spreads: Sequence[float] | None = None,
        pair: bool = False,
        outside_templates: Sequence[bool] | None = None,
    ) -> list[Verdict]:
        """Verdicts on many judgments, in order, computed together per set of choices;
        ``outside_templates``: one per judgment, as ``decide``'s ``outside_template``."""
        verdicts = self.policy.decide_many(judgments, order_spreads=order_spreads, pair=pair)
        if outside_templates is None:
            return verdicts
        if len(outside_templates) != len(verdicts):
            raise ValueError(f"{len(outside_templates)} flags for {len(verdicts)} judgments")
        return [_flagged(v, o) for v, o in zip(verdicts, outside_templates, strict=True)]

    def judge(
        self,
        engine: JudgingEngine,
        prompt: str | None = None,
        choices: Sequence[str] | None = None,
        **asked: Unpack[AskedFor],
    ) -> Verdict:
        """Judge with ``engine`` and decide: the profile checked against the engine (for this
        template), the probe's layers read, the choices the profile's unless given.

        Give the ``item`` alone where the profile carries its prompt template (a profile
        fitted on a task): it is judged in the very prompt the certificate covers, its span
        marked. Or give the whole ``prompt``, with ``item_span`` (characters of ``prompt``
        that hold the item) where the profile was fitted on a task or its probe reads means
        over the item; a prompt that is not the template around its item is decided with
        ``outside_template`` set. ``system`` and the response prefix and suffix are the
        engine's template's (``AskedFor``).
        """
        return self.judged(engine, prompt, choices, **asked)[1]

    def judged(
        self,
        engine: JudgingEngine,
        prompt: str | None = None,
        choices: Sequence[str] | None = None,
        *,
        item: str | None = None,
        system: str | None = None,
        response_prefix: str | None = None,
        response_suffix: str | None = None,
        item_span: tuple[int, int] | None = None,
    ) -> tuple[ScoredJudgment, Verdict]:
        """``judge``, with the judgment it decided on (its tokens and latency: a cascade's
        cost)."""
        asked = list(choices) if choices is not None else self.choices
        if asked is None:
            raise ValueError("give the choices: a gate without a profile has none of its own")
        if (prompt is None) == (item is None):
            raise ValueError("give the prompt, or the item alone (for a profile fitted on a task)")
        outside = False
        if item is not None:
            if item_span is not None:
                raise ValueError("an item alone marks its own span: give no item_span with it")
            prompt, item_span = self.render(item)
            if system is None and self.template is not None:
                system = self.template.system
        else:
            assert prompt is not None
            outside = self.outside_template(prompt, item_span)
        template = {
            "system": system,
            "response_prefix": response_prefix,
            "response_suffix": response_suffix,
        }
        self.check_engine(engine, choices=asked, **template)
        adapter = self.adapter
        judgment = engine.judge(
            prompt,
            asked,
            feature_layers=self.feature_layers,
            span_layers=self.span_layers,
            item_span=item_span,
            **template,
            **({} if adapter is None else {"adapter": adapter}),
        )
        return judgment, self.decide(judgment, outside_template=outside)

    def settings(self) -> dict[str, Any]:
        """What reopens this gate (``reopen``): the profile's name, the overrides and the
        defaults, as JSON-ready data; the decision log keeps it with a request."""
        return {
            "profile": None if self.profile is None else self.profile.name,
            "overrides": msgspec.to_builtins(self.overrides),
            "defaults": msgspec.to_builtins(self.defaults),
        }

    @staticmethod
    def settings_of(kept: Mapping[str, Any]) -> tuple[Overrides, PolicyDefaults | None]:
        """The overrides and defaults ``settings`` wrote (defaults None where not kept:
        a record from before defaults were logged)."""
        kept_overrides = dict(kept.get("overrides") or {})
        if kept.get("profile") is None and "threshold" in kept_overrides:
            # Kept before 0.x, when a request's threshold applied without a profile: that is
            # what the opt-in now says (a threshold there is refused).
            kept_overrides["uncertified_threshold"] = kept_overrides.pop("threshold")
        overrides = msgspec.convert(kept_overrides, Overrides)
        raw = kept.get("defaults")
        if raw is not None and "threshold" in raw:
            # Kept before 0.x, when the server's default threshold accepted uncalibrated
            # confidence: that is what the opt-in now says, so a replay reopens the same rule.
            raw = {**raw, "uncertified_threshold": raw["threshold"]}
            del raw["threshold"]
        defaults = None if raw is None else msgspec.convert(raw, PolicyDefaults)
        return overrides, defaults
