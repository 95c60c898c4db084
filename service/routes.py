"""The endpoints: each one decodes its body strictly and hands it to ``Service``.

The ``service`` argument is the app's one ``Service``, injected by the app (see
``service.app``). Bodies are decoded by ``service.bodies`` (msgspec, strict), so a malformed
one is refused with a 4xx that names the field before any work; errors raised here become
responses in ``service.errors``. Route options tell the front door (``service.frontdoor``)
what a route needs: ``PUBLIC`` routes need no API key, ``MODEL`` routes take an admission
slot. What each operation can answer is written once, in ``service.openapi``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, TypeVar

import anyio.to_thread
from litestar import Request, Response, delete, get, head, post, put, route
from litestar.di import NamedDependency
from litestar.enums import HttpMethod
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath
from litestar.types import ControllerRouterHandler

from calibration import CalibrationProfile
from service.bodies import decode_body
from service.errors import BadFieldError, TooLargeError
from service.frontdoor import MODEL, PUBLIC
from service.openapi import TIMEOUT_HEADER, openapi_document
from service.playground import PLAYGROUND_ROUTES
from service.profiles import parse_etags
from service.schemas import (
    BatchRequest,
    BatchResponse,
    FitRequest,
    JudgeRequest,
    JudgeResponse,
    ProfileSummary,
)
from service.serving import Service, Ticket

__all__ = ["ROUTES", "TIMEOUT_HEADER"]

METRICS_TYPE = "text/plain; version=0.0.4"

T = TypeVar("T")
AnyRequest = Request[Any, Any, Any]


async def _body(request: AnyRequest, type_: type[T]) -> T:
    return decode_body(await request.body(), request.headers.get("content-type"), type_)


def _ticket(service: Service, request: AnyRequest, limit_s: float | None = None) -> Ticket:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return service.ticket(None, limit_s)
    try:
        timeout = float(raw)
    except ValueError:
        timeout = math.nan
    if not (math.isfinite(timeout) and timeout > 0):
        raise BadFieldError(TIMEOUT_HEADER, f"must be a number of seconds > 0, got {raw!r}")
    return service.ticket(timeout, limit_s)


@get("/health", opt={PUBLIC: True})
async def health() -> dict[str, str]:
    return {"status": "ok"}


@head("/health", opt={PUBLIC: True})
async def health_head() -> None:
    return None


@get("/ready")
async def ready(service: NamedDependency[Service]) -> Response[dict[str, str]]:
    if service.loaded is not None:
        engine = service.loaded
        return Response({"status": "ready", "model": engine.model_id, "dtype": engine.dtype})
    if service.failure:
        return Response({"status": "failed", "detail": service.failure}, status_code=503)
    return Response({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})


@get("/metrics", media_type=METRICS_TYPE)
async def metrics(service: NamedDependency[Service]) -> Response[bytes]:
    return Response(service.render_metrics(), media_type=METRICS_TYPE)


@post("/judge", status_code=200, opt={MODEL: True})
async def judge_one(request: AnyRequest, service: NamedDependency[Service]) -> JudgeResponse:
    ticket = _ticket(service, request)
    return await service.judge(await _body(request, JudgeRequest), ticket)


@post("/judge/batch", status_code=200, opt={MODEL: True})
async def judge_batch(request: AnyRequest, service: NamedDependency[Service]) -> BatchResponse:
    ticket = _ticket(service, request)
    return await service.judge_batch(await _body(request, BatchRequest), ticket)


@get("/profiles")
async def list_profiles(service: NamedDependency[Service]) -> list[ProfileSummary]:
    return service.profile_summaries()


@get("/profiles/{name:str}")
async def get_profile(
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


# The app's body limit (max_body_bytes) is lifted for this route alone, which reads its body
# under max_profile_bytes: room for a probe at MAX_PROBE_WEIGHTS, see ServiceConfig.
@put("/profiles/{name:str}", status_code=200, request_max_body_size=None)
async def put_profile(
    name: FromPath[str], request: AnyRequest, service: NamedDependency[Service]
) -> Response[CalibrationProfile]:
    """Store a profile; ``If-Match: <etag>`` replaces only that version, ``If-None-Match: *``
    only creates. The compare and the write are one step in the store, under its lock."""
    body = await _limited_body(
        request, service.config.max_profile_bytes, "ServiceConfig.max_profile_bytes"
    )
    # Off the event loop: a probe's weights are up to megabytes of numbers to decode and check.
    decode = functools.partial(
        decode_body, body, request.headers.get("content-type"), CalibrationProfile
    )
    profile = await anyio.to_thread.run_sync(decode)
    write = functools.partial(
        service.put_profile,
        name,
        profile,
        if_match=parse_etags(request.headers.get("if-match")),
        if_none_match=parse_etags(request.headers.get("if-none-match")),
    )
    etag = await anyio.to_thread.run_sync(write)  # may wait for another writer's lock
    return Response(profile, headers={"ETag": etag})


@post("/profiles/{name:str}/fit", status_code=200, opt={MODEL: True})
async def fit(
    name: FromPath[str], request: AnyRequest, service: NamedDependency[Service]
) -> CalibrationProfile:
    ticket = _ticket(service, request, service.config.fit_timeout_s)
    return await service.fit(name, await _body(request, FitRequest), ticket)


@delete("/profiles/{name:str}", status_code=204)
async def delete_profile(
    name: FromPath[str], request: AnyRequest, service: NamedDependency[Service]
) -> None:
    remove = functools.partial(
        service.store.delete, name, if_match=parse_etags(request.headers.get("if-match"))
    )
    await anyio.to_thread.run_sync(remove)


def _options(path: str, methods: str, opt: dict[str, Any] | None = None) -> HTTPRouteHandler:
    """OPTIONS for a path with several handlers: Litestar's own lists only the first's method."""

    async def options() -> Response[None]:
        return Response(None, status_code=204, headers={"Allow": methods})

    return route(path, http_method=[HttpMethod.OPTIONS], opt=opt or {}, name=f"options {path}")(
        options
    )


@get("/schema/openapi.json")
async def schema(service: NamedDependency[Service]) -> dict[str, Any]:
    return openapi_document(secured=service.config.api_key is not None)


@get("/schema")
async def schema_index() -> Response[None]:
    return Response(None, status_code=307, headers={"Location": "/schema/openapi.json"})


ROUTES: list[ControllerRouterHandler] = [
    # First: a path's first handler decides its OPTIONS (see _options).
    _options("/health", "GET, HEAD, OPTIONS", {PUBLIC: True}),
    _options("/profiles/{name:str}", "DELETE, GET, OPTIONS, PUT"),
    health,
    health_head,
    ready,
    metrics,
    judge_one,
    judge_batch,
    list_profiles,
    get_profile,
    put_profile,
    fit,
    delete_profile,
    schema,
    schema_index,
    *PLAYGROUND_ROUTES,
]
