"""``POST /judge`` and ``POST /judge/batch``: judgments, batch items and shared questions.

Each item's gate is opened before any model work (``GateContext.opened``); its query is
prepared within the budget (``ServiceCore.prepare``) and joins the batcher's queue; the gate
decides; the verdict's row is appended to the decision log before the response is sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from calibration import CalibrationProfile, Overrides, Verdict
from calibration.cascade import StageItem
from judge import Engine, JudgeError, Judgment, Prepared, Query
from judge.engine import shared_query
from service.errors import (
    DeadlineError,
    QueueFullError,
    TooLargeError,
    UnprocessableError,
    error_of,
)
from service.log.record import LoggedDecision
from service.planner import PlannedJudgment, item_alone, plan_judgment
from service.schemas import (
    BatchItem,
    BatchResponse,
    ErrorBody,
    ItemRequest,
    JudgeRequest,
    JudgeResponse,
    SharedBatch,
    SharedQuestion,
)
from service.web.serving_core import ServiceCore, Ticket

if TYPE_CHECKING:
    # A cascade's machinery is imported only by a server that has one (service.web.serving).
    from service.cascade.stages import LocalStage, RemoteStage
    from service.web.serving_cascade import CascadeServing

__all__ = ["JudgeServing"]


@dataclass(frozen=True)
class _Plan:
    """What a judgment request needs before its model work: the planned judgment (its query
    and gate), and with a cascade its later stages (``CascadeServing.plan``; None: none)."""

    planned: PlannedJudgment
    later: list[LocalStage | RemoteStage] | None = None

    @property
    def query(self) -> Query:
        return self.planned.query


class JudgeServing:
    """Judgments: one, a batch of independent items, or questions about one shared context."""

    def __init__(self, service: ServiceCore, cascade: CascadeServing | None) -> None:
        self.service = service
        self.cascade = cascade

    async def judge(self, body: JudgeRequest | ItemRequest, ticket: Ticket) -> JudgeResponse:
        engine = self.service.engine()
        request, version = self._whole(body)
        query = request.query()
        plan = self._plan(engine, request, query, version)
        (prepared,) = await self.service.prepare(engine, [plan.query])
        if not isinstance(prepared, Prepared):
            raise prepared
        result = await self.service.batcher.judge(
            prepared, owner=ticket.owner, deadline=ticket.deadline
        )
        records: list[LoggedDecision] = []
        response = await self._decided(engine, result, request, plan, ticket, records)
        await self.service.append_to_log(records)
        return response

    async def judge_batch(
        self, request: Sequence[BatchItem] | SharedBatch, ticket: Ticket
    ) -> BatchResponse:
        """A batch: its items (each decoded already, ``service.bodies.decode_each``), or
        questions about one shared context."""
        engine = self.service.engine()
        records: list[LoggedDecision] = []
        if not isinstance(request, SharedBatch):
            items = await self._items(engine, request, ticket, records)
            await self.service.append_to_log(records)
            return BatchResponse(results=list(items))
        results = await self._shared(engine, request.context, request.questions, ticket, records)
        await self.service.append_to_log(records)
        return BatchResponse(results=list(results))

    def _whole(
        self, request: JudgeRequest | ItemRequest
    ) -> tuple[JudgeRequest, tuple[CalibrationProfile, str] | None]:
        """The whole request an item alone stands for: its profile's template around it (the
        prompt the profile was fitted on), the item's span marked, the profile's choices; and
        the profile's version it read, which its gate opens on (the store is read once: a
        profile stored in between cannot render the item in one version's template and
        decide it under another's certificate). No model work."""
        if isinstance(request, JudgeRequest):
            return request, None
        if request.profile is None:
            raise UnprocessableError(
                "profile",
                "an item alone is judged in the prompt its profile was fitted on: name the "
                "profile (one fitted on a task, as judge calibrate --task fits it)",
            )
        asked, version = item_alone(self.service.gates, request.profile, request.item)
        whole = request.judge_request(asked.prompt, asked.item_span, asked.choices, asked.system)
        return whole, version

    def _plan(
        self,
        engine: Engine,
        request: JudgeRequest | SharedQuestion,
        query: Query,
        version: tuple[CalibrationProfile, str] | None = None,
    ) -> _Plan:
        """Plan the request (``plan_judgment``, on ``version`` where the request read it
        already) and its cascade's later stages: no model work, no tokenizing. A shared
        question is outside a profile's template: it has no item."""
        planned = plan_judgment(
            self.service.gates,
            engine,
            query,
            request.profile,
            Overrides.of(request),
            version=version,
            shared=isinstance(request, SharedQuestion),
        )
        later = None
        if self.cascade is not None:  # a later stage decides under the same overrides
            overrides = planned.gate.overrides
            later = self.cascade.plan(request.profile, overrides, request.choices, "profile")
        return _Plan(planned, later)

    async def _decided(
        self,
        engine: Engine,
        result: Judgment,
        request: JudgeRequest | SharedQuestion,
        plan: _Plan,
        ticket: Ticket,
        records: list[LoggedDecision],
    ) -> JudgeResponse:
        """``_respond``, and with a cascade the later stages where this engine escalated
        (asked the prompt this engine judged: a shared question's, with its context)."""
        if plan.later is None:
            return self._respond(engine, result, request, plan, records)[0]
        assert self.cascade is not None  # later stages are planned only with one
        mine: list[LoggedDecision] = []
        response, verdict = self._respond(engine, result, request, plan, mine)
        item = StageItem(plan.query.prompt, request.choices, plan.query.item_span)
        outcome = await self.cascade.escalate(
            item, plan.later, (verdict, result, request.choices), mine, ticket.deadline
        )
        records += mine
        return outcome.staged(response)

    def _respond(
        self,
        engine: Engine,
        result: Judgment,
        request: JudgeRequest | SharedQuestion,
        plan: _Plan,
        records: list[LoggedDecision],
    ) -> tuple[JudgeResponse, Verdict]:
        """The response to one judgment, and the verdict it gives; its decision's log record
        joins ``records``."""
        response, verdict, record = plan.planned.respond(
            result,
            self.service.gates,
            model=engine.model_id,
            choices=request.choices,  # the verdict keeps the profile's order; this, the request's
            return_prompt=request.return_prompt,
        )
        self.service.metrics.decisions.labels(verdict.decision).inc()
        if record is not None:
            records.append(record)
        return response, verdict

    async def _items(
        self,
        engine: Engine,
        items: Sequence[BatchItem],
        ticket: Ticket,
        records: list[LoggedDecision],
    ) -> list[JudgeResponse | ErrorBody]:
        """A batch's items: each made whole (an item alone in its profile's prompt) and
        planned, all prepared in one trip to a worker thread, then each judged; an item
        refused on the way gets its error in its place."""
        plans: list[tuple[JudgeRequest, _Plan] | Exception] = []
        for item in items:
            try:
                whole, version = self._whole(item)
                plans.append((whole, self._plan(engine, whole, whole.query(), version)))
            except Exception as exc:  # _item decides: a 4xx in its place, else it fails all
                plans.append(exc)
        planned = [p for p in plans if not isinstance(p, Exception)]
        prepared = iter(await self.service.prepare(engine, [p.query for _, p in planned]))
        staged = [p if isinstance(p, Exception) else (*p, next(prepared)) for p in plans]
        return list(await asyncio.gather(*(self._item(engine, s, ticket, records) for s in staged)))

    async def _item(
        self,
        engine: Engine,
        staged: tuple[JudgeRequest, _Plan, Prepared | JudgeError | TooLargeError] | Exception,
        ticket: Ticket,
        records: list[LoggedDecision],
    ) -> JudgeResponse | ErrorBody:
        """One item of a batch: its 4xx, or a 503 when out of time, in its place.

        Any other 5xx fails the whole request.
        """
        try:
            if isinstance(staged, Exception):
                raise staged
            item, plan, prepared = staged
            if not isinstance(prepared, Prepared):
                raise prepared
            result = await self.service.batcher.judge(
                prepared, owner=ticket.owner, deadline=ticket.deadline
            )
            return await self._decided(engine, result, item, plan, ticket, records)
        except Exception as exc:
            error = error_of(exc)
            if error.status_code >= 500 and not isinstance(exc, DeadlineError | QueueFullError):
                raise
            return error

    async def _shared(
        self,
        engine: Engine,
        context: str,
        questions: Sequence[SharedQuestion],
        ticket: Ticket,
        records: list[LoggedDecision],
    ) -> list[JudgeResponse]:
        """Questions about one context: each prepared once, then judged row by row.

        Each question's query is the context and the question (``shared_query``), rendered
        and tokenized once. The prepared questions are split with the engine's own row packing
        (``judge.packing.pack_rows``, to the same ``max_batch_tokens``), and each row is one
        job, one ``run_shared`` call that packs it into the same single row: one pass, so the
        model is never held for long and other requests take their turns between rows. A row
        after the first finds the context in the engine's prefix cache, so splitting costs
        little.
        """
        queries = [shared_query(context, q.query()) for q in questions]
        plans = [self._plan(engine, q, query) for q, query in zip(questions, queries, strict=True)]
        # The field a 413 names: the context, unless this question's own prompt is longer.
        fields = [
            "context" if len(context) >= len(q.prompt) else f"questions[{i}].prompt"
            for i, q in enumerate(questions)
        ]
        ready: list[Prepared] = []
        for prepared in await self.service.prepare(engine, [p.query for p in plans], fields):
            if not isinstance(prepared, Prepared):
                raise prepared
            ready.append(prepared)
        results = await self.service.run_rows(engine, ready, ticket)
        return [
            await self._decided(engine, r, q, p, ticket, records)
            for r, q, p in zip(results, questions, plans, strict=True)
        ]
