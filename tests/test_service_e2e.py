"""End to end: a real server process on loopback, the real default model.

The servers' deadlines (--request-timeout, --shutdown-timeout) and the clients' timeouts are
hang bounds (``READY_S``): on a slow machine shared with other jobs, 32 judgments at once
can take longer than the server's 60 s default, which is a speed, not what these tests check.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server import READY_S, Server, free_port
from test_service import EXAMPLES

PROMPTS = [
    "Is this SMS spam? " + text
    for text in [
        "WINNER!! Claim your prize now",
        "See you at 8 for dinner?",
        "URGENT: your account is locked, reply with your PIN",
        "Can you pick up milk on the way home",
    ]
]
CHOICE_SETS = [["spam", "ham"], ["spam", "ham", "unsure"], ["1", "10", "100"], ["yes", "no"]]


def start(profiles: Path) -> Server:
    """A server whose deadlines only a hang reaches."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "service.cli.main",
        "serve",
        "--port",
        str(port),
        "--dtype",
        "float32",
    ]
    command += ["--request-timeout", f"{READY_S:g}", "--shutdown-timeout", f"{READY_S:g}"]
    server = Server([*command, "--profiles-dir", str(profiles), "--max-wait-ms", "20"], port)
    server.wait_ready()
    return server


@pytest.fixture
def server(model_server: Server) -> Server:
    """The session's `judge serve` on the real model (tests/conftest.py)."""
    return model_server


def test_ready_goes_from_503_to_200(server: Server) -> None:
    assert server.ready_statuses[0] == 503
    assert server.ready_statuses[-1] == 200


def test_concurrent_requests_equal_the_same_judgments_alone(server: Server) -> None:
    bodies = [
        {"prompt": f"{PROMPTS[i % 4]} (message {i})", "choices": CHOICE_SETS[(i // 4) % 4]}
        for i in range(32)
    ]
    with httpx.Client(base_url=server.url, timeout=READY_S) as client:
        before = client.get("/metrics").text
        with ThreadPoolExecutor(32) as pool:
            together = list(pool.map(lambda b: client.post("/judge", json=b), bodies))
        after = client.get("/metrics").text
        alone = [client.post("/judge", json=b) for b in bodies]
    assert [r.status_code for r in together] == [200] * 32
    for t, a in zip(together, alone, strict=True):
        assert t.json()["raw_probabilities"] == pytest.approx(
            a.json()["raw_probabilities"], abs=1e-4
        )
    # The 32 judgments were coalesced into fewer forward passes than requests.
    assert _batches(after) - _batches(before) < 32


def _batches(metrics: str) -> float:
    line = next(x for x in metrics.splitlines() if x.startswith("judge_batch_size_count"))
    return float(line.split()[-1])


def test_healthy_after_a_barrage_of_bad_requests(server: Server) -> None:
    bad = [
        ("POST", "/judge", b"{not json"),
        ("POST", "/judge", b'{"prompt": "x"}'),
        ("POST", "/judge", b'{"prompt": "x", "choices": ["a", "a"]}'),
        ("POST", "/judge", b'{"prompt": "x", "choices": "ab"}'),
        ("POST", "/judge", b"x" * 2_000_000),
        ("POST", "/judge/batch", b'{"items": [{"prompt": 1}]}'),
        ("GET", "/profiles/..%2F..%2Fetc", b""),
        ("POST", "/profiles/x/fit", b'{"choices": ["a", "b"], "examples": []}'),
        ("PUT", "/profiles/x", b'{"name": "x"}'),
        ("DELETE", "/profiles/missing", b""),
        ("GET", "/nowhere", b""),
    ]
    with httpx.Client(base_url=server.url, timeout=READY_S) as client:
        for _ in range(5):
            for method, path, content in bad:
                r = client.request(
                    method, path, content=content, headers={"content-type": "application/json"}
                )
                assert 400 <= r.status_code < 500, (method, path, r.status_code, r.text)
        assert client.get("/health").status_code == 200
        assert client.get("/ready").status_code == 200
        assert (
            client.post(
                "/judge", json={"prompt": PROMPTS[0], "choices": ["spam", "ham"]}
            ).status_code
            == 200
        )


def test_fitted_profile_survives_a_restart(tmp_path: Path) -> None:
    first = start(tmp_path)
    try:
        fit = {
            "choices": ["spam", "ham"],
            "examples": [{"prompt": p, "label": y} for p, y in EXAMPLES],
        }
        # A watchdog: the fit takes seconds, a minute or more on a slow, busy machine.
        r = httpx.post(f"{first.url}/profiles/sms/fit", json=fit, timeout=READY_S)
        assert r.status_code == 200, r.text
        fitted = r.json()
    finally:
        first.stop()
    second = start(tmp_path)
    try:
        assert httpx.get(f"{second.url}/profiles/sms").json() == fitted
        r = httpx.post(
            f"{second.url}/judge",
            json={"prompt": PROMPTS[0], "choices": ["spam", "ham"], "profile": "sms"},
            timeout=READY_S,
        )
        assert r.status_code == 200 and r.json()["profile"] == "sms"
        body = r.json()
        assert body["certified"] == (fitted["threshold"]["threshold"] is not None)
        assert len(body["reasons"]) == len(body["reason_codes"])
    finally:
        second.stop()


def test_sigterm_finishes_requests_in_flight_and_exits_0(tmp_path: Path) -> None:
    server = start(tmp_path)
    body = {"prompt": PROMPTS[0], "choices": ["spam", "ham"]}
    with ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(httpx.post, f"{server.url}/judge", json=body, timeout=READY_S)]
        answers += [
            pool.submit(httpx.post, f"{server.url}/judge", json=body, timeout=READY_S)
            for _ in range(7)
        ]
        time.sleep(0.3)  # in flight
        start_stop = time.monotonic()
        server.stop(wait_s=2 * READY_S)
        took = time.monotonic() - start_stop
    statuses = [a.result().status_code for a in answers if a.exception() is None]
    assert server.process.returncode == 0, server.output()
    # The bound only tells "stopped" from "hung" (--shutdown-timeout READY_S; the default's
    # mapping to uvicorn is tested in tests/test_cli.py).
    assert took < 2 * READY_S
    assert statuses and all(s == 200 for s in statuses)
