"""One logged decision: the record a decision log keeps, and what is kept with it.

``LoggedDecision`` is a decision as the service made it (``LoggedDecision.of``, called in one
place, ``service.gate_context``), with its label once feedback gives one. Kept with it:
a cascade's outcome (``with_cascade``: who decided, and each stage's part) and, where the
server keeps requests, what ``judge replay`` re-runs (``replayable_query`` for a judgment,
``replayable_question`` for a typed answer). Plain data: the client, the routes and the
readers of the log use it without the databases (``service.log.decision_log`` stores it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from calibration.carry import carry
from calibration.cascade import StageResult
from service.log.logged_features import LoggedFeatures

if TYPE_CHECKING:
    from calibration.gate import Gate
    from calibration.policy import Verdict
    from judge.judgments import Query

__all__ = [
    "CascadeLog",
    "LoggedDecision",
    "replayable_query",
    "replayable_question",
    "with_cascade",
]


class CascadeLog(msgspec.Struct, frozen=True, kw_only=True):
    """A cascade's outcome, kept with each of its stages' logged decisions."""

    decided_by: str | None  # the stage whose gate accepted; None: a person decides
    stages: list[StageResult]  # every stage tried, in order


def with_cascade(
    records: Sequence[LoggedDecision], decided_by: str | None, stages: Sequence[StageResult]
) -> list[LoggedDecision]:
    """``records`` (a cascade's stages' decisions on one item), each carrying its outcome."""
    kept = CascadeLog(decided_by=decided_by, stages=list(stages))
    return [msgspec.structs.replace(r, cascade=kept) for r in records]


class LoggedDecision(msgspec.Struct, frozen=True, kw_only=True):
    """One decision as the service made it, with its label once feedback gives one."""

    judgment_id: str  # UUIDv7 text, unique: the primary key
    created_at: float  # unix seconds (UTC) when the decision was made
    model: str  # model id
    model_sha256: str
    tokens_sha256: str
    policy_sha256: str
    profile: str | None
    profile_etag: str | None  # the profile's version
    # The SHA-256 of the adapter the judgment ran under (the profile's); None: the model as
    # loaded.
    adapter_sha256: str | None = None
    choices: list[str]  # in the judgment's order
    log_probs: list[float]  # raw per-choice log-probabilities, in `choices` order
    choice_mass: float
    probabilities: dict[str, float]  # calibrated
    choice: str
    confidence: float
    decision: Literal["accept", "escalate"]
    reason_codes: list[str]
    threshold: float | None
    certified: bool
    audit: bool  # chosen for audit sampling (a uniform random share)
    # The request as judged (prompt text): only when the server was told to keep prompts.
    request: dict[str, Any] | None = None
    # The hidden states a probe reads, for refitting one from the log: only with
    # --log-features (service.log.logged_features).
    features: LoggedFeatures | None = None
    # With a cascade: what became of the request this decision was one stage of (each local
    # stage logs its own decision, each carrying this).
    cascade: CascadeLog | None = None
    label: str | None = None  # the true label, from feedback
    labeled_at: float | None = None

    @classmethod
    def of(
        cls,
        verdict: Verdict,
        *,
        model: str,
        request: dict[str, Any] | None = None,
        features: LoggedFeatures | None = None,
        created_at: float | None = None,
    ) -> LoggedDecision:
        """The row of ``verdict``: the one place a decision becomes a log row, on every route.

        ``choices`` and ``log_probs`` are the verdict's (the profile's order, else the
        judgment's); ``request`` is what replays it (only with ``--log-requests``);
        ``features`` what refits a probe (only with ``--log-features``).
        """
        if verdict.judgment_id is None:
            raise ValueError("a verdict without a judgment id cannot be logged")
        return carry(
            verdict,
            cls,
            judgment_id=verdict.judgment_id,
            created_at=time.time() if created_at is None else created_at,
            model=model,
            model_sha256=verdict.model_sha256 or "",
            tokens_sha256=verdict.tokens_sha256 or "",
            policy_sha256=verdict.policy_sha256 or "",
            log_probs=verdict.raw_log_probs,
            probabilities=verdict.probabilities,
            request=request,
            features=features,
        )


def replayable_query(query: Query, gate: Gate) -> dict[str, Any]:
    """What ``judge replay`` re-runs of a judgment (``LoggedDecision.request``): its query,
    without the hidden-state layers and the adapter (the gate asks for its own profile's; the
    item's span stays), and the gate's settings."""
    bare = msgspec.structs.replace(query, feature_layers=(), span_layers=(), adapter=None)
    return {"query": msgspec.to_builtins(bare), **gate.settings()}


def replayable_question(state: object, qid: str, question: object, gate: Gate) -> dict[str, Any]:
    """What ``judge replay`` re-runs of a typed answer: the state, the question as asked (its
    JSON form, under its id) and the gate's settings."""
    return {"state": state, "question": {qid: msgspec.to_builtins(question)}, **gate.settings()}
