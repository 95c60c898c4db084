"""A typed Python client for the HTTP service, sync (``JudgeClient``) and async (``AsyncJudgeClient``).

    with JudgeClient("http://127.0.0.1:8000", api_key=key) as client:
        client.wait_ready(300)
        for text, d in client.gate(texts, profile="sms_spam"):
            if isinstance(d, JudgeResponse) and d.decision == "accept": ...

Responses decode into the service's own Structs (``service.schemas`` and calibration's
``CalibrationProfile``), so there is one schema, not a client-side copy; the response Structs
accept fields they do not know, so a newer server does not break an older client. Requests
are built from the request Structs and checked by the server, whose 4xx names the field.

Errors:

    ClientError           an HTTP error status, after any retries: .status_code, .field,
                          .detail and .body (the decoded error body)
    httpx.TransportError  no HTTP answer (connection refused, timeout), after any retries
    TimeoutError          wait_ready ran out of time

Retries (``RetryPolicy``): a 503 means the server did no work (still loading, queue full), so
every call is retried on it, waiting what ``Retry-After`` says (capped by ``max_wait``) or an
exponential backoff with jitter when it says nothing, within ``budget`` seconds of waiting
per call. A call that never got an answer is retried only when repeating it is harmless:
everything but ``fit``, which would fit (and judge every example) twice.
"""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import math
import random
import time
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Sequence,
)
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypedDict, TypeVar, Unpack
from urllib.parse import quote

import httpx
import msgspec

from calibration import CalibrationProfile
from service.schemas import (
    MAX_BATCH_ITEMS,
    BatchRequest,
    BatchResponse,
    ErrorBody,
    FitMethod,
    FitRequest,
    JudgeRequest,
    JudgeResponse,
    LabeledExample,
    ProfileSummary,
    SharedQuestion,
)

# The schema's Structs too, so that one import serves a program that uses the client.
__all__ = [
    "AsyncJudgeClient",
    "CalibrationProfile",
    "ClientError",
    "ErrorBody",
    "FitMethod",
    "GateResult",
    "JudgeClient",
    "JudgeOptions",
    "JudgeRequest",
    "JudgeResponse",
    "LabeledExample",
    "ProfileSummary",
    "RetryPolicy",
    "SharedQuestion",
    "parse_retry_after",
]

Item = TypeVar("Item", bound=str | JudgeRequest)
GateResult = JudgeResponse | ErrorBody
Example = tuple[str, str] | LabeledExample
T = TypeVar("T")


class ClientError(Exception):
    """The server answered with an error status (after retries, for a 503)."""

    def __init__(
        self, status_code: int, detail: str, field: str | None = None, body: Any = None
    ) -> None:
        super().__init__(status_code, detail, field)
        self.status_code = status_code
        self.detail = detail
        self.field = field
        self.body = body  # the decoded JSON body, or the text when it was not JSON

    def __str__(self) -> str:
        named = f" (field {self.field!r})" if self.field else ""
        return f"HTTP {self.status_code}{named}: {self.detail}"


@dataclass(frozen=True)
class RetryPolicy:
    """When to try a call again, and how long to wait first (seconds)."""

    max_retries: int = 3  # retries after the first try
    max_wait: float = 30.0  # cap on one wait, Retry-After included
    budget: float = 60.0  # cap on all the waits of one call together
    backoff: float = 0.5  # the first wait when the server gives no Retry-After; doubles each time

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        for name in ("max_wait", "budget", "backoff"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def wait(
        self, attempt: int, retry_after: str | None, waited: float, rng: random.Random
    ) -> float | None:
        """The wait before retry number ``attempt + 1``, or None when none is left.

        ``retry_after`` is the header of the failed answer (None after a transport error);
        ``waited`` is the time already spent waiting on this call.
        """
        if attempt >= self.max_retries:
            return None
        told = parse_retry_after(retry_after)
        if told is None:
            # "Equal jitter": half the exponential step, plus up to half again at random, so
            # clients that failed together do not all come back together.
            step = self.backoff * 2.0**attempt
            told = step / 2 + rng.uniform(0, step / 2)
        wait = min(told, self.max_wait)
        return wait if waited + wait <= self.budget else None


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header: delay-seconds or an HTTP date (RFC 9110 10.2.3)."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return max(seconds, 0.0) if math.isfinite(seconds) else None


# --- one call, as data: sync and async clients differ only in how they send it --------------


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    body: bytes | None = None
    idempotent: bool = True  # safe to send again when no answer came back
    timeout: float | None = None  # None: the client's


_DECODERS: dict[Any, msgspec.json.Decoder[Any]] = {}


def _decode(response: httpx.Response, into: type[T]) -> T:
    if response.status_code >= 400:
        raise _error(response)
    decoder = _DECODERS.get(into)
    if decoder is None:
        decoder = _DECODERS[into] = msgspec.json.Decoder(into)
    result: T = decoder.decode(response.content)
    return result


def _error(response: httpx.Response) -> ClientError:
    """The error an error answer stands for, from the service's {"status_code", "detail", "field"?}."""
    try:
        body: Any = msgspec.json.decode(response.content)
    except msgspec.DecodeError:
        body = response.text
    if isinstance(body, dict):
        detail = body.get("detail")
        field = body.get("field")
        return ClientError(
            response.status_code,
            str(detail) if detail is not None else response.reason_phrase,
            field if isinstance(field, str) else None,
            body,
        )
    return ClientError(response.status_code, str(body)[:500] or response.reason_phrase, None, body)


def _name(name: str) -> str:
    return quote(name, safe="")  # a name is one path segment, whatever it holds


def _examples(examples: Iterable[Example]) -> list[LabeledExample]:
    return [
        e if isinstance(e, LabeledExample) else LabeledExample(prompt=e[0], label=e[1])
        for e in examples
    ]


def _batch_results(response: httpx.Response, sent: int) -> list[GateResult]:
    results = _decode(response, BatchResponse).results
    if len(results) != sent:
        raise ClientError(
            response.status_code, f"the server answered {len(results)} results for {sent} items"
        )
    return results


def _shared_results(response: httpx.Response, sent: int) -> list[JudgeResponse]:
    out = []
    for r in _batch_results(response, sent):
        if isinstance(r, ErrorBody):  # the service fails a shared batch as a whole; in case
            raise ClientError(r.status_code, r.detail, r.field, r)
        out.append(r)
    return out


@dataclass
class _Gate:
    """How ``gate`` turns an item into a request; strings take the gate's options."""

    choices: list[str] | None
    options: dict[str, Any]

    def request(self, item: str | JudgeRequest) -> JudgeRequest:
        if isinstance(item, JudgeRequest):
            return item
        if not isinstance(item, str):
            raise TypeError(
                f"gate items must be str or JudgeRequest, got {type(item).__name__}: {item!r}"
            )
        assert self.choices is not None  # checked when the gate started
        return JudgeRequest(prompt=item, choices=self.choices, **self.options)


def _check_gate(batch_size: int, concurrency: int) -> None:
    if not 1 <= batch_size <= MAX_BATCH_ITEMS:
        raise ValueError(f"batch_size must be in [1, {MAX_BATCH_ITEMS}], got {batch_size}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")


class _Base:
    """What both clients share: settings and how each method's call is built."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        timeout: float,
        retries: RetryPolicy | None,
        seed: int | None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries if retries is not None else RetryPolicy()
        # Sent on every call; the key never appears in an error or a repr.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self._rng = random.Random(seed)

    @staticmethod
    def _judge_call(request: JudgeRequest) -> _Call:
        return _Call("POST", "/judge", msgspec.json.encode(request))

    @staticmethod
    def _batch_call(request: BatchRequest) -> _Call:
        return _Call("POST", "/judge/batch", msgspec.json.encode(request))

    @staticmethod
    def _fit_call(name: str, request: FitRequest, timeout: float | None) -> _Call:
        body = msgspec.json.encode(request)
        return _Call(
            "POST", f"/profiles/{_name(name)}/fit", body, idempotent=False, timeout=timeout
        )

    @staticmethod
    def _gate_options(
        choices: Sequence[str] | None,
        profile: str | None,
        threshold: float | None,
        min_choice_mass: float | None,
        system: str | None,
    ) -> _Gate:
        options = {
            "profile": profile,
            "threshold": threshold,
            "min_choice_mass": min_choice_mass,
            "system": system,
        }
        return _Gate(list(choices) if choices is not None else None, options)

    def _request(self, http: httpx.Client | httpx.AsyncClient, call: _Call) -> httpx.Request:
        headers = {"Content-Type": "application/json"} if call.body is not None else None
        timeout = self._timeout if call.timeout is None else call.timeout
        return http.build_request(
            call.method, call.path, content=call.body, headers=headers, timeout=timeout
        )


class JudgeOptions(TypedDict, total=False):
    """``judge``'s keyword arguments: the optional fields of ``JudgeRequest``."""

    system: str | None
    profile: str | None
    threshold: float | None
    min_choice_mass: float | None
    response_prefix: str | None
    response_suffix: str | None
    return_prompt: bool
    values: dict[str, float] | None  # a score: a number per choice
    max_std: float | None  # escalate a score whose std is above this


def _judge_request(prompt: str, choices: Sequence[str], **options: Any) -> JudgeRequest:
    return JudgeRequest(prompt=prompt, choices=list(choices), **options)


def _fit_request(choices: Sequence[str], examples: Iterable[Example], **options: Any) -> FitRequest:
    return FitRequest(choices=list(choices), examples=_examples(examples), **options)


class JudgeClient(_Base):
    """The service from Python, on ``httpx.Client``; safe to share between threads.

    ``transport`` replaces the network (an ``httpx.MockTransport`` in tests); ``sleep`` is
    how retries wait; ``seed`` fixes the backoff's jitter.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        retries: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        seed: int | None = None,
    ) -> None:
        super().__init__(base_url, api_key, timeout, retries, seed)
        self._http = httpx.Client(
            base_url=self.base_url, headers=self._headers, timeout=timeout, transport=transport
        )
        self._sleep = sleep

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: _Call) -> httpx.Response:
        """Send ``call``, retrying per ``self.retries``; an error status is returned, not raised."""
        waited, attempt = 0.0, 0
        while True:
            try:
                response = self._http.send(self._request(self._http, call))
            except httpx.TransportError:
                wait = self.retries.wait(attempt, None, waited, self._rng)
                if not call.idempotent or wait is None:
                    raise
            else:
                if response.status_code != 503:
                    return response
                retry_after = response.headers.get("retry-after")
                wait = self.retries.wait(attempt, retry_after, waited, self._rng)
                if wait is None:
                    return response
            self._sleep(wait)
            waited, attempt = waited + wait, attempt + 1

    # --- judging --------------------------------------------------------------------------

    def judge(
        self, prompt: str, choices: Sequence[str], **options: Unpack[JudgeOptions]
    ) -> JudgeResponse:
        """``POST /judge``: one prompt between ``choices``, and the decision on it."""
        request = _judge_request(prompt, choices, **options)
        return _decode(self._send(self._judge_call(request)), JudgeResponse)

    def judge_batch(self, items: Sequence[JudgeRequest]) -> list[GateResult]:
        """``POST /judge/batch``: each item's judgment, or its 4xx as an ErrorBody, in order."""
        call = self._batch_call(BatchRequest(items=list(items)))
        return _batch_results(self._send(call), len(items))

    def judge_shared(
        self, context: str, questions: Sequence[SharedQuestion]
    ) -> list[JudgeResponse]:
        """``POST /judge/batch`` with a shared context: the context is encoded once."""
        call = self._batch_call(BatchRequest(context=context, questions=list(questions)))
        return _shared_results(self._send(call), len(questions))

    def gate(
        self,
        items: Iterable[Item],
        *,
        choices: Sequence[str] | None = None,
        profile: str | None = None,
        threshold: float | None = None,
        min_choice_mass: float | None = None,
        system: str | None = None,
        batch_size: int = 16,
        concurrency: int = 4,
    ) -> Generator[tuple[Item, GateResult], None, None]:
        """Each item with its decision, in input order; lazy over ``items``.

        A string item is a prompt judged with the options given here (``choices`` default to
        the profile's); a ``JudgeRequest`` is sent as it is. Items go out ``batch_size`` to a
        request, at most ``concurrency`` requests at a time, so at most
        ``batch_size * concurrency`` items are held. An item's 4xx comes back as an ErrorBody
        in its place; a request that fails as a whole raises ClientError.
        """
        _check_gate(batch_size, concurrency)
        gate = self._gate_options(choices, profile, threshold, min_choice_mass, system)
        chunks = _chunks(items, batch_size)
        pool = ThreadPoolExecutor(concurrency, thread_name_prefix="judge-gate")
        pending: deque[tuple[list[Item], Future[list[GateResult]]]] = deque()

        def submit(chunk: list[Item]) -> None:
            if gate.choices is None and any(isinstance(i, str) for i in chunk):
                gate.choices = self._gate_choices(profile)
            requests = [gate.request(item) for item in chunk]
            pending.append((chunk, pool.submit(self.judge_batch, requests)))

        try:
            for chunk in itertools.islice(chunks, concurrency):
                submit(chunk)
            while pending:
                chunk, future = pending.popleft()
                yield from zip(chunk, future.result(), strict=True)
                # Only now: the chunk just yielded was the one held beyond those in flight.
                following = next(chunks, None)
                if following is not None:
                    submit(following)
        finally:
            for _, future in pending:
                future.cancel()
            pool.shutdown(wait=False, cancel_futures=True)

    def _gate_choices(self, profile: str | None) -> list[str]:
        if profile is None:
            raise ValueError("choices: give the choices, or a profile to take them from")
        return self.profile(profile).choices

    # --- profiles -------------------------------------------------------------------------

    def profiles(self) -> list[ProfileSummary]:
        """``GET /profiles``: a summary of every profile the server has."""
        return _decode(self._send(_Call("GET", "/profiles")), list[ProfileSummary])

    def profile(self, name: str) -> CalibrationProfile:
        """``GET /profiles/{name}``: the whole profile."""
        return _decode(self._send(_Call("GET", f"/profiles/{_name(name)}")), CalibrationProfile)

    def put_profile(self, profile: CalibrationProfile) -> CalibrationProfile:
        """``PUT /profiles/{profile.name}``: upload (or replace) a profile."""
        call = _Call("PUT", f"/profiles/{_name(profile.name)}", msgspec.json.encode(profile))
        return _decode(self._send(call), CalibrationProfile)

    def delete_profile(self, name: str) -> None:
        """``DELETE /profiles/{name}``."""
        response = self._send(_Call("DELETE", f"/profiles/{_name(name)}"))
        if response.status_code >= 400:
            raise _error(response)

    def fit(
        self,
        name: str,
        choices: Sequence[str],
        examples: Iterable[Example],
        *,
        system: str | None = None,
        response_prefix: str | None = None,
        response_suffix: str | None = None,
        target_precision: float = 0.9,
        delta: float = 0.1,
        alpha: float = 0.1,
        method: FitMethod = "auto",
        timeout: float | None = None,
    ) -> CalibrationProfile:
        """``POST /profiles/{name}/fit`` on (prompt, label) pairs; the server keeps the profile.

        ``method`` is ``FitRequest.method``: "auto" (the default), "temperature",
        "bias_temperature" or "probe" (a learned head on the model's hidden state; at least
        100 examples). Fitting judges every example, so give a ``timeout`` that fits their
        number. It is retried on a 503 (no work was done) but not when no answer came back.
        """
        request = _fit_request(
            choices,
            examples,
            system=system,
            response_prefix=response_prefix,
            response_suffix=response_suffix,
            target_precision=target_precision,
            delta=delta,
            alpha=alpha,
            method=method,
        )
        return _decode(self._send(self._fit_call(name, request, timeout)), CalibrationProfile)

    # --- readiness ------------------------------------------------------------------------

    def ready(self) -> bool:
        """``GET /ready``: True once the model is loaded, False while it loads.

        A model that failed to load raises ClientError: that server will never be ready.
        """
        return _ready(self._http.send(self._request(self._http, _Call("GET", "/ready"))))

    def wait_ready(self, timeout: float = 300.0, interval: float = 0.2) -> None:
        """Poll ``/ready`` until it answers 200; TimeoutError after ``timeout`` seconds.

        A server that cannot be reached yet counts as not ready; one whose model failed to
        load raises ClientError at once.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                response = self._http.send(self._request(self._http, _Call("GET", "/ready")))
            except httpx.TransportError:
                response = None
            if response is not None and _ready(response):
                return
            if time.monotonic() + interval > deadline:
                raise TimeoutError(f"{self.base_url} was not ready within {timeout} s")
            self._sleep(interval)


class AsyncJudgeClient(_Base):
    """``JudgeClient`` for asyncio, on ``httpx.AsyncClient``: the same methods, awaited."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        retries: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        seed: int | None = None,
    ) -> None:
        super().__init__(base_url, api_key, timeout, retries, seed)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, timeout=timeout, transport=transport
        )
        self._sleep = sleep

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _send(self, call: _Call) -> httpx.Response:
        """``JudgeClient._send``, awaited."""
        waited, attempt = 0.0, 0
        while True:
            try:
                response = await self._http.send(self._request(self._http, call))
            except httpx.TransportError:
                wait = self.retries.wait(attempt, None, waited, self._rng)
                if not call.idempotent or wait is None:
                    raise
            else:
                if response.status_code != 503:
                    return response
                retry_after = response.headers.get("retry-after")
                wait = self.retries.wait(attempt, retry_after, waited, self._rng)
                if wait is None:
                    return response
            await self._sleep(wait)
            waited, attempt = waited + wait, attempt + 1

    async def judge(
        self, prompt: str, choices: Sequence[str], **options: Unpack[JudgeOptions]
    ) -> JudgeResponse:
        """``JudgeClient.judge``, awaited."""
        request = _judge_request(prompt, choices, **options)
        return _decode(await self._send(self._judge_call(request)), JudgeResponse)

    async def judge_batch(self, items: Sequence[JudgeRequest]) -> list[GateResult]:
        """``JudgeClient.judge_batch``, awaited."""
        call = self._batch_call(BatchRequest(items=list(items)))
        return _batch_results(await self._send(call), len(items))

    async def judge_shared(
        self, context: str, questions: Sequence[SharedQuestion]
    ) -> list[JudgeResponse]:
        """``JudgeClient.judge_shared``, awaited."""
        call = self._batch_call(BatchRequest(context=context, questions=list(questions)))
        return _shared_results(await self._send(call), len(questions))

    async def gate(
        self,
        items: Iterable[Item] | AsyncIterable[Item],
        *,
        choices: Sequence[str] | None = None,
        profile: str | None = None,
        threshold: float | None = None,
        min_choice_mass: float | None = None,
        system: str | None = None,
        batch_size: int = 16,
        concurrency: int = 4,
    ) -> AsyncGenerator[tuple[Item, GateResult], None]:
        """``JudgeClient.gate`` as an async generator: ``async for item, d in client.gate(...)``.

        ``items`` may be an async iterable; requests in flight are tasks, at most
        ``concurrency`` of them.
        """
        _check_gate(batch_size, concurrency)
        gate = self._gate_options(choices, profile, threshold, min_choice_mass, system)
        chunks = _achunks(items, batch_size)
        pending: deque[tuple[list[Item], asyncio.Task[list[GateResult]]]] = deque()

        async def submit(chunk: list[Item]) -> None:
            if gate.choices is None and any(isinstance(i, str) for i in chunk):
                gate.choices = await self._gate_choices(profile)
            requests = [gate.request(item) for item in chunk]
            pending.append((chunk, asyncio.create_task(self.judge_batch(requests))))

        try:
            while len(pending) < concurrency and (chunk := await anext(chunks, None)) is not None:
                await submit(chunk)
            while pending:
                chunk, task = pending.popleft()
                for pair in zip(chunk, await task, strict=True):
                    yield pair
                following = await anext(chunks, None)
                if following is not None:
                    await submit(following)
        finally:
            for _, task in pending:
                task.cancel()
            await asyncio.gather(*(task for _, task in pending), return_exceptions=True)

    async def _gate_choices(self, profile: str | None) -> list[str]:
        if profile is None:
            raise ValueError("choices: give the choices, or a profile to take them from")
        return (await self.profile(profile)).choices

    async def profiles(self) -> list[ProfileSummary]:
        """``JudgeClient.profiles``, awaited."""
        return _decode(await self._send(_Call("GET", "/profiles")), list[ProfileSummary])

    async def profile(self, name: str) -> CalibrationProfile:
        """``JudgeClient.profile``, awaited."""
        response = await self._send(_Call("GET", f"/profiles/{_name(name)}"))
        return _decode(response, CalibrationProfile)

    async def put_profile(self, profile: CalibrationProfile) -> CalibrationProfile:
        """``JudgeClient.put_profile``, awaited."""
        call = _Call("PUT", f"/profiles/{_name(profile.name)}", msgspec.json.encode(profile))
        return _decode(await self._send(call), CalibrationProfile)

    async def delete_profile(self, name: str) -> None:
        """``JudgeClient.delete_profile``, awaited."""
        response = await self._send(_Call("DELETE", f"/profiles/{_name(name)}"))
        if response.status_code >= 400:
            raise _error(response)

    async def fit(
        self,
        name: str,
        choices: Sequence[str],
        examples: Iterable[Example],
        *,
        system: str | None = None,
        response_prefix: str | None = None,
        response_suffix: str | None = None,
        target_precision: float = 0.9,
        delta: float = 0.1,
        alpha: float = 0.1,
        method: FitMethod = "auto",
        timeout: float | None = None,
    ) -> CalibrationProfile:
        """``JudgeClient.fit``, awaited."""
        request = _fit_request(
            choices,
            examples,
            system=system,
            response_prefix=response_prefix,
            response_suffix=response_suffix,
            target_precision=target_precision,
            delta=delta,
            alpha=alpha,
            method=method,
        )
        response = await self._send(self._fit_call(name, request, timeout))
        return _decode(response, CalibrationProfile)

    async def ready(self) -> bool:
        """``JudgeClient.ready``, awaited."""
        return _ready(await self._http.send(self._request(self._http, _Call("GET", "/ready"))))

    async def wait_ready(self, timeout: float = 300.0, interval: float = 0.2) -> None:
        """``JudgeClient.wait_ready``, awaited."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                response = await self._http.send(self._request(self._http, _Call("GET", "/ready")))
            except httpx.TransportError:
                response = None
            if response is not None and _ready(response):
                return
            if time.monotonic() + interval > deadline:
                raise TimeoutError(f"{self.base_url} was not ready within {timeout} s")
            await self._sleep(interval)


def _ready(response: httpx.Response) -> bool:
    """True on 200, False while loading; raises on a failed load or any other error."""
    if response.status_code == 503:
        error = _error(response)
        body = error.body
        if isinstance(body, dict) and body.get("status") == "failed":
            raise error
        return False
    _decode(response, dict[str, Any])
    return True


def _chunks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


async def _achunks(items: Iterable[T] | AsyncIterable[T], size: int) -> AsyncIterator[list[T]]:
    if not isinstance(items, AsyncIterable):
        for whole in _chunks(items, size):
            yield whole
        return
    chunk: list[T] = []
    async for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
