"""The OpenAPI document: the service's contract, written once, here.

Every operation lists every status it can answer, each with its body's schema. The body
schemas come from msgspec (``msgspec.json.schema_components``), from the very types
``service.bodies`` decodes with, so every constraint the server enforces on a body (lengths,
ranges, patterns, unique choices, no unknown fields) is in the document by construction. A
test runs schemathesis against a live server with this document and fails on any finding.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

import judge
from calibration import CalibrationProfile
from calibration.profile import NAME_PATTERN
from service.frontdoor import REPLICA_HEADER
from service.schemas import (
    BatchRequest,
    BatchResponse,
    ErrorResponse,
    FitRequest,
    JudgeRequest,
    JudgeResponse,
    ProfileSummary,
    ReadyResponse,
    StatusResponse,
)

__all__ = ["openapi_document"]

SCHEME = "BearerAuth"
TIMEOUT_HEADER = "X-Request-Timeout"  # seconds; shortens the server's deadline, never lengthens

_ERRORS = {
    400: "The body (or a header) is malformed or breaks the schema; `field` names it",
    401: "Missing or wrong API key",
    404: "No such profile",
    408: "The body did not arrive in time",
    412: "If-Match or If-None-Match does not hold for the stored version; `field` names the header",
    413: "The body is too large (`--max-body-bytes`; a profile PUT has its own, larger limit, "
    "room for a probe's weights), or a judgment is over the server's token budget",
    415: "The body is not JSON",
    422: "The request is well-formed but cannot be served (the profile does not match, the "
    "prompt is too long for the model, the tokenizer cannot round-trip it, a profile breaks a "
    "rule across fields, a fit's method cannot be used); `field` names the part at fault",
    503: "The model is loading, the server is at capacity, or the deadline passed; retry "
    "after Retry-After seconds",
}

# (method, path, summary, request body type, (status, response type or None), error statuses)
_BODY_ERRORS = (400, 408, 413, 415)
_OPERATIONS: list[tuple[str, str, str, type | None, tuple[int, Any], tuple[int, ...]]] = [
    ("get", "/health", "Liveness: the process is up (no API key needed)", None,
     (200, StatusResponse), ()),
    ("head", "/health", "Liveness, without a body", None, (200, None), ()),
    ("get", "/ready", "Readiness: the model is loaded and has judged once", None,
     (200, ReadyResponse), (503,)),
    ("get", "/metrics", "Prometheus metrics", None, (200, "text"), ()),
    ("post", "/judge", "Judge one prompt between fixed choices", JudgeRequest,
     (200, JudgeResponse), (*_BODY_ERRORS, 404, 422, 503)),
    ("post", "/judge/batch", "Judge many items, or many questions about one context",
     BatchRequest, (200, BatchResponse), (*_BODY_ERRORS, 404, 422, 503)),
    ("get", "/profiles", "List calibration profiles", None, (200, list[ProfileSummary]), ()),
    ("get", "/profiles/{name}", "One calibration profile", None, (200, CalibrationProfile),
     (404,)),
    ("put", "/profiles/{name}", "Store a calibration profile under its name", CalibrationProfile,
     (200, CalibrationProfile), (*_BODY_ERRORS, 412, 422)),
    ("delete", "/profiles/{name}", "Delete a calibration profile", None, (204, None),
     (404, 412)),
    ("post", "/profiles/{name}/fit", "Fit a profile on labeled examples and store it",
     FitRequest, (200, CalibrationProfile), (*_BODY_ERRORS, 422, 503)),
    ("get", "/schema/openapi.json", "This document", None, (200, "object"), ()),
]  # fmt: skip

# Profiles carry versions (service.profiles): an ETag on what GET and PUT answer, and
# conditional PUT and DELETE.
_ETAG = {
    "schema": {"type": "string"},
    "description": "The stored version: the quoted sha256 of the profile's stored bytes",
}
_REPLICA = {
    "schema": {"type": "string"},
    "description": "The replica (host:pid) that answered; see service.frontdoor",
}
_TAGGED = {("get", "/profiles/{name}"), ("put", "/profiles/{name}")}
_PRECONDITIONS = {
    "If-Match": {
        "name": "If-Match",
        "in": "header",
        "required": False,
        "description": "Act only if the stored version has one of these ETags (`*`: any); else 412",
        "schema": {"type": "string"},
    },
    "If-None-Match": {
        "name": "If-None-Match",
        "in": "header",
        "required": False,
        "description": "`*`: store only if no version is stored yet; else 412",
        "schema": {"type": "string"},
    },
}
_CONDITIONAL = {
    ("put", "/profiles/{name}"): ("If-Match", "If-None-Match"),
    ("delete", "/profiles/{name}"): ("If-Match",),
}


# A working request for each operation that takes a body, for readers of the document (and for
# schemathesis's examples phase, which sends each and expects it to be accepted).
_SPAM = [
    "WINNER! You have won a free cruise, text CLAIM to 80082 now",
    "URGENT: your account is locked, call 0906 555 0199 to unlock it",
    "Free entry in a weekly draw to win concert tickets, text WIN to 80808",
    "Claim your 100 pound voucher now, reply SHOP, T&Cs apply",
    "Cheap loans approved in minutes, no credit checks, text LOAN to 60300",
]
_HAM = [
    "See you at the station at 6",
    "Can you pick up some bread on your way home?",
    "Sorry, I'll call you later, I'm in a meeting",
    "Happy birthday! See you on Saturday",
    "The film starts at 8, shall we eat before?",
]
_EXAMPLES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/judge"): {
        "prompt": f"Is this SMS spam? {_SPAM[0]}",
        "choices": ["spam", "ham"],
        "threshold": 0.8,
    },
    ("post", "/judge/batch"): {
        "context": f"SMS: {_HAM[0]}",
        "questions": [
            {"prompt": "Is it spam?", "choices": ["yes", "no"]},
            {"prompt": "Is it about a meeting place?", "choices": ["yes", "no"]},
        ],
    },
    ("post", "/profiles/{name}/fit"): {
        "choices": ["spam", "ham"],
        "examples": [
            {"prompt": f"Is this SMS spam? {text}", "label": label}
            for label, texts in (("spam", _SPAM), ("ham", _HAM))
            for text in texts
        ]
        * 2,
    },
}


@functools.cache
def openapi_document(*, secured: bool) -> dict[str, Any]:
    """The whole document; ``secured`` adds the bearer scheme and the 401 answers."""
    types = [t for op in _OPERATIONS for t in (op[3], op[4][1]) if isinstance(t, type)]
    schemas, components = msgspec.json.schema_components(
        [*types, ErrorResponse, list[ProfileSummary]], ref_template="#/components/schemas/{name}"
    )
    # Either items, or context with questions: a rule across fields that msgspec checks in
    # code (service.serving), written here so that the document states it too.
    components["BatchRequest"]["oneOf"] = [
        {
            "required": ["items"],
            "properties": {"items": {"type": "array"}, "context": {"type": "null"},
                           "questions": {"type": "null"}},
        },
        {
            "required": ["context", "questions"],
            "properties": {"items": {"type": "null"}, "context": {"type": "string"},
                           "questions": {"type": "array"}},
        },
    ]  # fmt: skip
    refs = dict(zip([*types, ErrorResponse, "profiles"], schemas, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for method, path, summary, body, (ok, answer), errors in _OPERATIONS:
        public = path == "/health"
        op: dict[str, Any] = {"summary": summary, "operationId": _operation_id(method, path)}
        params = []
        if "{name}" in path:
            params.append(
                {
                    "name": "name",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", "pattern": f"^{NAME_PATTERN}$"},
                }
            )
        if 503 in errors and body is not None:
            params.append(
                {
                    "name": TIMEOUT_HEADER,
                    "in": "header",
                    "required": False,
                    "description": "Seconds the client will wait; shortens the server's deadline",
                    "schema": {"type": "number", "exclusiveMinimum": 0},
                }
            )
        params += [_PRECONDITIONS[h] for h in _CONDITIONAL.get((method, path), ())]
        if params:
            op["parameters"] = params
        if body is not None:
            op["requestBody"] = {"required": True, "content": _json(refs[body])}
            if (method, path) in _EXAMPLES:
                op["requestBody"]["content"]["application/json"]["example"] = _EXAMPLES[
                    (method, path)
                ]
        responses: dict[str, Any] = {str(ok): _success(ok, answer, refs)}
        if (method, path) in _TAGGED:
            responses[str(ok)]["headers"] = {"ETag": _ETAG}
        statuses = sorted({*errors, *(() if public or not secured else (401,))})
        for status in statuses:
            responses[str(status)] = {
                "description": _ERRORS[status],
                # /ready's 503 says why it is not ready, in the shape of its 200.
                "content": _json(
                    refs[ReadyResponse]
                    if (path, status) == ("/ready", 503)
                    else refs[ErrorResponse]
                ),
            }
            if status == 503:
                responses["503"]["headers"] = {
                    "Retry-After": {"schema": {"type": "integer"}, "description": "Seconds"}
                }
        if method in ("put", "post") and path.startswith("/profiles/{name}"):
            # What was stored can be read and deleted by its name: links for stateful clients
            # (and for schemathesis's stateful phase).
            responses[str(ok)]["links"] = {
                f"{verb.capitalize()}Profile": {
                    "operationId": f"{verb}_profiles_name",
                    "parameters": {"name": "$request.path.name"},
                }
                for verb in ("get", "delete")
            }
        for response in responses.values():  # the front door names itself on every answer
            response.setdefault("headers", {})[REPLICA_HEADER] = _REPLICA
        op["responses"] = responses
        if public and secured:
            op["security"] = []
        paths.setdefault(path, {})[method] = op
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "judge", "version": judge.__version__},
        "paths": paths,
        "components": {"schemas": components},
    }
    if secured:
        document["components"]["securitySchemes"] = {SCHEME: {"type": "http", "scheme": "bearer"}}
        document["security"] = [{SCHEME: []}]
    return document


def _operation_id(method: str, path: str) -> str:
    words = [w.strip("{}").replace(".", "_") for w in path.split("/") if w]
    return "_".join([method, *words])


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _success(status: int, answer: Any, refs: dict[Any, Any]) -> dict[str, Any]:
    if answer is None:
        return {"description": "Done; no body"}
    if answer == "text":
        return {
            "description": "Prometheus text format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    if answer == "object":
        return {"description": "OpenAPI 3.1", "content": _json({"type": "object"})}
    key = "profiles" if answer == list[ProfileSummary] else answer
    return {"description": "OK", "content": _json(refs[key])}
