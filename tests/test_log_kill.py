"""A kill -9 of the server loses no decision whose response was sent.

The service appends a request's decisions to its decision log, committed, before the
response leaves (``Service._log``). So with clients sending ``POST /judge`` and
``POST /judge/batch`` as fast as they can, a SIGKILL of the server's process group in the
middle of the traffic must leave every judgment_id a client received in a 200 in the log, as
the response said it was decided, and the log must open cleanly afterwards.

The server is real (uvicorn, in its own process group) and the log is SQLite in WAL mode with
``synchronous=NORMAL``, the default. The engine is a fake, the mechanics being under test: P(yes)
is the number after "p=" in the prompt, so the traffic holds both accepted and escalated
decisions.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server import Server, free_port

from service.log.backends import open_log

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
CLIENTS = 6
ACKNOWLEDGED = 400  # decisions the clients hold before the kill
DEADLINE_S = 300  # a watchdog only: the test waits for a count, not for time

SERVER = """
import sys
from pathlib import Path

import uvicorn
from fakes import FakeEngine, judgment_of

from service import ServiceConfig, create_app


class ScoreEngine(FakeEngine):
    def judgment(self, query):
        _, marked, number = query.prompt.rpartition("p=")
        p = float(number) if marked else 0.5  # the warm-up's prompt has no number
        probabilities = {"yes": p, "no": 1 - p}
        return judgment_of({c: probabilities[c] for c in query.choices}, prompt=query.prompt)


profiles, decision_log, port = sys.argv[1:]
config = ServiceConfig(profiles_dir=Path(profiles), decision_log=decision_log)
app = create_app(ScoreEngine(), config=config)
uvicorn.run(app, host="127.0.0.1", port=int(port), log_level="warning", access_log=False)
"""


class Traffic:
    """What the clients hold: each acknowledged decision (id -> choice and decision), and how
    many requests are in flight; shared by the client threads under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acknowledged: dict[str, tuple[str, str]] = {}
        self.duplicates: list[str] = []
        self.in_flight = 0
        self.killed = threading.Event()
        self.stop = threading.Event()
        self.enough = threading.Event()  # ACKNOWLEDGED reached
        self.unexpected: list[str] = []  # anything but a 200 before the kill
        self.requests = 0

    def acknowledge(self, results: list[dict[str, Any]]) -> None:
        with self.lock:
            for result in results:
                judgment_id = result["judgment_id"]
                if judgment_id in self.acknowledged:
                    self.duplicates.append(judgment_id)
                self.acknowledged[judgment_id] = (result["choice"], result["decision"])
            if len(self.acknowledged) >= ACKNOWLEDGED:
                self.enough.set()


def item(rng: random.Random) -> dict[str, Any]:
    return {
        "prompt": f"Is it so? p={rng.choice([0.02, 0.3, 0.6, 0.95, 0.99])}",
        "choices": ["yes", "no"],
        # No profile here: the opt-in threshold lets raw confidence accept, so both kinds occur.
        "uncertified_threshold": 0.9,
    }


def client(url: str, traffic: Traffic, seed: int) -> None:
    """Send judgments and batches of 1-5 until stopped; keep the ids of full 200 responses."""
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=DEADLINE_S) as http:
        while not traffic.stop.is_set():
            size = rng.randint(0, 5)  # 0: POST /judge; else a batch of that many items
            with traffic.lock:
                traffic.in_flight += 1
                traffic.requests += 1
            try:
                if size == 0:
                    response = http.post("/judge", json=item(rng))
                else:
                    items = [item(rng) for _ in range(size)]
                    response = http.post("/judge/batch", json={"items": items})
                status, body = response.status_code, response.json()  # read in full
            except httpx.TransportError as exc:
                if not traffic.killed.is_set():
                    traffic.unexpected.append(f"{type(exc).__name__}: {exc}")
                return  # the server is gone
            finally:
                with traffic.lock:
                    traffic.in_flight -= 1
            if status != 200:
                if not traffic.killed.is_set():
                    traffic.unexpected.append(f"{status}: {body}")
                continue
            results = [body] if size == 0 else body["results"]
            if any(r.get("type") != "judgment" for r in results):
                traffic.unexpected.append(f"an item failed: {body}")
            traffic.acknowledge([r for r in results if r.get("type") == "judgment"])


def test_kill_9_loses_no_decision_whose_response_was_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "log.db"
    (tmp_path / "profiles").mkdir()
    path_env = os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path_env)  # the server process imports the fakes
    port = free_port()
    command = [sys.executable, "-c", SERVER, str(tmp_path / "profiles"), str(path), str(port)]
    server = Server(command, port, cwd=str(ROOT))
    traffic = Traffic()
    threads = [
        threading.Thread(target=client, args=(server.url, traffic, seed), daemon=True)
        for seed in range(CLIENTS)
    ]
    try:
        server.wait_ready()
        for thread in threads:
            thread.start()
        assert traffic.enough.wait(DEADLINE_S), (
            f"the clients got {len(traffic.acknowledged)} decisions, not {ACKNOWLEDGED}: "
            f"{traffic.unexpected[:3]}"
        )
        # Kill at a moment when requests are in flight (with six clients, at once).
        in_flight, deadline = 0, time.monotonic() + DEADLINE_S
        while not in_flight and time.monotonic() < deadline:
            with traffic.lock:
                in_flight = traffic.in_flight
                if in_flight:
                    traffic.killed.set()
                    os.killpg(server.process.pid, signal.SIGKILL)
        assert in_flight, f"no request in flight to kill: {traffic.unexpected[:3]}"
        traffic.stop.set()
        for thread in threads:
            thread.join(DEADLINE_S)
        assert server.process.wait(DEADLINE_S) == -signal.SIGKILL
    finally:
        traffic.stop.set()
        if server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(DEADLINE_S)
        if server.process.stdout is not None:
            server.process.stdout.close()
    assert not any(t.is_alive() for t in threads), "a client never stopped"
    assert not traffic.unexpected, f"before the kill: {traffic.unexpected[:5]}"
    assert not traffic.duplicates, f"judgment_ids answered twice: {traffic.duplicates[:5]}"
    acknowledged = traffic.acknowledged

    # The file is whole: SQLite recovers the WAL, and every page checks out.
    with sqlite3.connect(path) as check:
        assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    check.close()
    with open_log(str(path)) as log:  # opens, checks its schema and writes: no corruption
        logged = {d.judgment_id: (d.choice, d.decision) for d in log.decisions()}
        count = log.count()
    missing = sorted(set(acknowledged) - set(logged))
    assert not missing, (
        f"{len(acknowledged)} decisions acknowledged, {len(logged)} in the log, "
        f"{len(missing)} acknowledged but missing: {missing[:5]} "
        f"({traffic.requests} requests sent, {in_flight} in flight at the kill)"
    )
    assert count >= len(acknowledged), (
        f"{len(acknowledged)} decisions acknowledged, {count} rows in the log"
    )
    print(
        f"{len(acknowledged)} acknowledged, {len(logged)} in the log, {len(missing)} missing; "
        f"{traffic.requests} requests, {in_flight} in flight at the kill"
    )
    differ = [i for i in acknowledged if logged[i] != acknowledged[i]]
    assert not differ, f"logged otherwise than answered: {differ[:5]}"
    decisions = {decision for _, decision in acknowledged.values()}
    assert decisions == {"accept", "escalate"}  # the traffic held both kinds
