"""A cascade's later stages for typed questions: ``POST /v1/systemone`` and a pair on
``POST /judge`` escalate as a judgment does (``service.cascade.cascade_judgments``).

A question the first stage escalates is asked of each later stage in turn, as the same question
about the same state, under that stage's profile ("P-NAME", as ``calibration.tasks.fit_cascade``
names them): a model loaded in this process answers it through its own gate
(``service.decisions.judge_questions``: its listings, its order spread), another judge server
through its own ``POST /v1/systemone``. The stepping, the deadline and what a failed stage
means are the cascade's (``calibration.cascade.run_stages``); each question escalates on its
own, so a later stage is asked only what the stages before it left.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import msgspec

from calibration.carry import carry
from calibration.cascade import StageAnswer, StageResult, run_stages
from service.cascade.remote_stage import RemoteStage
from service.decisions import QuestionDecision, judge_questions
from service.gate_context import GateContext
from service.schemas import JudgeResponse
from service.systemone import SystemOneAnswer, SystemOneQuestion, wire_answer

if TYPE_CHECKING:
    from calibration import Gate, Overrides, Verdict
    from judge import Engine
    from judge.answers import Answer, Question
    from service.log.decision_log import LoggedDecision

# A request's view of a later stage: a judgment's or a question's.
_S = TypeVar("_S")

__all__ = [
    "LocalModel",
    "LocalQuestionStage",
    "QuestionItem",
    "QuestionStage",
    "RemoteQuestionStage",
    "asked_as",
    "escalated",
    "opened_stages",
    "records_of",
]


@dataclass
class LocalModel:
    """A later stage's model, loaded once; its lock lets one item at a time through."""

    engine: Engine
    lock: threading.Lock = field(default_factory=threading.Lock)


class QuestionItem(NamedTuple):
    """What each later stage is asked: one question (as the request asked it) about a state."""

    state: Any
    qid: str
    question: SystemOneQuestion


@dataclass
class LocalQuestionStage:
    """One request's view of a local later stage for a question: its gate, and what it
    answered (the answer and verdict, their wire form, the log's record)."""

    name: str
    model: LocalModel
    gate: Gate
    context: GateContext = field(default_factory=GateContext)  # the server's; else no log
    decided: tuple[Answer, Verdict] | None = None
    wire: SystemOneAnswer | None = None
    record: LoggedDecision | None = None

    def answer(self, item: QuestionItem, *, timeout_s: float | None) -> StageAnswer:
        with self.model.lock:
            decided = judge_questions(
                self.model.engine,
                item.state,
                {item.qid: item.question.question()},
                gates={item.qid: self.gate},
            )
        answer, verdict = decided[item.qid]
        self.decided, self.wire = (answer, verdict), wire_answer(answer, verdict)
        # Logged as a later stage of a judgment is: its hidden states, not its request (the
        # first stage's record replays the question).
        _, self.record = self.context.answered(
            answer, verdict, self.gate, model=self.model.engine.model_id
        )
        return StageAnswer.of(verdict, answer.judgment, list(answer.probabilities))

    def response(self, *, return_prompt: bool = False) -> JudgeResponse:
        """What it answered, in a judgment's shape (a pair on ``POST /judge``)."""
        assert self.decided is not None  # asked for only once it answered
        answer, verdict = self.decided
        return JudgeResponse.of(
            answer.judgment,
            verdict,
            choices=list(answer.probabilities),
            return_prompt=return_prompt,
            orderings=answer.orderings,
        )


@dataclass
class RemoteQuestionStage:
    """One request's view of a remote later stage for a question, and what it answered."""

    stage: RemoteStage
    wire: SystemOneAnswer | None = None
    model: str | None = None  # the model the server named
    latency_ms: float = 0.0  # the server's own time

    @property
    def name(self) -> str:
        return self.stage.name

    def answer(self, item: QuestionItem, *, timeout_s: float | None) -> StageAnswer:
        response = self.stage.ask(item.state, item.qid, item.question, timeout_s=timeout_s)
        if item.qid not in response.answers:
            raise ValueError(f"{self.stage.url} answered no question {item.qid!r}")
        self.wire, self.model = response.answers[item.qid], response.model
        self.latency_ms = response.latency_ms
        return stage_answer(self.wire, response.model)

    def response(self, *, return_prompt: bool = False) -> JudgeResponse:
        """What it answered, in a judgment's shape (a pair on ``POST /judge``; the server
        does not send back its prompt)."""
        assert self.wire is not None and self.model is not None  # once it answered
        best = stage_answer(self.wire, self.model).choice
        return JudgeResponse.of_answer(
            self.wire, choice=best, model=self.model, latency_ms=self.latency_ms
        )


QuestionStage = LocalQuestionStage | RemoteQuestionStage


def stage_answer(wire: SystemOneAnswer, model: str) -> StageAnswer:
    """A stage's answer from a question's wire answer: its decision on its probabilities, the
    most probable of them its choice. A remote server's computing is its own: no tokens."""
    probs = wire.probabilities
    best = max(probs, key=probs.__getitem__)
    return carry(wire, StageAnswer, choice=best, confidence=probs[best], model=model)


def escalated(
    first_name: str,
    first: tuple[Answer, Verdict],
    stages: Sequence[QuestionStage],
    item: QuestionItem,
    *,
    deadline_s: float | None = None,
) -> QuestionDecision:
    """A question's decision through the cascade, given its first stage's answer and verdict:
    where that stage escalated, the later ``stages`` asked in turn (blocking) until one
    accepts. The answer that stands is the deciding stage's, else the last that answered."""
    answer, verdict = first
    part = StageResult(
        stage=first_name,
        answer=StageAnswer.of(verdict, answer.judgment, list(answer.probabilities)),
        latency_ms=answer.judgment.latency_ms,
    )
    if verdict.decision == "accept":
        return QuestionDecision(answer, verdict, first_name, [part])
    outcome = run_stages(stages, item, deadline_s=deadline_s)
    answered = [s for s in stages if s.wire is not None]
    return QuestionDecision(
        answer,
        verdict,
        outcome.decided_by,
        [part, *outcome.stages],
        answered[-1] if answered else None,
    )


def opened_stages(
    cascade: Mapping[str, LocalModel | str],
    profile: str | None,
    overrides: Overrides,
    open_gate: Callable[[str | None], Gate],
    *,
    local: Callable[[str, LocalModel, Gate, GateContext], _S],
    remote: Callable[[RemoteStage], _S],
    choices: Sequence[str],
    field: str,
    context: GateContext | None = None,
    api_key: str | None = None,
) -> list[_S]:
    """One request's view of each later stage of ``cascade`` (by name: a loaded model, or
    another judge server's URL) under its ``profile`` P (stage NAME's is "P-NAME") and
    ``overrides``, made before any model work: a remote one as that server is asked
    (``api_key``: a fleet's servers share theirs); a local one with its gate, opened by
    ``open_gate`` and checked against its model and ``choices`` (a mismatch names ``field``),
    its decisions settled through ``context`` (a server's: its log; None: no log). Every
    front's cascade, for a judgment (``local=ServedLocal, remote=ServedRemote``) and a typed
    question (``LocalQuestionStage``, ``RemoteQuestionStage``) alike."""
    stages: list[_S] = []
    for name, target in cascade.items():
        mine = None if profile is None else f"{profile}-{name}"
        if isinstance(target, str):
            stages.append(remote(RemoteStage.under(name, target, mine, overrides, api_key)))
            continue
        gate = open_gate(mine)
        gate.check_engine(target.engine, choices=choices, field=field)
        stages.append(local(name, target, gate, context or GateContext()))
    return stages


def asked_as(question: Question, overrides: Overrides) -> SystemOneQuestion:
    """A question as a later stage is asked it: its wire form (``service.systemone``) with
    the bound on its listings' spread it was asked under."""
    wire = msgspec.convert(msgspec.to_builtins(question), SystemOneQuestion)
    return msgspec.structs.replace(wire, max_order_spread=overrides.max_order_spread)


def records_of(stages: Sequence[object]) -> list[LoggedDecision]:
    """The log records the local stages among ``stages`` made (with a log), a judgment's
    (``ServedLocal``) or a question's (``LocalQuestionStage``); a remote stage keeps none."""
    return [record for s in stages if (record := getattr(s, "record", None)) is not None]
