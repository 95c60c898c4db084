"""Typed questions about one state: ``POST /v1/systemone`` (``service.systemone``), and a
pair on ``POST /judge`` (``schemas.PairRequest``).

Served as a shared context is: each question's listings are rendered by
``judge.answers.plan_decisions``, prepared within the budget and run as shared rows
(``ServiceCore.run_rows``); each answer is decided by its own gate (``Gate.decide_answer``:
with the question's order spread, a pair's as ``position_inconsistent``), and its verdict is
logged before the response, as a judgment's is: it can be labelled, audited and replayed. A
pair on ``POST /judge`` is the one-question request of the same path, answered in a
judgment's shape.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from calibration import Overrides
from judge import Engine, Judgment, Prepared
from judge.answers import plan_decisions
from service.decisions import QuestionDecision
from service.errors import TooLargeError, UnprocessableError
from service.log.record import LoggedDecision, replayable_question
from service.schemas import JudgeResponse, PairRequest
from service.systemone import (
    SystemOnePair,
    SystemOneQuestion,
    SystemOneRequest,
    SystemOneResponse,
    Usage,
)
from service.web.serving_core import ServiceCore, Ticket

if TYPE_CHECKING:
    # A cascade's machinery is imported only by a server that has one (service.web.serving).
    from service.web.serving_cascade import CascadeServing

__all__ = ["SystemOneServing"]


# A pair on POST /judge is asked as this one question; its fields are the request's own.
_PAIR = "pair"


class SystemOneServing:
    """Typed questions about one state, in one run of the model."""

    def __init__(self, service: ServiceCore, cascade: CascadeServing | None = None) -> None:
        self.service = service
        self.cascade = cascade

    async def answer(self, request: SystemOneRequest, ticket: Ticket) -> SystemOneResponse:
        """Typed questions about one state (``service.systemone``), as shared questions are
        served (``JudgeServing._shared``).

        Everything is checked before any model work: the model's name, how many questions,
        then what ``_decided`` checks. Each refusal names ``questions.<id>.<field>``.
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
        decided, judgments = await self._decided(engine, request.state, request.questions, ticket)
        return SystemOneResponse(
            model=engine.model_id,
            answers={qid: d.wire() for qid, d in decided.items()},
            usage=Usage(input_tokens=sum(j.computed_tokens for j in judgments)),
            latency_ms=(time.perf_counter() - started) * 1000,
        )

    async def pair(self, request: PairRequest, ticket: Ticket) -> JudgeResponse:
        """A pair on ``POST /judge``: the one question ``_decided`` answers, in a judgment's
        shape (``choice`` is the winner's name). A refusal names the request's own field
        (``candidates``, ``profile``), not the question's."""
        engine = self.service.engine()
        fields = {f: getattr(request, f) for f in SystemOnePair.__struct_fields__}
        try:
            decided, _ = await self._decided(
                engine, request.state, {_PAIR: SystemOnePair(**fields)}, ticket
            )
        except Exception as exc:
            field = getattr(exc, "field", None)
            if isinstance(field, str) and field.startswith(f"questions.{_PAIR}."):
                exc.field = field.removeprefix(f"questions.{_PAIR}.")  # type: ignore[attr-defined]
            raise
        return decided[_PAIR].response(return_prompt=request.return_prompt)

    async def _decided(
        self,
        engine: Engine,
        state: Any,
        asked: Mapping[str, SystemOneQuestion],
        ticket: Ticket,
    ) -> tuple[dict[str, QuestionDecision], list[Judgment]]:
        """Each question's decision (with a cascade, through the later stages where this
        engine escalated), and the judgments of the run; the verdicts are logged before this
        returns.

        Checked before any model work: each question (``judge.answers.plan_decisions``), its
        gate (the profile against the engine and its choices), and each listing's size
        against the budget (``ServiceCore.prepare``); every refusal names
        ``questions.<id>.<field>``. Then the listings run as shared rows, the state computed
        once where the budget allows.
        """
        questions = {qid: q.question() for qid, q in asked.items()}
        plan = plan_decisions(state, questions)
        gates = {
            a.id: self.service.gates.opened(
                engine,
                asked[a.id].profile,
                Overrides.of(asked[a.id]),
                choices=a.choices,
                field=f"questions.{a.id}.profile",
            )
            for a in plan.asked
        }
        cascade = self.cascade
        later = {
            a.id: cascade.plan(
                asked[a.id].profile,
                Overrides.of(asked[a.id]),
                a.choices,
                f"questions.{a.id}.profile",
            )
            for a in plan.asked
            if cascade is not None
        }
        if any(g.feature_layers or g.span_layers or g.adapter for g in gates.values()):
            # A probe reads the pass's hidden states (at the decision point, or their mean
            # over the state, the item), maybe under its profile's adapter: ask for them.
            plan = plan_decisions(
                state,
                questions,
                feature_layers={qid: g.feature_layers for qid, g in gates.items()},
                span_layers={qid: g.span_layers for qid, g in gates.items()},
                adapters={qid: g.adapter for qid, g in gates.items()},
            )
        owners = [plan.question_of(i) for i in range(len(plan.queries))]
        fields = [_systemone_field(plan.context, q, asked[q]) for q in owners]
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
        decided: dict[str, QuestionDecision] = {}
        records: list[LoggedDecision] = []
        for qid, answer in plan.answers(judgments).items():
            gate = gates[qid]
            verdict = gate.decide_answer(answer)
            self.service.metrics.decisions.labels(verdict.decision).inc()
            decided[qid], record = self.service.gates.answered(
                answer,
                verdict,
                gate,
                model=engine.model_id,
                request=functools.partial(replayable_question, state, qid, asked[qid], gate),
            )
            mine = [] if record is None else [record]
            if cascade is not None:
                from service.cascade.stages import QuestionItem

                item = QuestionItem(state, qid, asked[qid])
                choices = list(answer.probabilities)
                escalation = await cascade.escalate(
                    item, later[qid], (verdict, answer.judgment, choices), mine, ticket.deadline
                )
                decided[qid] = QuestionDecision(answer, verdict, escalation)
            records += mine
        await self.service.append_to_log(records)
        return decided, judgments


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
