"""Request bodies: read as JSON, decoded strictly into the schema's types, or refused by name.

Decoding is msgspec's, with ``strict=True``: ``"threshold": "0.5"`` is a string where a
number belongs and is refused, as the OpenAPI document says (Litestar's own body parsing
coerces it). Every refusal is a ``BodyError`` whose ``field`` is the JSON path msgspec
reports, without its ``$.`` (``choices[1]``), or ``body`` / ``content-type`` for the body as a
whole.

A union of Structs (``schemas.BatchRequest``: ``ItemsBatch | SharedBatch``) is told apart by
the keys the body has: the one member whose required fields the body has (not as null) is
decoded, strictly; a body that has two members' keys, or none, is refused, naming the first
member's first required field. ``decode_each`` does the same for each element of a list read
raw (a batch's items), naming the element (``items[2].prompt``).
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar, overload

import msgspec

__all__ = ["BodyError", "decode_body", "decode_each", "integral", "located"]

T = TypeVar("T")

_PATH = re.compile(r" - at (?:`key` in )?`\$\.?([^`]*)`$")  # a map's bad key: the map's field
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


@overload
def decode_body(body: bytes, content_type: str | None, type_: type[T]) -> T: ...
@overload
def decode_body(body: bytes, content_type: str | None, type_: types.UnionType) -> Any: ...
def decode_body(body: bytes, content_type: str | None, type_: Any) -> Any:
    """``body`` decoded into ``type_``, or a BodyError that names the field at fault."""
    if not _is_json(content_type):
        raise BodyError(
            "content-type",
            f"the body must be JSON (content-type: application/json), got {content_type!r}",
            status=415,
        )
    if not body.strip():
        raise BodyError("body", "the request body is empty; send a JSON object")
    if isinstance(type_, types.UnionType):
        type_ = _member(body, typing.get_args(type_))
    try:
        try:
            return msgspec.json.decode(body, type=type_, strict=True)
        except msgspec.ValidationError as exc:
            if not _INT_GOT_FLOAT.match(str(exc)):
                raise
            # JSON Schema's integer is any number without a fraction, 2433.0 included; strict
            # msgspec wants 2433. Decode again with such numbers as ints (a float field
            # takes an int as well), so that only a real fraction is refused.
            return msgspec.convert(integral(msgspec.json.decode(body)), type_, strict=True)
    except RecursionError:
        raise BodyError("body", "the JSON body is nested too deeply") from None
    except msgspec.ValidationError as exc:
        raise BodyError(*located(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise BodyError("body", f"the body is not valid JSON: {exc}") from None


def decode_each(raws: Sequence[msgspec.Raw], type_: Any, field: str) -> list[Any]:
    """Each of ``raws`` decoded as ``decode_body`` decodes a body, or a BodyError that names the
    element and its field at fault (``items[2].prompt``)."""
    decoded = []
    for i, raw in enumerate(raws):
        try:
            decoded.append(decode_body(bytes(raw), None, type_))
        except BodyError as exc:
            own = exc.field if exc.field != "body" else ""
            where = f"{field}[{i}]" + (f".{own}" if own else "")
            text = str(exc).removeprefix(f"{own}: ") if own else str(exc)
            raise BodyError(where, f"{where}: {text.replace('the body', 'the item')}") from None
    return decoded


def _member(body: bytes, members: tuple[type[msgspec.Struct], ...]) -> type[msgspec.Struct]:
    """The member of a union of Structs whose required keys ``body`` has (a null is absent)."""
    try:
        keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except RecursionError:
        # Too deep to read the keys: the first member's strict decoding refuses it, naming
        # the first field it cannot take, as a body of one type is refused.
        return members[0]
    except msgspec.ValidationError:
        raise BodyError("body", "the body must be a JSON object") from None
    except msgspec.DecodeError as exc:
        raise BodyError("body", f"the body is not valid JSON: {exc}") from None
    given = {key for key, raw in keys.items() if bytes(raw).strip() != b"null"}
    required = [[f.encode_name for f in msgspec.structs.fields(m) if f.required] for m in members]
    chosen = [m for m, names in zip(members, required, strict=True) if given & set(names)]
    if len(chosen) == 1:
        return chosen[0]
    shapes = ", or ".join(" with ".join(names) for names in required)
    problem = "not both" if chosen else "the body has neither"
    raise BodyError(required[0][0], f"{required[0][0]}: give either {shapes}; {problem}")


def integral(value: Any) -> Any:
    """``value`` with every float that has no fraction (and fits a float exactly) as an int."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [integral(v) for v in value]
    if isinstance(value, dict):
        return {k: integral(v) for k, v in value.items()}
    return value


def located(message: str) -> tuple[str, str]:
    """The field a msgspec validation message is about, and the message with that field."""
    path = _PATH.search(message)
    # msgspec names a map's value "field[...]": the field is the map's (a list keeps its index)
    field = path.group(1).replace("[...]", "") if path else ""
    text = message[: path.start()] if path else message
    if path and path.group(0).startswith(" - at `key`"):
        text = f"a key: {text}"  # the map's key (a name), not one of its values
    named = _UNKNOWN.search(text) or _MISSING.search(text)
    if named:  # an unknown or missing field: name it, not the object that holds it
        field = f"{field}.{named.group(1)}" if field else named.group(1)
    field = field or "body"
    return field, f"{field}: {text}"
