"""The decision core: the one place every front (HTTP, MCP, the command line) opens a gate and
settles what it decides.

A route's gate (``calibration.gate.Gate``) is a stored profile's version (by name, with its
ETag), the request's ``Overrides`` over the server's ``PolicyDefaults``, the server's audit rate
for that profile (``--audit-rate [PROFILE=]RATE``: the share of decisions marked for people to
label, accepted and escalated alike) and the hidden-state layers its decision log keeps
(``service.log.logged_features``). Both servers hold one ``GateContext`` and open every gate
through it, so a decision made over MCP is drawn into the audit sample, and logs its layers,
as one made over HTTP does. After the gate, ``GateContext.settle`` turns each verdict into its
decision-log record, with the request that replays it and the hidden states it keeps, on
every route (``POST /judge`` and its batches, shared questions, System One and pairs, a
cascade's local stage, MCP's ``judge`` and ``decide``): tests/test_structure.py checks that no
other module builds one.

A front settles through ``respond`` (a judgment: its log record and its response together, the
probabilities in the request's order) or ``answered`` (a typed question's answer: its record and
its decision); ``judge ask``, ``judge decide`` and ``judge replay`` open their gates here too, on a
profile read from a file (``open_profile``), with no store and no log. tests/test_structure.py
checks that no front builds a ``Gate``, a ``JudgeResponse`` or a record itself.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from calibration.errors import ProfileError, ProfileNotFoundError
from calibration.gate import Gate, JudgingEngine, Overrides, fitted_template
from calibration.policy import Hold, PolicyDefaults, Verdict
from judge.scores import check_values
from service.decisions import QuestionDecision
from service.log.logged_features import LoggedFeatures, log_layers
from service.log.record import LoggedDecision, replayable_query
from service.schemas import JudgeResponse

if TYPE_CHECKING:
    from calibration import CalibrationProfile
    from judge import Judgment
    from judge.answers import Answer
    from judge.protocol import Query
    from service.profiles import ProfileStore

__all__ = ["NO_LOG", "GateContext", "ItemPrompt", "item_prompt", "scored"]

# Gates kept open, most recently used last: a profile's version under one set of overrides
# is one gate, opened once (its policy resolved, its checks against the engine made once).
# Bounded: overrides come from clients.
OPEN_GATES = 256


@dataclass(frozen=True)
class GateContext:
    """What a front brings to each gate it opens: a server its store, defaults, audit rates and
    log settings; the command line nothing (``GateContext()``: the built-in defaults, no log)."""

    store: ProfileStore | None = None
    defaults: PolicyDefaults = field(default_factory=PolicyDefaults)
    audit_rate: float = 0.0  # every profile's, and no profile's
    audit_rates: Mapping[str, float] = field(default_factory=dict)  # by profile name
    logging: bool = False  # a decision log is kept
    log_features: bool = False  # and it keeps hidden states (--log-features)
    log_requests: bool = False  # and it keeps what replays each decision (--log-requests)
    # The hold on a profile version, if its traffic's class mix moved (service.log.shift_watch).
    holds: Callable[[str | None, str | None], Hold | None] | None = None
    _open: OrderedDict[tuple[str | None, str | None, bytes], Gate] = field(
        default_factory=OrderedDict, init=False, repr=False, compare=False
    )
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def audit_rate_for(self, name: str | None) -> float:
        """The share of decisions under profile ``name`` marked for audit."""
        if name is not None and name in self.audit_rates:
            return self.audit_rates[name]
        return self.audit_rate

    def log_layers(self, profile: CalibrationProfile | None) -> tuple[int, ...]:
        """The hidden-state layers the log keeps of a decision under ``profile``: with
        ``--log-features`` and a log, a probe's own, else the candidate layers of the model it
        was fitted on (the gate checks it is this one); else none."""
        if profile is None or not self.logging:
            return ()
        return log_layers(
            profile.feature_layers, profile.fingerprint.num_layers, enabled=self.log_features
        )

    def read(
        self, name: str | None, field: str = "profile"
    ) -> tuple[CalibrationProfile, str] | None:
        """The stored version (profile and ETag) a request's profile ``name`` names, None where
        it names none: read once, so that the prompt an item is put in and the certificate that
        decides it are one version's. Raises the store's ProfileError naming ``field`` (where no
        profile has the name, the message lists those that exist); no model work."""
        if name is None:
            return None
        if self.store is None:  # the command line's context: it opens profiles it read
            raise LookupError(f"no profile store to read profile {name!r} from")
        try:
            return self.store.get_tagged(name)
        except ProfileNotFoundError as exc:
            names = ", ".join(self.store.names()) or "none"
            raise _named(
                ProfileNotFoundError(f"{exc} (the profiles are: {names})"), field
            ) from None
        except ProfileError as exc:
            raise _named(exc, field) from None

    def open(
        self,
        name: str | None,
        overrides: Overrides | None = None,
        *,
        version: tuple[CalibrationProfile, str] | None = None,
        field: str = "profile",
    ) -> Gate:
        """The gate of a request naming profile ``name`` (None: the defaults alone): the
        stored version and its ETag (``read``: a ProfileError names ``field``); no model work.

        A gate depends on nothing else (the defaults, audit rates and logged layers are the
        server's), so the gate of a version under the same overrides is opened once and kept
        (``OPEN_GATES`` of them): every request under it shares its resolved policy and the
        checks it has passed. A new version (another ETag) is another gate. ``version``: the
        profile and ETag the request read already (an item alone, rendered in that version's
        template), so that one version serves it end to end."""
        if name is None:
            profile, etag = None, None
        else:  # read already where given: the item's template came from this version
            profile, etag = version or self.read(name, field) or (None, None)
        hold = None if self.holds is None else self.holds(name, etag)
        key = (name, etag, msgspec.json.encode([overrides or Overrides(), hold]))
        with self._lock:
            gate = self._open.get(key)
            if gate is not None:
                self._open.move_to_end(key)
                return gate
        try:
            gate = self._gate(profile, name, overrides, etag=etag, hold=hold)
        except ProfileError as exc:
            raise _named(exc, field) from None
        with self._lock:
            self._open[key] = gate
            while len(self._open) > OPEN_GATES:
                self._open.popitem(last=False)
        return gate

    def opened(
        self,
        engine: JudgingEngine,
        name: str | None,
        overrides: Overrides | None = None,
        *,
        template: Query | None = None,
        choices: Sequence[str] | None = None,
        field: str | None = None,
        version: tuple[CalibrationProfile, str] | None = None,
    ) -> Gate:
        """``open``, and the gate's profile checked against ``engine`` for ``template``'s
        system prompt, response prefix and suffix and for ``choices``: a refusal names
        ``field`` where given (a typed question's profile), else the profile's name for a
        missing profile and what differs for a mismatch (``choices``, ``system``, ...). What a
        server does for each request before its model work; no tokenizing."""
        gate = self.open(name, overrides, version=version, field=field or "profile")
        gate.check_engine(
            engine,
            system=template.system if template else None,
            response_prefix=template.response_prefix if template else None,
            response_suffix=template.response_suffix if template else None,
            choices=choices,
            field=field,
        )
        return gate

    def open_profile(
        self,
        profile: CalibrationProfile | None,
        overrides: Overrides | None = None,
        *,
        etag: str | None = None,
    ) -> Gate:
        """The gate of ``profile`` itself (a file the command line read, a logged decision's
        version), under ``overrides`` and this context's defaults, audit rate and logged
        layers: not kept (nothing names it). Raises as ``Gate`` does: ``NoCertificateError``
        for a threshold with no certified one to override, ``ValueError`` for a bad setting."""
        return self._gate(profile, None if profile is None else profile.name, overrides, etag=etag)

    def _gate(
        self,
        profile: CalibrationProfile | None,
        name: str | None,
        overrides: Overrides | None,
        *,
        etag: str | None,
        hold: Hold | None = None,
    ) -> Gate:
        """A gate under this context's defaults, ``name``'s audit rate and logged layers."""
        return Gate(
            profile,
            etag=etag,
            overrides=overrides,
            defaults=self.defaults,
            audit_rate=self.audit_rate_for(name),
            log_layers=self.log_layers(profile),
            hold=hold,
        )

    def respond(
        self,
        judgment: Judgment,
        verdict: Verdict,
        gate: Gate,
        *,
        model: str,
        query: Query | None = None,
        choices: Sequence[str] | None = None,
        return_prompt: bool = False,
    ) -> tuple[JudgeResponse, LoggedDecision | None]:
        """A judgment's response and its decision-log record (None: no log), together.

        ``choices`` orders the response's probabilities (the request's order; None: the
        verdict's, the profile's). ``query`` is what replays the decision, kept where requests
        are logged (None: a cascade's later stage, whose first stage's record replays it)."""
        request = None if query is None else functools.partial(replayable_query, query, gate)
        record = self.settle(
            verdict, gate, model=model, features=judgment.features, request=request
        )
        response = JudgeResponse.of(judgment, verdict, choices=choices, return_prompt=return_prompt)
        return response, record

    def answered(
        self,
        answer: Answer,
        verdict: Verdict,
        gate: Gate,
        *,
        model: str,
        request: Callable[[], dict[str, Any]] | None = None,
    ) -> tuple[QuestionDecision, LoggedDecision | None]:
        """A typed question's decision and its decision-log record (None: no log), together;
        ``request`` gives what replays it (``replayable_question``), asked for only where
        requests are logged."""
        record = self.settle(
            verdict, gate, model=model, features=answer.judgment.features, request=request
        )
        return QuestionDecision(answer, verdict), record

    def settle(
        self,
        verdict: Verdict,
        gate: Gate,
        *,
        model: str,
        features: Mapping[int, Sequence[float]] | None,
        request: Callable[[], dict[str, Any]] | None = None,
    ) -> LoggedDecision | None:
        """The decision-log record of ``verdict``, given by ``gate`` on a judgment of
        ``model`` whose hidden states are ``features``; None when no log is kept.

        The record keeps the gate's logged layers of ``features`` and, when requests are
        logged, what ``request`` returns (a replayable query or question: asked for only then,
        as building one renders the prompt's text)."""
        if not self.logging:
            return None
        kept = request() if self.log_requests and request is not None else None
        logged = LoggedFeatures.of(features, gate.log_layers)
        return LoggedDecision.of(verdict, model=model, request=kept, features=logged)


def _named(error: ProfileError, field: str) -> ProfileError:
    """``error``, naming the request's field at fault (what ``service.errors.error_of`` reads)."""
    error.field = field  # type: ignore[attr-defined]
    return error


# The command line's context (judge ask, decide, replay and their cascades' stages): no store
# (it opens the profiles it read from files), the built-in defaults, no audit, no log.
NO_LOG = GateContext()


def scored(overrides: Overrides, choices: Sequence[str], *, profile: str | None) -> Overrides:
    """``overrides`` with a score's ``values`` checked against ``choices`` (in their order),
    and the numerals' values where ``max_std`` is asked without a profile (whose own values
    would serve); every front's, before any model work. Raises ``ValuesError`` naming
    ``values``."""
    if overrides.values is None and (overrides.max_std is None or profile is not None):
        return overrides
    values = check_values(overrides.values, choices)
    return msgspec.structs.replace(overrides, values=values)


class ItemPrompt(NamedTuple):
    """What an item sent alone stands for under its profile: the prompt the profile was fitted
    on around it, the item's characters in it, the profile's choices and system prompt."""

    prompt: str
    item_span: tuple[int, int] | None
    choices: list[str]
    system: str | None


def item_prompt(profile: CalibrationProfile | None, item: str) -> ItemPrompt:
    """``item`` put in the prompt ``profile`` was fitted on (its template), every front's way:
    ``POST /judge``'s item alone, MCP's, ``judge ask``'s. A profile without a template, or
    none, is a ``ProfileMismatchError`` naming ``item``."""
    template = fitted_template(profile)
    assert profile is not None  # fitted_template refuses None
    prompt, span = template.render(item)
    return ItemPrompt(prompt, span, list(profile.choices), template.system)
