"""The HTTP service: ``create_app(engine)`` builds the Litestar app around an engine.

The engine comes in from outside, as anything that satisfies ``judge.Engine``: the CLI hands in
a loader for the real model (so the server answers /health and /ready while it loads), tests
may hand in a loaded engine or a fake. This module only wires the pieces together:

    service.config    ServiceConfig, the server's settings, checked once
    service.web.frontdoor before routing: API key, a malformed path parameter or header,
                      admission, read timeout, clients that leave
    service.operations the table of operations: routes, OpenAPI, metric labels, client paths
    service.web.routes    the endpoints, thin, registered from the table
    service.bodies    strict decoding of request bodies
    service.schemas   request and response bodies (msgspec Structs)
    service.web.openapi   the OpenAPI document, derived from the table, every status of each
    service.web.serving   the Service the endpoints call: the shared core (ServiceCore: engine,
                      store, gates, batcher) and its judging, System One, profile, feedback
                      and cascade families
    service.web.batcher   model work on one thread, single judgments coalesced into batches
    service.profiles  profiles on disk, one JSON file each
    service.errors    every error's status code and body, in one table
    service.metrics   Prometheus metrics, as ASGI middleware
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio.to_thread
from litestar import Litestar
from litestar.di import Provide
from litestar.exceptions import HTTPException
from litestar.utils import normalize_path

from judge import Engine
from service.config import ServiceConfig
from service.errors import exception_handlers
from service.web.frontdoor import FrontDoor, Route
from service.web.routes import ROUTES
from service.web.serving import Service

__all__ = ["ServiceConfig", "create_app"]


def create_app(
    engine: Engine | None = None,
    *,
    loader: Callable[[], Engine] | None = None,
    config: ServiceConfig | None = None,
) -> Litestar:
    """Build the app around ``engine``, or around whatever ``loader`` returns once it has run."""
    if engine is not None and loader is None:
        load = _returning(engine)
    elif loader is not None and engine is None:
        load = loader
    else:
        raise ValueError("pass exactly one of engine and loader")
    config = config or ServiceConfig()
    service = Service(config)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        service.batcher.start()
        loading = asyncio.get_running_loop().create_task(service.warm_up(load))
        try:
            yield
        finally:
            loading.cancel()
            await service.batcher.stop()
            if service.refitter is not None:  # a refit under way finishes first
                await anyio.to_thread.run_sync(service.refitter.close)
            if service.shift_watch is not None:  # and a check of the class mix
                await anyio.to_thread.run_sync(service.shift_watch.close)
            if service.decision_log is not None:
                service.decision_log.close()  # every decision in it was committed when made

    def provide_service() -> Service:
        return service

    app = Litestar(
        route_handlers=ROUTES,
        # One service for the app's life: cached, so no request calls the provider again.
        dependencies={"service": Provide(provide_service, sync_to_thread=False, use_cache=True)},
        lifespan=[lifespan],
        exception_handlers=exception_handlers(),
        request_max_body_size=config.max_body_bytes,
        openapi_config=None,  # the document is service.web.openapi's, served by a route
    )

    @functools.lru_cache(maxsize=4096)  # bounded: paths come from clients
    def route(path: str, method: str) -> Route:
        """The route that will handle this request: its options and path parameters, as the
        router finds them for the handler; no options when no route will."""
        try:
            _, handler, _, parameters, _ = app.asgi_router.handle_routing(
                path=normalize_path(path), method=method
            )
        except HTTPException:  # no such path or method: Litestar answers it, after the key
            return Route({}, {})
        return Route(handler.opt, parameters)

    app.asgi_handler = FrontDoor(
        app.asgi_handler,
        route=route,
        metrics=service.metrics,
        admission=service.admission,
        api_key=config.api_key,
        read_timeout_s=config.read_timeout_s,
    )
    return app


def _returning(engine: Engine) -> Callable[[], Engine]:
    return lambda: engine
