"""The HTTP service: ``create_app(engine)`` builds the Litestar app around an engine.

The engine comes in from outside, as anything that satisfies ``judge.Engine``: the CLI hands in
a loader for the real model (so the server answers /health and /ready while it loads), tests
may hand in a loaded engine or a fake. This module only wires the pieces together:

    service.config    ServiceConfig, the server's settings, checked once
    service.routes    the endpoints, thin
    service.schemas   request and response bodies (msgspec Structs)
    service.serving   what the endpoints do: profile checks, the policy, the batcher, fitting
    service.batcher   model work on one thread, single judgments coalesced into batches
    service.profiles  profiles on disk, one JSON file each
    service.errors    every error's status code and body, in one table
    service.auth      the API key, as a guard
    service.metrics   Prometheus metrics, as ASGI middleware
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components

import judge
from judge import Engine
from service.auth import api_key_guard, security_components, security_requirement
from service.config import ServiceConfig
from service.errors import exception_handlers
from service.routes import ROUTES
from service.serving import Service

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

    def provide_service() -> Service:
        return service

    key = config.api_key
    return Litestar(
        route_handlers=ROUTES,
        dependencies={"service": Provide(provide_service, sync_to_thread=False)},
        guards=[api_key_guard(key)] if key else [],
        lifespan=[lifespan],
        middleware=[service.metrics.middleware],
        exception_handlers=exception_handlers(),
        request_max_body_size=config.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="judge",
            version=judge.__version__,
            path="/schema",
            components=security_components() if key else Components(),
            security=security_requirement() if key else None,
        ),
    )


def _returning(engine: Engine) -> Callable[[], Engine]:
    return lambda: engine
