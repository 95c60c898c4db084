"""The API key: a Litestar guard on the whole app, and its OpenAPI security scheme.

Litestar runs a route's guards before it reads or parses the request body (``HTTPRoute.handle``
calls ``authorize_connection`` before ``_get_response_for_request``), so a request without the
key costs neither a body parse nor model work. A route opts out with ``opt={PUBLIC: True}``;
only ``/health`` does. Paths that match no route answer 404 without the key, as routing comes
before any guard.
"""

from __future__ import annotations

import hmac
from typing import Any

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi.spec import Components, SecurityRequirement, SecurityScheme
from litestar.types import Guard

__all__ = ["PUBLIC", "SCHEME", "api_key_guard", "security_components", "security_requirement"]

PUBLIC = "public"  # route opt: no key needed
SCHEME = "BearerAuth"


def api_key_guard(key: str) -> Guard:
    """A guard that refuses, with a 401, any request without ``Authorization: Bearer <key>``."""
    expected = f"Bearer {key}".encode()

    async def guard(
        connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler
    ) -> None:
        if handler.opt.get(PUBLIC):
            return
        given = connection.headers.get("authorization", "").encode("latin-1")
        if not hmac.compare_digest(given, expected):  # constant time: no timing oracle
            raise NotAuthorizedException(
                detail="missing or wrong API key: send 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return guard


def security_components() -> Components:
    return Components(security_schemes={SCHEME: SecurityScheme(type="http", scheme="bearer")})


def security_requirement() -> list[SecurityRequirement]:
    return [{SCHEME: []}]
