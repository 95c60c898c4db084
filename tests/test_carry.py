"""calibration.carry: a record's fields carried into another by name."""

from __future__ import annotations

import msgspec
import pytest
from fakes import judgment_of

from calibration.carry import carry
from calibration.policy import make_policy


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


class _Record(msgspec.Struct, frozen=True, kw_only=True):
    choice: str
    probabilities: dict[str, float]
    raw_probabilities: dict[str, float]
    model: str


def test_a_verdict_is_carried_with_its_probabilities_in_the_order_asked() -> None:
    verdict = make_policy(None).decide(judgment_of({"a": 0.5, "b": 0.3, "c": 0.2}))
    record = verdict.carried(_Record, ["c", "a", "b"], model="m")
    assert list(record.probabilities) == list(record.raw_probabilities) == ["c", "a", "b"]
    assert record.probabilities == verdict.probabilities and record.choice == verdict.choice
    assert record.raw_probabilities == pytest.approx({"a": 0.5, "b": 0.3, "c": 0.2})
    assert record.model == "m"
    with pytest.raises(KeyError):  # a choice the verdict does not have
        verdict.carried(_Record, ["a", "d"], model="m")
