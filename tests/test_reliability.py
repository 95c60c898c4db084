"""Bounded work and no wasted work: fairness, deadlines, clients that leave, admission at the
door, slow bodies, the key before routing, and a clean stop.

A real uvicorn server (in a thread, on loopback) around a fake engine whose passes take a set
time, or wait until the test opens a gate, and record what they judged, so each test can count
the work done and the work dropped.

No test depends on how fast this machine is: what must happen while the model is busy happens
while a gate holds it, and a test waits for an event (a metric, a queue depth) rather than a
set time. ``HANG_S`` bounds those waits; only a hang reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fakes import FakeEngine
from server import free_port, wait_url_ready

from judge import Judgment, Prepared, Query
from service import ServiceConfig, create_app
from service.errors import DeadlineError
from service.web.batcher import Batcher
from service.web.serving import Service

BODY = {"prompt": "Is this spam?", "choices": ["spam", "ham"]}
HANG_S = 120.0  # a watchdog for every wait below: each ends in milliseconds when all is well
DEPTH = "judge_queue_depth"
RUN = 'judge_model_jobs{outcome="run"}'
DROPPED = 'judge_model_jobs{outcome="dropped"}'


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


class GatedEngine(TimedEngine):
    """After ``free_passes`` passes, a pass waits until the test opens ``gate``: the model is
    busy for exactly as long as the test needs, however slow the machine. ``started`` is set
    when the first pass begins. Open the gate before the server stops: a stop waits for the
    pass running."""

    def __init__(self, free_passes: int = 0) -> None:
        super().__init__(delay=0.0)
        self.free_passes = free_passes
        self.gate = threading.Event()
        self.started = threading.Event()

    def run(self, prepared: Sequence[Prepared]) -> list[Judgment]:
        self.started.set()
        if len(self.passes) >= self.free_passes and not self.gate.wait(HANG_S):
            raise AssertionError("the test never opened the gate")
        return super().run(prepared)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` until it holds (``HANG_S`` at most: a hang)."""
    deadline = time.monotonic() + HANG_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {HANG_S:.0f} s: {what}")
        time.sleep(0.02)


async def until(condition: Callable[[], bool], what: str) -> None:
    """``wait_until`` inside the event loop."""
    deadline = time.monotonic() + HANG_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {HANG_S:.0f} s: {what}")
        await asyncio.sleep(0.001)


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
        wait_url_ready(url, headers, timeout=HANG_S)  # a busy machine starts slowly
        yield url
    finally:
        server.should_exit = True
        thread.join(10)


def metric(url: str, name: str, headers: Mapping[str, str] | None = None) -> float:
    for line in httpx.get(f"{url}/metrics", headers=headers).text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}")


def count(url: str, name: str) -> float:
    """``metric``, 0 for a series not recorded yet."""
    try:
        return metric(url, name)
    except AssertionError:
        return 0.0


def unread(url: str, body: bytes) -> socket.socket:
    """A connection that has sent a complete ``POST /judge`` and reads nothing: closing it is
    the client hanging up before the answer comes."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    head = (
        f"POST /judge HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    s.sendall(head.encode() + body)
    return s


# --- the scheduler on its own ----------------------------------------------------------------

FAKE = FakeEngine()


def prepared(prompt: str) -> Prepared:
    """A prepared judgment of ``prompt`` (the fake's tokens: one per character, plus one)."""
    return FAKE.prepare(Query(prompt=prompt, choices=["a", "b"]))


def test_requests_take_turns_so_a_big_batch_does_not_starve_a_small_one() -> None:
    order: list[str] = []
    started, queued = threading.Event(), threading.Event()

    def run(queries: Sequence[Prepared]) -> list[Judgment]:
        started.set()
        queued.wait(HANG_S)  # the first pass holds the model until the small request waits
        order.extend(q.prompt for q in queries)
        return FAKE.run(queries)

    async def main() -> None:
        batcher = Batcher(run, max_batch_size=2, max_wait_ms=0)
        batcher.start()
        deadline = time.monotonic() + HANG_S
        big = [
            batcher.judge(prepared(f"big{i}"), owner="big", deadline=deadline)
            for i in range(20)
        ]  # fmt: skip
        big_task = asyncio.gather(*big)
        await until(started.is_set, "the big request's first pass runs")
        waiting = batcher.depth
        small = asyncio.ensure_future(
            batcher.judge(prepared("small"), owner="small", deadline=deadline)
        )
        await until(lambda: batcher.depth == waiting + 1, "the small request is queued")
        queued.set()
        assert (await small).prompt == "small"
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


@pytest.mark.parametrize(("padded", "expected"), [(False, [9]), (True, [1, 8])])
def test_the_batcher_coalesces_by_the_rule_of_the_engines_pass(
    padded: bool, expected: list[int]
) -> None:
    # A 900-token judgment and eight of 20: 1,060 tokens laid end to end (the lean pass) fit a
    # budget of 1,200; left-padded (the generic pass) they would be 9 x 900.
    passes: list[int] = []

    def run(queries: Sequence[Prepared]) -> list[Judgment]:
        passes.append(len(queries))
        return FAKE.run(queries)

    long, short = prepared("x" * 899), prepared("x" * 19)
    assert (long.tokens, short.tokens) == (900, 20)

    async def main() -> None:
        batcher = Batcher(
            run, max_batch_size=16, max_batch_tokens=1200, max_wait_ms=0, padded=padded
        )
        batcher.start()
        deadline = time.monotonic() + 10
        jobs = [long, *[short] * 8]
        await asyncio.gather(
            *(batcher.judge(p, owner=i, deadline=deadline) for i, p in enumerate(jobs))
        )
        await batcher.stop()

    asyncio.run(main())
    assert passes == expected


class LeanEngine(FakeEngine):
    decoder_pass = "lean"


@pytest.mark.parametrize(("engine", "padded"), [(FakeEngine(), True), (LeanEngine(), False)])
def test_the_service_tells_the_batcher_whether_the_engines_pass_pads(
    tmp_path: Path, engine: FakeEngine, padded: bool
) -> None:
    service = Service(ServiceConfig(profiles_dir=tmp_path))
    assert service.batcher.padded  # until the engine has loaded: the larger count

    async def main() -> None:
        await service.warm_up(lambda: engine)
        await service.batcher.stop()

    asyncio.run(main())
    assert service.loaded is engine and service.batcher.padded is padded


def test_a_lone_client_never_waits_but_a_pass_after_a_shared_one_waits_for_company() -> None:
    passes: list[list[str]] = []

    def run(queries: Sequence[Prepared]) -> list[Judgment]:
        passes.append([q.prompt for q in queries])
        return FAKE.run(queries)

    async def main() -> float:
        # A wait that only a hang outlasts: the pass of two that waits for company runs when
        # the second arrives (it is full then), however long that takes on this machine.
        batcher = Batcher(run, max_batch_size=2, max_wait_ms=HANG_S * 1000)
        batcher.start()
        deadline = time.monotonic() + 2 * HANG_S
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
    assert alone_s < HANG_S / 2  # it did not wait out max_wait_ms
    assert passes == [["alone"], ["x", "y"], ["p", "q"]]


def test_jobs_whose_waiter_left_or_whose_deadline_passed_are_dropped_unrun() -> None:
    judged: list[str] = []
    started, gate = threading.Event(), threading.Event()

    def run(queries: Sequence[Prepared]) -> list[Judgment]:
        started.set()
        gate.wait(HANG_S)  # "first" holds the model until the test lets it go
        judged.extend(q.prompt for q in queries)
        return FAKE.run(queries)

    async def main() -> Batcher:
        batcher = Batcher(run, max_batch_size=1, max_wait_ms=0)
        batcher.start()
        far = time.monotonic() + HANG_S

        def job(prompt: str, deadline: float) -> Any:
            return batcher.judge(prepared(prompt), owner=prompt, deadline=deadline)

        first = asyncio.ensure_future(job("first", far))
        await until(started.is_set, '"first" is running')
        gone = asyncio.ensure_future(job("gone", far))
        # Long enough to be queued before it passes, on any machine: the model is held anyway.
        late = asyncio.ensure_future(job("late", time.monotonic() + 1.0))
        await until(lambda: batcher.depth == 2, "both wait for the model")
        gone.cancel()  # its client disconnected
        with pytest.raises(DeadlineError):
            await late
        gate.set()
        assert (await first).prompt == "first"
        assert (await job("after", far)).prompt == "after"
        await batcher.stop()
        return batcher

    batcher = asyncio.run(main())
    assert judged == ["first", "after"]
    assert batcher.dropped == 2 and batcher.run == 2


# --- the live server -------------------------------------------------------------------------


def test_a_client_that_hangs_up_costs_no_model_work(tmp_path: Path) -> None:
    engine = GatedEngine()
    gone = 'judge_http_requests_total{method="POST",route="/judge",status="499"}'
    with live(engine, tmp_path, max_batch_size=1) as url:
        try:
            clients = [
                unread(url, f'{{"prompt": "left {i}", "choices": ["a", "b"]}}'.encode())
                for i in range(8)
            ]
            # One judgment on the model, seven queued behind it; then all eight hang up.
            wait_until(lambda: metric(url, RUN) + metric(url, DEPTH) == 8, "8 jobs in")
            for client in clients:
                client.close()
            wait_until(lambda: count(url, gone) == 8, "8 responses recorded as 499")
        finally:
            engine.gate.set()  # the first pass, already running when its client left, ends
        wait_until(lambda: metric(url, DEPTH) == 0, "the queue is empty")
        assert len(engine.judged) <= 1, engine.judged
        assert metric(url, DROPPED) >= 7
        assert metric(url, gone) == 8


def test_a_request_deadline_drops_its_work_and_answers_503(tmp_path: Path) -> None:
    engine = GatedEngine()
    with live(engine, tmp_path, max_batch_size=1) as url:
        with ThreadPoolExecutor(2) as pool:
            busy = pool.submit(httpx.post, f"{url}/judge", json=BODY, timeout=HANG_S)
            try:
                wait_until(engine.started.is_set, "the busy request is on the model")
                hurried = {**BODY, "prompt": "hurried"}
                r = httpx.post(
                    f"{url}/judge",
                    json=hurried,
                    headers={"X-Request-Timeout": "0.2"},
                    timeout=HANG_S,
                )
            finally:
                engine.gate.set()
            assert busy.result().status_code == 200
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "deadline" in r.json()["detail"]
        wait_until(lambda: metric(url, DROPPED) == 1, "the worker reached the hurried job")
        assert "hurried" not in engine.judged
        for bad in ("0", "-1", "soon", "nan", "inf"):
            r = httpx.post(f"{url}/judge", json=BODY, headers={"X-Request-Timeout": bad})
            assert r.status_code == 400 and r.json()["field"] == "X-Request-Timeout"


def test_a_batch_past_its_deadline_keeps_the_items_done(tmp_path: Path) -> None:
    # The first item's pass runs at once; the next holds the model past the deadline.
    engine = GatedEngine(free_passes=1)
    items = [{"prompt": f"item {i}", "choices": ["a", "b"]} for i in range(6)]
    with live(engine, tmp_path, max_batch_size=1) as url:
        try:
            r = httpx.post(
                f"{url}/judge/batch",
                json={"items": items},
                headers={"X-Request-Timeout": "2.0"},
                timeout=HANG_S,
            )
        finally:
            engine.gate.set()
    results = r.json()["results"]
    assert r.status_code == 200 and len(results) == 6
    done = [x for x in results if x["type"] == "judgment"]
    late = [x for x in results if x["type"] == "error"]
    assert 1 <= len(done) < 6 and all(x["status_code"] == 503 for x in late)


def test_admission_waits_at_the_door_then_refuses_without_reading_the_body(
    tmp_path: Path,
) -> None:
    # The first request holds the only place until the test lets it go; the second must give
    # up at the door before that. Checked by order (the first is still running), not by a
    # time bound.
    engine = GatedEngine()
    with live(engine, tmp_path, max_queue=1, admission_wait_s=0.3, max_batch_size=1) as url:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, f"{url}/judge", json=BODY, timeout=HANG_S)
            try:
                wait_until(engine.started.is_set, "the first request is on the model")
                start = time.perf_counter()
                # A broken body: were it read, this would be a 400, not a 503.
                r = httpx.post(
                    f"{url}/judge",
                    content=b'{"broken',
                    headers={"content-type": "application/json"},
                    timeout=HANG_S,
                )
                waited = time.perf_counter() - start
                first_still_running = not first.done()
            finally:
                engine.gate.set()
            assert first.result().status_code == 200
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert waited >= 0.25  # it waited its turn at the door (admission_wait_s) ...
        assert first_still_running  # ... then gave up, without waiting for the first to finish
        assert httpx.get(f"{url}/health").status_code == 200  # not behind the door


def test_at_capacity_a_request_the_schema_refuses_is_still_a_400_naming_the_field(
    tmp_path: Path,
) -> None:
    # The first request holds the only place until the test lets it go. A path parameter or
    # header the schema refuses is answered before admission: a 400 naming it, not the 503 a
    # request that waited at the door would get.
    engine = GatedEngine()
    fit = {"choices": ["spam", "ham"], "examples": [{"prompt": "x", "label": "spam"}] * 10}
    refused = [
        ("/profiles/)/fit", fit, {}, "name"),
        ("/judge", BODY, {"X-Request-Timeout": "soon"}, "X-Request-Timeout"),
        ("/judge/batch", {"items": [BODY]}, {"X-Request-Timeout": "-1"}, "X-Request-Timeout"),
    ]
    with live(engine, tmp_path, max_queue=1, admission_wait_s=0.3, max_batch_size=1) as url:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, f"{url}/judge", json=BODY, timeout=HANG_S)
            try:
                wait_until(engine.started.is_set, "the first request is on the model")
                answers = [
                    httpx.post(f"{url}{path}", json=body, headers=headers, timeout=HANG_S)
                    for path, body, headers, _ in refused
                ]
                first_still_running = not first.done()
                # A schema-valid request still waits its turn, and is refused at the door.
                busy = httpx.post(f"{url}/profiles/ok/fit", json=fit, timeout=HANG_S)
            finally:
                engine.gate.set()
            assert first.result().status_code == 200
        for r, (path, _, _, field) in zip(answers, refused, strict=True):
            assert r.status_code == 400 and r.json()["field"] == field, (path, r.text)
        assert first_still_running
        assert busy.status_code == 503


def test_a_body_that_does_not_arrive_in_time_gets_408(tmp_path: Path) -> None:
    with live(TimedEngine(0.0), tmp_path, read_timeout_s=0.3) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                b"POST /judge HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{"
            )
            s.settimeout(HANG_S)
            # Until the server closes (it answers "connection: close"): under load the
            # headers and the body can come in separate reads.
            chunks = []
            while chunk := s.recv(4096):
                chunks.append(chunk)
            answer = b"".join(chunks).decode()
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
    left = 'judge_http_requests_total{method="POST",route="/profiles/{name}/fit",status="499"}'
    with live(engine, tmp_path, max_batch_size=4) as url:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{url}/profiles/left/fit", json=body, timeout=0.5)
        # Once the fit is recorded as left and nothing waits for the model, every job it
        # started has ended (run counts a pass's jobs as it starts; judged, as it ends).
        wait_until(
            lambda: (
                count(url, left) == 1
                and metric(url, DEPTH) == 0
                and metric(url, RUN) == len(engine.judged)
            ),
            "the fit is cancelled and its last pass has ended",
        )
        judged = len(engine.judged)
        time.sleep(0.5)
        assert len(engine.judged) == judged < 200  # it stopped when the client left
        assert httpx.get(f"{url}/profiles/left").status_code == 404
        assert not list((tmp_path / "profiles").glob("*left*"))


def test_requests_cut_off_by_shutdown_get_503_not_500(tmp_path: Path) -> None:
    engine = TimedEngine(delay=2.0)
    with ThreadPoolExecutor(3) as pool:
        with live(engine, tmp_path, grace_s=1, max_batch_size=1) as url:
            answers = [
                pool.submit(
                    httpx.post, f"{url}/judge", json={**BODY, "prompt": f"p{i}"}, timeout=HANG_S
                )
                for i in range(3)
            ]
            # The first pass is running, two requests wait (or, on a slow machine, later).
            wait_until(lambda: metric(url, RUN) + metric(url, DEPTH) == 3, "3 jobs in")
        # Leaving the block stops the server: 1 s of grace, then the rest are cut off.
        statuses = sorted(a.result().status_code for a in answers)
    assert statuses[-1] == 503 and set(statuses) <= {200, 503}, statuses
    cut = [a.result() for a in answers if a.result().status_code == 503]
    assert all(
        r.headers["Retry-After"] == "1" and "shutting down" in r.json()["detail"] for r in cut
    )
