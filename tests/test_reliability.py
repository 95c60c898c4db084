"""Bounded work and no wasted work: fairness, deadlines, clients that leave, admission at the
door, slow bodies, the key before routing, and a clean stop.

A real uvicorn server (in a thread, on loopback) around a fake engine whose passes take a set
time and record what they judged, so each test can count the work done and the work dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fakes import FakeEngine
from server import free_port

from judge import Judgment, Prepared, Query
from service import ServiceConfig, create_app
from service.batcher import Batcher, DeadlineError

BODY = {"prompt": "Is this spam?", "choices": ["spam", "ham"]}


class TimedEngine(FakeEngine):
    """A pass takes ``delay`` seconds; every judged prompt is recorded, in order."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.judged: list[str] = []
        self.passes: list[list[str]] = []

    def run(self, prepared: Sequence[Prepared]) -> list[Judgment]:
        time.sleep(self.delay)
        results = super().run(prepared)
        prompts = [r.prompt for r in results]
        self.judged += prompts
        self.passes.append(prompts)
        return results

    def judgment(self, query: Query) -> Judgment:
        return msgspec_replace(super().judgment(query), prompt=query.prompt)


def msgspec_replace(j: Judgment, **changes: Any) -> Judgment:
    import msgspec

    return msgspec.structs.replace(j, **changes)


@contextlib.contextmanager
def live(
    engine: FakeEngine, tmp_path: Path, *, grace_s: int | None = None, **settings: Any
) -> Iterator[str]:
    """A real server on loopback for the duration; yields its base URL once ready."""
    config = ServiceConfig(profiles_dir=tmp_path / "profiles", **settings)
    port = free_port()
    app = create_app(engine, config=config)
    server = uvicorn.Server(
        uvicorn.Config(app, port=port, log_level="warning", timeout_graceful_shutdown=grace_s)
    )

    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    try:
        deadline = time.monotonic() + 60  # generous: a busy machine starts slowly
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/ready", headers=headers).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError("the server did not become ready within 60 s")
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(10)


def metric(url: str, name: str, headers: Mapping[str, str] | None = None) -> float:
    for line in httpx.get(f"{url}/metrics", headers=headers).text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}")


def hang_up(url: str, body: bytes, after: float) -> None:
    """Send a complete request, then close the connection before the answer comes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        head = (
            f"POST /judge HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        s.sendall(head.encode() + body)
        time.sleep(after)


# --- the scheduler on its own ----------------------------------------------------------------

FAKE = FakeEngine()


def prepared(prompt: str) -> Prepared:
    """A prepared judgment of ``prompt`` (the fake's tokens: one per character, plus one)."""
    return FAKE.prepare(Query(prompt=prompt, choices=["a", "b"]))


def test_requests_take_turns_so_a_big_batch_does_not_starve_a_small_one() -> None:
    order: list[str] = []

    def run(queries: Sequence[Prepared]) -> list[Judgment]:
        time.sleep(0.01)
        order.extend(q.prompt for q in queries)
        return FAKE.run(queries)

    async def main() -> None:
        batcher = Batcher(run, max_batch_size=2, max_wait_ms=0)
        batcher.start()
        deadline = time.monotonic() + 10
        big = [
            batcher.judge(prepared(f"big{i}"), owner="big", deadline=deadline)
            for i in range(20)
        ]  # fmt: skip
        big_task = asyncio.gather(*big)
        await asyncio.sleep(0.015)  # the big request's first pass is running
        small = await batcher.judge(prepared("small"), owner="small", deadline=deadline)
        assert small.prompt == "small"
        await big_task
        await batcher.stop()

    asyncio.run(main())
    # The small request went into the second or third pass, not after all 20 big items.
    assert order.index("small") < 10  # in one of the next passes, not after all 20 big items


def test_a_pass_holds_at_most_max_batch_tokens() -> None:
    passes: list[int] = []

    def run(queries: Sequence[Prepared]) -> list[Judgment]:
        passes.append(len(queries))
        return FAKE.run(queries)

    long = prepared("x" * 299)
    assert long.tokens == 300

    async def main() -> None:
        batcher = Batcher(run, max_batch_size=16, max_batch_tokens=1000, max_wait_ms=20)
        batcher.start()
        deadline = time.monotonic() + 10
        await asyncio.gather(
            *(
                batcher.judge(long, owner=i, deadline=deadline)
                for i in range(7)
            )
        )  # fmt: skip
        await batcher.stop()

    asyncio.run(main())
    assert passes == [3, 3, 1]


def test_a_lone_client_never_waits_but_a_pass_after_a_shared_one_waits_for_company() -> None:
    passes: list[list[str]] = []

    def run(queries: Sequence[Prepared]) -> list[Judgment]:
        passes.append([q.prompt for q in queries])
        return FAKE.run(queries)

    async def main() -> float:
        batcher = Batcher(run, max_batch_size=16, max_wait_ms=400)
        batcher.start()
        deadline = time.monotonic() + 10
        start = time.monotonic()
        await batcher.judge(prepared("alone"), owner="a", deadline=deadline)
        alone_s = time.monotonic() - start
        # Two at once share a pass; the next pass then waits for company.
        await asyncio.gather(
            batcher.judge(prepared("x"), owner="x", deadline=deadline),
            batcher.judge(prepared("y"), owner="y", deadline=deadline),
        )
        first = asyncio.ensure_future(batcher.judge(prepared("p"), owner="p", deadline=deadline))
        await asyncio.sleep(0.05)  # within the wait: it joins the pass "p" is waiting in
        await batcher.judge(prepared("q"), owner="q", deadline=deadline)
        await first
        await batcher.stop()
        return alone_s

    alone_s = asyncio.run(main())
    assert alone_s < 0.3  # it did not wait out the 400 ms
    assert passes == [["alone"], ["x", "y"], ["p", "q"]]


def test_jobs_whose_waiter_left_or_whose_deadline_passed_are_dropped_unrun() -> None:
    judged: list[str] = []

    def run(queries: Sequence[Prepared]) -> list[Judgment]:
        time.sleep(0.2)
        judged.extend(q.prompt for q in queries)
        return FAKE.run(queries)

    async def main() -> Batcher:
        batcher = Batcher(run, max_batch_size=1, max_wait_ms=0)
        batcher.start()
        far, near = time.monotonic() + 10, time.monotonic() + 0.1

        def job(prompt: str, deadline: float) -> Any:
            return batcher.judge(prepared(prompt), owner=prompt, deadline=deadline)

        first = asyncio.ensure_future(job("first", far))
        await asyncio.sleep(0.02)  # "first" is running now
        gone = asyncio.ensure_future(job("gone", far))
        late = asyncio.ensure_future(job("late", near))
        await asyncio.sleep(0.02)
        gone.cancel()  # its client disconnected
        with pytest.raises(DeadlineError):
            await late
        assert (await first).prompt == "first"
        assert (await job("after", far)).prompt == "after"
        await batcher.stop()
        return batcher

    batcher = asyncio.run(main())
    assert judged == ["first", "after"]
    assert batcher.dropped == 2 and batcher.run == 2


# --- the live server -------------------------------------------------------------------------


def test_a_client_that_hangs_up_costs_no_model_work(tmp_path: Path) -> None:
    engine = TimedEngine(delay=0.3)
    with live(engine, tmp_path, max_batch_size=1) as url:
        with ThreadPoolExecutor(8) as pool:
            for i in range(8):
                body = f'{{"prompt": "left {i}", "choices": ["a", "b"]}}'.encode()
                pool.submit(hang_up, url, body, 0.1)
        time.sleep(1.0)  # the first pass, already running when its client left, ends
        assert len(engine.judged) <= 1, engine.judged
        assert metric(url, 'judge_model_jobs{outcome="dropped"}') >= 7
        assert (
            metric(url, 'judge_http_requests_total{method="POST",route="/judge",status="499"}') == 8
        )


def test_a_request_deadline_drops_its_work_and_answers_503(tmp_path: Path) -> None:
    engine = TimedEngine(delay=0.5)
    with live(engine, tmp_path, max_batch_size=1) as url:
        with ThreadPoolExecutor(2) as pool:
            busy = pool.submit(httpx.post, f"{url}/judge", json=BODY, timeout=10)
            time.sleep(0.1)
            hurried = {**BODY, "prompt": "hurried"}
            r = httpx.post(
                f"{url}/judge", json=hurried, headers={"X-Request-Timeout": "0.2"}, timeout=10
            )
            assert busy.result().status_code == 200
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "deadline" in r.json()["detail"]
        time.sleep(0.6)
        assert "hurried" not in engine.judged
        for bad in ("0", "-1", "soon", "nan", "inf"):
            r = httpx.post(f"{url}/judge", json=BODY, headers={"X-Request-Timeout": bad})
            assert r.status_code == 400 and r.json()["field"] == "X-Request-Timeout"


def test_a_batch_past_its_deadline_keeps_the_items_done(tmp_path: Path) -> None:
    engine = TimedEngine(delay=0.3)
    items = [{"prompt": f"item {i}", "choices": ["a", "b"]} for i in range(6)]
    with live(engine, tmp_path, max_batch_size=1) as url:
        r = httpx.post(
            f"{url}/judge/batch",
            json={"items": items},
            headers={"X-Request-Timeout": "1.0"},
            timeout=10,
        )
    results = r.json()["results"]
    assert r.status_code == 200 and len(results) == 6
    done = [x for x in results if x["type"] == "judgment"]
    late = [x for x in results if x["type"] == "error"]
    assert 1 <= len(done) < 6 and all(x["status_code"] == 503 for x in late)


def test_admission_waits_at_the_door_then_refuses_without_reading_the_body(
    tmp_path: Path,
) -> None:
    # The first request holds the only place for 3 s; the second must give up at the door long
    # before that. Checked by order (the first is still running), not by a tight time bound.
    engine = TimedEngine(delay=3.0)
    with live(engine, tmp_path, max_queue=1, admission_wait_s=0.3, max_batch_size=1) as url:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, f"{url}/judge", json=BODY, timeout=10)
            time.sleep(0.1)
            start = time.perf_counter()
            # A broken body: were it read, this would be a 400, not a 503.
            r = httpx.post(
                f"{url}/judge", content=b'{"broken', headers={"content-type": "application/json"}
            )
            waited = time.perf_counter() - start
            first_still_running = not first.done()
            assert first.result().status_code == 200
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert waited >= 0.25  # it waited its turn at the door (admission_wait_s) ...
        assert first_still_running  # ... then gave up, without waiting for the first to finish
        assert httpx.get(f"{url}/health").status_code == 200  # not behind the door


def test_a_body_that_does_not_arrive_in_time_gets_408(tmp_path: Path) -> None:
    with live(TimedEngine(0.0), tmp_path, read_timeout_s=0.3) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                b"POST /judge HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{"
            )
            s.settimeout(5)
            answer = s.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 408") and '"field":"body"' in answer


def test_the_key_comes_before_routing_and_its_scheme_is_case_insensitive(tmp_path: Path) -> None:
    with live(TimedEngine(0.0), tmp_path, api_key="s3cret") as url:
        for path in ("/no-such-route", "/judge/nothing", "/profiles/x/y/z"):
            r = httpx.get(f"{url}{path}")
            assert r.status_code == 401, path  # no key: no telling which routes exist
        assert httpx.delete(f"{url}/health").status_code == 401  # wrong method, no key
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = httpx.post(f"{url}/judge", json=BODY, headers={"Authorization": f"{scheme} s3cret"})
            assert r.status_code == 200, scheme
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{url}/no-such-route", headers=auth).status_code == 404
        assert httpx.head(f"{url}/health").status_code == 200
        r = httpx.options(f"{url}/profiles/x", headers=auth)
        assert {"GET", "PUT", "DELETE"} <= {m.strip() for m in r.headers["allow"].split(",")}


def test_a_fit_whose_client_leaves_writes_nothing(tmp_path: Path) -> None:
    engine = TimedEngine(delay=0.05)
    examples = [{"prompt": f"message {i}", "label": "spam" if i % 2 else "ham"} for i in range(200)]
    body = {"choices": ["spam", "ham"], "examples": examples}
    with live(engine, tmp_path, max_batch_size=4) as url:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{url}/profiles/left/fit", json=body, timeout=0.5)
        time.sleep(1.0)
        judged = len(engine.judged)
        time.sleep(1.0)
        assert len(engine.judged) == judged < 200  # it stopped when the client left
        assert httpx.get(f"{url}/profiles/left").status_code == 404
        assert not list((tmp_path / "profiles").glob("*left*"))


def test_requests_cut_off_by_shutdown_get_503_not_500(tmp_path: Path) -> None:
    engine = TimedEngine(delay=2.0)
    with ThreadPoolExecutor(3) as pool:
        with live(engine, tmp_path, grace_s=1, max_batch_size=1) as url:
            answers = [
                pool.submit(
                    httpx.post, f"{url}/judge", json={**BODY, "prompt": f"p{i}"}, timeout=30
                )
                for i in range(3)
            ]
            time.sleep(0.5)  # the first pass is running, two requests wait
        # Leaving the block stops the server: 1 s of grace, then the rest are cut off.
        statuses = sorted(a.result().status_code for a in answers)
    assert statuses[-1] == 503 and set(statuses) <= {200, 503}, statuses
    cut = [a.result() for a in answers if a.result().status_code == 503]
    assert all(
        r.headers["Retry-After"] == "1" and "shutting down" in r.json()["detail"] for r in cut
    )
