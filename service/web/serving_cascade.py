"""The server's side of a cascade (``judge serve --cascade NAME=TARGET ...``): its later
stages loaded once at start-up, opened per request (each local stage's gate opened and checked
before any model work) and run off the event loop, their records logged and counted in
``/metrics``. What a cascade decides is ``service.cascade``'s (``escalated``), which every
front runs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence

import anyio.to_thread

from calibration import Overrides, Verdict
from calibration.cascade import StageItem
from calibration.policy import ScoredJudgment
from service.cascade.escalation import Escalation, escalated
from service.cascade.stages import (
    LocalModel,
    LocalStage,
    QuestionItem,
    RemoteStage,
    is_remote,
    opened_stages,
)
from service.log.record import LoggedDecision
from service.web.serving_core import WARM_UP, ServiceCore

__all__ = ["CascadeServing"]

log = logging.getLogger("judge.service")


class CascadeServing:
    """The later stages of this server's cascade: loaded once, opened and run per request."""

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

    def plan(
        self, profile: str | None, overrides: Overrides, choices: Sequence[str], field: str
    ) -> list[LocalStage | RemoteStage]:
        """Each later stage for a request (a judgment, a typed question) under its ``profile``
        and ``overrides`` (``opened_stages``: a fleet's servers share this one's key): a local
        one's gate opened on its profile (``P-NAME``) and checked against its engine and
        ``choices``, settling through the server's gate context; no model work. A missing or
        mismatched profile is refused here, naming ``field``."""
        config = self.service.config
        targets = {name: self.local.get(name, target) for name, target in config.cascade.items()}

        return opened_stages(
            targets,
            profile,
            overrides,
            functools.partial(self.service.gates.open, overrides=overrides, field=field),
            choices=choices,
            field=field,
            context=self.service.gates,
            api_key=config.api_key,
        )

    async def escalate(
        self,
        item: StageItem | QuestionItem,
        stages: list[LocalStage | RemoteStage],
        first: tuple[Verdict, ScoredJudgment, Sequence[str]],
        records: list[LoggedDecision],
        deadline: float,
    ) -> Escalation:
        """The cascade's outcome, given the first stage's verdict on its judgment over its
        choices: where it escalated, the later stages asked (off the event loop) until one
        accepts. ``records`` holds this request's records (the first stage's, if logged): the
        later local stages' join them, and each carries the outcome; ``/metrics`` counts who
        decided and which stages failed."""
        verdict, judgment, choices = first
        run = functools.partial(
            escalated,
            self.service.config.stage_name,
            verdict,
            judgment,
            choices,
            stages,
            item,
            deadline_s=deadline - time.monotonic(),
        )
        # Only the later stages' model work goes off the event loop.
        outcome = run() if verdict.decision == "accept" else await anyio.to_thread.run_sync(run)
        metrics = self.service.metrics
        metrics.cascade_decisions.labels(outcome.decided_by or "person").inc()
        for p in outcome.cascade:
            if p.failure is not None:
                metrics.cascade_failures.labels(p.stage, p.failure).inc()
        records[:] = outcome.logged(records)
        return outcome
