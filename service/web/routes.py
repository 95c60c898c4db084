"""The endpoints: each one decodes its body strictly and hands it to ``Service``.

Each handler serves the operation of its name in ``service.operations``, which says its
method, path, success status and options; ``ROUTES`` registers them from that table, and an
OPTIONS for each of its paths whose Allow lists the path's methods.

The ``service`` argument is the app's one ``Service``, injected by the app (see
``service.web.app``). Bodies are decoded by ``service.bodies`` (msgspec, strict), so a malformed
one is refused with a 4xx that names the field before any work; errors raised here become
responses in ``service.errors``. Route options tell the front door (``service.web.frontdoor``)
what a route needs: ``PUBLIC`` routes need no API key, ``MODEL`` routes take an admission
slot, and ``OPERATION`` is the route's operation, whose malformed path parameters and headers
the front door refuses before anything else (``Operation.refusal``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import anyio.to_thread
from litestar import Request, Response, route
from litestar.di import NamedDependency
from litestar.enums import HttpMethod
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath
from litestar.types import ControllerRouterHandler

import service.schemas as schemas
from calibration import CalibrationProfile
from calibration.profile import current_format
from service.bodies import decode_body, decode_each
from service.errors import BadFieldError, TooLargeError
from service.log.health import ProfileHealth
from service.log.health_history import HealthHistory
from service.log.record import LoggedDecision
from service.operations import (
    OPERATIONS,
    TIMEOUT_HEADER,
    Operation,
    allowed,
    paths,
    request_timeout,
)
from service.profiles import Preconditions
from service.systemone import SystemOneResponse, decode_request
from service.web.frontdoor import MODEL, OPERATION, PUBLIC
from service.web.openapi import openapi_document
from service.web.playground import PLAYGROUND_ROUTES
from service.web.serving import Service, Ticket

__all__ = ["HANDLERS", "ROUTES", "TIMEOUT_HEADER"]

METRICS_TYPE = "text/plain; version=0.0.4"

T = TypeVar("T")
AnyRequest = Request[Any, Any, Any]


async def _body(request: AnyRequest, type_: type[T]) -> T:
    return decode_body(await request.body(), request.headers.get("content-type"), type_)


async def _batch_body(request: AnyRequest) -> list[schemas.BatchItem] | schemas.SharedBatch:
    """The batch's body: one of its shapes, chosen by the keys it has, and its items each
    decoded as a whole request or an item alone, by theirs (``service.bodies``)."""
    batch: schemas.BatchRequest = decode_body(
        await request.body(), request.headers.get("content-type"), schemas.BatchRequest
    )
    if isinstance(batch, schemas.SharedBatch):
        return batch
    return decode_each(batch.items, schemas.BatchItem, "items")


def _ticket(service: Service, request: AnyRequest, limit_s: float | None = None) -> Ticket:
    """The request's deadline. The front door has refused a malformed X-Request-Timeout
    already (``Operation.refusal``); the handler still refuses one on its own."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return service.ticket(None, limit_s)
    try:
        timeout = request_timeout(raw)
    except ValueError as e:
        raise BadFieldError(TIMEOUT_HEADER, str(e)) from None
    return service.ticket(timeout, limit_s)


async def health() -> dict[str, str]:
    return {"status": "ok"}


async def health_head() -> None:
    return None


async def ready(service: NamedDependency[Service]) -> Response[dict[str, object]]:
    if service.loaded is not None:
        engine = service.loaded
        return Response(
            {
                "status": "ready",
                "model": engine.model_id,
                "dtype": engine.dtype,
                "batch_invariant": bool(getattr(engine, "batch_invariant", False)),
                **({"arithmetic": a} if (a := getattr(engine, "arithmetic", None)) else {}),
                # A cascade's stages, in order, this server's engine first.
                **(
                    {"cascade": [service.config.stage_name, *service.config.cascade]}
                    if service.config.cascade
                    else {}
                ),
            }
        )
    if service.failure:
        return Response({"status": "failed", "detail": service.failure}, status_code=503)
    return Response({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})


async def metrics(service: NamedDependency[Service]) -> Response[bytes]:
    return Response(service.render_metrics(), media_type=METRICS_TYPE)


async def judge(request: AnyRequest, service: NamedDependency[Service]) -> schemas.JudgeResponse:
    ticket = _ticket(service, request)
    # A prompt with choices, or a pair: told apart by the keys the body has.
    body: schemas.JudgeBody = decode_body(
        await request.body(), request.headers.get("content-type"), schemas.JudgeBody
    )
    if isinstance(body, schemas.PairRequest):
        return await service.systemone.pair(body, ticket)
    return await service.judging.judge(body, ticket)


async def judge_batch(
    request: AnyRequest, service: NamedDependency[Service]
) -> schemas.BatchResponse:
    ticket = _ticket(service, request)
    return await service.judging.judge_batch(await _batch_body(request), ticket)


async def systemone(request: AnyRequest, service: NamedDependency[Service]) -> SystemOneResponse:
    ticket = _ticket(service, request)
    body = decode_request(await request.body(), request.headers.get("content-type"))
    return await service.systemone.answer(body, ticket)


async def list_profiles(service: NamedDependency[Service]) -> list[schemas.ProfileSummary]:
    return service.profiles.summaries()


async def profile(
    name: FromPath[str], service: NamedDependency[Service]
) -> Response[CalibrationProfile]:
    profile, etag = service.store.get_tagged(name)
    return Response(profile, headers={"ETag": etag})


async def _limited_body(request: AnyRequest, limit: int, setting: str) -> bytes:
    """The whole body, or a 413 naming ``limit`` as soon as it is known to be over it."""
    over = TooLargeError(
        "body", f"the body is over this server's limit of {limit} bytes for it ({setting})"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise over
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise over
        chunks.append(chunk)
    return b"".join(chunks)


async def put_profile(
    name: FromPath[str], request: AnyRequest, service: NamedDependency[Service]
) -> Response[CalibrationProfile]:
    """Store a profile; ``If-Match: <etag>`` replaces only that version, ``If-None-Match: *``
    only creates. The compare and the write are one step in the store, under its lock."""
    body = await _limited_body(
        request, service.config.max_profile_bytes, "ServiceConfig.max_profile_bytes"
    )
    # Off the event loop: a probe's weights are up to megabytes of numbers to decode and check.
    # A profile saved by an earlier version (format 2) is read as this one, as files are.
    decode = functools.partial(
        decode_body, current_format(body), request.headers.get("content-type"), CalibrationProfile
    )
    profile = await anyio.to_thread.run_sync(decode)
    write = functools.partial(
        service.profiles.put,
        name,
        profile,
        Preconditions.of(request.headers),
    )
    etag = await anyio.to_thread.run_sync(write)  # may wait for another writer's lock
    return Response(profile, headers={"ETag": etag})


async def fit(
    name: FromPath[str], request: AnyRequest, service: NamedDependency[Service]
) -> CalibrationProfile:
    ticket = _ticket(service, request, service.config.fit_timeout_s)
    return await service.profiles.fit(name, await _body(request, schemas.FitRequest), ticket)


async def delete_profile(
    name: FromPath[str], request: AnyRequest, service: NamedDependency[Service]
) -> None:
    remove = functools.partial(service.store.delete, name, Preconditions.of(request.headers))
    await anyio.to_thread.run_sync(remove)


async def profile_versions(
    name: FromPath[str], service: NamedDependency[Service]
) -> schemas.ProfileVersions:
    return await anyio.to_thread.run_sync(service.profiles.versions, name)


async def rollback_profile(
    name: FromPath[str], request: AnyRequest, service: NamedDependency[Service]
) -> Response[CalibrationProfile]:
    """Store a kept version again; ``If-Match`` makes it replace only that current version."""
    body = await _body(request, schemas.RollbackRequest)
    rollback = functools.partial(
        service.store.rollback, name, body.etag, Preconditions.of(request.headers)
    )
    etag = await anyio.to_thread.run_sync(rollback)
    return Response(service.store.get(name), headers={"ETag": etag})


async def label_queue(name: FromPath[str], service: NamedDependency[Service]) -> schemas.LabelQueue:
    return await service.feedback.queue(name)


async def profile_health(name: FromPath[str], service: NamedDependency[Service]) -> ProfileHealth:
    return await service.feedback.health(name)


async def profile_health_history(
    name: FromPath[str], service: NamedDependency[Service]
) -> HealthHistory:
    return await service.feedback.history(name)


async def judgment(judgment_id: FromPath[str], service: NamedDependency[Service]) -> LoggedDecision:
    return await service.feedback.judgment(judgment_id)


async def label(
    judgment_id: FromPath[str], request: AnyRequest, service: NamedDependency[Service]
) -> schemas.LabelResult:
    return await service.feedback.label(judgment_id, await _body(request, schemas.LabelRequest))


async def labels(request: AnyRequest, service: NamedDependency[Service]) -> schemas.LabelsResponse:
    return await service.feedback.labels(await _body(request, schemas.LabelsRequest))


async def schema(service: NamedDependency[Service]) -> dict[str, Any]:
    return openapi_document(secured=service.config.api_key is not None)


async def schema_index() -> Response[None]:
    return Response(None, status_code=307, headers={"Location": "/schema/openapi.json"})


HANDLERS: dict[str, Callable[..., Any]] = {
    "health": health,
    "health_head": health_head,
    "ready": ready,
    "metrics": metrics,
    "judge": judge,
    "judge_batch": judge_batch,
    "systemone": systemone,
    "profiles": list_profiles,
    "profile": profile,
    "put_profile": put_profile,
    "delete_profile": delete_profile,
    "fit": fit,
    "profile_versions": profile_versions,
    "rollback_profile": rollback_profile,
    "label_queue": label_queue,
    "profile_health": profile_health,
    "profile_health_history": profile_health_history,
    "judgment": judgment,
    "label": label,
    "labels": labels,
    "schema": schema,
    "schema_index": schema_index,
}
# What a route needs beyond its operation: the app's body limit (max_body_bytes) is lifted for
# PUT /profiles/{name} alone, which reads its body under max_profile_bytes (room for a probe at
# MAX_PROBE_WEIGHTS, see ServiceConfig).
_EXTRA: dict[str, dict[str, Any]] = {
    "metrics": {"media_type": METRICS_TYPE},
    "put_profile": {"request_max_body_size": None},
}


def _opt(public: bool, model: bool = False) -> dict[str, Any]:
    return {key: True for key, on in ((PUBLIC, public), (MODEL, model)) if on}


def _handler(op: Operation) -> HTTPRouteHandler:
    """The operation's handler, registered as the table says."""
    return route(
        op.route,
        http_method=[HttpMethod(op.method)],
        status_code=op.ok[0],
        # The operation itself: the front door refuses what its schema refuses (see refusal).
        opt={**_opt(op.public, op.model), OPERATION: op},
        name=op.name,
        include_in_schema=False,  # the document is service.web.openapi's
        **_EXTRA.get(op.name, {}),
    )(HANDLERS[op.name])


def _options(path: str, operations: list[Operation]) -> HTTPRouteHandler:
    """OPTIONS for a path: Litestar's own lists only the first handler's method."""
    methods = allowed(path)

    async def options() -> Response[None]:
        return Response(None, status_code=204, headers={"Allow": methods})

    public = all(op.public for op in operations)
    route_path = operations[0].route
    return route(
        route_path,
        http_method=[HttpMethod.OPTIONS],
        opt=_opt(public),
        name=f"options {path}",
        include_in_schema=False,
    )(options)


if set(HANDLERS) != {op.name for op in OPERATIONS}:
    raise RuntimeError("service.web.routes.HANDLERS and service.operations.OPERATIONS differ")

ROUTES: list[ControllerRouterHandler] = [
    # First: a path's first handler decides its OPTIONS (see _options).
    *(_options(path, ops) for path, ops in paths().items()),
    *(_handler(op) for op in OPERATIONS),
    *PLAYGROUND_ROUTES,
]
