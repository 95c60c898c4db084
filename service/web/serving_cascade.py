"""The server's side of a cascade (``judge serve --cascade NAME=TARGET ...``): its later
stages loaded once at start-up, planned per request (each local stage's gate opened and checked
before any model work) and run off the event loop, their records logged and counted in
``/metrics``. What a cascade decides is ``service.cascade``'s (``cascaded``, ``escalated``),
which ``judge ask --cascade`` runs too.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio.to_thread

from calibration import Gate, Overrides, ProfileError, Verdict
from calibration.cascade import StageItem, StageResult
from judge import Judgment
from judge.answers import Answer
from service.cascade.cascade_judgments import (
    ServedLocal,
    ServedRemote,
    ServedStage,
    cascaded,
)
from service.cascade.cascade_questions import (
    LocalModel,
    LocalQuestionStage,
    QuestionItem,
    QuestionStage,
    RemoteQuestionStage,
    escalated,
    opened_stages,
)
from service.cascade.remote_stage import RemoteStage, is_remote
from service.decisions import QuestionDecision
from service.gate_context import GateContext
from service.log.decision_log import LoggedDecision, with_cascade
from service.schemas import JudgeRequest, JudgeResponse, SharedQuestion
from service.systemone import SystemOneQuestion
from service.web.serving_core import WARM_UP, ServiceCore

__all__ = ["CascadeServing"]

log = logging.getLogger("judge.service")

# What a cascade's run ends in: a judgment's response, or a typed question's decision.
_Outcome = TypeVar("_Outcome", JudgeResponse, QuestionDecision)
# A request's view of a later stage: a judgment's or a question's.
_View = TypeVar("_View")


class CascadeServing:
    """The later stages of this server's cascade: loaded once, planned and run per request."""

    def __init__(self, service: ServiceCore) -> None:
        self.service = service
        self.local: dict[str, LocalModel] = {}

    def load(self, dtype: str) -> None:
        """Load and warm each local later stage (blocking; at start-up, before ready)."""
        from judge.engines import open_engine

        for name, target in self.service.config.cascade.items():
            if is_remote(target):
                continue
            engine = open_engine(target, dtype=dtype)  # type: ignore[arg-type]
            engine.judge(*WARM_UP)
            self.local[name] = LocalModel(engine)
            log.info("cascade stage %s: model %s, %s pass", name, engine.model_id, engine.dtype)

    def plan(self, request: JudgeRequest | SharedQuestion) -> list[ServedStage]:
        """Each later stage for ``request`` (a judgment, or a question about a shared
        context): a local one's gate opened on its profile (``P-NAME``) and checked against
        its engine; no model work. A missing or mismatched profile is refused here, naming
        ``profile``."""
        return self._opened(
            request.profile,
            Overrides.of(request),
            request.choices,
            "profile",
            local=ServedLocal,
            remote=ServedRemote,
        )

    def plan_question(
        self, qid: str, question: SystemOneQuestion, choices: Sequence[str]
    ) -> list[QuestionStage]:
        """``plan`` for a typed question (its answer's ``choices``), a refusal naming
        ``questions.<qid>.profile``."""
        return self._opened(
            question.profile,
            Overrides.of(question),
            choices,
            f"questions.{qid}.profile",
            local=LocalQuestionStage,
            remote=RemoteQuestionStage,
        )

    def _opened(
        self,
        profile: str | None,
        overrides: Overrides,
        choices: Sequence[str],
        field: str,
        *,
        local: Callable[[str, LocalModel, Gate, GateContext], _View],
        remote: Callable[[RemoteStage], _View],
    ) -> list[_View]:
        """Each later stage under a request's ``profile`` and ``overrides``
        (``opened_stages``: a fleet's servers share this one's key), a local one settling
        through the server's gate context."""
        config = self.service.config
        targets = {name: self.local.get(name, target) for name, target in config.cascade.items()}

        def open_gate(mine: str | None) -> Gate:
            try:
                return self.service.gates.open(mine, overrides)
            except ProfileError as exc:  # no such profile: error_of reads the field
                exc.field = field  # type: ignore[attr-defined]
                raise

        return opened_stages(
            targets,
            profile,
            overrides,
            open_gate,
            local=local,
            remote=remote,
            choices=choices,
            field=field,
            context=self.service.gates,
            api_key=config.api_key,
        )

    async def escalate(
        self,
        item: StageItem,
        stages: list[ServedStage],
        first: tuple[Judgment, Verdict, JudgeResponse],
        records: list[LoggedDecision],
        deadline: float,
    ) -> JudgeResponse:
        """The first stage's judgment, verdict and response to ``item``; where it escalated,
        the later stages tried (off the event loop) until one accepts. ``records`` holds this
        request's records (the first stage's, if logged): the later stages' join them, and
        each carries the outcome."""
        return await self._through(cascaded, item, stages, first, records, deadline)

    async def escalate_question(
        self,
        item: QuestionItem,
        stages: list[QuestionStage],
        first: tuple[Answer, Verdict],
        records: list[LoggedDecision],
        deadline: float,
    ) -> QuestionDecision:
        """``escalate`` for a typed question (``cascade_questions.escalated``): the first
        stage's answer and verdict, and the later stages where it escalated."""
        return await self._through(escalated, item, stages, first, records, deadline)

    async def _through(
        self,
        through: Callable[..., _Outcome],
        item: object,
        stages: Sequence[ServedStage | QuestionStage],
        first: tuple[Any, Verdict, *tuple[Any, ...]],
        records: list[LoggedDecision],
        deadline: float,
    ) -> _Outcome:
        """``through`` (``cascaded`` or ``escalated``) on the first stage's outcome, then
        what the cascade's outcome leaves (``_kept``)."""
        run = functools.partial(
            through,
            self.service.config.stage_name,
            first,
            stages,
            item,
            deadline_s=deadline - time.monotonic(),
        )
        # Only the later stages' model work goes off the event loop.
        outcome = run() if first[1].decision == "accept" else await anyio.to_thread.run_sync(run)
        self._kept(outcome.decided_by, outcome.cascade or [], stages, records)
        return outcome

    def _kept(
        self,
        decided_by: str | None,
        parts: list[StageResult],
        stages: Sequence[ServedStage | QuestionStage],
        records: list[LoggedDecision],
    ) -> None:
        """What a cascade's outcome leaves: the later local stages' records join ``records``
        (the first stage's, if logged), each carrying the outcome; ``/metrics`` counts who
        decided and which stages failed."""
        local = [s for s in stages if isinstance(s, ServedLocal | LocalQuestionStage)]
        records += [s.record for s in local if s.record is not None]
        metrics = self.service.metrics
        metrics.cascade_decisions.labels(decided_by or "person").inc()
        for p in parts:
            if p.failure is not None:
                metrics.cascade_failures.labels(p.stage, p.failure).inc()
        records[:] = with_cascade(records, decided_by, parts)
