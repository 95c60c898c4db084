"""Limits that the engine enforces and the wire schemas state, in a module with no torch.

``service.schemas`` (and so the client) reads them without loading the engine.
"""

from __future__ import annotations

__all__ = ["MAX_CHOICES"]

MAX_CHOICES = 1024  # choices per question; more is a TooManyChoicesError: split the question
