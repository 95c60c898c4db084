"""The decision log's endpoints: a logged decision, its labels, and the profiles' health.

Labels are stored atomically per decision (``service.log.decision_log``); health
(``service.log.health.profile_health``) reads the log's recent decisions of a profile's current
version, and ``/metrics`` reads every profile's at most every ``HEALTH_TTL_S`` seconds. A label
the log cannot store (a full disk) is a 503 that says so, counted as a decision's is
(``judge_decision_log_errors_total``): the labeller sends it again.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import anyio.to_thread

from calibration import ProfileError
from calibration.carry import carry
from service.errors import LogUnavailableError, NoLogError
from service.log.decision_log import (
    DecisionLog,
    DecisionLogError,
    LabelFailure,
    UnknownJudgmentError,
)
from service.log.health import ProfileHealth, profile_health
from service.log.health_history import HealthHistory, health_history
from service.log.labelling_queue import LabellingQueue
from service.log.record import LoggedDecision
from service.schemas import (
    LabelQueue,
    LabelRequest,
    LabelResult,
    LabelsRequest,
    LabelsResponse,
    QueueEntry,
)
from service.web.serving_core import ServiceCore

__all__ = ["FeedbackServing"]

log = logging.getLogger("judge.service")
T = TypeVar("T")

QUEUE_AHEAD = 20  # decisions of each stream GET /profiles/{name}/queue returns
HEALTH_TTL_S = 30.0  # /metrics reads the profiles' health at most this often
# A refused label in a batch: the status the same label alone would have got.
_LABEL_FAILURES = {"unknown_judgment": 404, "not_a_choice": 422, "relabel": 409}


class FeedbackServing:
    """Labels for logged decisions, and the health they give each profile."""

    def __init__(self, service: ServiceCore) -> None:
        self.service = service
        self._health: tuple[float, list[ProfileHealth]] | None = None
        if service.decision_log is not None:
            service.metrics.watch_health(self.health_all)

    def _log_or_404(self) -> DecisionLog:
        if self.service.decision_log is None:
            raise NoLogError(
                "this server keeps no decision log: start it with --decision-log to keep "
                "decisions, take their labels and check profiles' health"
            )
        return self.service.decision_log

    async def judgment(self, judgment_id: str) -> LoggedDecision:
        """The logged decision ``judgment_id``, with its label if it has one."""
        found = await anyio.to_thread.run_sync(self._log_or_404().get, judgment_id)
        if found is None:
            raise UnknownJudgmentError(judgment_id)
        return found

    async def label(self, judgment_id: str, request: LabelRequest) -> LabelResult:
        """Store the true label of one logged decision (4xx: unknown, not a choice, relabel)."""
        label = functools.partial(
            self._log_or_404().label, judgment_id, request.label, replace=request.replace
        )
        outcome = await self._store(label)
        self.service.metrics.labels.labels(outcome.status).inc()
        self._nudge_refit([outcome.status])
        return LabelResult(
            judgment_id=outcome.judgment_id,
            label=outcome.label,
            status=outcome.status,
            previous=outcome.previous,
        )

    async def labels(self, request: LabelsRequest) -> LabelsResponse:
        """Labels of many decisions, each stored or refused in its place."""
        label_many = functools.partial(
            self._log_or_404().label_many,
            [(item.judgment_id, item.label) for item in request.labels],
            replace=request.replace,
        )
        results = []
        for outcome in await self._store(label_many):
            if isinstance(outcome, LabelFailure):
                status = _LABEL_FAILURES[outcome.error]
                results.append(
                    LabelResult(
                        judgment_id=outcome.judgment_id,
                        label=outcome.label,
                        status="error",
                        status_code=status,
                        detail=outcome.detail,
                    )
                )
                self.service.metrics.labels.labels("error").inc()
            else:
                results.append(
                    LabelResult(
                        judgment_id=outcome.judgment_id,
                        label=outcome.label,
                        status=outcome.status,
                        previous=outcome.previous,
                    )
                )
                self.service.metrics.labels.labels(outcome.status).inc()
        self._nudge_refit([r.status for r in results])
        return LabelsResponse(results=results)

    async def _store(self, write: Callable[[], T]) -> T:
        """Run a label ``write`` on a worker thread. A log that cannot store it fails the
        request with a 503 that says so, counted in ``judge_decision_log_errors_total`` as a
        decision's is: a bare 500 said the server was broken, where sending the label again
        once the disk has room is all it takes (answered ``unchanged`` where a commit whose
        outcome was unknown had stored it)."""
        try:
            return await anyio.to_thread.run_sync(write)
        except DecisionLogError as exc:
            self.service.metrics.decision_log_errors.inc()
            log.error("a label could not be written to the decision log: %s", exc)
            raise LogUnavailableError(
                f"the label could not be stored in the decision log ({exc}): send it again "
                "later (a label stored already is answered unchanged)"
            ) from exc

    def _nudge_refit(self, statuses: list[str]) -> None:
        """Tell the background refit (``--refit-every``) that labels were stored."""
        if self.service.refitter is not None and {"labeled", "relabeled"} & set(statuses):
            self.service.refitter.labels_arrived()

    async def queue(self, name: str) -> LabelQueue:
        """The next decisions to label under profile ``name`` (``QUEUE_AHEAD`` of each
        stream) and what its labelled audit decisions say (``service.log.labelling_queue``)."""
        decision_log = self._log_or_404()
        profile, etag = self.service.store.get_tagged(name)

        def read() -> LabelQueue:
            queue = LabellingQueue(decision_log, profile, etag, ahead=QUEUE_AHEAD)
            health = queue.health()
            t = profile.threshold
            return LabelQueue(
                profile=name,
                etag=etag,
                audit=[carry(i, QueueEntry) for i in queue.upcoming("audit", QUEUE_AHEAD)],
                teach=[carry(i, QueueEntry) for i in queue.upcoming("teach", QUEUE_AHEAD)],
                pending_audit=queue.pending("audit"),
                pending_teach=queue.pending("teach"),
                unreadable=queue.unreadable,
                n_audited=health.n_audited,
                n_audited_labeled=health.n_audited_labeled,
                threshold=t.threshold,
                coverage=t.coverage if t.threshold is not None else 0.0,
                labels=health.labels,
            )

        return await anyio.to_thread.run_sync(read)

    async def health(self, name: str) -> ProfileHealth:
        """The health of the stored profile ``name`` (its current version) from the log."""
        decision_log = self._log_or_404()
        profile, etag = self.service.store.get_tagged(name)
        current = getattr(self.service.loaded, "model_sha256", None)
        check = functools.partial(
            profile_health,
            decision_log,
            profile,
            etag,
            current_model_sha256=current or None,
            alpha_prior=self.service.config.alpha_prior,
        )
        return await anyio.to_thread.run_sync(check)

    async def history(self, name: str) -> HealthHistory:
        """The stored profile ``name``'s current version's health at 20 points of its
        decisions (``service.log.health_history``)."""
        decision_log = self._log_or_404()
        profile, etag = self.service.store.get_tagged(name)

        def read() -> HealthHistory:
            records = decision_log.decisions(profile=name, profile_etag=etag)
            return health_history(
                profile, etag, records, alpha_prior=self.service.config.alpha_prior
            )

        return await anyio.to_thread.run_sync(read)

    def health_all(self) -> list[ProfileHealth]:
        """The health of every stored profile that has logged decisions; for /metrics, read
        at most every ``HEALTH_TTL_S`` seconds (each read scans the log's recent decisions)."""
        now = time.monotonic()
        if self._health is not None and now - self._health[0] < HEALTH_TTL_S:
            return self._health[1]
        out = []
        if self.service.decision_log is not None:
            current = getattr(self.service.loaded, "model_sha256", None)
            for name in self.service.store.names():
                try:
                    profile, etag = self.service.store.get_tagged(name)
                    health = profile_health(
                        self.service.decision_log,
                        profile,
                        etag,
                        current_model_sha256=current or None,
                        alpha_prior=self.service.config.alpha_prior,
                    )
                except (ProfileError, DecisionLogError):
                    continue  # unreadable: its own GET says why
                if health.n_decisions:
                    out.append(health)
        self._health = (now, out)
        return out
