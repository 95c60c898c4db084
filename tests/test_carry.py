"""calibration.carry: a record's fields carried into another by name."""

from __future__ import annotations

import msgspec
import pytest

from calibration.carry import carry


class _Source(msgspec.Struct, frozen=True, kw_only=True):
    choice: str
    confidence: float
    internal: int = 0

    @property
    def doubled(self) -> float:
        return 2 * self.confidence


class _Target(msgspec.Struct, frozen=True, kw_only=True):
    choice: str
    confidence: float
    model: str
    doubled: float | None = None


def test_same_named_fields_are_carried_and_given_ones_win() -> None:
    source = _Source(choice="spam", confidence=0.9, internal=3)
    assert carry(source, _Target, model="m") == _Target(choice="spam", confidence=0.9, model="m")
    given = carry(source, _Target, model="m", confidence=0.5)
    assert given.confidence == 0.5 and given.choice == "spam"


def test_a_property_is_not_a_field_and_a_missing_required_one_is_an_error() -> None:
    source = _Source(choice="spam", confidence=0.9)
    assert carry(source, _Target, model="m").doubled is None  # the target's default
    with pytest.raises(TypeError, match="model"):
        carry(source, _Target)
