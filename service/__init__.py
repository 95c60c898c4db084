"""The HTTP service over the judge engine (Litestar + msgspec; no torch here)."""

from service.app import create_app
from service.config import ServiceConfig

__all__ = ["ServiceConfig", "create_app"]
