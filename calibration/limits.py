"""Limits that the fitters enforce and the wire schemas state, in a module with no scipy.

``service.schemas`` (and so the client) reads them without loading the fitters.
"""

from __future__ import annotations

__all__ = ["MIN_EXAMPLES"]

MIN_EXAMPLES = 20  # labeled examples a profile is fitted on, at least
