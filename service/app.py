"""The HTTP service: ``create_app(judge)`` builds the Litestar app around an engine.

The engine comes in from outside: the CLI hands in a loader for the real model (so the server
answers /health and /ready while it loads), tests may hand in a loaded engine. Every forward
pass runs on the batcher's worker thread, never on the event loop. Errors become responses
in one place, ``_error_handlers``: each domain error has its status code and a body naming
the field; anything unexpected is a bare 500 and a log line.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio.to_thread
import msgspec
import numpy as np
from litestar import Litestar, Request, Response, delete, get, post, put
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig
from litestar.params import FromPath, JSONBody
from litestar.types import ASGIApp, HTTPResponseStartEvent, Receive, Scope, Send

from calibration.conformal import prediction_set
from calibration.errors import ProfileError, ProfileMismatchError, ProfileNotFoundError
from calibration.fitting import fit_profile
from calibration.profile import CalibrationProfile
from judge.engine import Judge, Judgment, Query
from judge.errors import ChoicesError, InvalidQueryError, JudgeError
from service.batcher import Batcher, QueueFullError
from service.metrics import ServiceMetrics
from service.profiles import ProfileStore
from service.schemas import (
    BatchRequest,
    BatchResponse,
    ErrorBody,
    FitRequest,
    JudgeRequest,
    JudgeResponse,
    ProfileSummary,
    SharedQuestion,
)

__all__ = ["ServiceConfig", "create_app"]

log = logging.getLogger("judge.service")


@dataclass(frozen=True)
class ServiceConfig:
    profiles_dir: Path = Path("profiles")
    max_batch_size: int = 16
    max_wait_ms: float = 5.0
    max_queue: int = 256
    request_timeout_s: float = 60.0
    api_key: str | None = None
    max_body_bytes: int = 1_000_000
    default_threshold: float = 0.9  # used when neither the request nor a profile sets one
    min_choice_mass: float = 0.0  # escalate below this; 0 disables the check
    fit_chunk: int = 16  # examples per model job while fitting, so judgments interleave


class NotReadyError(Exception):
    """The model is still loading or warming up."""


@dataclass
class _Service:
    config: ServiceConfig
    store: ProfileStore
    metrics: ServiceMetrics
    judge: Judge | None = None
    ready: bool = False
    failure: str | None = None
    batcher: Batcher = field(init=False)

    def engine(self) -> Judge:
        if not self.ready or self.judge is None:
            raise NotReadyError("the model is still loading")
        return self.judge


def create_app(
    judge: Judge | None = None,
    *,
    loader: Callable[[], Judge] | None = None,
    config: ServiceConfig | None = None,
) -> Litestar:
    """Build the app around ``judge``, or around whatever ``loader`` returns once it has run."""
    if (judge is None) == (loader is None):
        raise ValueError("pass exactly one of judge and loader")
    config = config or ServiceConfig()
    svc = _Service(config, ProfileStore(config.profiles_dir), ServiceMetrics(), judge)
    svc.batcher = Batcher(
        lambda queries: svc.engine().judge_each(queries),
        max_batch_size=config.max_batch_size,
        max_wait_ms=config.max_wait_ms,
        max_queue=config.max_queue,
        on_batch=svc.metrics.batch_size.observe,
    )

    async def warm_up() -> None:
        try:
            engine = judge if judge is not None else await anyio.to_thread.run_sync(loader)  # type: ignore[arg-type]
            await anyio.to_thread.run_sync(
                lambda: engine.judge("Warm-up: is this a test?", ["yes", "no"])
            )
        except Exception as exc:
            log.exception("loading the model failed")
            svc.failure = f"{type(exc).__name__}: {exc}"
            return
        svc.judge, svc.ready = engine, True
        log.info("ready: model %s, dtype %s", engine.model_id, engine.dtype)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        svc.batcher.start()
        loading = asyncio.get_running_loop().create_task(warm_up())
        try:
            yield
        finally:
            loading.cancel()
            await svc.batcher.stop()

    timeout = config.request_timeout_s

    @get("/health", summary="Liveness: the process is up")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @get("/ready", summary="Readiness: the model is loaded and has judged once")
    async def ready() -> Response[dict[str, str]]:
        if svc.ready and svc.judge is not None:
            return Response(
                {"status": "ready", "model": svc.judge.model_id, "dtype": svc.judge.dtype}
            )
        if svc.failure:
            return Response({"status": "failed", "detail": svc.failure}, status_code=503)
        return Response({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})

    @get("/metrics", summary="Prometheus metrics", media_type="text/plain; version=0.0.4")
    async def metrics() -> Response[bytes]:
        svc.metrics.queue_depth.set(svc.batcher.depth)
        return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4")

    @post("/judge", summary="Judge one prompt between fixed choices", status_code=200)
    async def judge_one(data: JSONBody[JudgeRequest]) -> JudgeResponse:
        engine = svc.engine()
        profile = _profile_for(svc, engine, data)
        result = await svc.batcher.judge(_query(data), timeout)
        if isinstance(result, JudgeError):
            raise result
        return _respond(svc, engine, result, data, profile)

    @post(
        "/judge/batch",
        summary="Judge many items, or many questions about one context",
        status_code=200,
    )
    async def judge_batch(data: JSONBody[BatchRequest]) -> BatchResponse:
        engine = svc.engine()
        if (data.items is None) == (data.questions is None) or (data.questions is not None) != (
            data.context is not None
        ):
            raise _BadField("items", "give either items, or context with questions")
        if data.questions is not None:
            return await _shared(svc, engine, data.context or "", data.questions)
        return BatchResponse(
            results=list(
                await asyncio.gather(*(_batch_item(svc, engine, item) for item in data.items or []))
            )
        )

    @get("/profiles", summary="List calibration profiles")
    async def list_profiles() -> list[ProfileSummary]:
        summaries = []
        for name in svc.store.names():
            try:
                p = svc.store.get(name)
            except ProfileError:
                continue  # an unreadable file is not a profile; GET /profiles/{name} says why
            summaries.append(
                ProfileSummary(
                    name=p.name,
                    model=p.model,
                    choices=p.choices,
                    method=p.method,
                    temperature=p.temperature,
                    threshold=p.threshold,
                    metrics_after=p.metrics_after,
                    n_examples=p.n_examples,
                    created_at=p.created_at,
                )
            )
        return summaries

    @get("/profiles/{name:str}", summary="One calibration profile")
    async def get_profile(name: FromPath[str]) -> CalibrationProfile:
        return svc.store.get(name)

    @put("/profiles/{name:str}", summary="Upload a calibration profile", status_code=200)
    async def put_profile(
        name: FromPath[str], data: JSONBody[CalibrationProfile]
    ) -> CalibrationProfile:
        if data.name != name:
            raise _BadField(
                "name", f"the profile is named {data.name!r} but the path says {name!r}"
            )
        svc.store.put(data)
        return data

    @post("/profiles/{name:str}/fit", summary="Fit a profile on labeled examples", status_code=200)
    async def fit(name: FromPath[str], data: JSONBody[FitRequest]) -> CalibrationProfile:
        engine = svc.engine()
        profile = await _fit(svc, engine, name, data)
        svc.store.put(profile)
        return profile

    @delete("/profiles/{name:str}", summary="Delete a calibration profile", status_code=204)
    async def delete_profile(name: FromPath[str]) -> None:
        svc.store.delete(name)

    middleware: list[Callable[[ASGIApp], ASGIApp]] = [svc.metrics.middleware]
    if config.api_key:
        middleware.append(_api_key_middleware(config.api_key))
    return Litestar(
        route_handlers=[
            health,
            ready,
            metrics,
            judge_one,
            judge_batch,
            list_profiles,
            get_profile,
            put_profile,
            fit,
            delete_profile,
        ],
        lifespan=[lifespan],
        middleware=middleware,
        exception_handlers=_error_handlers(),
        request_max_body_size=config.max_body_bytes,
        openapi_config=OpenAPIConfig(title="judge", version="0.1.0", path="/schema"),
    )


# --- judging --------------------------------------------------------------------------------


def _query(data: JudgeRequest | SharedQuestion, prompt: str | None = None) -> Query:
    return Query(
        prompt=data.prompt if prompt is None else prompt,
        choices=list(data.choices),
        system=getattr(data, "system", None),
        response_prefix=getattr(data, "response_prefix", None),
        response_suffix=getattr(data, "response_suffix", None),
    )


def _profile_for(
    svc: _Service, engine: Judge, data: JudgeRequest | SharedQuestion
) -> CalibrationProfile | None:
    """The request's profile, checked against the engine's configuration before any work."""
    if data.profile is None:
        return None
    profile = svc.store.get(data.profile)
    configuration = engine.configuration(
        system=getattr(data, "system", None),
        response_prefix=getattr(data, "response_prefix", None),
        response_suffix=getattr(data, "response_suffix", None),
    )
    profile.check(**configuration, choices=data.choices)
    return profile


def _respond(
    svc: _Service,
    engine: Judge,
    result: Judgment,
    data: JudgeRequest | SharedQuestion,
    profile: CalibrationProfile | None,
) -> JudgeResponse:
    probabilities = profile.calibrate(result.logits) if profile else dict(result.probabilities)
    choice = max(probabilities, key=probabilities.__getitem__)
    confidence = probabilities[choice]
    reasons = []
    threshold = data.threshold
    if threshold is None and profile is not None:
        threshold = profile.threshold.threshold
        if threshold is None:
            reasons.append(
                f"profile {profile.name!r} has no feasible threshold: {profile.threshold.reason}"
            )
    elif threshold is None:
        threshold = svc.config.default_threshold
    if threshold is not None and confidence < threshold:
        reasons.append(f"confidence {confidence:.4f} is below the threshold {threshold:.4f}")
    min_mass = svc.config.min_choice_mass if data.min_choice_mass is None else data.min_choice_mass
    if result.choice_mass < min_mass:
        reasons.append(f"choice mass {result.choice_mass:.4f} is below {min_mass:.4f}")
    members = None
    if profile is not None:
        row = np.array([probabilities[c] for c in profile.choices])
        members = [profile.choices[i] for i in prediction_set(row, profile.conformal_quantile)]
        if len(members) != 1:
            reasons.append(f"the prediction set holds {len(members)} choices, not one")
    decision: Literal["accept", "escalate"] = "escalate" if reasons else "accept"
    svc.metrics.decisions.labels(decision).inc()
    return JudgeResponse(
        choice=choice,
        confidence=confidence,
        probabilities=probabilities,
        raw_probabilities=dict(result.probabilities),
        decision=decision,
        reason="; ".join(reasons) or None,
        threshold=threshold,
        temperature=profile.temperature if profile else None,
        choice_mass=result.choice_mass,
        prediction_set=members,
        profile=profile.name if profile else None,
        model=engine.model_id,
        latency_ms=result.latency_ms,
        prompt=result.prompt if data.return_prompt else None,
    )


async def _batch_item(
    svc: _Service, engine: Judge, item: JudgeRequest
) -> JudgeResponse | ErrorBody:
    try:
        profile = _profile_for(svc, engine, item)
        result = await svc.batcher.judge(_query(item), svc.config.request_timeout_s)
        if isinstance(result, JudgeError):
            raise result
        return _respond(svc, engine, result, item, profile)
    except Exception as exc:
        status, body = _error_body(exc)
        if status >= 500:
            raise
        return ErrorBody(status_code=status, detail=str(body["detail"]), field=body.get("field"))


async def _shared(
    svc: _Service, engine: Judge, context: str, questions: Sequence[SharedQuestion]
) -> BatchResponse:
    profiles = [_profile_for(svc, engine, q) for q in questions]
    queries = [_query(q) for q in questions]
    results = await svc.batcher.call(
        lambda: engine.judge_shared(context, queries), svc.config.request_timeout_s
    )
    svc.metrics.batch_size.observe(len(queries))
    return BatchResponse(
        results=[
            _respond(svc, engine, r, q, p)
            for r, q, p in zip(results, questions, profiles, strict=True)
        ]
    )


async def _fit(svc: _Service, engine: Judge, name: str, data: FitRequest) -> CalibrationProfile:
    for i, example in enumerate(data.examples):
        if example.label not in data.choices:
            raise _BadField(
                f"examples[{i}].label",
                f"label {example.label!r} is not one of the choices {data.choices}",
            )
    queries = [
        Query(
            prompt=e.prompt,
            choices=list(data.choices),
            system=data.system,
            response_prefix=data.response_prefix,
            response_suffix=data.response_suffix,
        )
        for e in data.examples
    ]
    results: list[Judgment] = []
    step = svc.config.fit_chunk
    for start in range(0, len(queries), step):
        chunk = queries[start : start + step]
        # Chunks are separate jobs, so requests waiting meanwhile are served in between.
        results += await svc.batcher.call(
            functools.partial(engine.judge_batch, chunk), svc.config.request_timeout_s
        )
    logits = np.array([[r.logits[c] for c in data.choices] for r in results])
    labels = np.array([data.choices.index(e.label) for e in data.examples])
    digest = hashlib.sha256(msgspec.json.encode(data.examples)).hexdigest()

    def fit_now() -> CalibrationProfile:
        return fit_profile(
            name,
            logits,
            labels,
            data.choices,
            dtype=engine.dtype,
            **engine.configuration(
                system=data.system,
                response_prefix=data.response_prefix,
                response_suffix=data.response_suffix,
            ),
            dataset=f"POST /profiles/{name}/fit",
            dataset_sha256=digest,
            target_precision=data.target_precision,
            delta=data.delta,
            alpha=data.alpha,
        )

    return await anyio.to_thread.run_sync(fit_now)


# --- errors ---------------------------------------------------------------------------------


class _BadField(Exception):
    """A request that passed the schema but is still wrong in one field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# Domain error -> (status, field). The first matching class wins, so subclasses come first.
_STATUS: list[tuple[type[Exception], int, str | None]] = [
    (_BadField, 400, None),
    (ChoicesError, 400, "choices"),
    (InvalidQueryError, 400, "prompt"),
    (JudgeError, 422, "prompt"),  # too long for the model, or a tokenizer that cannot round-trip
    (ProfileNotFoundError, 404, "profile"),
    (ProfileMismatchError, 422, None),
    (ProfileError, 400, "profile"),
    (QueueFullError, 503, None),
    (TimeoutError, 503, None),
    (NotReadyError, 503, None),
]


def _error_body(exc: Exception) -> tuple[int, dict[str, Any]]:
    for cls, status, field_name in _STATUS:
        if isinstance(exc, cls):
            name = getattr(exc, "field", None) or field_name
            detail = str(exc)
            if isinstance(exc, TimeoutError):
                detail = "the request timed out waiting for the model; retry later"
            elif isinstance(exc, QueueFullError):
                detail = f"the server is at capacity ({exc}); retry later"
            body: dict[str, Any] = {"status_code": status, "detail": detail}
            if name:
                body["field"] = name
            return status, body
    return 500, {"status_code": 500, "detail": "Internal Server Error"}


Handler = Callable[[Request[Any, Any, Any], Any], Response[Any]]


def _error_handlers() -> dict[int | type[Exception], Handler]:
    def domain(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        status, body = _error_body(exc)
        if status >= 500:
            log.exception(
                "unexpected error on %s %s", request.method, request.url.path, exc_info=exc
            )
        headers = {"Retry-After": "1"} if status == 503 else None
        return Response(body, status_code=status, headers=headers)

    def validation(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        assert isinstance(exc, ValidationException)
        errors = exc.extra if isinstance(exc.extra, list) else []
        first = errors[0] if errors and isinstance(errors[0], dict) else {}
        key = first.get("key")
        named = re.search(r"field `([^`]+)`", str(first.get("message", "")))
        if named and key in (None, "data"):
            key = named.group(1)  # a missing or unknown field: name it, not the whole body
        detail = f"{key}: {first.get('message')}" if key else (first.get("message") or exc.detail)
        body = {"status_code": exc.status_code, "detail": detail, "field": key, "errors": errors}
        return Response(body, status_code=exc.status_code)

    def http(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        assert isinstance(exc, HTTPException)
        body: dict[str, Any] = {"status_code": exc.status_code, "detail": exc.detail}
        if exc.status_code in (400, 413):  # the body as a whole: not JSON, or too large
            body["field"] = "body"
        return Response(body, status_code=exc.status_code, headers=exc.headers)

    handlers: dict[int | type[Exception], Handler] = {cls: domain for cls, _, _ in _STATUS}
    handlers[ValidationException] = validation
    handlers[HTTPException] = http
    handlers[Exception] = domain
    return handlers


def _api_key_middleware(key: str) -> Callable[[ASGIApp], ASGIApp]:
    expected = f"Bearer {key}".encode()

    def wrap(app: ASGIApp) -> ASGIApp:
        async def check(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["path"] != "/health":
                given = dict(scope["headers"]).get(b"authorization", b"")
                if not hmac.compare_digest(given, expected):
                    body = msgspec.json.encode(
                        {
                            "status_code": 401,
                            "detail": "missing or wrong API key: send 'Authorization: Bearer <key>'",
                            "field": "Authorization",
                        }
                    )
                    headers: list[tuple[bytes, bytes]] = [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"www-authenticate", b"Bearer"),
                    ]
                    start: HTTPResponseStartEvent = {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": headers,
                    }
                    await send(start)
                    await send({"type": "http.response.body", "body": body, "more_body": False})
                    return
            await app(scope, receive, send)

        return check

    return wrap
