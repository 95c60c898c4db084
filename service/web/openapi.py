"""The OpenAPI document: the service's contract, derived from the table of operations.

The operations (method, path, summary, bodies, statuses) are ``service.operations``'s; what
only a document says (error descriptions, headers, examples, links) is written here. Every
operation lists every status it can answer, each with its body's schema. The body
schemas come from msgspec (``msgspec.json.schema_components``), from the very types
``service.bodies`` decodes with, so every constraint the server enforces on a body (lengths,
ranges, patterns, unique choices, no unknown fields) is in the document by construction. A
test runs schemathesis against a live server with this document and fails on any finding.
"""

from __future__ import annotations

import copy
import functools
import types
import typing
from typing import Any

import msgspec

import judge
from service.operations import BY_NAME, OPERATIONS, PARAMETER_PATTERN, TIMEOUT_HEADER
from service.schemas import ErrorResponse, ReadyResponse
from service.web.frontdoor import REPLICA_HEADER

__all__ = ["TIMEOUT_HEADER", "openapi_document"]

SCHEME = "BearerAuth"
_REF = "#/components/schemas/{name}"

_ERRORS = {
    400: "The body, a header or a path parameter is malformed or breaks the schema; `field` "
    "names it. A path parameter or header is checked first, before the body is read",
    401: "Missing or wrong API key",
    404: "No such profile, or no logged decision with that id (or the server keeps no "
    "decision log: --decision-log)",
    408: "The body did not arrive in time",
    412: "If-Match or If-None-Match does not hold for the stored version; `field` names the header",
    413: "The body is too large (`--max-body-bytes`; a profile PUT has its own, larger limit, "
    "room for a probe's weights), a judgment is over the server's token budget, or a System One "
    "request asks more questions than the server's limit (`--max-questions`)",
    409: "The decision has another label already; send `replace: true` to change it",
    415: "The body is not JSON",
    422: "The request is well-formed but cannot be served (the profile does not match, the "
    "prompt is too long for the model, the tokenizer cannot round-trip it, a profile breaks a "
    "rule across fields, a fit's method cannot be used, a label is not one of the decision's "
    "choices); `field` names the part at fault",
    503: "The model is loading, the server is at capacity, the deadline passed, or the "
    "decision log could not be read or written; retry after Retry-After seconds",
}

# Profiles carry versions (service.profiles): an ETag on what GET and PUT answer, and
# conditional PUT and DELETE.
_ETAG = {
    "schema": {"type": "string"},
    "description": "The stored version: the quoted sha256 of the profile's stored bytes",
}
_REPLICA = {
    "schema": {"type": "string"},
    "description": "The replica (host:pid) that answered; see service.web.frontdoor",
}
_TAGGED = {"profile", "put_profile"}  # operation names
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
        "description": "Act only if the stored version has none of these ETags (`*`: only if "
        "no version is stored, as a PUT that creates); else 412",
        "schema": {"type": "string"},
    },
}
_CONDITIONAL = {
    "put_profile": ("If-Match", "If-None-Match"),
    "delete_profile": ("If-Match", "If-None-Match"),
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
_EXAMPLES: dict[str, dict[str, Any]] = {
    "judge": {
        "prompt": f"Is this SMS spam? {_SPAM[0]}",
        "choices": ["spam", "ham"],
    },
    "judge_batch": {
        "context": f"SMS: {_HAM[0]}",
        "questions": [
            {"prompt": "Is it spam?", "choices": ["yes", "no"]},
            {"prompt": "Is it about a meeting place?", "choices": ["yes", "no"]},
        ],
    },
    "systemone": {
        "state": {"ticket": "I was charged twice for my subscription this month."},
        "questions": {
            "billing": {"type": "noul", "instructions": "Is this about billing?"},
            "team": {
                "type": "choice",
                "instructions": "Which team should handle it?",
                "criteria": {"billing": "payments, refunds", "technical": "bugs, outages"},
            },
            "urgency": {
                "type": "score",
                "instructions": "How urgent is it?",
                "criteria": ["not urgent", "soon", "now"],
            },
        },
    },
    "fit": {
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
    operations = [op for op in OPERATIONS if op.documented]
    bodies = [t for op in operations for t in (op.body, op.ok[1]) if not isinstance(t, str | None)]
    named = list(dict.fromkeys([*_members(bodies), ErrorResponse, ReadyResponse]))
    schemas, components = msgspec.json.schema_components(named, ref_template=_REF)
    refs: dict[Any, Any] = dict(zip(named, schemas, strict=True))
    for body in bodies:  # a union: its members' shapes exclude each other (service.bodies)
        if isinstance(body, types.UnionType):
            refs[body] = {"oneOf": [refs[member] for member in typing.get_args(body)]}
    _batch_items(components)
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        method, path = op.method.lower(), op.path
        ok, answer = op.ok
        document: dict[str, Any] = {"summary": op.summary, "operationId": op.operation_id}
        params = [
            {
                "name": name,
                "in": "path",
                "required": True,
                "schema": {"type": "string", "pattern": PARAMETER_PATTERN},
            }
            for name in op.parameters
        ]
        if op.model:
            params.append(
                {
                    "name": TIMEOUT_HEADER,
                    "in": "header",
                    "required": False,
                    "description": "Seconds the client will wait; shortens the server's deadline",
                    "schema": {"type": "number", "exclusiveMinimum": 0},
                }
            )
        params += [_PRECONDITIONS[h] for h in _CONDITIONAL.get(op.name, ())]
        if params:
            document["parameters"] = params
        if op.body is not None:
            content = _json(refs[op.body])
            if op.name in _EXAMPLES:
                content["application/json"]["example"] = _EXAMPLES[op.name]
            document["requestBody"] = {"required": True, "content": content}
        responses: dict[str, Any] = {str(ok): _success(answer, refs)}
        if op.name in _TAGGED:
            responses[str(ok)]["headers"] = {"ETag": _ETAG}
        statuses = sorted({*op.errors, *(() if op.public or not secured else (401,))})
        for status in statuses:
            responses[str(status)] = {
                "description": _ERRORS[status],
                # /ready's 503 says why it is not ready, in the shape of its 200.
                "content": _json(
                    refs[ReadyResponse if (op.name, status) == ("ready", 503) else ErrorResponse]
                ),
            }
            if status == 503:
                responses["503"]["headers"] = {
                    "Retry-After": {"schema": {"type": "integer"}, "description": "Seconds"}
                }
        if op.name in ("put_profile", "fit"):
            # What was stored can be read and deleted by its name: links for stateful clients
            # (and for schemathesis's stateful phase).
            responses[str(ok)]["links"] = {
                f"{verb.capitalize()}Profile": {
                    "operationId": other.operation_id,
                    "parameters": {"name": "$request.path.name"},
                }
                for verb, other in (
                    ("get", BY_NAME["profile"]),
                    ("delete", BY_NAME["delete_profile"]),
                )
            }
        for response in responses.values():  # the front door names itself on every answer
            response.setdefault("headers", {})[REPLICA_HEADER] = _REPLICA
        document["responses"] = responses
        if op.public and secured:
            document["security"] = []
        paths.setdefault(path, {})[method] = document
    out: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "judge", "version": judge.__version__},
        "paths": paths,
        "components": {"schemas": components},
    }
    if secured:
        out["components"]["securitySchemes"] = {SCHEME: {"type": "http", "scheme": "bearer"}}
        out["security"] = [{SCHEME: []}]
    return out


def _batch_items(components: dict[str, Any]) -> None:
    """A batch item's own schema: a whole request (a JudgeRequest whose choices may repeat)
    or an item alone (an ItemRequest), told apart by their keys (``schemas.BatchItem``).

    The engine, not the schema, refuses repeated choices (msgspec cannot check uniqueItems),
    and a batch answers each item's refusal in its place: the request is accepted (200) with
    that item's 400 among the results, so the batch's schema does not forbid it.
    """
    item = copy.deepcopy(components["JudgeRequest"])
    del item["properties"]["choices"]["uniqueItems"]
    item["title"] = "BatchJudgeRequest"
    item["description"] = "A JudgeRequest in a batch: repeated choices are refused in its place"
    components["BatchJudgeRequest"] = item
    components["ItemsBatch"]["properties"]["items"]["items"] = {
        "oneOf": [
            {"$ref": _REF.format(name="BatchJudgeRequest")},
            {"$ref": _REF.format(name="ItemRequest")},
        ]
    }


def _members(bodies: list[Any]) -> list[Any]:
    """The types that get a schema of their own: each body, or each member of a union."""
    return [
        m for t in bodies for m in (typing.get_args(t) if isinstance(t, types.UnionType) else (t,))
    ]


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _success(answer: Any, refs: dict[Any, Any]) -> dict[str, Any]:
    if answer is None:
        return {"description": "Done; no body"}
    if answer == "text":
        return {
            "description": "Prometheus text format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    if answer == "object":
        return {"description": "OpenAPI 3.1", "content": _json({"type": "object"})}
    return {"description": "OK", "content": _json(refs[answer])}
