"""Start the real service in its own process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

# A watchdog, not a speed: a server that has not answered /ready in this long is hung. Loading
# the model takes seconds, a minute or more on a slow machine shared with other jobs.
READY_S = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, command: Sequence[str], port: int, cwd: str | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.ready_statuses: list[int] = []
        # Its own process group, so that stopping it also stops what `make` started.
        self.process = subprocess.Popen(
            list(command),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def wait_ready(self, headers: dict[str, str] | None = None, timeout: float = READY_S) -> None:
        """Until ``/ready`` answers 200 (``headers``: a key the server needs); each status
        it answered on the way is kept in ``ready_statuses``."""

        def exited() -> str | None:
            return None if self.process.poll() is None else f"server exited: {self.output()}"

        wait_url_ready(self.url, headers, exited=exited, seen=self.ready_statuses, timeout=timeout)

    def stop(self, wait_s: float = 30) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``wait_s``."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(wait_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)

    def output(self) -> str:
        self.stop()
        assert self.process.stdout is not None
        return self.process.stdout.read().decode(errors="replace")[-4000:]


def wait_url_ready(
    url: str,
    headers: dict[str, str] | None = None,
    *,
    exited: Callable[[], str | None] = lambda: None,
    seen: list[int] | None = None,
    timeout: float = READY_S,
) -> None:
    """Poll a live server's ``/ready`` at ``url`` until it answers 200: the one poll every
    test of a served process uses. ``exited`` says why the server is gone (None while it
    runs); ``seen`` collects each status answered; ``timeout`` is a watchdog, not a speed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gone = exited()
        if gone is not None:
            raise AssertionError(gone)
        try:
            status = httpx.get(f"{url}/ready", headers=headers, timeout=5).status_code
        except httpx.TransportError:
            time.sleep(0.1)
            continue
        if seen is not None:
            seen.append(status)
        if status == 200:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server at {url} did not become ready within {timeout:.0f} s")


def settled(client: Any, headers: dict[str, str] | None = None) -> Any:
    """An in-process app's (a litestar TestClient's) ``/ready`` once loading is over, ready
    or failed: the one poll every in-process test uses (``READY_S``: a watchdog)."""
    deadline = time.monotonic() + READY_S
    while (ready := client.get("/ready", headers=headers)).json()["status"] == "loading":
        assert time.monotonic() < deadline, "the app never finished loading"
        time.sleep(0.05)
    return ready


def wait_app_ready(client: Any, headers: dict[str, str] | None = None) -> Any:
    """``settled``, which must be ready; returns the client, for chaining."""
    ready = settled(client, headers)
    assert ready.status_code == 200, f"the app never became ready: {ready.json()}"
    return client
