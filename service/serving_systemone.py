"""``POST /v1/systemone``: typed questions about one state (``service.systemone``).

Served as a shared context is: each question's listings are rendered by
``judge.answers.plan_decisions``, prepared within the budget and run as shared rows
(``ServiceCore.run_rows``); each answer is decided by its own gate, with the question's order
spread (``Gate.decide(..., order_spread=...)``), and its verdict is logged before the response,
as a judgment's is: it can be labelled, audited and replayed.
"""

from __future__ import annotations

import time

import msgspec

from calibration import Overrides
from judge import Prepared
from judge.answers import plan_decisions
from service.decision_log import LoggedDecision, replayable_question
from service.errors import TooLargeError, UnprocessableError
from service.logged_features import LoggedFeatures
from service.serving_core import ServiceCore, Ticket
from service.systemone import (
    SystemOneAnswer,
    SystemOnePair,
    SystemOneQuestion,
    SystemOneRequest,
    SystemOneResponse,
    Usage,
    wire_answer,
)

__all__ = ["SystemOneServing"]


class SystemOneServing:
    """Typed questions about one state, in one run of the model."""

    def __init__(self, service: ServiceCore) -> None:
        self.service = service

    async def answer(self, request: SystemOneRequest, ticket: Ticket) -> SystemOneResponse:
        """Typed questions about one state (``service.systemone``), as shared questions are
        served (``JudgeServing._shared``).

        Everything is checked before any model work: the model's name, how many questions,
        each question (``judge.answers.plan_decisions``), its gate (the profile against the
        engine and its choices), and each listing's size against the budget
        (``ServiceCore.prepare``); every refusal names ``questions.<id>.<field>``. Then the
        listings run as shared rows, the state computed once where the budget allows; each
        answer is decided by its own gate and logged before the response.
        """
        started = time.perf_counter()
        engine = self.service.engine()
        if request.model is not None and request.model != engine.model_id:
            raise UnprocessableError(
                "model",
                f"this server serves {engine.model_id!r}, not {request.model!r}; "
                "leave model out or name that one",
            )
        limit = self.service.config.max_questions
        if len(request.questions) > limit:
            raise TooLargeError(
                "questions",
                f"{len(request.questions)} questions, over this server's limit of {limit} "
                "(--max-questions): split them over several requests",
            )
        questions = {qid: q.question() for qid, q in request.questions.items()}
        plan = plan_decisions(request.state, questions)
        gates = {
            asked.id: self.service.open_gate(
                engine,
                request.questions[asked.id].profile,
                Overrides.of(request.questions[asked.id]),
                choices=asked.choices,
                field=f"questions.{asked.id}.profile",
            )
            for asked in plan.asked
        }
        if any(g.feature_layers or g.span_layers for g in gates.values()):
            # A probe reads the pass's hidden states (at the decision point, or their mean
            # over the state, the item): ask for them.
            plan = plan_decisions(
                request.state,
                questions,
                feature_layers={qid: g.feature_layers for qid, g in gates.items()},
                span_layers={qid: g.span_layers for qid, g in gates.items()},
            )
        owners = [plan.question_of(i) for i in range(len(plan.queries))]
        fields = [_systemone_field(plan.context, q, request.questions[q]) for q in owners]
        ready: list[Prepared] = []
        for i, (field_name, prepared) in enumerate(
            zip(fields, await self.service.prepare(engine, plan.queries, fields), strict=True)
        ):
            if not isinstance(prepared, Prepared):
                # The engine names the query's fields: its choices are the question's criteria,
                # its prompt the state and the question.
                if prepared.field in (None, "choices"):
                    prepared.field = plan.field_of(i, prepared.field)
                elif not prepared.field.startswith(("questions.", "state")):
                    prepared.field = field_name
                raise prepared
            ready.append(prepared)
        judgments = await self.service.run_rows(engine, ready, ticket)
        answers: dict[str, SystemOneAnswer] = {}
        records: list[LoggedDecision] = []
        for qid, answer in plan.answers(judgments).items():
            gate = gates[qid]
            verdict = gate.decide_answer(answer)
            self.service.metrics.decisions.labels(verdict.decision).inc()
            answers[qid] = wire_answer(answer, verdict)
            if self.service.decision_log is not None:
                kept = None
                if self.service.config.log_requests:
                    asked = request.questions[qid]
                    kept = replayable_question(request.state, qid, asked, gate)
                features = LoggedFeatures.of(answer.judgment.features, gate.log_layers)
                records.append(
                    LoggedDecision.of(
                        verdict, model=engine.model_id, request=kept, features=features
                    )
                )
        await self.service.append_to_log(records)
        return SystemOneResponse(
            model=engine.model_id,
            answers=answers,
            usage=Usage(input_tokens=sum(j.computed_tokens for j in judgments)),
            latency_ms=(time.perf_counter() - started) * 1000,
        )


def _systemone_field(context: str, qid: str, question: SystemOneQuestion) -> str:
    """The field a 413 names for a question's listing: the state, unless the question's own
    text (its instructions, its criteria or a pair's candidates) is longer."""
    sizes = {
        "state": len(context),
        "instructions": len(question.instructions),
        "criteria": len(msgspec.json.encode(question.criteria)),
    }
    if isinstance(question, SystemOnePair):
        sizes["candidates"] = len(msgspec.json.encode(question.candidates))
    longest = max(sizes, key=sizes.__getitem__)  # the first of equals: the state
    return "state" if longest == "state" else f"questions.{qid}.{longest}"
