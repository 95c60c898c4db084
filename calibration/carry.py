"""One record's fields carried into another by name.

A response, a log row, a stage's answer and a profile's summary are each a verdict or a
profile seen from outside: most of their fields are the source's field of the same name. Built
with ``carry``, each lists only what differs (a field computed, renamed or reordered), so a
field added to both sides flows through without a line to forget.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

__all__ = ["carry"]

S = TypeVar("S", bound=msgspec.Struct)


def carry(source: msgspec.Struct, target: type[S], /, **given: Any) -> S:
    """A ``target`` made of ``given`` and, for each of its other fields, ``source``'s field of
    the same name. A field neither gives keeps ``target``'s default (a required one is the
    constructor's TypeError). Properties of ``source`` are not fields: give them."""
    fields = source.__struct_fields__
    shared = {f: getattr(source, f) for f in target.__struct_fields__ if f in fields}
    return target(**(shared | given))
