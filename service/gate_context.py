"""A server's side of a gate: the one place the HTTP service and the MCP server open one, and
settle what it decides.

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
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from calibration.gate import Gate, Overrides
from calibration.policy import Hold, PolicyDefaults, Verdict
from service.log.decision_log import LoggedDecision
from service.log.logged_features import LoggedFeatures, log_layers

if TYPE_CHECKING:
    from calibration import CalibrationProfile
    from service.profiles import ProfileStore

__all__ = ["GateContext"]

# Gates kept open, most recently used last: a profile's version under one set of overrides
# is one gate, opened once (its policy resolved, its checks against the engine made once).
# Bounded: overrides come from clients.
OPEN_GATES = 256


@dataclass(frozen=True)
class GateContext:
    """What a server brings to each gate it opens."""

    store: ProfileStore
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

    def open(self, name: str | None, overrides: Overrides | None = None) -> Gate:
        """The gate of a request naming profile ``name`` (None: the defaults alone): the
        stored version and its ETag. Raises the store's ProfileError; no model work.

        A gate depends on nothing else (the defaults, audit rates and logged layers are the
        server's), so the gate of a version under the same overrides is opened once and kept
        (``OPEN_GATES`` of them): every request under it shares its resolved policy and the
        checks it has passed. A new version (another ETag) is another gate."""
        profile, etag = self.store.get_tagged(name) if name is not None else (None, None)
        hold = None if self.holds is None else self.holds(name, etag)
        key = (name, etag, msgspec.json.encode([overrides or Overrides(), hold]))
        with self._lock:
            gate = self._open.get(key)
            if gate is not None:
                self._open.move_to_end(key)
                return gate
        gate = Gate(
            profile,
            etag=etag,
            overrides=overrides,
            defaults=self.defaults,
            audit_rate=self.audit_rate_for(name),
            log_layers=self.log_layers(profile),
            hold=hold,
        )
        with self._lock:
            self._open[key] = gate
            while len(self._open) > OPEN_GATES:
                self._open.popitem(last=False)
        return gate

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
