"""A cascade behind ``POST /judge`` (``judge serve --cascade NAME=TARGET ...``).

This server's engine is the first stage (``--stage-name``), decided as every judgment is. An
item it escalates goes to each later stage in turn (``calibration.cascade.Cascade``): a
model loaded in this process, which judges on its own lock off the event loop, or another
judge server (``service.remote_stage``). A request's profile P is the first stage's; stage
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

import functools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio.to_thread
import msgspec

from calibration import Cascade, Gate, Overrides, Verdict
from calibration.cascade import LocalStage, StageAnswer, StageItem, StageResult
from judge import Engine, Judgment
from service.decision_log import CascadeLog, LoggedDecision
from service.gate_context import GateContext
from service.remote_stage import RemoteStage, answer_of
from service.schemas import JudgeRequest, JudgeResponse
from service.serving_core import WARM_UP, ServiceCore

__all__ = [
    "CascadeServing",
    "LocalModel",
    "ServedLocal",
    "ServedRemote",
    "ServedStage",
    "cascaded",
    "is_remote",
]

log = logging.getLogger("judge.service")


def is_remote(target: str) -> bool:
    """Whether a stage's target is another server (a URL) rather than a model to load."""
    return target.startswith(("http://", "https://"))


@dataclass
class LocalModel:
    """A later stage's model, loaded once; its lock lets one item at a time through."""

    engine: Engine
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class ServedLocal:
    """One request's view of a local later stage: its gate, and what it answered."""

    name: str
    model: LocalModel
    gate: Gate
    context: GateContext | None = None  # the server's (None: no log, as in judge ask)
    response: JudgeResponse | None = None
    record: LoggedDecision | None = None

    def answer(self, item: StageItem, *, timeout_s: float | None) -> StageAnswer:
        with self.model.lock:
            judgment, verdict = LocalStage(self.name, self.model.engine, self.gate).judged(item)
        assert isinstance(judgment, Judgment)  # an engine's, not a bare ScoredJudgment
        self.response = JudgeResponse.of(judgment, verdict, choices=item.choices)
        # What the log keeps of a first stage's decision it keeps of this one's (with
        # --log-features, the hidden states a refit of this stage's probe reads), but not its
        # request: the first stage's record replays the request.
        if self.context is not None:
            self.record = self.context.settle(
                verdict, self.gate, model=self.model.engine.model_id, features=judgment.features
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


class CascadeServing:
    """The later stages of this server's cascade: loaded once, planned and run per request."""

    def __init__(self, service: ServiceCore) -> None:
        self.service = service
        self.local: dict[str, LocalModel] = {}

    def load(self, dtype: str) -> None:
        """Load and warm each local later stage (blocking; at start-up, before ready)."""
        from judge import Judge

        for name, target in self.service.config.cascade.items():
            if is_remote(target):
                continue
            engine = Judge.load(target, dtype=dtype)  # type: ignore[arg-type]
            engine.judge(*WARM_UP)
            self.local[name] = LocalModel(engine)
            log.info("cascade stage %s: model %s, %s pass", name, engine.model_id, engine.dtype)

    def plan(self, request: JudgeRequest) -> list[ServedStage]:
        """Each later stage for ``request``: a local one's gate opened on its profile
        (``P-NAME``) and checked against its engine; no model work. A missing or mismatched
        profile is refused here, naming ``profile``."""
        config = self.service.config
        overrides = Overrides.of(request)
        stages: list[ServedStage] = []
        for name, target in config.cascade.items():
            profile = None if request.profile is None else f"{request.profile}-{name}"
            if is_remote(target):
                # A fleet's servers share their key.
                remote = RemoteStage.under(name, target, profile, overrides, config.api_key)
                stages.append(ServedRemote(remote))
                continue
            model = self.local[name]
            gate = self.service.open_gate(
                model.engine, profile, overrides, choices=request.choices, field="profile"
            )
            stages.append(ServedLocal(name, model, gate, self.service.gates))
        return stages

    async def escalate(
        self,
        request: JudgeRequest,
        stages: list[ServedStage],
        first: tuple[Judgment, Verdict, JudgeResponse],
        records: list[LoggedDecision],
        deadline: float,
    ) -> JudgeResponse:
        """The first stage's judgment, verdict and response; where it escalated, the later
        stages tried (off the event loop) until one accepts. ``records`` holds this request's records (the
        first stage's, if logged): the later stages' join them, and each carries the
        outcome."""
        run = functools.partial(
            cascaded,
            self.service.config.stage_name,
            first,
            stages,
            StageItem(request.prompt, request.choices, request.item_span),
            deadline_s=deadline - time.monotonic(),
        )
        accepted = first[1].decision == "accept"
        # Only the later stages' model work goes off the event loop.
        final = run() if accepted else await anyio.to_thread.run_sync(run)
        decided_by, parts = final.decided_by, final.cascade or []
        records += [s.record for s in stages if isinstance(s, ServedLocal) and s.record]
        metrics = self.service.metrics
        metrics.cascade_decisions.labels(decided_by or "person").inc()
        for p in parts:
            if p.failure is not None:
                metrics.cascade_failures.labels(p.stage, p.failure).inc()
        kept = CascadeLog(decided_by=decided_by, stages=parts)
        records[:] = [msgspec.structs.replace(r, cascade=kept) for r in records]
        return final


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
