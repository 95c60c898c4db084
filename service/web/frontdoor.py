"""The front door: what every HTTP request goes through before routing, and after it leaves.

An ASGI layer around the Litestar app (see ``service.web.app``), because all of this must happen
before the app reads, parses or routes anything:

- **API key** (when set), on every path but the public ones (``/health``, the playground), so
  that unknown paths answer 401 like known ones and routes cannot be enumerated without the
  key. ``Authorization: Bearer <key>``; the scheme is case-insensitive (RFC 7235).
- **What the schema refuses before the body**: a path parameter that breaks its pattern, or a
  malformed X-Request-Timeout (``Operation.refusal`` of the route's operation), is a 400 naming
  it, before admission and before the body is read: neither a full server (503) nor a body over
  the size limit (413) can answer for it.
- **Admission.** A request that needs the model (a route with ``opt={MODEL: True}``) takes
  one of ``max_queue`` slots before its body is read. When none is free it waits at the door,
  unread, for up to ``admission_wait_s``, then gets a 503 with Retry-After. Clients that retry
  at once therefore cost one cheap refusal per wait, not one per round trip, and the CPU stays
  with the model (an instant 503 let 64 retrying clients cost more CPU than the model's own
  work).
- **Read timeout.** The whole body must arrive within ``read_timeout_s``, else 408: a slow
  client cannot hold a slot.
- **Clients that leave.** Once the body is in, the connection is watched; when the client
  disconnects, the request's task is cancelled, which drops its queued model work (see
  ``service.web.batcher``) and stops a fit before it writes anything.
- **Metrics**: every response by method, route and status; 499 for a client that left.
- **Which replica answered**: every response carries ``X-Judge-Replica: <host>:<pid>``, so
  behind a balancer (``service.web.ray_serve``) a client or a test can tell replicas apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from service.metrics import ServiceMetrics

if TYPE_CHECKING:
    from service.operations import Operation

__all__ = [
    "MODEL",
    "OPERATION",
    "PUBLIC",
    "REPLICA_HEADER",
    "Admission",
    "FrontDoor",
    "Route",
    "bearer_token",
]

PUBLIC = "public"  # route opt: no API key needed
MODEL = "model"  # route opt: needs the model, so it is admitted through the slots
OPERATION = "operation"  # route opt: the service.operations.Operation the route serves
CLIENT_CLOSED = 499  # the status recorded for a client that left before its response
REPLICA_HEADER = "X-Judge-Replica"


class _Abandon(BaseException):
    """Raised inside the app's task when its client is gone or too slow: nothing to answer.

    A BaseException, so that the app's own exception handling (which catches Exception) does
    not turn it into a 500 for nobody.
    """


class Admission:
    """``slots`` requests at once; the rest wait their turn, in order, for up to ``wait_s``."""

    def __init__(self, slots: int, wait_s: float) -> None:
        self._slots = asyncio.Semaphore(slots)
        self.wait_s = wait_s
        self.waiting = 0
        self.refused = 0

    async def enter(self) -> bool:
        if not self._slots.locked():
            await self._slots.acquire()
            return True
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), self.wait_s)
            return True
        except TimeoutError:
            self.refused += 1
            return False
        finally:
            self.waiting -= 1

    def leave(self) -> None:
        self._slots.release()


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (any case of the scheme)."""
    value = next((v.decode("latin-1") for k, v in headers if k.lower() == b"authorization"), "")
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class Route(NamedTuple):
    """The route that will handle a request, as the app's router finds it."""

    opt: Mapping[str, Any]  # its options; empty when no route will handle the request
    parameters: Mapping[str, Any]  # its path parameters, as the router parsed them


@dataclass
class _Exchange:
    """What happened to one request so far."""

    body_done: bool = False
    started: bool = False  # the response has begun
    finished: bool = False  # the response has been sent in full
    gone: bool = False  # the client disconnected first
    slow: bool = False  # the body did not arrive in time
    status: int = 500


class FrontDoor:
    def __init__(
        self,
        app: ASGIApp,
        *,
        route: Callable[[str, str], Route],
        metrics: ServiceMetrics,
        admission: Admission,
        api_key: str | None,
        read_timeout_s: float,
        replica: str | None = None,
    ) -> None:
        self.app = app
        # This process, unless the caller names it otherwise: one process is one replica.
        name = replica or f"{socket.gethostname()}:{os.getpid()}"
        self._replica = (REPLICA_HEADER.lower().encode(), name.encode("latin-1"))
        self.route = route
        self.metrics = metrics
        self.admission = admission
        self.key = api_key
        self.read_timeout_s = read_timeout_s
        self.abandoned = 0  # requests whose client left before the response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        exchange = _Exchange()
        # Routed once: its options here, and its operation's path template the metric's label.
        route = self.route(scope["path"], str(scope.get("method", "")))
        operation: Operation | None = route.opt.get(OPERATION)

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.started, exchange.status = True, message["status"]
                message = {**message, "headers": [*message.get("headers", ()), self._replica]}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                exchange.finished = True
            await send(message)

        try:
            await self._handle(scope, receive, tracked, exchange, route)
        finally:
            status = exchange.status if exchange.started else CLIENT_CLOSED
            label = "other" if operation is None else operation.path
            self.metrics.observe(str(scope.get("method", "?")), label, status, start)

    async def _handle(
        self, scope: Scope, receive: Receive, send: Send, exchange: _Exchange, route: Route
    ) -> None:
        opt = route.opt
        if self.key is not None and not opt.get(PUBLIC) and not self._authorized(scope):
            await _reply(
                send,
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                "Authorization",
                {"WWW-Authenticate": "Bearer"},
            )
            return
        operation: Operation | None = opt.get(OPERATION)
        if operation is not None:
            refused = operation.refusal(route.parameters, _headers(scope))
            if refused is not None:
                field, detail = refused
                await _reply(send, 400, detail, field, {})
                return
        if not opt.get(MODEL):
            await self._run(scope, receive, send, exchange)
            return
        if not await self.admission.enter():
            await _reply(
                send,
                503,
                "the server is at capacity: every slot for model work stayed busy for "
                f"{self.admission.wait_s:g} s; retry later",
                None,
                {"Retry-After": "1"},
            )
            return
        try:
            await self._run(scope, receive, send, exchange)
        finally:
            self.admission.leave()

    def _authorized(self, scope: Scope) -> bool:
        token = bearer_token(scope["headers"])
        assert self.key is not None
        return token is not None and hmac.compare_digest(token.encode(), self.key.encode())

    async def _run(self, scope: Scope, receive: Receive, send: Send, exchange: _Exchange) -> None:
        """Run the app in a task of its own, cancelled if the client leaves or is too slow."""
        deadline: float | None = None
        watcher: asyncio.Task[None] | None = None

        async def watch() -> None:
            while True:  # after the body, the server's next message is the disconnect
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not exchange.finished:
                        exchange.gone = True
                        work.cancel()
                    return

        async def body() -> Any:
            nonlocal deadline, watcher
            if exchange.body_done:  # the app asks again: nothing more will come
                await asyncio.Future()  # until the watcher cancels the task, or the response ends
            deadline = deadline or time.monotonic() + self.read_timeout_s
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except TimeoutError:
                exchange.slow = True
                raise _Abandon from None
            if message["type"] == "http.disconnect":
                exchange.gone = True
                raise _Abandon
            if not message.get("more_body"):
                exchange.body_done = True
                watcher = asyncio.get_running_loop().create_task(watch())
            return message

        work: asyncio.Task[None] = asyncio.get_running_loop().create_task(
            _call(self.app, scope, body, send)
        )
        stopping = False
        try:
            await asyncio.shield(work)
        except (_Abandon, asyncio.CancelledError):
            if not (exchange.gone or exchange.slow) or not work.done():
                # This request itself was cancelled: the server is stopping and its grace
                # period is over. Drop the work, and answer for it below.
                work.cancel()
                stopping = True
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
        if exchange.gone:
            self.abandoned += 1
        elif stopping:
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()  # handled: a 503 is the answer, not a traceback and a 500
            if not exchange.started:
                await _reply(
                    send,
                    503,
                    "the server is shutting down; retry, on another replica or once it is back",
                    None,
                    {"Retry-After": "1", "Connection": "close"},
                )
        elif exchange.slow and not exchange.started:
            await _reply(
                send,
                408,
                f"the request body did not arrive within {self.read_timeout_s:g} s",
                "body",
                {"Connection": "close"},
            )


def _headers(scope: Scope) -> dict[str, str]:
    """The request's headers by lowercased name; the first of a repeated one, as the app reads."""
    out: dict[str, str] = {}
    for name, value in scope["headers"]:
        out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return out


async def _call(app: ASGIApp, scope: Scope, receive: Any, send: Send) -> None:
    await app(scope, receive, send)


async def _reply(
    send: Send, status: int, detail: str, field: str | None, headers: Mapping[str, str]
) -> None:
    body: dict[str, Any] = {"status_code": status, "detail": detail}
    if field is not None:
        body["field"] = field
    data = msgspec.json.encode(body)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data, "more_body": False})
