"""What each endpoint does between the request body and the response body.

A judgment request goes: its size in tokens against the budget (``max_request_tokens``),
profile lookup and ``profile.check`` against the engine's configuration and the request's
choices, and the policy built (``calibration.make_policy``), all before any model work; then
the query joins the batcher's queue under the request's ``Ticket`` and is judged on the model's
thread, coalesced with whatever else is waiting; then the policy decides. Every accept/escalate
decision is ``Policy.decide``: nothing here compares a confidence with a threshold. A probe
profile's policy reads the hidden state of its layers (``Policy.feature_layers``), so its plan
asks the engine for them (``Query.feature_layers``); they reach the decision and go no further.

A request's jobs share one ticket: its owner (the batcher takes owners in turn, so a large
batch or a fit interleaves with everyone else) and its deadline (the server's, or a shorter
one the client asked for). A batch item that misses the deadline gets a 503 in its place; the
items done are kept. A fit judges its examples through the same queue and fits on a worker
thread (``tasks.fit_labeled``); if its client leaves, the request is cancelled and nothing is
written. A fit whose method may be a probe ("auto", "probe") judges its examples with the
hidden states of ``calibration.probe.candidate_layers``; a probe that cannot be fitted is
refused (``method``) before any model work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import re
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import anyio.to_thread
import msgspec
import numpy as np

from calibration import (
    CalibrationError,
    CalibrationProfile,
    FitError,
    Policy,
    ProfileError,
    make_policy,
)
from calibration.fitting import resolve_methods
from calibration.maps import CalibrationMap, Probe
from calibration.probe import candidate_layers, probe_weights
from calibration.profile import NAME_PATTERN
from calibration.tasks import fit_labeled, labeled_queries, scores_from_judgments
from judge import Configuration, Engine, JudgeError, Judgment, PrefixCache, Query, TokenCount
from judge.scores import check_values
from service.batcher import Batcher, DeadlineError, QueueFullError
from service.config import ServiceConfig
from service.errors import (
    BadFieldError,
    NotReadyError,
    TooLargeError,
    UnprocessableError,
    error_body,
)
from service.frontdoor import Admission
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

__all__ = ["Service"]

log = logging.getLogger("judge.service")

WARM_UP = ("Warm-up: is this a test?", ["yes", "no"])


@dataclass(frozen=True)
class Ticket:
    """One request's claim on the model: who it is (for turns) and until when it is wanted."""

    deadline: float  # time.monotonic()
    owner: Hashable = field(default_factory=object)


@dataclass(frozen=True)
class _Plan:
    """What a judgment request needs before its model work: the query and its policy."""

    query: Query
    tokens: int
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
        self.admission = Admission(config.max_queue, config.admission_wait_s)
        self.batcher = Batcher(
            lambda queries: self.engine().judge_each(queries),
            max_batch_size=config.max_batch_size,
            max_batch_tokens=config.max_batch_tokens,
            max_wait_ms=config.max_wait_ms,
            max_jobs=config.max_jobs,
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

    def ticket(self, timeout_s: float | None, limit_s: float | None = None) -> Ticket:
        """A new request's ticket: the shorter of its own timeout and the server's."""
        limit = self.config.request_timeout_s if limit_s is None else limit_s
        timeout = limit if timeout_s is None else min(timeout_s, limit)
        return Ticket(deadline=time.monotonic() + timeout)

    def render_metrics(self) -> bytes:
        self.metrics.queue_depth.set(self.batcher.depth)
        self.metrics.admission_waiting.set(self.admission.waiting)
        self.metrics.jobs.labels("run").set(self.batcher.run)
        self.metrics.jobs.labels("dropped").set(self.batcher.dropped)
        return self.metrics.render()

    # --- judging -----------------------------------------------------------------------------

    async def judge(self, request: JudgeRequest, ticket: Ticket) -> JudgeResponse:
        engine = self.engine()
        query = _query(request)
        (size,) = await self._sizes(engine, [query])
        plan = self._plan(engine, request, query, size)
        result = await self.batcher.judge(
            plan.query, tokens=plan.tokens, owner=ticket.owner, deadline=ticket.deadline
        )
        if isinstance(result, JudgeError):
            raise result
        return self._respond(engine, result, request, plan)

    async def judge_batch(self, request: BatchRequest, ticket: Ticket) -> BatchResponse:
        engine = self.engine()
        if request.items is not None and request.context is None and request.questions is None:
            sizes = await self._sizes(engine, [_query(item) for item in request.items])
            items = await asyncio.gather(
                *(
                    self._item(engine, item, size, ticket)
                    for item, size in zip(request.items, sizes, strict=True)
                )
            )
            return BatchResponse(results=list(items))
        if request.items is None and request.context is not None and request.questions is not None:
            results = await self._shared(engine, request.context, request.questions, ticket)
            return BatchResponse(results=list(results))
        raise BadFieldError("items", "give either items, or context with questions")

    async def _sizes(
        self, engine: Engine, queries: Sequence[Query]
    ) -> list[TokenCount | JudgeError]:
        """Each query's size, or the error that makes it unjudgeable: tokenizing, no model work.

        On a worker thread (not the model's), so a long prompt does not hold the event loop.
        """

        def count() -> list[TokenCount | JudgeError]:
            sizes: list[TokenCount | JudgeError] = []
            for q in queries:
                try:
                    sizes.append(engine.count_tokens(q))
                except JudgeError as exc:
                    sizes.append(exc)
            return sizes

        return await anyio.to_thread.run_sync(count)

    def _check_size(self, size: TokenCount | JudgeError, field: str | None = None) -> int:
        """The query's tokens, if within the budget; else the error, naming the field."""
        if isinstance(size, JudgeError):
            raise size
        budget = self.config.max_request_tokens
        if size.total > budget:
            name = field or size.largest
            raise TooLargeError(
                name,
                f"the judgment is {size.total} tokens, over this server's budget of {budget} "
                f"(--max-request-tokens); {name} is the largest part "
                f"({size.parts.get(size.largest, 0)} tokens): shorten it or split the work",
            )
        return size.total

    def _plan(
        self,
        engine: Engine,
        request: JudgeRequest | SharedQuestion,
        query: Query,
        size: TokenCount | JudgeError,
        field: str | None = None,
    ) -> _Plan:
        """Check the request's size and profile, and build its policy: no model work."""
        tokens = self._check_size(size, field)
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
        values = getattr(request, "values", None)
        max_std = getattr(request, "max_std", None)
        if values is not None or (max_std is not None and profile is None):
            values = check_values(values, request.choices)  # numerals by default
        policy = make_policy(
            profile,
            threshold=request.threshold,
            min_choice_mass=request.min_choice_mass,
            max_std=max_std,
            values=values,
            defaults=self.config.policy_defaults,
        )
        if policy.feature_layers:  # a probe reads the pass's hidden state: ask for it
            query = msgspec.structs.replace(query, feature_layers=policy.feature_layers)
        return _Plan(query, tokens, profile, policy)

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
            temperature=_temperature(plan.profile.calibration_map) if plan.profile else None,
            choice_mass=decision.choice_mass,
            prediction_set=decision.prediction_set,
            profile=decision.profile,
            model=engine.model_id,
            latency_ms=result.latency_ms,
            prompt=result.prompt if request.return_prompt else None,
            expected_value=decision.expected_value,
            std=decision.std,
            max_std=decision.max_std,
            calibration_method=plan.profile.calibration_map.method if plan.profile else None,
            feature_layers=list(plan.policy.feature_layers) or None,
        )

    async def _item(
        self,
        engine: Engine,
        item: JudgeRequest,
        size: TokenCount | JudgeError,
        ticket: Ticket,
    ) -> JudgeResponse | ErrorBody:
        """One item of a batch: its 4xx, or a 503 when out of time, in its place.

        Any other 5xx fails the whole request.
        """
        try:
            plan = self._plan(engine, item, _query(item), size)
            result = await self.batcher.judge(
                plan.query, tokens=plan.tokens, owner=ticket.owner, deadline=ticket.deadline
            )
            if isinstance(result, JudgeError):
                raise result
            return self._respond(engine, result, item, plan)
        except Exception as exc:
            status, body = error_body(exc)
            if status >= 500 and not isinstance(exc, DeadlineError | QueueFullError):
                raise
            return ErrorBody(status_code=status, detail=body["detail"], field=body.get("field"))

    async def _shared(
        self,
        engine: Engine,
        context: str,
        questions: Sequence[SharedQuestion],
        ticket: Ticket,
    ) -> list[JudgeResponse]:
        """Questions about one context, in jobs of at most ``max_batch_tokens`` tokens each.

        Each job is one ``judge_shared`` call. A job after the first finds the context in the
        engine's prefix cache, so splitting costs little and keeps each pass short.
        """
        queries = [
            msgspec.structs.replace(_query(q), prompt=f"{context}\n\n{q.prompt}") for q in questions
        ]
        sizes = await self._sizes(engine, [*queries, Query(prompt=context, choices=["yes", "no"])])
        plans = []
        for i, (q, query, size) in enumerate(zip(questions, queries, sizes[:-1], strict=True)):
            field = "context" if len(context) >= len(q.prompt) else f"questions[{i}].prompt"
            plans.append(self._plan(engine, q, query, size, field))
        context_size = sizes[-1]
        shared = context_size.parts["prompt"] if isinstance(context_size, TokenCount) else 0
        jobs: list[list[int]] = []
        tokens = 0
        for i, plan in enumerate(plans):
            own = max(plan.tokens - shared, 1)
            fits = tokens + own <= self.config.max_batch_tokens
            if jobs and len(jobs[-1]) < self.config.max_batch_size and fits:
                jobs[-1].append(i)
                tokens += own
                continue
            jobs.append([i])
            tokens = shared + own
        results: list[Judgment] = []
        for job in jobs:
            # The engine prepends the context itself; a probe's layers come from the plan.
            part = [
                msgspec.structs.replace(
                    _query(questions[i]), feature_layers=plans[i].query.feature_layers
                )
                for i in job
            ]
            results += await self.batcher.call(
                functools.partial(engine.judge_shared, context, part),
                owner=ticket.owner,
                deadline=ticket.deadline,
            )
            self.metrics.batch_size.observe(len(job))
        return [
            self._respond(engine, r, q, p)
            for r, q, p in zip(results, questions, plans, strict=True)
        ]

    # --- profiles -----------------------------------------------------------------------------

    async def fit(self, name: str, request: FitRequest, ticket: Ticket) -> CalibrationProfile:
        """Judge the labeled examples, fit a profile on them, save it and return it."""
        engine = self.engine()
        if not re.fullmatch(NAME_PATTERN, name):
            raise BadFieldError("name", f"profile name {name!r} must match {NAME_PATTERN}")
        for i, example in enumerate(request.examples):
            if example.label not in request.choices:
                raise UnprocessableError(
                    f"examples[{i}].label",
                    f"label {example.label!r} is not one of the choices {request.choices}",
                )
        labels = {e.label for e in request.examples}
        if len(labels) < 2:
            raise UnprocessableError(
                "examples",
                f"all {len(request.examples)} examples have the label {labels.pop()!r}: "
                "calibration needs examples of at least two choices",
            )
        template = {
            "system": request.system,
            "response_prefix": request.response_prefix,
            "response_suffix": request.response_suffix,
        }
        configuration = engine.configuration(**template)
        layers = _fit_layers(request, configuration)  # refuses an impossible probe up front
        queries = labeled_queries(
            [e.prompt for e in request.examples],
            request.choices,
            feature_layers=layers,
            **template,
        )
        sizes = await self._sizes(engine, queries)
        tokens = [self._check_size(s, f"examples[{i}].prompt") for i, s in enumerate(sizes)]
        judgments: list[Judgment] = []
        # The hidden states, kept as one float32 array rather than in the judgments: as lists
        # of Python floats, 20,000 examples at 5 layers of 576 would take about 2 GB.
        features: np.ndarray | None = None  # (n, m, H)
        wave = 4 * self.config.max_batch_size  # jobs queued at once: a bounded share of the queue
        for start in range(0, len(queries), wave):
            results = await asyncio.gather(
                *(
                    self.batcher.judge(
                        queries[i], tokens=tokens[i], owner=ticket.owner, deadline=ticket.deadline
                    )
                    for i in range(start, min(start + wave, len(queries)))
                )
            )
            for i, result in enumerate(results, start):
                if isinstance(result, JudgeError):
                    if result.field in (None, "prompt"):
                        result.field = f"examples[{i}].prompt"
                    raise result
                if layers:
                    row = _features_of(result, layers)  # (m, H)
                    if features is None:
                        features = np.empty((len(queries), *row.shape), dtype=np.float32)
                    features[i] = row
                    result = msgspec.structs.replace(result, features=None)
                judgments.append(result)
        scores = scores_from_judgments(
            judgments, [e.label for e in request.examples], request.choices
        )
        if features is not None:
            scores = dataclasses.replace(scores, features=features, feature_layers=layers)
        fit = functools.partial(
            fit_labeled,
            name,
            scores,
            request.choices,
            configuration,
            dataset=f"POST /profiles/{name}/fit",
            dataset_sha256=hashlib.sha256(msgspec.json.encode(request.examples)).hexdigest(),
            target_precision=request.target_precision,
            delta=request.delta,
            alpha=request.alpha,
            methods=_FIT_METHODS[request.method],
        )
        try:
            profile = await anyio.to_thread.run_sync(fit)
        except (CalibrationError, ValueError) as exc:  # e.g. every example has the same label
            # The fitter's own refusals of a method ("method 'probe' needs ...") name it.
            field = "method" if str(exc).startswith("method ") else "examples"
            raise UnprocessableError(
                field, f"cannot fit a profile on these examples: {exc}"
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
                    calibration_map=_map_summary(p.calibration_map),
                    threshold=p.threshold,
                    metrics_after=p.metrics_after,
                    n_examples=p.n_examples,
                    created_at=p.created_at,
                    signal=p.signal,
                    label_free=p.label_free,
                    values=p.values,
                    max_std=p.max_std,
                )
            )
        return summaries

    def put_profile(
        self,
        name: str,
        profile: CalibrationProfile,
        *,
        if_match: Sequence[str] | None = None,
        if_none_match: Sequence[str] | None = None,
    ) -> str:
        """Store ``profile`` under ``name`` and return its ETag.

        ``if_match`` replaces only one of those versions, ``if_none_match`` (``["*"]``) only
        creates; the store compares and writes in one step, under its lock, so it may block
        while another writer holds it (call it off the event loop).
        """
        if profile.name != name:
            raise UnprocessableError(
                "name", f"the profile is named {profile.name!r} but the path says {name!r}"
            )
        return self.store.put(profile, if_match=if_match, if_none_match=if_none_match)


# FitRequest.method -> fit_labeled's methods: the candidates that compete with no scaling.
_FIT_METHODS: dict[str, str | list[str]] = {
    "auto": "auto",
    "temperature": ["temperature"],
    "bias_temperature": ["temperature", "bias_temperature"],
    "probe": ["probe"],
}


def _fit_layers(request: FitRequest, configuration: Configuration) -> tuple[int, ...]:
    """The hidden-state layers to judge a fit's examples with: a probe's candidates, or none.

    An explicit probe that cannot be fitted (no hidden states, too few examples, more weights
    than a profile may hold: ``calibration.fitting.resolve_methods``) is refused here, naming
    ``method``, before any model work; "auto" fits without one, and its profile's note says
    why.
    """
    if request.method not in ("auto", "probe"):
        return ()
    num_layers = configuration.get("num_layers")
    hidden_size = configuration.get("hidden_size")
    if num_layers is None or hidden_size is None:
        if request.method == "probe":
            raise UnprocessableError(
                "method",
                f"method 'probe' reads the model's hidden states, and this server's engine "
                f"({configuration['model']}) exposes none; use method auto or temperature",
            )
        return ()
    if request.method == "probe":
        try:  # the fitter's own rules for when a probe can be fitted, before any model work
            weights = probe_weights(len(request.choices), hidden_size)
            resolve_methods(["probe"], len(request.examples), weights)
        except FitError as exc:
            raise UnprocessableError("method", str(exc)) from exc
    # "auto": the fitter decides whether the probe can compete, and its note says why not.
    return candidate_layers(num_layers)


def _features_of(judgment: Judgment, layers: Sequence[int]) -> np.ndarray:
    """(m, H) float32: the judgment's hidden states of ``layers``, in that order."""
    features = judgment.features or {}
    missing = [n for n in layers if n not in features]
    if missing:  # the engine broke its contract: Query.feature_layers come back in features
        raise RuntimeError(f"the engine returned no features for layers {missing}")
    return np.asarray([features[n] for n in layers], dtype=np.float32)


def _temperature(calibration_map: CalibrationMap) -> float | None:
    """The map's temperature; None for a probe, which has none (its ``temperature`` is 1)."""
    return None if isinstance(calibration_map, Probe) else calibration_map.temperature


def _map_summary(calibration_map: CalibrationMap) -> CalibrationMapSummary:
    layers = list(calibration_map.layers) if isinstance(calibration_map, Probe) else None
    return CalibrationMapSummary(
        method=calibration_map.method, temperature=_temperature(calibration_map), layers=layers
    )


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
