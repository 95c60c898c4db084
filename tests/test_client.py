"""service.client against a real server process on the default model; retries, the API key
and the gate's bounds against an ``httpx.MockTransport``, where the network cannot be made to
fail on cue."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import io
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from server import READY_S, Server
from test_service import EXAMPLES

from judge.identity import new_judgment_id
from service.client import (
    AsyncJudgeClient,
    ClientError,
    JudgeClient,
    RetryPolicy,
    parse_retry_after,
    server_deadline,
)
from service.schemas import (
    BatchResponse,
    ErrorBody,
    ItemsBatch,
    JudgeRequest,
    JudgeResponse,
    SharedBatch,
    SharedQuestion,
)

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [
    "WINNER!! Claim your prize now",
    "See you at 8 for dinner?",
    "URGENT: your account is locked, reply with your PIN",
    "Can you pick up milk on the way home",
    "Free ringtones! Text TONE to 87070",
    "Running late, start without me",
    "You have won a cruise, call now",
]
PROMPTS = [f"Is this SMS spam? {t}" for t in TEXTS]
CHOICES = ["spam", "ham", "unsure"]


def sent_items(request: httpx.Request) -> list[JudgeRequest]:
    """The whole requests a batch sent (each item is read raw, then decoded by its keys)."""
    raws = msgspec.json.decode(request.content, type=ItemsBatch).items
    return [msgspec.json.decode(raw, type=JudgeRequest) for raw in raws]


@pytest.fixture
def server(model_server: Server) -> Server:
    """The session's `judge serve` on the real model (tests/conftest.py)."""
    return model_server


@pytest.fixture
def client(server: Server) -> Iterator[JudgeClient]:
    with JudgeClient(server.url, timeout=120) as c:
        yield c


def raw_judgment(url: str, body: dict[str, Any]) -> JudgeResponse:
    r = httpx.post(f"{url}/judge", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return msgspec.json.decode(r.content, type=JudgeResponse)


def raw_answer(url: str, path: str, body: Any) -> tuple[int, Any]:
    """Status and decoded body of a POST sent with httpx alone, the client's reference."""
    content = body if isinstance(body, bytes) else msgspec.json.encode(body)
    r = httpx.post(
        f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=120
    )
    return r.status_code, r.json()


def same_judgment(a: JudgeResponse, b: JudgeResponse) -> None:
    """Equal in every field but the latency and the judgment's own id (fresh per judgment);
    numbers to float noise (batching, the cache)."""
    assert a.judgment_id != b.judgment_id
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if name in ("latency_ms", "judgment_id"):
            continue
        if name in ("probabilities", "raw_probabilities"):
            assert list(x) == list(y)
            assert x == pytest.approx(y, abs=1e-4)
        elif isinstance(x, float):
            assert x == pytest.approx(y, abs=1e-4), name
        else:
            assert x == y, name


# --- against the real server ------------------------------------------------------------


def test_judge_equals_a_raw_post(server: Server, client: JudgeClient) -> None:
    assert client.ready()
    got = client.judge(PROMPTS[0], CHOICES, uncertified_threshold=0.5, return_prompt=True)
    body = {
        "prompt": PROMPTS[0],
        "choices": CHOICES,
        "uncertified_threshold": 0.5,
        "return_prompt": True,
    }
    same_judgment(got, raw_judgment(server.url, body))
    assert got.prompt is not None and PROMPTS[0] in got.prompt
    assert sum(got.probabilities.values()) == pytest.approx(1.0)
    # The client's options reach the server: a system prompt changes the rendered prompt.
    other = client.judge(PROMPTS[0], CHOICES, system="You grade texts.", return_prompt=True)
    assert other.prompt is not None and "You grade texts." in other.prompt


def test_a_score_through_the_client(server: Server, client: JudgeClient) -> None:
    values = {"low": 0.0, "mid": 5.0, "high": 10.0}
    got = client.judge(PROMPTS[0], list(values), values=values, max_std=0.0)
    body = {"prompt": PROMPTS[0], "choices": list(values), "values": values, "max_std": 0.0}
    raw = raw_judgment(server.url, body)
    assert got.expected_value is not None and raw.expected_value is not None
    assert got.expected_value == pytest.approx(raw.expected_value)
    assert got.std == pytest.approx(raw.std) and got.max_std == 0.0
    assert got.decision == "escalate" and "high_std" in got.reason_codes


def test_a_pair_through_the_client(server: Server, client: JudgeClient) -> None:
    state = "Question: what is the capital of France?"
    candidates = {"paris": "Paris", "lyon": "Lyon"}
    got = client.judge_pair(state, "Which answer is right?", candidates, uncertified_threshold=0.0)
    body = {
        "state": state,
        "instructions": "Which answer is right?",
        "candidates": candidates,
        "uncertified_threshold": 0.0,
    }
    same_judgment(got, raw_judgment(server.url, body))
    assert got.choice in candidates and got.orderings == 2 and got.max_order_spread == 0.2
    assert got.order_spread is not None
    assert (got.order_spread > 0.2) == ("position_inconsistent" in got.reason_codes)

    async def both() -> JudgeResponse:
        async with AsyncJudgeClient(server.url, timeout=120) as c:
            return await c.judge_pair(
                state,
                "Which answer is right?",
                candidates,
                order="given",
                uncertified_threshold=0.0,
            )

    one = asyncio.run(both())
    assert one.orderings == 1 and one.order_spread == 0.0


def test_batch_keeps_order_and_item_errors(server: Server, client: JudgeClient) -> None:
    items = [
        JudgeRequest(prompt=PROMPTS[1], choices=["spam", "ham"]),
        JudgeRequest(prompt=PROMPTS[2], choices=["a", "a"]),
        JudgeRequest(prompt=PROMPTS[3], choices=["spam", "ham"], profile="no-such-profile"),
        JudgeRequest(prompt=PROMPTS[4], choices=CHOICES),
    ]
    results = client.judge_batch(items)
    assert [type(r) for r in results] == [JudgeResponse, ErrorBody, ErrorBody, JudgeResponse]
    first, dup, missing, last = results
    # Each item's error is what POST /judge answers for that item alone.
    for error, item, field in [(dup, items[1], "choices"), (missing, items[2], "profile")]:
        assert isinstance(error, ErrorBody)
        status, body = raw_answer(server.url, "/judge", msgspec.json.encode(item))
        assert 400 <= status < 500 and error.status_code == status
        assert error.field == body["field"] == field and error.detail == body["detail"]
    assert isinstance(first, JudgeResponse) and isinstance(last, JudgeResponse)
    same_judgment(
        first, raw_judgment(server.url, {"prompt": PROMPTS[1], "choices": ["spam", "ham"]})
    )
    same_judgment(last, raw_judgment(server.url, {"prompt": PROMPTS[4], "choices": CHOICES}))


def test_shared_context_equals_a_raw_post(server: Server, client: JudgeClient) -> None:
    context = "A text message arrived: " + TEXTS[2]
    questions = [
        SharedQuestion(prompt=" Is it spam?", choices=["yes", "no"]),
        SharedQuestion(prompt=" How urgent does it sound?", choices=["low", "medium", "high"]),
    ]
    got = client.judge_shared(context, questions)
    raw = httpx.post(
        f"{server.url}/judge/batch",
        content=msgspec.json.encode(SharedBatch(context=context, questions=questions)),
        headers={"content-type": "application/json"},
        timeout=120,
    )
    expected = msgspec.json.decode(raw.content, type=BatchResponse).results
    assert len(got) == 2
    for a, b in zip(got, expected, strict=True):
        assert isinstance(b, JudgeResponse)
        same_judgment(a, b)
    assert list(got[1].probabilities) == ["low", "medium", "high"]


def test_profile_fit_list_get_delete_put(client: JudgeClient) -> None:
    # A watchdog: the fit takes 5-60 s here, minutes on a slow machine shared with other jobs.
    fitted = client.fit("sms", ["spam", "ham"], EXAMPLES, timeout=READY_S)
    assert fitted.name == "sms" and fitted.n_examples == len(EXAMPLES)
    summaries = {p.name: p for p in client.profiles()}
    assert summaries["sms"].n_examples == len(EXAMPLES)
    assert summaries["sms"].choices == fitted.choices
    assert client.profile("sms") == fitted

    client.delete_profile("sms")
    assert "sms" not in {p.name for p in client.profiles()}
    with pytest.raises(ClientError) as missing:
        client.profile("sms")
    assert missing.value.status_code == 404 and missing.value.field == "profile"
    with pytest.raises(ClientError) as again:
        client.delete_profile("sms")
    assert again.value.status_code == 404

    assert client.put_profile(fitted) == fitted
    assert client.profile("sms") == fitted
    d = client.judge(PROMPTS[0], ["ham", "spam"], profile="sms")
    assert d.profile == "sms" and d.temperature == fitted.calibration_map.temperature
    # Without choices, the gate takes the profile's.
    [(text, g)] = list(client.gate([PROMPTS[0]], profile="sms"))
    assert text == PROMPTS[0] and isinstance(g, JudgeResponse)
    assert list(g.probabilities) == fitted.choices
    assert g.confidence == pytest.approx(d.confidence, abs=1e-4)


def test_4xx_raises_with_status_field_and_detail(server: Server, client: JudgeClient) -> None:
    with pytest.raises(ClientError) as one_choice:
        client.judge(PROMPTS[0], ["spam"])
    e = one_choice.value
    status, body = raw_answer(server.url, "/judge", {"prompt": PROMPTS[0], "choices": ["spam"]})
    assert e.status_code == status == 400 and e.field == body["field"] == "choices"
    assert e.detail == body["detail"] and e.body == body
    assert str(e).startswith("HTTP 400 (field 'choices'): ") and e.detail in str(e)

    with pytest.raises(ClientError) as bad_profile:
        client.judge(PROMPTS[0], ["spam", "ham"], profile="missing")
    assert bad_profile.value.status_code == 404 and bad_profile.value.field == "profile"
    with pytest.raises(ClientError) as bad_fit:
        client.fit("x", ["spam", "ham"], [("a", "spam")])
    assert 400 <= bad_fit.value.status_code < 500 and bad_fit.value.field == "examples"


def test_gate_yields_in_input_order_with_errors_in_place(client: JudgeClient) -> None:
    bad = JudgeRequest(prompt=PROMPTS[0], choices=["x", "x"])
    items: list[str | JudgeRequest] = [*PROMPTS[:3], bad, *PROMPTS[3:]]
    out = list(client.gate(iter(items), choices=CHOICES, batch_size=2, concurrency=3))
    assert [item for item, _ in out] == items
    for item, d in out:
        if item is bad:
            assert isinstance(d, ErrorBody) and 400 <= d.status_code < 500
            assert d.field == "choices"
            continue
        assert isinstance(item, str) and isinstance(d, JudgeResponse)
        alone = client.judge(item, CHOICES)
        assert d.raw_probabilities == pytest.approx(alone.raw_probabilities, abs=1e-4)
        assert d.decision == alone.decision


def test_async_client_judges_and_gates(server: Server) -> None:
    async def go() -> tuple[JudgeResponse, list[tuple[str, Any]]]:
        async with AsyncJudgeClient(server.url, timeout=120) as client:
            await client.wait_ready(30)
            one = await client.judge(PROMPTS[0], CHOICES)
            gated = [pair async for pair in client.gate(PROMPTS, choices=CHOICES, batch_size=3)]
            return one, gated

    one, gated = asyncio.run(go())
    same_judgment(one, raw_judgment(server.url, {"prompt": PROMPTS[0], "choices": CHOICES}))
    assert [text for text, _ in gated] == PROMPTS
    with JudgeClient(server.url, timeout=120) as sync:
        for text, d in gated:
            assert isinstance(d, JudgeResponse)
            alone = sync.judge(text, CHOICES)
            assert d.raw_probabilities == pytest.approx(alone.raw_probabilities, abs=1e-4)


def test_readme_client_example_runs(server: Server) -> None:
    page = (ROOT / "docs" / "client.md").read_text()
    section = page[page.index("# Python client and playground") :]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    code = code.replace("http://127.0.0.1:8000", server.url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/client.md", "exec"), {})
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert re.fullmatch(r"(spam|ham) [01]\.\d{3} (accept|escalate)", lines[0])
    assert all(re.match(r"(spam|ham): |to a person: ", line) for line in lines[1:])


# --- mechanics, on a mock transport -----------------------------------------------------


def judgment(choices: list[str], top: int = 0) -> JudgeResponse:
    p = {c: (0.9 if i == top else 0.1 / (len(choices) - 1)) for i, c in enumerate(choices)}
    return JudgeResponse(
        choice=choices[top],
        confidence=p[choices[top]],
        probabilities=p,
        raw_probabilities=p,
        decision="accept",
        reasons=[],
        reason_codes=[],
        threshold=0.5,
        certified=False,
        temperature=None,
        choice_mass=1.0,
        prediction_set=None,
        profile=None,
        model="mock",
        latency_ms=1.0,
        judgment_id=new_judgment_id(),
        tokens_sha256="0" * 64,
        model_sha256="1" * 64,
        policy_sha256="2" * 64,
        profile_etag=None,
    )


JUDGMENT = msgspec.json.encode(judgment(["a", "b"]))


def mock(
    handler: Callable[[httpx.Request], httpx.Response], **options: Any
) -> tuple[JudgeClient, list[float]]:
    waits: list[float] = []
    client = JudgeClient(
        "http://judge.test", transport=httpx.MockTransport(handler), sleep=waits.append, **options
    )
    return client, waits


def test_api_key_goes_in_the_authorization_header() -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, content=JUDGMENT)

    keyed, _ = mock(handler, api_key="s3cret")
    keyed.judge("p", ["a", "b"])
    keyed.ready()
    plain, _ = mock(handler)
    plain.judge("p", ["a", "b"])
    assert seen == ["Bearer s3cret", "Bearer s3cret", None]


def test_503_is_retried_honouring_retry_after() -> None:
    answers = [
        httpx.Response(503, headers={"Retry-After": "2"}, json={"status_code": 503, "detail": "x"}),
        httpx.Response(
            503, headers={"Retry-After": "0.5"}, json={"status_code": 503, "detail": "x"}
        ),
        httpx.Response(200, content=JUDGMENT),
    ]
    client, waits = mock(lambda request: answers.pop(0))
    assert client.judge("p", ["a", "b"]).choice == "a"
    assert waits == [2.0, 0.5] and answers == []


def test_retry_after_is_capped_and_the_budget_bounds_all_waits() -> None:
    calls: list[int] = []

    def busy(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        body = {"status_code": 503, "detail": "the server is at capacity", "field": None}
        return httpx.Response(503, headers={"Retry-After": "100"}, json=body)

    policy = RetryPolicy(max_retries=10, max_wait=4.0, budget=10.0)
    client, waits = mock(busy, retries=policy)
    with pytest.raises(ClientError) as raised:
        client.judge("p", ["a", "b"])
    # Each wait is capped at 4 s; a third would bring the total past the 10 s budget.
    assert waits == [4.0, 4.0] and len(calls) == 3
    assert raised.value.status_code == 503 and "at capacity" in raised.value.detail

    client, waits = mock(busy, retries=RetryPolicy(max_retries=2, max_wait=1.0))
    with pytest.raises(ClientError):
        client.profiles()
    assert waits == [1.0, 1.0]

    client, waits = mock(busy, retries=RetryPolicy(max_retries=0))
    with pytest.raises(ClientError):
        client.profiles()
    assert waits == []


def test_backoff_without_retry_after_doubles_with_jitter() -> None:
    client, waits = mock(
        lambda request: httpx.Response(503, text="busy"),
        retries=RetryPolicy(max_retries=5, backoff=1.0, max_wait=100.0, budget=1000.0),
        seed=1,
    )
    with pytest.raises(ClientError) as raised:
        client.judge("p", ["a", "b"])
    assert raised.value.detail == "busy" and raised.value.body == "busy"
    assert len(waits) == 5
    for i, w in enumerate(waits):
        assert 2**i / 2 <= w <= 2**i
    assert len(set(waits)) == 5  # jittered, not a fixed schedule


def test_retry_after_as_an_http_date() -> None:
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert parse_retry_after(later) == pytest.approx(30, abs=2)
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None
    assert parse_retry_after(" 3 ") == 3.0


def test_connection_errors_are_retried_only_when_repeating_is_harmless() -> None:
    def flaky() -> Callable[[httpx.Request], httpx.Response]:
        tries: list[str] = []

        def handler(request: httpx.Request) -> httpx.Response:
            tries.append(request.url.path)
            if len(tries) == 1:
                raise httpx.ConnectError("refused", request=request)
            if request.url.path.endswith("/fit"):
                return httpx.Response(200, content=b"{}")  # never reached
            return httpx.Response(200, content=JUDGMENT)

        return handler

    client, waits = mock(flaky(), seed=0)
    assert client.judge("p", ["a", "b"]).choice == "a"
    assert len(waits) == 1

    client, waits = mock(flaky())
    with pytest.raises(httpx.ConnectError):
        client.fit("x", ["a", "b"], [("p", "a")])
    assert waits == []

    # A 503 means the server did no work, so even a fit is sent again.
    answers = [httpx.Response(503, headers={"Retry-After": "1"}), httpx.Response(400, json={})]
    client, waits = mock(lambda request: answers.pop(0))
    with pytest.raises(ClientError) as raised:
        client.fit("x", ["a", "b"], [("p", "a")])
    assert waits == [1.0] and raised.value.status_code == 400


def test_error_bodies_that_are_not_the_service_s() -> None:
    client, _ = mock(lambda request: httpx.Response(502, text="<html>Bad Gateway</html>"))
    with pytest.raises(ClientError) as raised:
        client.profiles()
    assert raised.value.status_code == 502 and raised.value.field is None
    assert "Bad Gateway" in str(raised.value)


def test_wait_ready_polls_until_ready_and_stops_on_a_failed_load() -> None:
    answers = [
        httpx.Response(503, json={"status": "loading"}, headers={"Retry-After": "1"}),
        httpx.Response(503, json={"status": "loading"}, headers={"Retry-After": "1"}),
        httpx.Response(200, json={"status": "ready", "model": "m", "dtype": "float32"}),
    ]
    client, waits = mock(lambda request: answers.pop(0))
    client.wait_ready(timeout=60, interval=0.25)
    assert waits == [0.25, 0.25]

    failed = {"status": "failed", "detail": "ModelLoadError: no such model"}
    client, _ = mock(lambda request: httpx.Response(503, json=failed))
    with pytest.raises(ClientError, match="no such model"):
        client.wait_ready(timeout=60)

    client, _ = mock(lambda request: httpx.Response(503, json={"status": "loading"}))
    assert client.ready() is False
    with pytest.raises(TimeoutError):
        client.wait_ready(timeout=0)


class BatchServer:
    """Answers /judge/batch after a per-request delay, counting requests in flight."""

    def __init__(self, delay: Callable[[list[JudgeRequest]], float], fail_on: str = "") -> None:
        self.delay = delay
        self.fail_on = fail_on
        self.in_flight = 0
        self.most_in_flight = 0
        self.requests = 0
        self.lock = threading.Lock()

    def answer(self, request: httpx.Request) -> httpx.Response:
        items = sent_items(request)
        if any(i.prompt == self.fail_on for i in items):
            return httpx.Response(500, json={"status_code": 500, "detail": "Internal Server Error"})
        results: list[JudgeResponse | ErrorBody] = [
            ErrorBody(status_code=400, detail="bad", field="choices")
            if item.prompt.startswith("bad")
            else judgment(item.choices, top=number(item.prompt) % len(item.choices))
            for item in items
        ]
        return httpx.Response(200, content=msgspec.json.encode(BatchResponse(results=results)))

    def handler(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.requests += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            items = sent_items(request)
            time.sleep(self.delay(items))
            return self.answer(request)
        finally:
            with self.lock:
                self.in_flight -= 1

    async def async_handler(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            items = sent_items(request)
            await asyncio.sleep(self.delay(items))
            return self.answer(request)
        finally:
            self.in_flight -= 1


def later_batches_first(items: list[JudgeRequest]) -> float:
    # Early batches answer last, so that answers arrive out of order.
    return 0.03 / (1 + number(items[0].prompt) // 4)


def number(prompt: str) -> int:
    return int(prompt.removeprefix("bad-"))


class Source:
    """An input that counts how much of it has been read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.read = 0

    def __iter__(self) -> Iterator[str]:
        for i in range(self.n):
            self.read += 1
            yield f"bad-{i}" if i % 7 == 3 else str(i)

    async def aiter(self) -> AsyncIterator[str]:
        for item in self:
            yield item


def check_gated(pairs: list[tuple[str, Any]], n: int) -> None:
    assert [item for item, _ in pairs] == [f"bad-{i}" if i % 7 == 3 else str(i) for i in range(n)]
    for item, d in pairs:
        if item.startswith("bad"):
            assert isinstance(d, ErrorBody) and d.field == "choices"
        else:
            assert isinstance(d, JudgeResponse) and d.choice == ["a", "b", "c"][int(item) % 3]


def test_gate_is_ordered_lazy_and_bounded() -> None:
    backend = BatchServer(later_batches_first)
    client, _ = mock(backend.handler)
    source = Source(60)
    gated = client.gate(source, choices=["a", "b", "c"], batch_size=4, concurrency=3)
    first = next(gated)
    assert source.read <= 4 * 3  # nothing read beyond what may be in flight
    pairs = [first, *gated]
    check_gated(pairs, 60)
    assert backend.requests == 15
    assert 2 <= backend.most_in_flight <= 3

    # Stopping early stops reading and sending.
    backend = BatchServer(lambda items: 0.0)
    client, _ = mock(backend.handler)
    endless = Source(10**9)
    gated = client.gate(endless, choices=["a", "b", "c"], batch_size=5, concurrency=4)
    for i, _pair in enumerate(gated):
        if i == 20:
            break
    gated.close()
    read = endless.read
    time.sleep(0.05)
    # Nothing is read after close, so nothing can be sent beyond the batches of what was read:
    # a bound that holds however late a request already in a worker thread reaches the
    # server (counting what was sent at close raced with such a request on a busy machine).
    assert read <= 21 + 5 * 4 and endless.read == read
    assert backend.requests <= -(-read // 5)


class BusyServer(BatchServer):
    """Runs out of time on each item the first time it comes (a 503 in its place), and on
    ``never`` every time; notes each request's items and the requests in flight at its
    arrival."""

    def __init__(self, never: str = "") -> None:
        super().__init__(lambda items: 0.01)
        self.never = never
        self.seen: set[str] = set()
        # Each request's items, the requests in flight (itself included) and whether none of
        # its items came before.
        self.arrivals: list[tuple[list[str], int, bool]] = []
        self.deadlines: set[str | None] = set()

    def answer(self, request: httpx.Request) -> httpx.Response:
        items = sent_items(request)
        prompts = [i.prompt for i in items]
        with self.lock:
            new = not self.seen.intersection(prompts)
            self.arrivals.append((prompts, self.in_flight, new))
            self.deadlines.add(request.headers.get("X-Request-Timeout"))
            fresh = [p for p in prompts if p not in self.seen or p == self.never]
            self.seen.update(prompts)
        if not fresh:
            return super().answer(request)
        out = ErrorBody(status_code=503, detail="the request's deadline passed")
        body = BatchResponse(
            results=[out if p in fresh else judgment(["a", "b", "c"]) for p in prompts]
        )
        return httpx.Response(200, content=msgspec.json.encode(body))


def test_a_busy_server_paces_the_gate_and_gets_every_item_again() -> None:
    """Items a server had no time for come back 503: the gate sends them again (waiting as
    the retry policy says) instead of handing the 503s on, and sends fewer requests at once
    while they do, down to one; input order holds (issue 66: a busy 2-core server)."""
    backend = BusyServer()
    client, waits = mock(backend.handler)
    pairs = list(client.gate((str(i) for i in range(40)), choices=["a", "b", "c"], batch_size=4))
    assert [item for item, _ in pairs] == [str(i) for i in range(40)]
    assert all(isinstance(d, JudgeResponse) for _, d in pairs)
    sent = [p for prompts, _, _ in backend.arrivals for p in prompts]
    assert sorted(sent) == sorted(str(i) for i in range(40) for _ in range(2))  # each twice
    assert len(waits) == 10  # one wait before each chunk's resend
    # Every request found the server out of time, so once the four the window opened with
    # were answered it holds one: each new chunk goes out alone.
    new = [n for _, n, first in backend.arrivals if first]
    assert len(new) == 10 and new[4:] == [1] * 6
    # And each told the server the client's deadline: less than its own timeout.
    assert backend.deadlines == {f"{server_deadline(60.0):.3f}"}

    # One the server never has time for keeps its 503 once the retries are spent.
    backend = BusyServer(never="5")
    client, waits = mock(backend.handler, retries=RetryPolicy(max_retries=2))
    pairs = list(client.gate((str(i) for i in range(8)), choices=["a", "b", "c"], batch_size=4))
    left = {item: d for item, d in pairs if isinstance(d, ErrorBody)}
    assert list(left) == ["5"] and left["5"].status_code == 503
    assert sum(p == "5" for prompts, _, _ in backend.arrivals for p in prompts) == 3

    # The async client, through the same steps.
    backend, slept = BusyServer(), []

    async def go() -> list[tuple[str, Any]]:
        async def sleep(seconds: float) -> None:
            slept.append(seconds)

        transport = httpx.MockTransport(backend.async_handler)
        async with AsyncJudgeClient("http://judge.test", transport=transport, sleep=sleep) as c:
            items = (str(i) for i in range(8))
            return [pair async for pair in c.gate(items, choices=["a", "b", "c"], batch_size=4)]

    pairs = asyncio.run(go())
    assert [item for item, _ in pairs] == [str(i) for i in range(8)] and len(slept) == 2
    assert all(isinstance(d, JudgeResponse) for _, d in pairs)


def test_the_server_s_deadline_is_a_little_less_than_the_client_s() -> None:
    assert server_deadline(60.0) == 54.0  # a tenth less
    assert server_deadline(5.0) == 4.0  # at least a second less
    assert server_deadline(1.0) == 0.5  # at most half
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, content=JUDGMENT)

    client, _ = mock(handler, timeout=20.0)
    client.judge("p", ["a", "b"])
    assert sent[-1].headers["X-Request-Timeout"] == "18.000"
    with contextlib.suppress(Exception):
        client.profiles()  # no model work: no deadline to give
    assert "X-Request-Timeout" not in sent[-1].headers


def test_gate_raises_when_a_whole_request_fails() -> None:
    client, _ = mock(BatchServer(lambda items: 0.0, fail_on="9").handler)
    got = []
    with pytest.raises(ClientError) as raised:
        for item, _ in client.gate(Source(20), choices=["a", "b"], batch_size=4):
            got.append(item)
    assert raised.value.status_code == 500
    assert got == ["0", "1", "2", "bad-3", "4", "5", "6", "7"]  # the batches before it


def test_gate_needs_choices_or_a_profile() -> None:
    client, _ = mock(BatchServer(lambda items: 0.0).handler)
    with pytest.raises(ValueError, match="choices"):
        next(client.gate(["text"]))
    with pytest.raises(ValueError, match="batch_size"):
        next(client.gate(["text"], choices=["a", "b"], batch_size=0))
    with pytest.raises(TypeError, match="str or JudgeRequest"):
        next(client.gate([3], choices=["a", "b"]))  # type: ignore[type-var]


def test_async_gate_is_ordered_lazy_and_bounded() -> None:
    backend = BatchServer(later_batches_first)
    source = Source(60)

    async def go() -> list[tuple[str, Any]]:
        transport = httpx.MockTransport(backend.async_handler)
        async with AsyncJudgeClient("http://judge.test", transport=transport) as client:
            gated = client.gate(
                source.aiter(), choices=["a", "b", "c"], batch_size=4, concurrency=3
            )
            first = await anext(gated)
            assert source.read <= 4 * 3
            return [first, *[pair async for pair in gated]]

    check_gated(asyncio.run(go()), 60)
    assert backend.requests == 15
    assert 2 <= backend.most_in_flight <= 3


def test_async_retries_use_the_injected_sleep() -> None:
    answers = [
        httpx.Response(503, headers={"Retry-After": "3"}),
        httpx.Response(200, content=JUDGMENT),
    ]
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    async def go() -> JudgeResponse:
        transport = httpx.MockTransport(lambda request: answers.pop(0))
        async with AsyncJudgeClient("http://judge.test", transport=transport, sleep=sleep) as c:
            return await c.judge("p", ["a", "b"])

    assert asyncio.run(go()).choice == "a" and waits == [3.0]


def test_fit_sends_its_method_sync_and_async() -> None:
    sent: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(msgspec.json.decode(request.content))
        body = {
            "status_code": 422,
            "detail": "method 'probe' needs 100 examples",
            "field": "method",
        }
        return httpx.Response(422, json=body)

    client, _ = mock(handler)
    with pytest.raises(ClientError) as raised:
        client.fit("x", ["a", "b"], [("p", "a")], method="probe")
    assert raised.value.status_code == 422 and raised.value.field == "method"
    with pytest.raises(ClientError):
        client.fit("x", ["a", "b"], [("p", "a")])

    async def go() -> None:
        transport = httpx.MockTransport(handler)
        async with AsyncJudgeClient("http://judge.test", transport=transport) as c:
            await c.fit("x", ["a", "b"], [("p", "a")], method="bias_temperature")

    with pytest.raises(ClientError):
        asyncio.run(go())
    assert [body["method"] for body in sent] == ["probe", "auto", "bias_temperature"]


def test_retry_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="max_retries"):
        RetryPolicy(max_retries=-1)
    with pytest.raises(ValueError, match="budget"):
        RetryPolicy(budget=float("nan"))


def test_each_method_sends_its_operation_s_method_and_path() -> None:
    """The paths are the service's table's (service.operations), sync and async alike."""
    from service.operations import BY_NAME

    sent: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append((request.method, request.url.raw_path.decode()))
        return httpx.Response(404, json={"status_code": 404, "detail": "x"})

    calls: list[tuple[str, dict[str, str], Callable[[Any], Any]]] = [
        ("judge", {}, lambda c: c.judge("p", ["a", "b"])),
        ("judge", {}, lambda c: c.judge_pair("s", "Which?", {"a": "x", "b": "y"})),
        ("judge_batch", {}, lambda c: c.judge_batch([JudgeRequest(prompt="p", choices=["a", "b"])])),
        ("judge_batch", {}, lambda c: c.judge_shared("c", [SharedQuestion(prompt="q", choices=["a", "b"])])),
        ("profiles", {}, lambda c: c.profiles()),
        ("profile", {"name": "a b/c"}, lambda c: c.profile("a b/c")),
        ("delete_profile", {"name": "sms"}, lambda c: c.delete_profile("sms")),
        ("fit", {"name": "sms"}, lambda c: c.fit("sms", ["a", "b"], [("p", "a")])),
        ("ready", {}, lambda c: c.ready()),
        ("profile_health_history", {"name": "sms"}, lambda c: c.profile_health_history("sms")),
        ("profile_versions", {"name": "sms"}, lambda c: c.profile_versions("sms")),
        ("rollback_profile", {"name": "sms"}, lambda c: c.rollback_profile("sms", '"abc"')),
        ("label_queue", {"name": "sms"}, lambda c: c.label_queue("sms")),
    ]  # fmt: skip
    for name, params, call in calls:
        op = BY_NAME[name]
        want = (op.method, op.url(**params))
        client, _ = mock(handler, retries=RetryPolicy(max_retries=0))
        sent.clear()
        with pytest.raises(ClientError):
            call(client)
        assert sent == [want], name

        async def go(call: Callable[[Any], Any] = call) -> None:
            transport = httpx.MockTransport(handler)
            async with AsyncJudgeClient("http://judge.test", transport=transport) as c:
                await call(c)

        sent.clear()
        with pytest.raises(ClientError):
            asyncio.run(go())
        assert sent == [want], name


# --- a remote cascade stage (service.cascade.stages) ------------------------------------------------


def test_a_remote_stage_decides_what_the_local_one_escalates(
    server: Server, client: JudgeClient
) -> None:
    from calibration import Cascade, Gate, Overrides
    from judge import Judge
    from service.cascade.stages import LocalStage, RemoteStage

    judge = Judge.load(dtype="float32")
    never = LocalStage("local", judge, Gate(overrides=Overrides(uncertified_threshold=1.0)))
    verdict = Cascade([never, RemoteStage("remote", server.url)]).judge(PROMPTS[0], CHOICES)
    local, remote = verdict.stages
    assert local.answer is not None and local.answer.decision == "escalate"
    assert remote.answer is not None and remote.failure is None
    # The remote answer is the server's own: the same item posted there directly.
    direct = client.judge(PROMPTS[0], CHOICES)
    assert remote.answer.raw_probabilities == direct.raw_probabilities
    assert remote.answer.raw_probabilities == local.answer.raw_probabilities  # same model
    assert remote.answer.decision == direct.decision
    assert verdict.decided_by == ("remote" if direct.decision == "accept" else None)


@contextlib.contextmanager
def _dying_server(hold_s: float) -> Iterator[str]:
    """A port whose process reads the request and dies after ``hold_s`` without answering,
    as a judge server killed mid-request does (the connection closes with no response)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            conn.recv(65536)
            time.sleep(hold_s)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        thread.join(timeout=5)


def test_a_remote_stage_killed_mid_request_or_too_slow_is_an_escalation() -> None:
    from calibration import Cascade
    from service.cascade.stages import RemoteStage

    with _dying_server(hold_s=0.2) as url:
        verdict = Cascade([RemoteStage("remote", url)]).judge(PROMPTS[0], CHOICES)
    (stage,) = verdict.stages
    assert not verdict.accepted and verdict.decided_by is None
    assert stage.failure == "stage_failed" and stage.answer is None
    # The connection closed with no response (or reset, the request unread): no answer.
    assert re.match(r"(RemoteProtocolError|ReadError)", stage.error or ""), stage.error
    # One that holds the request past what is left of the deadline: a timeout.
    with _dying_server(hold_s=3.0) as url:
        verdict = Cascade([RemoteStage("remote", url)]).judge(PROMPTS[0], CHOICES, deadline_s=0.5)
    (stage,) = verdict.stages
    assert stage.failure == "stage_timeout" and "did not answer within" in (stage.error or "")


def test_typed_questions_escalate_to_a_remote_stage(server: Server, judge: Any) -> None:
    """With a remote later stage, a typed question (POST /v1/systemone) and a pair (POST
    /judge) the first stage escalates are asked of the other server as the same question, and
    its answer stands; a stage that is down is an escalation with its reason code."""
    from litestar.testing import TestClient
    from server import settled

    from service import ServiceConfig, create_app

    question = {
        "type": "choice",
        "instructions": "Spam or ham?",
        "criteria": {"spam": None, "ham": None},
    }
    pair: dict[str, Any] = {
        "state": "Which message is the spam?",
        "instructions": "Pick the unsolicited advertising.",
        "candidates": {"a": TEXTS[0], "b": TEXTS[1]},
    }
    config = ServiceConfig(cascade={"remote": server.url, "down": "http://127.0.0.1:9"})
    with TestClient(app=create_app(judge, config=config)) as app:
        assert settled(app).status_code == 200
        r = app.post("/v1/systemone", json={"state": TEXTS[0], "questions": {"q": question}})
        assert r.status_code == 200, r.text
        answer = r.json()["answers"]["q"]
        paired = app.post("/judge", json=pair)
        assert paired.status_code == 200, paired.text
    # No profile: no stage has a certificate, so each escalates and a person decides.
    first, remote, down = answer["cascade"]
    assert [p["stage"] for p in answer["cascade"]] == ["local", "remote", "down"]
    assert first["answer"]["reason_codes"] == ["uncalibrated"]
    assert remote["answer"]["reason_codes"] == ["uncalibrated"]
    assert down["failure"] == "stage_failed" and down["answer"] is None
    assert answer["decided_by"] is None and answer["decision"] == "escalate"
    # The remote part is the server's own answer to the same question, which stands.
    with JudgeClient(server.url, timeout=120) as direct:
        own = direct.systemone(TEXTS[0], {"q": question}).answers["q"]
        own_pair = direct.judge_pair(pair["state"], pair["instructions"], pair["candidates"])
    assert remote["answer"]["raw_probabilities"] == own.raw_probabilities
    assert answer["raw_probabilities"] == own.raw_probabilities
    assert remote["answer"]["judgment_id"] == answer["judgment_id"]
    # A pair the remote stage answered, in a judgment's shape: its winner and its listings.
    body = paired.json()
    assert [p["stage"] for p in body["cascade"]] == ["local", "remote", "down"]
    assert body["raw_probabilities"] == own_pair.raw_probabilities
    assert body["orderings"] == 2 and body["choice"] in ("a", "b")
    assert body["judgment_id"] == body["cascade"][1]["answer"]["judgment_id"]


# --- a System One server as a stage (service.cascade.system_one_stage) -----------------------------


def test_a_system_one_stage_is_decided_by_its_own_gate(server: Server) -> None:
    from calibration import Cascade, Gate, Overrides
    from service.cascade.system_one_stage import SystemOneStage

    stage = SystemOneStage("s1", server.url, instructions="Spam or ham?")
    verdict = Cascade([stage]).judge(PROMPTS[0], CHOICES)
    (part,) = verdict.stages
    assert part.failure is None and part.answer is not None
    # What the server answers the same question directly, decided by this side's gate.
    question = {
        "type": "choice",
        "instructions": "Spam or ham?",
        "criteria": dict.fromkeys(CHOICES),
    }
    with JudgeClient(server.url, timeout=120) as c:
        direct = c.systemone(PROMPTS[0], {"item": question}).answers["item"]
    assert part.answer.raw_probabilities == pytest.approx(direct.raw_probabilities, abs=1e-4)
    assert part.answer.computed_tokens and part.answer.model
    top = max(direct.raw_probabilities.values())
    assert part.answer.decision == ("accept" if top >= 0.9 else "escalate")
    assert verdict.decided_by == ("s1" if top >= 0.9 else None)
    # A stricter gate on this side escalates what the server would not.
    strict = SystemOneStage(
        "s1", server.url, gate=Gate(overrides=Overrides(uncertified_threshold=1.0))
    )
    assert Cascade([strict]).judge(PROMPTS[0], CHOICES).decided_by is None


def test_a_system_one_stage_reads_a_bare_answer_and_fails_as_an_escalation() -> None:
    from calibration import Cascade, Gate, Overrides
    from service.cascade.system_one_stage import SystemOneStage

    sent: list[dict[str, Any]] = []

    def bare(request: httpx.Request) -> httpx.Response:
        sent.append({"body": json.loads(request.content), **dict(request.headers)})
        answer = {"type": "choice", "choice": "ham", "confidence": 0.96}  # no probabilities
        return httpx.Response(200, json={"model": "hosted-1", "answers": {"item": answer}})

    stage = SystemOneStage(
        "hosted",
        "http://s1.test/api/",
        model="hosted-1",
        api_key="k",
        transport=httpx.MockTransport(bare),
        # No profile for a hosted model here: the opt-in lets its 0.96 accept.
        gate=Gate(overrides=Overrides(uncertified_threshold=0.9)),
    )
    verdict = Cascade([stage]).judge("Is this spam? hi", ["spam", "ham", "unsure"])
    (part,) = verdict.stages
    assert part.answer is not None and verdict.decided_by == "hosted"
    assert part.answer.raw_probabilities == pytest.approx(
        {"spam": 0.02, "ham": 0.96, "unsure": 0.02}
    )
    assert part.answer.model == "hosted-1" and part.answer.computed_tokens is None
    (request,) = sent
    assert request["body"] == {
        "state": "Is this spam? hi",
        "questions": {
            "item": {
                "type": "choice",
                "instructions": "Which option fits?",
                "criteria": {"spam": None, "ham": None, "unsure": None},
            }
        },
        "model": "hosted-1",
    }
    assert request["authorization"] == "Bearer k"

    def down(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, text="bad gateway")

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no answer", request=request)

    for handler, failure, words in (
        (down, "stage_failed", "502"),
        (slow, "stage_timeout", "within"),
    ):
        failing = SystemOneStage("hosted", "http://s1.test", transport=httpx.MockTransport(handler))
        (part,) = Cascade([failing]).judge("Is this spam? hi", ["spam", "ham"]).stages
        assert part.failure == failure and part.answer is None and words in (part.error or "")
