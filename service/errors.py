"""Errors become responses here, and only here.

Each domain error has a row in ``STATUS``: its status code and the request field it names.
``error_of`` is the one place an error becomes a body, ``{"status_code", "detail", "field"?}``:
a response's, a batch item's (in its place among the results) and a ``judge ask`` line's. Anything unexpected is a bare 500 with nothing internal
in the body, and a log line with the traceback.

The service's own errors:

    BodyError        400 or 415: the body is not JSON, or does not fit the schema
    BadFieldError    400: one field is wrong in a way the schema could not catch
    UnprocessableError 422: the request fits the schema, but a rule across fields refuses it
    TooLargeError    413: a judgment is over the server's token budget
    NotReadyError    503: the model is still loading or warming up
    LogUnavailableError 503: the decision log could not be written, so nothing was decided
                     (or labeled)
    NoLogError       404: the server keeps no decision log (no --decision-log)

and from ``service.profiles``:

    PreconditionFailedError 412: If-Match / If-None-Match found another stored version

and from ``service.log.decision_log``:

    UnknownJudgmentError 404: no logged decision has that id
    LabelNotAChoiceError 422: the label is not one of the decision's choices
    RelabelError         409: the decision has another label already (replace to change it)
    DecisionLogError     503: the log cannot be read (its writes are LogUnavailableError)

Only a 500 is logged with its traceback: a 503 (busy, timed out) is the service working as
designed, and logging each would flood the log exactly when the server is under load.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from calibration import (
    CalibrationProfile,
    NoCertificateError,
    ProfileError,
    ProfileMismatchError,
    ProfileNotFoundError,
    RuleError,
)
from judge import (
    AmbiguousChoicesError,
    ChoicesError,
    InvalidQueryError,
    JudgeError,
    ModelServerError,
    TooManyPathsError,
    ValuesError,  # the engine's: calibration re-exports it
)
from service.bodies import BodyError
from service.log.decision_log import (
    DecisionLogError,
    LabelNotAChoiceError,
    RelabelError,
    UnknownJudgmentError,
)
from service.profiles import PreconditionFailedError
from service.schemas import ErrorBody

if TYPE_CHECKING:  # Litestar loads with the handlers: `judge ask` imports error_of without it
    from litestar import Request, Response
    from litestar.exceptions import HTTPException

__all__ = [
    "STATUS",
    "BadFieldError",
    "DeadlineError",
    "LogUnavailableError",
    "NoLogError",
    "NotReadyError",
    "QueueFullError",
    "TooLargeError",
    "UnprocessableError",
    "error_of",
    "exception_handlers",
]

log = logging.getLogger("judge.service")


class QueueFullError(Exception):
    """The job queue is at capacity; the caller should retry later."""


class DeadlineError(TimeoutError):
    """The request's deadline passed before its model work was done."""


class BadFieldError(Exception):
    """A request that passed the schema but is still wrong in one field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class UnprocessableError(BadFieldError):
    """Schema-valid, but refused by a rule across fields (a label that is not a choice)."""


class TooLargeError(BadFieldError):
    """A judgment over the server's token budget (``--max-request-tokens``)."""


class NotReadyError(Exception):
    """The model is still loading or warming up."""


class LogUnavailableError(Exception):
    """The decision log could not be written: the decision is not served unlogged, the label
    not stored."""


class NoLogError(LookupError):
    """An endpoint that reads the decision log, on a server that keeps none."""

    field = "judgment_id"


# Domain error -> (status, field). The first matching class wins, so subclasses come first;
# an error with its own ``field`` attribute (BadFieldError, ProfileMismatchError) names that.
STATUS: list[tuple[type[Exception], int, str | None]] = [
    (TooLargeError, 413, None),
    (UnprocessableError, 422, None),
    (BadFieldError, 400, None),
    # Choices the schema refuses too (uniqueItems, which msgspec does not check itself).
    (AmbiguousChoicesError, 422, "choices"),  # schema-valid, but their token paths collide
    (TooManyPathsError, 422, "choices"),  # schema-valid, but their grammar tree is too large
    (ChoicesError, 400, "choices"),
    (InvalidQueryError, 422, "prompt"),  # schema-valid, refused by the engine (e.g. values)
    (ModelServerError, 502, None),  # the model's own server failed: not the request's fault
    (JudgeError, 422, "prompt"),  # too long for the model, or a tokenizer that cannot round-trip
    # An uploaded profile that fits the schema but breaks a rule: the field its message
    # starts with ("calibration_map.weights must be ..."), else the body (see _rule_field).
    (RuleError, 422, "body"),
    (ValuesError, 422, "values"),  # a score's values or max_std that do not fit the choices
    (PreconditionFailedError, 412, None),  # names the header: If-Match or If-None-Match
    (ProfileNotFoundError, 404, "profile"),
    (UnknownJudgmentError, 404, "judgment_id"),
    (NoLogError, 404, None),
    (LabelNotAChoiceError, 422, "label"),
    (RelabelError, 409, "label"),
    (ProfileMismatchError, 422, None),
    (NoCertificateError, 422, None),  # names the field: a threshold with no certificate
    (ProfileError, 400, "profile"),
    (QueueFullError, 503, None),
    (TimeoutError, 503, None),
    (NotReadyError, 503, None),
    (LogUnavailableError, 503, None),
    # A read of the log that failed (a write lock held past the busy timeout, a database
    # gone): the log is unavailable, not the server broken, and a retry may do.
    (DecisionLogError, 503, None),
]


def error_of(exc: Exception) -> ErrorBody:
    """The body for ``exc``: its status and field from its row in STATUS, or a bare 500."""
    if isinstance(exc, BodyError):
        return ErrorBody(status_code=exc.status, detail=str(exc), field=exc.field)
    for cls, status, field_name in STATUS:
        if isinstance(exc, cls):
            name = getattr(exc, "field", None) or _rule_field(exc) or field_name
            detail = str(exc)
            if isinstance(exc, TimeoutError) and not isinstance(exc, DeadlineError):
                detail = "the request timed out waiting for the model; retry later"
            elif isinstance(exc, QueueFullError):
                detail = f"the server is at capacity ({exc}); retry later"
            return ErrorBody(status_code=status, detail=detail, field=name or None)
    return ErrorBody(status_code=500, detail="Internal Server Error")


def _response_body(error: ErrorBody) -> dict[str, Any]:
    """A response's body (``ErrorResponse``): the batch item's, without its type tag."""
    body: dict[str, Any] = {"status_code": error.status_code, "detail": error.detail}
    if error.field is not None:
        body["field"] = error.field
    return body


# A rule's message starts with the field it is about, as a path: "calibration_map.weights
# must be ...", "split counts ... exceed ...", "threshold.coverage must be ...".
_LEADING_PATH = re.compile(r"([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)(?=[\s\[])")


def _rule_field(exc: Exception) -> str | None:
    """The profile field a RuleError names first, when its message starts with one.

    Only profiles (PUT /profiles/{name}) decode into types that raise RuleError. A message
    that starts otherwise ("the map's bias has ...") names no field, and the body stands in.
    """
    if not isinstance(exc, RuleError):
        return None
    match = _LEADING_PATH.match(str(exc))
    if match is None or match.group(1).split(".")[0] not in CalibrationProfile.__struct_fields__:
        return None
    return match.group(1)


Handler = Callable[["Request[Any, Any, Any]", Any], "Response[Any]"]


def _domain(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    from litestar import Response

    error = error_of(exc)
    status = error.status_code
    if status == 500:
        log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    headers = {"Retry-After": "1"} if status == 503 else None
    return Response(_response_body(error), status_code=status, headers=headers)


def _http(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    from litestar import Response

    body: dict[str, Any] = {"status_code": exc.status_code, "detail": exc.detail}
    if exc.status_code in (400, 413):  # the body as a whole: not JSON, or too large
        body["field"] = "body"
    if exc.status_code == 413:  # the app's limit (PUT /profiles/{name} has its own, larger)
        limit = _body_limit(request)
        if limit is not None:
            body["detail"] = (
                f"the body is over this server's limit of {limit} bytes (--max-body-bytes)"
            )
    return Response(body, status_code=exc.status_code, headers=exc.headers)


def _body_limit(request: Request[Any, Any, Any]) -> int | None:
    try:
        return request.route_handler.resolve_request_max_body_size()
    except Exception:  # no handler resolved: say nothing rather than guess
        return None


def exception_handlers() -> dict[int | type[Exception], Handler]:
    """The app's handler map; Litestar picks the closest class in the exception's MRO."""
    from litestar.exceptions import HTTPException

    handlers: dict[int | type[Exception], Handler] = {cls: _domain for cls, _, _ in STATUS}
    handlers[BodyError] = _domain
    handlers[HTTPException] = _http
    handlers[Exception] = _domain
    return handlers
