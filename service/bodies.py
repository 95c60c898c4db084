"""Request bodies: read as JSON, decoded strictly into the schema's types, or refused by name.

Decoding is msgspec's, with ``strict=True``: ``"threshold": "0.5"`` is a string where a
number belongs and is refused, as the OpenAPI document says (Litestar's own body parsing
coerces it). Every refusal is a ``BodyError`` whose ``field`` is the JSON path msgspec
reports, without its ``$.`` (``choices[1]``), or ``body`` / ``content-type`` for the body as a
whole.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

__all__ = ["BodyError", "decode_body"]

T = TypeVar("T")

_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_INT_GOT_FLOAT = re.compile(r"Expected `int( \| null)?`, got `float`")  # optional ints too
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]+)`")
_MISSING = re.compile(r"Object missing required field `([^`]+)`")


class BodyError(Exception):
    """A request body that cannot be used: ``status`` 400 (bad JSON or schema) or 415."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status = status


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return True  # clients that send no content type mean JSON here; nothing else is read
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def decode_body(body: bytes, content_type: str | None, type_: type[T]) -> T:
    """``body`` decoded into ``type_``, or a BodyError that names the field at fault."""
    if not _is_json(content_type):
        raise BodyError(
            "content-type",
            f"the body must be JSON (content-type: application/json), got {content_type!r}",
            status=415,
        )
    if not body.strip():
        raise BodyError("body", "the request body is empty; send a JSON object")
    try:
        try:
            return msgspec.json.decode(body, type=type_, strict=True)
        except msgspec.ValidationError as exc:
            if not _INT_GOT_FLOAT.match(str(exc)):
                raise
            # JSON Schema's integer is any number without a fraction, 2433.0 included; strict
            # msgspec wants 2433. Decode again with such numbers as ints (a float field
            # takes an int as well), so that only a real fraction is refused.
            return msgspec.convert(_integral(msgspec.json.decode(body)), type_, strict=True)
    except RecursionError:
        raise BodyError("body", "the JSON body is nested too deeply") from None
    except msgspec.ValidationError as exc:
        raise BodyError(*_located(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise BodyError("body", f"the body is not valid JSON: {exc}") from None


def _integral(value: Any) -> Any:
    """``value`` with every float that has no fraction (and fits a float exactly) as an int."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


def _located(message: str) -> tuple[str, str]:
    """The field a msgspec validation message is about, and the message with that field."""
    path = _PATH.search(message)
    field = path.group(1) if path else ""
    text = message[: path.start()] if path else message
    named = _UNKNOWN.search(text) or _MISSING.search(text)
    if named:  # an unknown or missing field: name it, not the object that holds it
        field = f"{field}.{named.group(1)}" if field else named.group(1)
    field = field or "body"
    return field, f"{field}: {text}"
