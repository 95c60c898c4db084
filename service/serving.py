"""What each endpoint does between the request body and the response body.

A judgment request goes: profile lookup and ``profile.check`` against the engine's
configuration and the request's choices, and the policy built (``calibration.make_policy``),
all before any model work; then the query joins the batcher's queue and is judged on the
model's thread, coalesced with whatever else is waiting; then the policy decides. Every
accept/escalate decision is ``Policy.decide``: nothing here compares a confidence with a
threshold. A fit judges its examples in chunks through the same queue, so judgments keep being
served in between, and fits on a worker thread (``tasks.fit_labeled``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio.to_thread
import msgspec

from calibration import (
    CalibrationError,
    CalibrationProfile,
    Policy,
    ProfileError,
    make_policy,
)
from calibration.profile import NAME_PATTERN
from judge import Engine, JudgeError, Judgment, PrefixCache, Query
from service.batcher import Batcher
from service.config import ServiceConfig
from service.errors import BadFieldError, NotReadyError, error_body
from service.metrics import ServiceMetrics
from service.profiles import ProfileStore
from service.schemas import (
    BatchRequest,
    BatchResponse,
    CalibrationMapSummary,
    ErrorBody,
    FitRequest,
    JudgeRequest,
    JudgeResponse,
    ProfileSummary,
    SharedQuestion,
)
from tasks import fit_labeled, labeled_queries, scores_from_judgments

__all__ = ["Service"]

log = logging.getLogger("judge.service")

WARM_UP = ("Warm-up: is this a test?", ["yes", "no"])


@dataclass(frozen=True)
class _Plan:
    """What a judgment request needs before its model work: the query and its policy."""

    query: Query
    profile: CalibrationProfile | None
    policy: Policy


class Service:
    """The engine behind the endpoints: its batcher, profile store, metrics and readiness."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.store = ProfileStore(config.profiles_dir)
        self.metrics = ServiceMetrics()
        self.loaded: Engine | None = None  # set once the engine has loaded and judged once
        self.failure: str | None = None  # why loading failed
        self.batcher = Batcher(
            lambda queries: self.engine().judge_each(queries),
            max_batch_size=config.max_batch_size,
            max_wait_ms=config.max_wait_ms,
            max_queue=config.max_queue,
            on_batch=self.metrics.batch_size.observe,
        )

    def engine(self) -> Engine:
        if self.loaded is None:
            raise NotReadyError("the model is still loading")
        return self.loaded

    async def warm_up(self, load: Callable[[], Engine]) -> None:
        """Load the engine and judge once, off the event loop; then the service is ready."""
        try:
            engine = await anyio.to_thread.run_sync(load)
            await anyio.to_thread.run_sync(functools.partial(engine.judge, *WARM_UP))
        except Exception as exc:
            log.exception("loading the model failed")
            self.failure = f"{type(exc).__name__}: {exc}"
            return
        cache = getattr(engine, "prefix_cache", None)  # a Judge's; other engines may have none
        if isinstance(cache, PrefixCache):
            self.metrics.watch_prefix_cache(cache.stats)
        self.loaded = engine
        log.info("ready: model %s, dtype %s", engine.model_id, engine.dtype)

    def render_metrics(self) -> bytes:
        self.metrics.queue_depth.set(self.batcher.depth)
        return self.metrics.render()

    # --- judging -----------------------------------------------------------------------------

    async def judge(self, request: JudgeRequest) -> JudgeResponse:
        engine = self.engine()
        plan = self._plan(engine, request, _query(request))
        result = await self.batcher.judge(plan.query, self.config.request_timeout_s)
        if isinstance(result, JudgeError):
            raise result
        return self._respond(engine, result, request, plan)

    async def judge_batch(self, request: BatchRequest) -> BatchResponse:
        engine = self.engine()
        if request.items is not None and request.context is None and request.questions is None:
            items = await asyncio.gather(*(self._item(engine, item) for item in request.items))
            return BatchResponse(results=list(items))
        if request.items is None and request.context is not None and request.questions is not None:
            return BatchResponse(
                results=list(await self._shared(engine, request.context, request.questions))
            )
        raise BadFieldError("items", "give either items, or context with questions")

    def _plan(self, engine: Engine, request: JudgeRequest | SharedQuestion, query: Query) -> _Plan:
        """Check the request's profile against the engine and build its policy: no model work."""
        profile = None
        if request.profile is not None:
            profile = self.store.get(request.profile)
            profile.check(
                engine,
                system=query.system,
                response_prefix=query.response_prefix,
                response_suffix=query.response_suffix,
                choices=request.choices,
            )
        policy = make_policy(
            profile,
            threshold=request.threshold,
            min_choice_mass=request.min_choice_mass,
            defaults=self.config.policy_defaults,
        )
        return _Plan(query, profile, policy)

    def _respond(
        self,
        engine: Engine,
        result: Judgment,
        request: JudgeRequest | SharedQuestion,
        plan: _Plan,
    ) -> JudgeResponse:
        decision = plan.policy.decide(result)
        self.metrics.decisions.labels(decision.decision).inc()
        return JudgeResponse(
            choice=decision.choice,
            confidence=decision.confidence,
            # The decision keeps the profile's order; a response keeps the request's.
            probabilities={c: decision.probabilities[c] for c in request.choices},
            raw_probabilities=dict(result.probabilities),
            decision=decision.decision,
            reasons=list(decision.reasons),
            reason_codes=list(decision.reason_codes),
            threshold=decision.threshold,
            certified=decision.certified,
            temperature=plan.profile.calibration_map.temperature if plan.profile else None,
            choice_mass=decision.choice_mass,
            prediction_set=decision.prediction_set,
            profile=decision.profile,
            model=engine.model_id,
            latency_ms=result.latency_ms,
            prompt=result.prompt if request.return_prompt else None,
        )

    async def _item(self, engine: Engine, item: JudgeRequest) -> JudgeResponse | ErrorBody:
        """One item of a batch: its 4xx in its place; a 5xx fails the whole request."""
        try:
            plan = self._plan(engine, item, _query(item))
            result = await self.batcher.judge(plan.query, self.config.request_timeout_s)
            if isinstance(result, JudgeError):
                raise result
            return self._respond(engine, result, item, plan)
        except Exception as exc:
            status, body = error_body(exc)
            if status >= 500:
                raise
            return ErrorBody(status_code=status, detail=body["detail"], field=body.get("field"))

    async def _shared(
        self, engine: Engine, context: str, questions: Sequence[SharedQuestion]
    ) -> list[JudgeResponse]:
        plans = [self._plan(engine, q, _query(q)) for q in questions]
        queries = [p.query for p in plans]
        results = await self.batcher.call(
            functools.partial(engine.judge_shared, context, queries),
            self.config.request_timeout_s,
        )
        self.metrics.batch_size.observe(len(queries))
        return [
            self._respond(engine, r, q, p)
            for r, q, p in zip(results, questions, plans, strict=True)
        ]

    # --- profiles -----------------------------------------------------------------------------

    async def fit(self, name: str, request: FitRequest) -> CalibrationProfile:
        """Judge the labeled examples, fit a profile on them, save it and return it."""
        engine = self.engine()
        if not re.fullmatch(NAME_PATTERN, name):
            raise BadFieldError("name", f"profile name {name!r} must match {NAME_PATTERN}")
        for i, example in enumerate(request.examples):
            if example.label not in request.choices:
                raise BadFieldError(
                    f"examples[{i}].label",
                    f"label {example.label!r} is not one of the choices {request.choices}",
                )
        template = {
            "system": request.system,
            "response_prefix": request.response_prefix,
            "response_suffix": request.response_suffix,
        }
        queries = labeled_queries([e.prompt for e in request.examples], request.choices, **template)
        judgments: list[Judgment] = []
        step = self.config.fit_chunk
        for start in range(0, len(queries), step):
            # Chunks are separate jobs, so requests waiting meanwhile are served in between.
            judgments += await self.batcher.call(
                functools.partial(engine.judge_batch, queries[start : start + step]),
                self.config.request_timeout_s,
            )
        scores = scores_from_judgments(
            judgments, [e.label for e in request.examples], request.choices
        )
        fit = functools.partial(
            fit_labeled,
            name,
            scores,
            request.choices,
            engine.configuration(**template),
            dataset=f"POST /profiles/{name}/fit",
            dataset_sha256=hashlib.sha256(msgspec.json.encode(request.examples)).hexdigest(),
            target_precision=request.target_precision,
            delta=request.delta,
            alpha=request.alpha,
        )
        try:
            profile = await anyio.to_thread.run_sync(fit)
        except (CalibrationError, ValueError) as exc:  # e.g. every example has the same label
            raise BadFieldError(
                "examples", f"cannot fit a profile on these examples: {exc}"
            ) from exc
        self.store.put(profile)
        return profile

    def profile_summaries(self) -> list[ProfileSummary]:
        summaries = []
        for name in self.store.names():
            try:
                p = self.store.get(name)
            except ProfileError:
                continue  # an unreadable file is not a profile; GET /profiles/{name} says why
            summaries.append(
                ProfileSummary(
                    name=p.name,
                    model=p.model,
                    choices=p.choices,
                    calibration_map=CalibrationMapSummary(
                        method=p.calibration_map.method, temperature=p.calibration_map.temperature
                    ),
                    threshold=p.threshold,
                    metrics_after=p.metrics_after,
                    n_examples=p.n_examples,
                    created_at=p.created_at,
                )
            )
        return summaries

    def put_profile(self, name: str, profile: CalibrationProfile) -> CalibrationProfile:
        if profile.name != name:
            raise BadFieldError(
                "name", f"the profile is named {profile.name!r} but the path says {name!r}"
            )
        self.store.put(profile)
        return profile


def _query(request: JudgeRequest | SharedQuestion) -> Query:
    """The engine's query for a request; a shared question uses the engine's template."""
    if isinstance(request, SharedQuestion):
        return Query(prompt=request.prompt, choices=list(request.choices))
    return Query(
        prompt=request.prompt,
        choices=list(request.choices),
        system=request.system,
        response_prefix=request.response_prefix,
        response_suffix=request.response_suffix,
    )
