"""The ways judge is served: HTTP (Litestar + msgspec; no torch here), the Python client
(``service.client``) and the ``judge`` command line (``service.cli``).

``create_app`` and ``ServiceConfig`` load on first use (PEP 562), so ``import service.client``
does not pull in Litestar.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from judge.lazy import exports

if TYPE_CHECKING:
    from service.config import ServiceConfig
    from service.web.app import create_app

_EXPORTS = {"ServiceConfig": "service.config", "create_app": "service.web.app"}

__all__ = ["ServiceConfig", "create_app"]


__getattr__, __dir__ = exports(__name__, _EXPORTS)
