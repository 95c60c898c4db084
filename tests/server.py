"""Start the real service in its own process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
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

    def wait_ready(self, timeout: float = READY_S) -> None:
        self.wait_ready_with({}, timeout)

    def wait_ready_with(self, headers: dict[str, str], timeout: float = READY_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited: {self.output()}")
            try:
                status = httpx.get(f"{self.url}/ready", headers=headers, timeout=5).status_code
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            self.ready_statuses.append(status)
            if status == 200:
                return
            time.sleep(0.05)
        raise AssertionError("server never became ready")

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


def wait_app_ready(client: Any) -> None:
    """Poll an in-process app's ``/ready`` (a litestar TestClient) until it answers 200, for
    up to 600 tries 0.05 s apart; the assertion says what ``/ready`` last answered."""
    for _ in range(600):
        if client.get("/ready").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(f"the app never became ready: {client.get('/ready').json()}")
