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
everything but ``fit``, which would fit (and judge every example) twice
(``Operation.idempotent``). A call that runs the model sends the server its deadline
(X-Request-Timeout, ``server_deadline``: a little less than the client's timeout), so that a
busy server answers 503 before the client gives up; the gate resends the items of a batch
that came back 503 and sends fewer requests at once while they do.

One implementation, two transports. What each method does (the request, the retries, the
answer's decoding, the gate's ordering and bounds) is written once, in ``_Core``, as a
generator of steps that does no I/O: it yields ``_Send`` (one HTTP exchange) and ``_Sleep``
(a wait), and the gate also ``_Take`` (the next chunk of input), ``_Spawn``, ``_Join`` and
``_Emit``. ``JudgeClient`` runs the steps on ``httpx.Client``, threads and ``time.sleep``;
``AsyncJudgeClient`` on ``httpx.AsyncClient``, tasks and ``asyncio.sleep``. Methods and paths
come from the service's table of operations (``service.operations``).

Installed alone (``pip install calibrated-judge``, without the ``server`` extra), the client needs only
msgspec, httpx and numpy: this module imports neither the engine nor the server.
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
    Mapping,
    Sequence,
)
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Literal, Self, TypedDict, TypeVar, Unpack

import httpx
import msgspec

from calibration.profile import CalibrationProfile
from service.log.health import ProfileHealth
from service.log.health_history import HealthHistory
from service.log.record import LoggedDecision
from service.operations import BY_NAME, TIMEOUT_HEADER, Operation
from service.schemas import (
    MAX_BATCH_ITEMS,
    BatchItem,
    BatchResponse,
    ErrorBody,
    FitMethod,
    FitRequest,
    ItemRequest,
    ItemsBatch,
    JudgeRequest,
    JudgeResponse,
    LabeledExample,
    LabelItem,
    LabelQueue,
    LabelRequest,
    LabelResult,
    LabelsRequest,
    LabelsResponse,
    PairRequest,
    ProfileSummary,
    ProfileVersions,
    RollbackRequest,
    SharedBatch,
    SharedQuestion,
)
from service.systemone import SystemOneQuestion, SystemOneRequest, SystemOneResponse

# The schema's Structs too, so that one import serves a program that uses the client.
__all__ = [
    "AsyncJudgeClient",
    "CalibrationProfile",
    "ClientError",
    "ErrorBody",
    "FitMethod",
    "FitOptions",
    "GateOptions",
    "GateResult",
    "ItemOptions",
    "ItemRequest",
    "JudgeClient",
    "JudgeOptions",
    "JudgeRequest",
    "JudgeResponse",
    "LabelResult",
    "LabeledExample",
    "LabelsResponse",
    "LoggedDecision",
    "PairOptions",
    "ProfileHealth",
    "ProfileSummary",
    "RetryPolicy",
    "SharedQuestion",
    "SystemOneQuestion",
    "SystemOneResponse",
    "parse_retry_after",
    "server_deadline",
]

Item = TypeVar("Item", bound=str | JudgeRequest)
GateResult = JudgeResponse | ErrorBody
Example = tuple[str, str] | LabeledExample
T = TypeVar("T")
Steps = Generator["_Send | _Sleep", Any, T]  # a call, as steps: see _Core


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


def server_deadline(timeout: float) -> float:
    """The deadline a call that waits ``timeout`` seconds gives the server (X-Request-Timeout):
    a tenth less (at least 1 s, at most half), so that a server out of time answers 503 in
    each item's place while the client still listens, instead of working on while the client
    times out and sends the whole request again."""
    return timeout - min(max(1.0, timeout / 10), timeout / 2)


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


# --- a call's answer ----------------------------------------------------------------------

_DECODERS: dict[Any, msgspec.json.Decoder[Any]] = {}


def _decode(response: httpx.Response, into: Any) -> Any:
    if response.status_code >= 400:
        raise _error(response)
    decoder = _DECODERS.get(into)
    if decoder is None:
        decoder = _DECODERS[into] = msgspec.json.Decoder(into)
    return decoder.decode(response.content)


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


def _batch_results(response: httpx.Response, sent: int) -> list[GateResult]:
    results: list[GateResult] = _decode(response, BatchResponse).results
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


# --- the options of the methods that take many --------------------------------------------


class JudgeOptions(TypedDict, total=False):
    """``judge``'s keyword arguments: the optional fields of ``JudgeRequest``."""

    system: str | None
    profile: str | None
    threshold: float | None  # overrides the profile's certified threshold (none: a 422)
    uncertified_threshold: float | None  # the opt-in: accept with no certificate
    min_choice_mass: float | None
    response_prefix: str | None
    response_suffix: str | None
    return_prompt: bool
    values: dict[str, float] | None  # a score: a number per choice
    max_std: float | None  # escalate a score whose std is above this
    item_span: tuple[int, int] | None  # the item's [start, end) characters in the prompt


class ItemOptions(TypedDict, total=False):
    """``judge_item``'s keyword arguments: the optional fields of ``ItemRequest``."""

    threshold: float | None
    uncertified_threshold: float | None
    min_choice_mass: float | None
    return_prompt: bool


class PairOptions(TypedDict, total=False):
    """``judge_pair``'s keyword arguments: the optional fields of ``PairRequest``."""

    criteria: str | dict[str, Any] | None  # the rubric
    order: Literal["given", "invariant"]  # "invariant" (default): both orders
    profile: str | None  # fitted for the two candidates' names
    threshold: float | None
    uncertified_threshold: float | None
    min_choice_mass: float | None
    max_order_spread: float | None  # escalate when the orders disagree more (default 0.2)
    return_prompt: bool


class FitOptions(TypedDict, total=False):
    """``fit``'s keyword arguments: the optional fields of ``FitRequest``, and a timeout.

    ``method`` (default "auto"; "temperature", "bias_temperature" or "probe": a learned head
    on the model's hidden state, at least 100 examples); ``target_precision`` (0.9),
    ``delta`` (0.1) and ``alpha`` (0.1); ``timeout``: seconds for the whole fit (default:
    the client's).
    """

    system: str | None
    response_prefix: str | None
    response_suffix: str | None
    target_precision: float
    delta: float
    alpha: float
    method: FitMethod
    timeout: float | None


class GateOptions(TypedDict, total=False):
    """``gate``'s keyword arguments.

    ``choices`` (default: the profile's), ``profile``, ``threshold``,
    ``uncertified_threshold``, ``min_choice_mass`` and ``system`` apply to string items: with
    no choices, a profile fitted on a task gets each string as the item alone, in its own
    prompt. ``batch_size`` (16) items go in one request, at most ``concurrency`` (4) requests
    at a time.
    """

    choices: Sequence[str] | None
    profile: str | None
    threshold: float | None
    uncertified_threshold: float | None
    min_choice_mass: float | None
    system: str | None
    batch_size: int
    concurrency: int


# --- the steps a call is made of, and the gate's -------------------------------------------


@dataclass(frozen=True)
class _Send:
    """One HTTP exchange: answered with the response, or a TransportError thrown back."""

    method: str
    path: str
    body: bytes | None = None
    timeout: float | None = None  # None: the client's
    # The operation runs the model: the server is told the client's deadline
    # (X-Request-Timeout), so that it gives up, and answers, before the client stops waiting.
    deadline: bool = False


@dataclass(frozen=True)
class _Sleep:
    seconds: float


@dataclass(frozen=True)
class _Take:
    """The next ``size`` items of the gate's input (fewer at its end; none past it)."""

    size: int


@dataclass(frozen=True)
class _Spawn:
    """Start ``steps`` without waiting for them: answered with a handle for ``_Join``."""

    steps: Steps[list[GateResult]]


@dataclass(frozen=True)
class _Join:
    handle: Any  # what _Spawn answered


@dataclass(frozen=True)
class _Call:
    """Run ``steps`` here and now: answered with their result."""

    steps: Steps[Any]


@dataclass(frozen=True)
class _Emit:
    """Hand these (item, result) pairs to the gate's consumer."""

    pairs: list[tuple[Any, GateResult]]


_GateStep = _Take | _Spawn | _Join | _Call | _Emit


@dataclass(frozen=True)
class _Done(Generic[T]):
    value: T


def _unserved(result: GateResult) -> bool:
    """An item the server served no decision for, a 503 in its place (out of time, out of
    queue room, or a log that could not keep it): nothing of it was logged or answered, so
    it may be sent again."""
    return isinstance(result, ErrorBody) and result.status_code == 503


def _sleeping(seconds: float) -> Steps[None]:
    """A wait, as steps a transport runs."""
    yield _Sleep(seconds)


def _resume(
    steps: Generator[Any, Any, T], value: Any, error: BaseException | None
) -> Any | _Done[T]:
    """The next step, given the last one's answer (or error); ``_Done`` when they are over."""
    try:
        return steps.send(value) if error is None else steps.throw(error)
    except StopIteration as done:
        return _Done(done.value)


@dataclass(frozen=True)
class _GateSettings:
    batch_size: int
    concurrency: int

    @staticmethod
    def of(options: GateOptions) -> _GateSettings:
        batch_size, concurrency = options.get("batch_size", 16), options.get("concurrency", 4)
        if not 1 <= batch_size <= MAX_BATCH_ITEMS:
            raise ValueError(f"batch_size must be in [1, {MAX_BATCH_ITEMS}], got {batch_size}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        return _GateSettings(batch_size, concurrency)


# --- the one implementation ---------------------------------------------------------------


class _Core:
    """Everything both clients do, as steps (see the module's docstring); no I/O here."""

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

    def _request(self, http: httpx.Client | httpx.AsyncClient, send: _Send) -> httpx.Request:
        headers = {"Content-Type": "application/json"} if send.body is not None else {}
        timeout = self._timeout if send.timeout is None else send.timeout
        if send.deadline and timeout is not None:
            headers[TIMEOUT_HEADER] = f"{server_deadline(timeout):.3f}"
        return http.build_request(
            send.method, send.path, content=send.body, headers=headers, timeout=timeout
        )

    # --- one operation, with retries ------------------------------------------------------

    def _exchange(
        self, operation: Operation, body: Any = None, timeout: float | None = None, /, **path: str
    ) -> Steps[httpx.Response]:
        """Send ``operation``, retrying per ``self.retries``; an error status is returned."""
        content = None if body is None else msgspec.json.encode(body)
        send = _Send(operation.method, operation.url(**path), content, timeout, operation.model)
        waited, attempt = 0.0, 0
        while True:
            try:
                response = yield send
            except httpx.TransportError:
                wait = self.retries.wait(attempt, None, waited, self._rng)
                if not operation.idempotent or wait is None:
                    raise
            else:
                if response.status_code != 503:
                    return response
                retry_after = response.headers.get("retry-after")
                wait = self.retries.wait(attempt, retry_after, waited, self._rng)
                if wait is None:
                    return response
            yield _Sleep(wait)
            waited, attempt = waited + wait, attempt + 1

    def _call(self, operation: str, into: Any, body: Any = None, /, **path: str) -> Steps[Any]:
        """The answer to ``operation`` (a name) decoded into ``into``; its error status raised."""
        response = yield from self._exchange(BY_NAME[operation], body, None, **path)
        return _decode(response, into)

    # --- the methods' steps ---------------------------------------------------------------

    def _judge(
        self, prompt: str, choices: Sequence[str], options: JudgeOptions
    ) -> Steps[JudgeResponse]:
        request = JudgeRequest(prompt=prompt, choices=list(choices), **options)
        return self._call("judge", JudgeResponse, request)

    def _judge_item(self, item: str, profile: str, options: ItemOptions) -> Steps[JudgeResponse]:
        request = ItemRequest(item=item, profile=profile, **options)
        return self._call("judge", JudgeResponse, request)

    def _judge_pair(
        self, state: Any, instructions: str, candidates: Mapping[str, str], options: PairOptions
    ) -> Steps[JudgeResponse]:
        request = PairRequest(
            state=state, instructions=instructions, candidates=dict(candidates), **options
        )
        return self._call("judge", JudgeResponse, request)

    def _judge_batch(self, items: Sequence[BatchItem]) -> Steps[list[GateResult]]:
        raws = [msgspec.Raw(msgspec.json.encode(item)) for item in items]
        response = yield from self._exchange(BY_NAME["judge_batch"], ItemsBatch(items=raws))
        return _batch_results(response, len(items))

    def _judge_shared(
        self, context: str, questions: Sequence[SharedQuestion]
    ) -> Steps[list[JudgeResponse]]:
        batch = SharedBatch(context=context, questions=list(questions))
        response = yield from self._exchange(BY_NAME["judge_batch"], batch)
        return _shared_results(response, len(questions))

    def _systemone(
        self,
        state: Any,
        questions: Mapping[str, SystemOneQuestion | Mapping[str, Any]],
        model: str | None,
    ) -> Steps[SystemOneResponse]:
        request = SystemOneRequest(
            state=state,
            questions={
                qid: q if isinstance(q, msgspec.Struct) else msgspec.convert(q, SystemOneQuestion)
                for qid, q in questions.items()
            },
            model=model,
        )
        return self._call("systemone", SystemOneResponse, request)

    def _profiles(self) -> Steps[list[ProfileSummary]]:
        return self._call("profiles", list[ProfileSummary])

    def _profile(self, name: str) -> Steps[CalibrationProfile]:
        return self._call("profile", CalibrationProfile, name=name)

    def _put_profile(self, profile: CalibrationProfile) -> Steps[CalibrationProfile]:
        return self._call("put_profile", CalibrationProfile, profile, name=profile.name)

    def _delete_profile(self, name: str) -> Steps[None]:
        response = yield from self._exchange(BY_NAME["delete_profile"], name=name)
        if response.status_code >= 400:
            raise _error(response)

    def _fit(
        self, name: str, choices: Sequence[str], examples: Iterable[Example], options: FitOptions
    ) -> Steps[CalibrationProfile]:
        timeout = options.get("timeout")
        fields: dict[str, Any] = {k: v for k, v in options.items() if k != "timeout"}
        labeled = [
            e if isinstance(e, LabeledExample) else LabeledExample(prompt=e[0], label=e[1])
            for e in examples
        ]
        request = FitRequest(choices=list(choices), examples=labeled, **fields)
        response = yield from self._exchange(BY_NAME["fit"], request, timeout, name=name)
        profile: CalibrationProfile = _decode(response, CalibrationProfile)
        return profile

    def _judgment(self, judgment_id: str) -> Steps[LoggedDecision]:
        return self._call("judgment", LoggedDecision, judgment_id=judgment_id)

    def _label(self, judgment_id: str, label: str, replace: bool) -> Steps[LabelResult]:
        body = LabelRequest(label=label, replace=replace)
        return self._call("label", LabelResult, body, judgment_id=judgment_id)

    def _labels(self, labels: Iterable[tuple[str, str]], replace: bool) -> Steps[LabelsResponse]:
        items = [LabelItem(judgment_id=i, label=label) for i, label in labels]
        return self._call("labels", LabelsResponse, LabelsRequest(labels=items, replace=replace))

    def _profile_health(self, name: str) -> Steps[ProfileHealth]:
        return self._call("profile_health", ProfileHealth, name=name)

    def _profile_health_history(self, name: str) -> Steps[HealthHistory]:
        return self._call("profile_health_history", HealthHistory, name=name)

    def _profile_versions(self, name: str) -> Steps[ProfileVersions]:
        return self._call("profile_versions", ProfileVersions, name=name)

    def _rollback_profile(self, name: str, etag: str) -> Steps[CalibrationProfile]:
        body = RollbackRequest(etag=etag)
        return self._call("rollback_profile", CalibrationProfile, body, name=name)

    def _label_queue(self, name: str) -> Steps[LabelQueue]:
        return self._call("label_queue", LabelQueue, name=name)

    def _ready(self) -> Steps[bool]:
        ready = BY_NAME["ready"]
        return _ready((yield _Send(ready.method, ready.path)))

    def _wait_ready(self, timeout: float, interval: float) -> Steps[None]:
        ready = BY_NAME["ready"]
        deadline = time.monotonic() + timeout
        while True:
            try:
                response = yield _Send(ready.method, ready.path)
            except httpx.TransportError:  # not listening yet counts as not ready
                response = None
            if response is not None and _ready(response):
                return
            if time.monotonic() + interval > deadline:
                raise TimeoutError(f"{self.base_url} was not ready within {timeout} s")
            yield _Sleep(interval)

    # --- the gate -------------------------------------------------------------------------

    def _gate(
        self, options: GateOptions, settings: _GateSettings
    ) -> Generator[_GateStep, Any, None]:
        """Each item with its result, in input order, at most ``concurrency`` requests out.

        Reads a chunk only when one is sent in its place: at most ``batch_size *
        concurrency`` items are held.
        """
        choices = options.get("choices")
        listed = list(choices) if choices is not None else None
        profile = options.get("profile")
        given = ("profile", "threshold", "uncertified_threshold", "min_choice_mass", "system")
        fields = {k: options.get(k) for k in given}
        # With no choices given, a profile fitted on a task (one that carries its prompt) gets
        # each string as the item alone, judged in that prompt (ItemRequest).
        alone = False

        def request(item: str | JudgeRequest) -> BatchItem:
            if isinstance(item, JudgeRequest):
                return item
            if not isinstance(item, str):
                raise TypeError(
                    f"gate items must be str or JudgeRequest, got {type(item).__name__}: {item!r}"
                )
            if alone:  # the profile's prompt has its own system prompt
                own = {k: v for k, v in fields.items() if k != "system"}
                return ItemRequest(item=item, **own)  # type: ignore[arg-type]
            assert listed is not None
            return JudgeRequest(prompt=item, choices=listed, **fields)  # type: ignore[arg-type]

        pending: deque[tuple[list[Any], list[BatchItem], Any]] = deque()
        # Requests in flight: up to ``concurrency``, halved after a request whose items the
        # server ran out of time or room for, one more after each that it answered whole
        # (additive increase, multiplicative decrease, as TCP paces a congested link).
        window = settings.concurrency

        def send(chunk: list[Any]) -> Generator[_GateStep, Any, None]:
            nonlocal listed, alone
            if listed is None and any(isinstance(i, str) for i in chunk):
                if profile is None:
                    raise ValueError("choices: give the choices, or a profile to take them from")
                fitted = yield _Call(self._profile(profile))
                listed, alone = fitted.choices, fitted.template is not None
                if alone and fields["system"] is not None:
                    raise ValueError(
                        f"system: profile {profile!r} was fitted on a task, whose prompt has its "
                        "own system prompt; give choices to send whole prompts instead"
                    )
            requests = [request(item) for item in chunk]
            pending.append((chunk, requests, (yield _Spawn(self._judge_batch(requests)))))

        while len(pending) < window and (chunk := (yield _Take(settings.batch_size))):
            yield from send(chunk)
        while pending:
            chunk, requests, handle = pending.popleft()
            results, strained = yield from self._resent(requests, (yield _Join(handle)))
            window = max(1, window // 2) if strained else min(settings.concurrency, window + 1)
            yield _Emit(list(zip(chunk, results, strict=True)))
            # Only now: the chunk just emitted was the one held beyond those in flight.
            while len(pending) < window and (following := (yield _Take(settings.batch_size))):
                yield from send(following)

    def _resent(
        self, requests: list[BatchItem], results: list[GateResult]
    ) -> Generator[_GateStep, Any, tuple[list[GateResult], bool]]:
        """``results`` with each item the server served no decision for (a 503 in its place:
        ``_unserved``) sent again, in one request with the others like it, after
        the retry policy's wait and within its budget; and whether there were any. One still
        out of time when the retries are spent keeps its 503."""
        results = list(results)
        again = [i for i, r in enumerate(results) if _unserved(r)]
        strained = bool(again)
        waited, attempt = 0.0, 0
        while again and (wait := self.retries.wait(attempt, None, waited, self._rng)) is not None:
            yield _Call(_sleeping(wait))
            waited, attempt = waited + wait, attempt + 1
            answers = yield _Call(self._judge_batch([requests[i] for i in again]))
            for i, answer in zip(again, answers, strict=True):
                results[i] = answer
            again = [i for i in again if _unserved(results[i])]
        return results, strained


# --- the two transports -------------------------------------------------------------------


class JudgeClient(_Core):
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

    def _run(self, steps: Steps[T]) -> T:
        """Take ``steps`` to their end: send what they send, sleep what they sleep."""
        value: Any = None
        error: BaseException | None = None
        while not isinstance(step := _resume(steps, value, error), _Done):
            value, error = None, None
            if isinstance(step, _Sleep):
                self._sleep(step.seconds)
                continue
            try:
                value = self._http.send(self._request(self._http, step))
            except httpx.TransportError as exc:
                error = exc
        return step.value

    def judge(
        self, prompt: str, choices: Sequence[str], **options: Unpack[JudgeOptions]
    ) -> JudgeResponse:
        """``POST /judge``: one prompt between ``choices``, and the decision on it."""
        return self._run(self._judge(prompt, choices, options))

    def judge_item(self, item: str, profile: str, **options: Unpack[ItemOptions]) -> JudgeResponse:
        """``POST /judge`` with the item alone: judged in the prompt ``profile`` (one fitted on
        a task) was fitted on, between its choices, and the decision on it."""
        return self._run(self._judge_item(item, profile, options))

    def judge_pair(
        self,
        state: Any,
        instructions: str,
        candidates: Mapping[str, str],
        **options: Unpack[PairOptions],
    ) -> JudgeResponse:
        """``POST /judge`` with a pair: which of the two named ``candidates`` is the better by
        ``instructions``, about ``state``, judged in both orders (``choice``: the winner)."""
        return self._run(self._judge_pair(state, instructions, candidates, options))

    def judge_batch(self, items: Sequence[BatchItem]) -> list[GateResult]:
        """``POST /judge/batch``: each item's judgment, or its 4xx as an ErrorBody, in order.
        An item is a whole ``JudgeRequest`` or an ``ItemRequest`` (the item alone, for a
        profile fitted on a task)."""
        return self._run(self._judge_batch(items))

    def judge_shared(
        self, context: str, questions: Sequence[SharedQuestion]
    ) -> list[JudgeResponse]:
        """``POST /judge/batch`` with a shared context: the context is encoded once."""
        return self._run(self._judge_shared(context, questions))

    def systemone(
        self,
        state: Any,
        questions: Mapping[str, SystemOneQuestion | Mapping[str, Any]],
        model: str | None = None,
    ) -> SystemOneResponse:
        """``POST /v1/systemone``: typed questions about ``state``, each answered and gated.

        ``questions`` maps an id to a ``SystemOneNoul``, ``SystemOneChoice``,
        ``SystemOneScore`` or ``SystemOnePair`` (``service.systemone``), or to its JSON form
        (``{"type": ...}``).
        """
        return self._run(self._systemone(state, questions, model))

    def profiles(self) -> list[ProfileSummary]:
        """``GET /profiles``: a summary of every profile the server has."""
        return self._run(self._profiles())

    def profile(self, name: str) -> CalibrationProfile:
        """``GET /profiles/{name}``: the whole profile."""
        return self._run(self._profile(name))

    def put_profile(self, profile: CalibrationProfile) -> CalibrationProfile:
        """``PUT /profiles/{profile.name}``: upload (or replace) a profile."""
        return self._run(self._put_profile(profile))

    def delete_profile(self, name: str) -> None:
        """``DELETE /profiles/{name}``."""
        self._run(self._delete_profile(name))

    def fit(
        self,
        name: str,
        choices: Sequence[str],
        examples: Iterable[Example],
        **options: Unpack[FitOptions],
    ) -> CalibrationProfile:
        """``POST /profiles/{name}/fit`` on (prompt, label) pairs; the server keeps the profile.

        ``options`` are ``FitOptions``. Fitting judges every example, so give a ``timeout``
        that fits their number. It is retried on a 503 (no work was done) but not when no
        answer came back.
        """
        return self._run(self._fit(name, choices, examples, options))

    def judgment(self, judgment_id: str) -> LoggedDecision:
        """``GET /judgments/{judgment_id}``: a logged decision, with its label if it has one
        (the server keeps a decision log: ``judge serve --decision-log``)."""
        return self._run(self._judgment(judgment_id))

    def label(self, judgment_id: str, label: str, *, replace: bool = False) -> LabelResult:
        """``POST /judgments/{judgment_id}/label``: the true label of a logged decision.

        Another label than one given before raises ClientError (409) unless ``replace``.
        """
        return self._run(self._label(judgment_id, label, replace))

    def labels(self, labels: Iterable[tuple[str, str]], *, replace: bool = False) -> LabelsResponse:
        """``POST /labels``: (judgment_id, label) pairs, each stored or refused in its place."""
        return self._run(self._labels(labels, replace))

    def profile_health(self, name: str) -> ProfileHealth:
        """``GET /profiles/{name}/health``: audited precision, drift and the model, from the
        server's decision log."""
        return self._run(self._profile_health(name))

    def profile_health_history(self, name: str) -> HealthHistory:
        """``GET /profiles/{name}/health/history``: the health at 20 points of the current
        version's decisions (shares with their confidence sequences, live prior, alarms)."""
        return self._run(self._profile_health_history(name))

    def profile_versions(self, name: str) -> ProfileVersions:
        """``GET /profiles/{name}/versions``: the kept versions and the background refits."""
        return self._run(self._profile_versions(name))

    def rollback_profile(self, name: str, etag: str) -> CalibrationProfile:
        """``POST /profiles/{name}/rollback``: serve the kept version ``etag`` again."""
        return self._run(self._rollback_profile(name, etag))

    def label_queue(self, name: str) -> LabelQueue:
        """``GET /profiles/{name}/queue``: what to label next (audit and teach streams) and
        the certificate's state."""
        return self._run(self._label_queue(name))

    def ready(self) -> bool:
        """``GET /ready``: True once the model is loaded, False while it loads.

        A model that failed to load raises ClientError: that server will never be ready.
        """
        return self._run(self._ready())

    def wait_ready(self, timeout: float = 300.0, interval: float = 0.2) -> None:
        """Poll ``/ready`` until it answers 200; TimeoutError after ``timeout`` seconds.

        A server that cannot be reached yet counts as not ready; one whose model failed to
        load raises ClientError at once.
        """
        self._run(self._wait_ready(timeout, interval))

    def gate(
        self, items: Iterable[Item], **options: Unpack[GateOptions]
    ) -> Generator[tuple[Item, GateResult], None, None]:
        """Each item with its decision, in input order; lazy over ``items``.

        A string item is a prompt judged with the options given here (``GateOptions``:
        ``choices`` default to the profile's); a ``JudgeRequest`` is sent as it is. Items go
        out ``batch_size`` to a request, at most ``concurrency`` requests at a time, so at
        most ``batch_size * concurrency`` items are held. An item's 4xx comes back as an
        ErrorBody in its place; a request that fails as a whole raises ClientError.

        A server that cannot keep up paces the gate: each request tells it the client's
        deadline (``server_deadline``), an item it ran out of time or room for (503) is sent
        again per the retry policy, and such a request halves the requests in flight (each
        answered whole adds one back, up to ``concurrency``). Only an item still unserved when
        its retries are spent comes back as its 503.
        """
        settings = _GateSettings.of(options)
        steps = self._gate(options, settings)
        source = iter(items)
        pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="judge-gate")
        spawned: list[Future[list[GateResult]]] = []
        value: Any = None
        try:
            while not isinstance(step := _resume(steps, value, None), _Done):
                if isinstance(step, _Emit):
                    yield from step.pairs
                    value = None
                elif isinstance(step, _Take):
                    value = list(itertools.islice(source, step.size))
                elif isinstance(step, _Spawn):
                    value = pool.submit(self._run, step.steps)
                    spawned.append(value)
                elif isinstance(step, _Join):
                    value = step.handle.result()
                else:
                    value = self._run(step.steps)
        finally:
            for future in spawned:
                future.cancel()
            pool.shutdown(wait=False, cancel_futures=True)


class AsyncJudgeClient(_Core):
    """``JudgeClient`` for asyncio, on ``httpx.AsyncClient``: the same methods, awaited.

    ``gate`` is an async generator (``async for item, d in client.gate(...)``) whose items
    may be an async iterable; its requests in flight are tasks.
    """

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

    async def _run(self, steps: Steps[T]) -> T:
        """``JudgeClient._run``, awaited."""
        value: Any = None
        error: BaseException | None = None
        while not isinstance(step := _resume(steps, value, error), _Done):
            value, error = None, None
            if isinstance(step, _Sleep):
                await self._sleep(step.seconds)
                continue
            try:
                value = await self._http.send(self._request(self._http, step))
            except httpx.TransportError as exc:
                error = exc
        return step.value

    async def judge(
        self, prompt: str, choices: Sequence[str], **options: Unpack[JudgeOptions]
    ) -> JudgeResponse:
        """``JudgeClient.judge``, awaited."""
        return await self._run(self._judge(prompt, choices, options))

    async def judge_item(
        self, item: str, profile: str, **options: Unpack[ItemOptions]
    ) -> JudgeResponse:
        """``JudgeClient.judge_item``, awaited."""
        return await self._run(self._judge_item(item, profile, options))

    async def judge_pair(
        self,
        state: Any,
        instructions: str,
        candidates: Mapping[str, str],
        **options: Unpack[PairOptions],
    ) -> JudgeResponse:
        """``JudgeClient.judge_pair``, awaited."""
        return await self._run(self._judge_pair(state, instructions, candidates, options))

    async def judge_batch(self, items: Sequence[BatchItem]) -> list[GateResult]:
        """``JudgeClient.judge_batch``, awaited."""
        return await self._run(self._judge_batch(items))

    async def judge_shared(
        self, context: str, questions: Sequence[SharedQuestion]
    ) -> list[JudgeResponse]:
        """``JudgeClient.judge_shared``, awaited."""
        return await self._run(self._judge_shared(context, questions))

    async def systemone(
        self,
        state: Any,
        questions: Mapping[str, SystemOneQuestion | Mapping[str, Any]],
        model: str | None = None,
    ) -> SystemOneResponse:
        """``JudgeClient.systemone``, awaited."""
        return await self._run(self._systemone(state, questions, model))

    async def profiles(self) -> list[ProfileSummary]:
        """``JudgeClient.profiles``, awaited."""
        return await self._run(self._profiles())

    async def profile(self, name: str) -> CalibrationProfile:
        """``JudgeClient.profile``, awaited."""
        return await self._run(self._profile(name))

    async def put_profile(self, profile: CalibrationProfile) -> CalibrationProfile:
        """``JudgeClient.put_profile``, awaited."""
        return await self._run(self._put_profile(profile))

    async def delete_profile(self, name: str) -> None:
        """``JudgeClient.delete_profile``, awaited."""
        await self._run(self._delete_profile(name))

    async def fit(
        self,
        name: str,
        choices: Sequence[str],
        examples: Iterable[Example],
        **options: Unpack[FitOptions],
    ) -> CalibrationProfile:
        """``JudgeClient.fit``, awaited."""
        return await self._run(self._fit(name, choices, examples, options))

    async def judgment(self, judgment_id: str) -> LoggedDecision:
        """``JudgeClient.judgment``, awaited."""
        return await self._run(self._judgment(judgment_id))

    async def label(self, judgment_id: str, label: str, *, replace: bool = False) -> LabelResult:
        """``JudgeClient.label``, awaited."""
        return await self._run(self._label(judgment_id, label, replace))

    async def labels(
        self, labels: Iterable[tuple[str, str]], *, replace: bool = False
    ) -> LabelsResponse:
        """``JudgeClient.labels``, awaited."""
        return await self._run(self._labels(labels, replace))

    async def profile_health(self, name: str) -> ProfileHealth:
        """``JudgeClient.profile_health``, awaited."""
        return await self._run(self._profile_health(name))

    async def profile_health_history(self, name: str) -> HealthHistory:
        """``JudgeClient.profile_health_history``, awaited."""
        return await self._run(self._profile_health_history(name))

    async def profile_versions(self, name: str) -> ProfileVersions:
        """``JudgeClient.profile_versions``, awaited."""
        return await self._run(self._profile_versions(name))

    async def rollback_profile(self, name: str, etag: str) -> CalibrationProfile:
        """``JudgeClient.rollback_profile``, awaited."""
        return await self._run(self._rollback_profile(name, etag))

    async def label_queue(self, name: str) -> LabelQueue:
        """``JudgeClient.label_queue``, awaited."""
        return await self._run(self._label_queue(name))

    async def ready(self) -> bool:
        """``JudgeClient.ready``, awaited."""
        return await self._run(self._ready())

    async def wait_ready(self, timeout: float = 300.0, interval: float = 0.2) -> None:
        """``JudgeClient.wait_ready``, awaited."""
        await self._run(self._wait_ready(timeout, interval))

    async def gate(
        self, items: Iterable[Item] | AsyncIterable[Item], **options: Unpack[GateOptions]
    ) -> AsyncGenerator[tuple[Item, GateResult], None]:
        """``JudgeClient.gate`` as an async generator; ``items`` may be an async iterable."""
        settings = _GateSettings.of(options)
        steps = self._gate(options, settings)
        source = _aiter(items)
        spawned: list[asyncio.Task[list[GateResult]]] = []
        value: Any = None
        try:
            while not isinstance(step := _resume(steps, value, None), _Done):
                if isinstance(step, _Emit):
                    for pair in step.pairs:
                        yield pair
                    value = None
                elif isinstance(step, _Take):
                    value = [item async for item in _islice(source, step.size)]
                elif isinstance(step, _Spawn):
                    value = asyncio.create_task(self._run(step.steps))
                    spawned.append(value)
                elif isinstance(step, _Join):
                    value = await step.handle
                else:
                    value = await self._run(step.steps)
        finally:
            for task in spawned:
                task.cancel()
            await asyncio.gather(*spawned, return_exceptions=True)


async def _aiter(items: Iterable[T] | AsyncIterable[T]) -> AsyncIterator[T]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


async def _islice(items: AsyncIterator[T], size: int) -> AsyncIterator[T]:
    """The next ``size`` items of ``items`` (fewer at its end), reading no more than those."""
    for _ in range(size):
        try:
            yield await anext(items)
        except StopAsyncIteration:
            return
