"""A judgment's cascade, behind every route that decides (``judge serve --cascade NAME=TARGET
...``, served by ``service.web.serving_cascade``; ``judge ask --cascade``): ``POST /judge`` and
its batches, questions about a shared context, ``POST /v1/systemone`` and pairs (typed
questions: ``service.cascade.cascade_questions``).

This server's engine is the first stage (``--stage-name``), decided as every judgment is. An
item it escalates goes to each later stage in turn (``calibration.cascade.Cascade``): a
model loaded in this process, which judges on its own lock off the event loop, or another
judge server (``service.cascade.remote_stage``). A request's profile P is the first stage's; stage
NAME decides with "P-NAME" (``calibration.tasks.fit_cascade`` names them so), whose gate is
opened, and checked against its engine, before any model work. What a stage decides comes
back as that stage's own response, with ``decided_by`` and every stage's part
(``JudgeResponse.cascade``); each local stage's decision is logged, each row carrying the
cascade's outcome; ``/metrics`` counts who decided and which stages failed.

A later stage's time comes out of the request's deadline: none starts after it, and a remote
one gets what is left as its timeout. A local stage holds its own lock, so it judges one item
at a time (a cascade's later stages see only what the first escalates).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from calibration import Cascade, Gate, Verdict
from calibration.cascade import LocalStage, StageAnswer, StageItem, StageResult
from judge import Judgment
from service.cascade.cascade_questions import LocalModel
from service.cascade.remote_stage import RemoteStage, answer_of
from service.gate_context import GateContext
from service.log.decision_log import LoggedDecision
from service.schemas import JudgeResponse

__all__ = [
    "ServedLocal",
    "ServedRemote",
    "ServedStage",
    "cascaded",
]


@dataclass
class ServedLocal:
    """One request's view of a local later stage: its gate, and what it answered."""

    name: str
    model: LocalModel
    gate: Gate
    # The server's; judge ask's has no log, so its stages leave no record.
    context: GateContext = field(default_factory=GateContext)
    response: JudgeResponse | None = None
    record: LoggedDecision | None = None

    def answer(self, item: StageItem, *, timeout_s: float | None) -> StageAnswer:
        with self.model.lock:
            judgment, verdict = LocalStage(self.name, self.model.engine, self.gate).judged(item)
        assert isinstance(judgment, Judgment)  # an engine's, not a bare ScoredJudgment
        # What the log keeps of a first stage's decision it keeps of this one's (with
        # --log-features, the hidden states a refit of this stage's probe reads), but not its
        # request (no query): the first stage's record replays the request.
        self.response, self.record = self.context.respond(
            judgment, verdict, self.gate, model=self.model.engine.model_id, choices=item.choices
        )
        return StageAnswer.of(verdict, judgment, item.choices)


@dataclass
class ServedRemote:
    """One request's view of a remote later stage, and what it answered."""

    stage: RemoteStage
    response: JudgeResponse | None = None

    @property
    def name(self) -> str:
        return self.stage.name

    def answer(self, item: StageItem, *, timeout_s: float | None) -> StageAnswer:
        self.response = self.stage.call(item, timeout_s=timeout_s)
        return answer_of(self.response, item.choices)


# One request's view of a later stage (``CascadeServing.plan``).
ServedStage = ServedLocal | ServedRemote


def cascaded(
    first_name: str,
    first: tuple[Judgment, Verdict, JudgeResponse],
    stages: Sequence[ServedStage],
    item: StageItem,
    *,
    deadline_s: float | None = None,
) -> JudgeResponse:
    """A cascade's response to an item, given its first stage's judgment, verdict and
    response: where the first stage escalated, the later ``stages`` tried in turn (blocking)
    until one accepts.

    The deciding stage's response, else the last that answered (the strongest judge's view of
    an item a person now takes), with ``decided_by`` and every stage's part (``cascade``).
    What ``judge serve --cascade`` and ``judge ask --cascade`` answer.
    """
    judgment, verdict, response = first
    part = StageResult(
        stage=first_name,
        answer=StageAnswer.of(verdict, judgment, item.choices),
        latency_ms=judgment.latency_ms,
    )
    parts, answered = [part], [response]
    decided_by = first_name if response.decision == "accept" else None
    if decided_by is None:
        outcome = Cascade(stages).judge(
            item.prompt, item.choices, item_span=item.item_span, deadline_s=deadline_s
        )
        decided_by = outcome.decided_by
        parts += outcome.stages
        answered += [s.response for s in stages if s.response is not None]
    return msgspec.structs.replace(answered[-1], decided_by=decided_by, cascade=parts)
