"""The same Litestar app on Ray Serve: replicas behind one endpoint, scaled by count or load.

An optional extra (``ray``: ``service.install.install_hint('ray')``); nothing else in the project imports ray.

Each replica is one Ray actor, one process, that builds the whole app itself with
``create_app(loader=...)``: its own engine, batcher, admission and metrics. Ray's proxy takes
HTTP on one port and hands each request to a replica (Ray Serve's ``serve.ingress`` accepts
any ASGI app built at replica start; a non-FastAPI app is run as it is, and its lifespan
startup and shutdown are run by uvicorn's ``LifespanOn``, see
``ray/serve/_private/http_util.py:ASGIAppReplicaWrapper``).

Readiness stays honest. The app's lifespan starts loading the model in the background (as in
one process, where ``/ready`` answers 503 until then); here ``_UntilReady`` holds back the
lifespan's "startup complete" until the app's own ``/ready`` answers 200, so Ray counts a
replica as started, and routes to it, only once its model is loaded and has judged once. A
replica whose model fails to load fails its start (Ray retries it). Ray's periodic health
check asks the same ``/ready``.

Profiles: every replica must see the same ones, so a plain directory in the config becomes a
``SharedDirectory`` at its absolute path (``service.profiles``): each lookup notices a change
made by any replica, and writes compare and swap under a lock in that directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from judge import Engine
from service.config import ServiceConfig
from service.install import install_hint
from service.profiles import SharedDirectory
from service.web.app import create_app

__all__ = ["INSTALL_HINT", "Scaling", "application", "check_ray", "run"]

log = logging.getLogger("judge.service")

INSTALL_HINT = f"Ray Serve is not installed: {install_hint('ray')}"
APP_NAME = "judge"


@dataclass(frozen=True)
class Scaling:
    """How many replicas, and what each one gets.

    ``replicas`` fixes the count; ``min_replicas``/``max_replicas`` (with
    ``target_ongoing_requests``) let Ray's autoscaler choose it by load instead.
    """

    replicas: int | None = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    replica_cpus: float = 1.0
    # How long a replica may take to load its model and judge once before its start fails.
    load_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        autoscaled = self.min_replicas is not None or self.max_replicas is not None
        if autoscaled and self.replicas is not None:
            raise ValueError("give either replicas, or min_replicas/max_replicas, not both")
        if not autoscaled and self.replicas is None:
            raise ValueError("give replicas, or min_replicas and max_replicas")
        if not autoscaled and self.target_ongoing_requests is not None:
            raise ValueError("target_ongoing_requests needs min_replicas/max_replicas")
        for name in ("replicas", "max_replicas"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.min_replicas is not None and (
            not isinstance(self.min_replicas, int) or self.min_replicas < 0
        ):
            raise ValueError(f"min_replicas must be a whole number >= 0, got {self.min_replicas!r}")
        if autoscaled:
            low, high = self.min_replicas or 0, self.max_replicas or max(self.min_replicas or 1, 1)
            if high < max(low, 1):
                raise ValueError(
                    f"max_replicas ({self.max_replicas}) must be at least min_replicas ({low}) "
                    "and at least 1"
                )
        for name in ("replica_cpus", "target_ongoing_requests", "load_timeout_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")

    def deployment_options(self, config: ServiceConfig) -> dict[str, Any]:
        """Keyword arguments for ``serve.deployment(...).options``."""
        options: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": self.replica_cpus},
            # As many requests at a replica as its front door admits: the rest wait in Ray's
            # router for a free replica instead of at a busy one's door.
            "max_ongoing_requests": config.max_queue,
            "health_check_period_s": 5.0,
            "health_check_timeout_s": 30.0,
        }
        if self.replicas is not None:
            options["num_replicas"] = self.replicas
        else:
            low = self.min_replicas or 0
            autoscaling: dict[str, Any] = {
                "min_replicas": low,
                "max_replicas": self.max_replicas or max(low, 1),
                "initial_replicas": max(low, 1),
            }
            if self.target_ongoing_requests is not None:
                autoscaling["target_ongoing_requests"] = self.target_ongoing_requests
            options["autoscaling_config"] = autoscaling
        return options


def check_ray() -> None:
    """Raise ImportError with the install command when Ray Serve is missing."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc


def shared_config(config: ServiceConfig) -> ServiceConfig:
    """The config with its profiles in a SharedDirectory at an absolute path.

    Absolute because a replica's working directory is Ray's, not the caller's.
    """
    location = config.profiles_dir
    if isinstance(location, Path):
        location = SharedDirectory(location.resolve())
    return dataclasses.replace(config, profiles_dir=location)


class _UntilReady:
    """An ASGI layer that reports lifespan startup complete only once ``/ready`` says 200."""

    def __init__(self, app: ASGIApp, api_key: str | None, timeout_s: float) -> None:
        self.app = app
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s

    async def ready(self) -> tuple[int, dict[str, Any]]:
        """The app's own answer to GET /ready, asked in this process."""
        transport = httpx.ASGITransport(app=self.app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            r = await client.get("/ready", headers=self.headers)
        return r.status_code, r.json()

    async def wait(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            status, body = await self.ready()
            if status == 200:
                return
            if body.get("status") == "failed":
                raise RuntimeError(f"the model failed to load: {body.get('detail')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the model did not load within {self.timeout_s:g} s")
            await asyncio.sleep(0.1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def gated(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                try:
                    await self.wait()
                except (RuntimeError, TimeoutError) as exc:
                    message = {"type": "lifespan.startup.failed", "message": str(exc)}
            await send(message)

        await self.app(scope, receive, gated)


def application(
    loader: Callable[[], Engine],
    config: ServiceConfig | None = None,
    scaling: Scaling | None = None,
) -> Any:
    """The Ray Serve application (``Deployment.bind()``), for ``serve.run``.

    ``loader`` runs in each replica (it is pickled there), so it must be importable or
    picklable: ``functools.partial(Judge.load, ..., **config.engine_options)`` is. The engine
    must pack to the server's ``max_batch_tokens`` (``engine_options``), or the replica's
    model fails to load and so does its start.
    """
    check_ray()
    from ray import serve

    config = shared_config(config or ServiceConfig())
    plan = scaling or Scaling()

    @serve.ingress()
    class JudgeReplica:
        """One replica: the app, built in the replica's own process with its own engine."""

        def __init__(self, loader: Callable[[], Engine], config: ServiceConfig) -> None:
            self._gate = _UntilReady(
                create_app(loader=loader, config=config), config.api_key, plan.load_timeout_s
            )

        def __serve_build_asgi_app__(self) -> ASGIApp:
            return self._gate

        async def check_health(self) -> None:
            """Ray's health check: the app's own readiness, asked in this process."""
            status, body = await self._gate.ready()
            if status != 200:
                raise RuntimeError(f"not ready: {body}")

    deployment = serve.deployment(name="JudgeReplica", **plan.deployment_options(config))
    return deployment(JudgeReplica).bind(loader, config)


def run(
    loader: Callable[[], Engine],
    config: ServiceConfig,
    scaling: Scaling,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
) -> None:
    """Serve on Ray until interrupted: join the cluster at ``address``, else start a local one."""
    check_ray()
    import ray
    from ray import serve

    ray.init(address=address, include_dashboard=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application(loader, config, scaling), name=APP_NAME, route_prefix="/")
        log.info("serving on http://%s:%d with Ray Serve", host, port)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
