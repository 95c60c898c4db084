"""The HTTP operations, written once: every other description of the API is derived from this.

    service.web.routes   registers a handler for each operation (method, path, status, options),
                     and OPTIONS for each path, whose Allow lists the path's methods
    service.web.openapi  the OpenAPI document's paths: summary, bodies, statuses, operationId
    service.metrics  the route label of a request: the path template of its operation
    service.client   each call's method and path
    service.web.frontdoor what each refuses before its body: a malformed path parameter or header

This module imports no Litestar: the client uses it. A path is an OpenAPI template,
``/profiles/{name}``, each ``{parameter}`` one path segment.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote

from calibration.profile import NAME_PATTERN, CalibrationProfile
from service.log.health import ProfileHealth
from service.log.health_history import HealthHistory
from service.log.record import LoggedDecision
from service.schemas import (
    BatchRequest,
    BatchResponse,
    FitRequest,
    JudgeBody,
    JudgeResponse,
    LabelQueue,
    LabelRequest,
    LabelResult,
    LabelsRequest,
    LabelsResponse,
    ProfileSummary,
    ProfileVersions,
    ReadyResponse,
    RollbackRequest,
    StatusResponse,
)
from service.systemone import SystemOneRequest, SystemOneResponse

__all__ = [
    "BY_NAME",
    "OPERATIONS",
    "PARAMETER_PATTERN",
    "TIMEOUT_HEADER",
    "Operation",
    "allowed",
    "paths",
    "request_timeout",
]

TIMEOUT_HEADER = "X-Request-Timeout"  # seconds; shortens the server's deadline, never lengthens
# Every path parameter (a profile's name, a logged decision's id) is a name of this pattern: the
# OpenAPI document declares it for each, and the front door refuses a value that breaks it.
PARAMETER_PATTERN = f"^{NAME_PATTERN}$"

Method = Literal["GET", "HEAD", "POST", "PUT", "DELETE"]
# A success body: a type msgspec encodes, None (no body), "text" (Prometheus) or "object" (JSON)
Answer = Any

_BODY_ERRORS = (400, 408, 413, 415)
_PARAMETER = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class Operation:
    """One method on one path: what it takes, what it answers, and how it is served."""

    name: str  # the handler's name, and the client's
    method: Method
    path: str
    summary: str
    body: Any = None  # the request body's type; None: no body
    ok: tuple[int, Answer] = (200, None)  # the success status and its body
    errors: tuple[int, ...] = ()  # every error status it can answer (401 comes with a key)
    public: bool = False  # no API key needed
    model: bool = False  # needs the model: admitted through the front door's slots
    idempotent: bool = True  # safe to send again when no answer came back
    documented: bool = True  # in the OpenAPI document
    parameters: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parameters", tuple(_PARAMETER.findall(self.path)))
        if (self.parameters or self.model) and 400 not in self.errors:
            raise ValueError(
                f"{self.name}: the front door answers a malformed path parameter or "
                f"{TIMEOUT_HEADER} with 400 (see refusal), so its errors must list 400"
            )

    def refusal(
        self, parameters: Mapping[str, str], headers: Mapping[str, str]
    ) -> tuple[str, str] | None:
        """What the schema refuses in a request's path parameters or headers, before its body:
        ``(field, detail)`` for the first fault, None if none. ``headers``: names lowercased.

        The front door answers it with a 400 before admission and before reading the body,
        so that neither a full server (503) nor an oversized body (413) hides it.
        """
        for name in self.parameters:
            value = parameters.get(name, "")
            if not re.fullmatch(PARAMETER_PATTERN, value):
                return name, f"path parameter {name} must match {PARAMETER_PATTERN}, got {value!r}"
        raw = headers.get(TIMEOUT_HEADER.lower())
        if self.model and raw is not None:  # the operations that take the header
            try:
                request_timeout(raw)
            except ValueError as e:
                return TIMEOUT_HEADER, str(e)
        return None

    @property
    def operation_id(self) -> str:
        """The OpenAPI operationId: ``post_profiles_name_fit``."""
        words = [w.strip("{}").replace(".", "_") for w in self.path.split("/") if w]
        return "_".join([self.method.lower(), *words])

    @property
    def route(self) -> str:
        """The path in Litestar's syntax: ``/profiles/{name:str}``."""
        return _PARAMETER.sub(r"{\1:str}", self.path)

    def url(self, **values: str) -> str:
        """The path with its parameters filled in, each quoted as one path segment."""
        if set(values) != set(self.parameters):
            raise TypeError(f"{self.name} takes the path parameters {self.parameters}")
        return _PARAMETER.sub(lambda m: quote(values[m.group(1)], safe=""), self.path)


OPERATIONS: tuple[Operation, ...] = (
    Operation("health", "GET", "/health", "Liveness: the process is up (no API key needed)",
              ok=(200, StatusResponse), public=True),
    Operation("health_head", "HEAD", "/health", "Liveness, without a body", public=True),
    Operation("ready", "GET", "/ready", "Readiness: the model is loaded and has judged once",
              ok=(200, ReadyResponse), errors=(503,)),
    Operation("metrics", "GET", "/metrics", "Prometheus metrics", ok=(200, "text")),
    Operation("judge", "POST", "/judge",
              "Judge one prompt between fixed choices, or which of two candidates is the better",
              body=JudgeBody, ok=(200, JudgeResponse),
              errors=(*_BODY_ERRORS, 404, 422, 503), model=True),
    Operation("judge_batch", "POST", "/judge/batch",
              "Judge many items, or many questions about one context",
              body=BatchRequest, ok=(200, BatchResponse),
              errors=(*_BODY_ERRORS, 404, 422, 503), model=True),
    Operation("systemone", "POST", "/v1/systemone",
              "Typed questions about one state, in the System One wire format",
              body=SystemOneRequest, ok=(200, SystemOneResponse),
              errors=(*_BODY_ERRORS, 404, 422, 503), model=True),
    Operation("profiles", "GET", "/profiles", "List calibration profiles",
              ok=(200, list[ProfileSummary])),
    Operation("profile", "GET", "/profiles/{name}", "One calibration profile",
              ok=(200, CalibrationProfile), errors=(400, 404)),
    Operation("put_profile", "PUT", "/profiles/{name}",
              "Store a calibration profile under its name", body=CalibrationProfile,
              ok=(200, CalibrationProfile), errors=(*_BODY_ERRORS, 412, 422)),
    Operation("delete_profile", "DELETE", "/profiles/{name}", "Delete a calibration profile",
              ok=(204, None), errors=(400, 404, 412)),
    # Fitting judges every example: sent twice, it would do all of that twice.
    Operation("fit", "POST", "/profiles/{name}/fit",
              "Fit a profile on labeled examples and store it", body=FitRequest,
              ok=(200, CalibrationProfile), errors=(*_BODY_ERRORS, 422, 503), model=True,
              idempotent=False),
    Operation("profile_versions", "GET", "/profiles/{name}/versions",
              "A profile's kept versions, and its background refits from the decision log",
              ok=(200, ProfileVersions), errors=(400, 404)),
    Operation("rollback_profile", "POST", "/profiles/{name}/rollback",
              "Serve a kept version of a profile again (If-Match: only over that version)",
              body=RollbackRequest, ok=(200, CalibrationProfile),
              errors=(*_BODY_ERRORS, 404, 412)),
    Operation("label_queue", "GET", "/profiles/{name}/queue",
              "What to label next under a profile: its unlabelled logged decisions, the audit "
              "stream (they certify) and the teach stream (they fit), and the certificate's state",
              ok=(200, LabelQueue), errors=(400, 404, 503)),
    Operation("profile_health", "GET", "/profiles/{name}/health",
              "A profile's health from the decision log: audited precision against its "
              "certificate, drift from its calibration data, the model",
              ok=(200, ProfileHealth), errors=(400, 404, 503)),
    Operation("profile_health_history", "GET", "/profiles/{name}/health/history",
              "A profile's health at 20 points of its current version's decisions: each "
              "choice's share with its confidence sequence, the live class prior, the alarms",
              ok=(200, HealthHistory), errors=(400, 404, 503)),
    Operation("judgment", "GET", "/judgments/{judgment_id}",
              "A logged decision, with its label if it has one", ok=(200, LoggedDecision),
              errors=(400, 404, 503)),
    Operation("label", "POST", "/judgments/{judgment_id}/label",
              "The true label of a logged decision (feedback)", body=LabelRequest,
              ok=(200, LabelResult), errors=(*_BODY_ERRORS, 404, 409, 422, 503)),
    Operation("labels", "POST", "/labels",
              "True labels of many logged decisions, each stored or refused in its place",
              body=LabelsRequest, ok=(200, LabelsResponse), errors=(*_BODY_ERRORS, 404, 503)),
    Operation("schema", "GET", "/schema/openapi.json", "This document", ok=(200, "object")),
    Operation("schema_index", "GET", "/schema", "A redirect to the OpenAPI document",
              ok=(307, None), documented=False),
)  # fmt: skip

BY_NAME: Mapping[str, Operation] = {op.name: op for op in OPERATIONS}


def request_timeout(raw: str) -> float:
    """The seconds an X-Request-Timeout header gives; ValueError unless a finite number > 0."""
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{TIMEOUT_HEADER} must be a number of seconds > 0, got {raw!r}")
    return seconds


def paths(operations: Iterable[Operation] = OPERATIONS) -> dict[str, list[Operation]]:
    """Each path and its operations, in the table's order."""
    out: dict[str, list[Operation]] = {}
    for op in operations:
        out.setdefault(op.path, []).append(op)
    return out


def allowed(path: str) -> str:
    """The Allow header of ``path`` (a template): its methods and OPTIONS."""
    return ", ".join(sorted({op.method for op in paths()[path]} | {"OPTIONS"}))
