"""A cascade's one escalation, for judgments and typed questions alike.

Every front decides an item with its own engine first (the first stage, named by
``--stage-name``); ``escalated`` then hands what that stage escalated to each later stage in
turn (``calibration.cascade.run_stages``: the deadline, what a failed stage means) and says
who decided, each stage's part, and which later stage's answer stands:

    escalation = escalated("local", verdict, judgment, choices, stages, item, deadline_s=2.0)
    escalation.staged(own_response)   # the answer that stands, with decided_by and cascade

The stages (``service.cascade.stages``: ``LocalStage``, ``RemoteStage``) are made per
request and keep what they answered (``Kept``), so the answer that stands is the deciding
stage's, else the last that answered (the strongest judge's view of an item a person now
takes), else the first stage's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from calibration.cascade import Stage, StageAnswer, StageResult, run_stages
from service.log.record import with_cascade
from service.schemas import JudgeResponse
from service.systemone import SystemOneAnswer

if TYPE_CHECKING:
    from calibration import Verdict
    from calibration.policy import ScoredJudgment
    from service.log.record import LoggedDecision

__all__ = ["Escalation", "Kept", "escalated"]

# What a front sends back: a judgment's response, or a typed question's wire answer.
_Own = TypeVar("_Own", JudgeResponse, SystemOneAnswer)


@dataclass(frozen=True)
class Kept:
    """What a later stage answered for one request, in every shape a front sends: a
    judgment's (``POST /judge``, a pair there), a typed question's wire answer (None where it
    was asked a judgment), and its decision-log record (None: remote, or no log)."""

    response: JudgeResponse
    wire: SystemOneAnswer | None = None
    record: LoggedDecision | None = None


@dataclass(frozen=True)
class Escalation:
    """Who decided (a stage's name; None: a person), each stage's part in order, the later
    stage's answer that stands (None: the first stage's own), and the later local stages'
    log records."""

    decided_by: str | None
    cascade: list[StageResult]
    standing: Kept | None = None
    records: tuple[LoggedDecision, ...] = ()

    def staged(self, own: _Own) -> _Own:
        """The answer that stands (``own``: the first stage's, in the shape the front sends;
        a later stage's in the same shape), with ``decided_by`` and ``cascade``."""
        if self.standing is not None:
            if isinstance(own, JudgeResponse):
                own = self.standing.response
            elif self.standing.wire is not None:
                own = self.standing.wire
        return msgspec.structs.replace(own, decided_by=self.decided_by, cascade=self.cascade)

    def logged(self, first: Sequence[LoggedDecision]) -> list[LoggedDecision]:
        """The item's log records: the first stage's (``first``; none without a log) and the
        later local stages', each carrying the outcome."""
        return with_cascade([*first, *self.records], self.decided_by, self.cascade)


def escalated(
    first: str,
    verdict: Verdict,
    judgment: ScoredJudgment,
    choices: Sequence[str],
    stages: Sequence[Stage[Any]],
    item: object,
    *,
    deadline_s: float | None = None,
) -> Escalation:
    """The cascade's outcome for ``item`` (a ``StageItem`` or a ``QuestionItem``), given the
    first stage's (``first``) ``verdict`` on its ``judgment`` over ``choices``: where it
    escalated, the later ``stages`` asked in turn (blocking) until one accepts."""
    part = StageResult(
        stage=first,
        answer=StageAnswer.of(verdict, judgment, choices),
        latency_ms=float(getattr(judgment, "latency_ms", 0.0)),
    )
    if verdict.decision == "accept":
        return Escalation(first, [part])
    outcome = run_stages(stages, item, deadline_s=deadline_s)
    # A stage judge speaks (service.cascade.stages) keeps what it answered; another (a System
    # One server's) keeps nothing, and its answer stands only as its part.
    kept: list[Kept] = [k for s in stages if (k := getattr(s, "kept", None)) is not None]
    return Escalation(
        outcome.decided_by,
        [part, *outcome.stages],
        kept[-1] if kept else None,
        tuple(k.record for k in kept if k.record is not None),
    )
