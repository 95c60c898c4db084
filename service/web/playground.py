"""The playground: a page, served by the service itself, to try the judge by hand.

``GET /`` redirects to ``/playground``; the page's script and style are under ``/static``.
These routes are public because a browser navigating to a page cannot send a Bearer header:
the page asks for the API key, keeps it in a variable of the tab (never in storage) and sends
it on each call to the API, which stays behind the key. They are left out of the OpenAPI
schema, which describes the API only.

The page builds every element from data with ``createElement`` and ``textContent``, never
``innerHTML``, and its Content-Security-Policy allows no inline script, so a choice or detail
that holds markup is shown as text and cannot run.

``GET /playground/profiles/{name}/reliability.png`` serves the reliability diagram that
``judge calibrate`` writes beside a profile, when the profiles directory has one; it needs the
key like the profile itself.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from litestar import MediaType, Response, get
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.response import File, Redirect
from litestar.static_files import create_static_files_router
from litestar.types import ControllerRouterHandler

from calibration import ProfileNotFoundError
from calibration.profile import NAME_PATTERN
from service.web.frontdoor import PUBLIC
from service.web.serving import Service

__all__ = ["CONTENT_SECURITY_POLICY", "PLAYGROUND_ROUTES", "STATIC"]

STATIC = Path(__file__).parent / "static"

# Everything from this origin only, no inline script or style markup, no plugins, no framing.
# blob: images are the reliability PNG, fetched with the key and shown from memory.
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' blob:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@functools.cache
def _page() -> bytes:
    return (STATIC / "playground.html").read_bytes()


@get("/", include_in_schema=False, opt={PUBLIC: True}, status_code=307)
async def root() -> Redirect:
    return Redirect("/playground", status_code=307)


@get("/playground", include_in_schema=False, opt={PUBLIC: True}, sync_to_thread=False)
def playground() -> Response[bytes]:
    return Response(_page(), media_type=MediaType.HTML, headers=PAGE_HEADERS)


@get("/playground/profiles/{name:str}/reliability.png", include_in_schema=False)
async def reliability_png(name: FromPath[str], service: NamedDependency[Service]) -> File:
    # The name is checked before it touches the file system: no "..", no separators.
    path = service.store.directory / f"{name}.reliability.png"
    if not re.fullmatch(NAME_PATTERN, name) or not path.is_file():
        raise ProfileNotFoundError(
            f"profile {name!r} has no reliability diagram here "
            f"(`judge calibrate` writes {name}.reliability.png beside {name}.json)"
        )
    return File(path, media_type="image/png", content_disposition_type="inline")


PLAYGROUND_ROUTES: list[ControllerRouterHandler] = [
    root,
    playground,
    reliability_png,
    create_static_files_router(
        path="/static",
        directories=[STATIC],
        name="playground-static",
        opt={PUBLIC: True},
        include_in_schema=False,
    ),
]
