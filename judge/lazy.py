"""A package's exports, loaded on first use (PEP 562 module ``__getattr__``).

``judge``, ``calibration`` and ``service`` name their public API at the top level, but
importing a package must not import all of it: ``calibration`` and the client use
``judge.atomicio`` and ``judge.scores`` without torch, and ``service.client`` uses
``calibration``'s Structs without scipy or Litestar. Each package keeps a table of
name -> defining module and gets its ``__getattr__`` and ``__dir__`` from here::

    __getattr__, __dir__ = exports(__name__, {"Judge": "judge.engine", ...})

A leaf: it imports nothing from the project.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["exports"]


def exports(
    package: str, table: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose names live in ``table``'s modules."""
    namespace = vars(sys.modules[package])

    def get(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups find it without calling this function
        return value

    def names() -> list[str]:
        return sorted(set(namespace) | set(table))

    return get, names
