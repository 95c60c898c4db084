"""The HTTP service over the judge engine (Litestar + msgspec; no torch here)."""

from service.app import ServiceConfig, create_app

__all__ = ["ServiceConfig", "create_app"]
