"""The typed questions of a decision request (System One's noul, choice and score, and judge's
pair), as data.

Only the questions' shapes and limits, and how a criterion reads as text: no engine, so the
wire types (``service.systemone``) and the client use them without loading the engine.
``judge.answers`` turns them into queries and their judgments into answers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

__all__ = [
    "MAX_LEVELS",
    "MAX_OPTIONS",
    "ChoiceQuestion",
    "Criterion",
    "NoulQuestion",
    "Order",
    "PairQuestion",
    "Question",
    "ScoreQuestion",
    "describe",
]

MAX_OPTIONS = 255  # a choice question's options (the System One limit)
MAX_LEVELS = 10  # a score's levels; "0".."9" are one token each in common tokenizers

Order = Literal["given", "invariant"]
# A criterion: free text, or an object whose values describe the option ({"what": ...}).
Criterion = str | dict[str, Any] | None


class NoulQuestion(msgspec.Struct, frozen=True, kw_only=True, tag="noul", tag_field="type"):
    """Yes or no; the answer is the probability of yes."""

    instructions: Annotated[str, Meta(min_length=1)]
    criteria: Criterion = None
    order: Order = "given"


class ChoiceQuestion(msgspec.Struct, frozen=True, kw_only=True, tag="choice", tag_field="type"):
    """One of 2-255 named options, each with an optional description."""

    instructions: Annotated[str, Meta(min_length=1)]
    criteria: Annotated[dict[str, Criterion], Meta(min_length=2, max_length=MAX_OPTIONS)]
    order: Order = "given"


class ScoreQuestion(msgspec.Struct, frozen=True, kw_only=True, tag="score", tag_field="type"):
    """A level on an ordered scale of 2-10 levels; the answer is the expected level index."""

    instructions: Annotated[str, Meta(min_length=1)]
    criteria: Annotated[list[Criterion], Meta(min_length=2, max_length=MAX_LEVELS)]
    order: Order = "given"


class PairQuestion(msgspec.Struct, frozen=True, kw_only=True, tag="pair", tag_field="type"):
    """Which of two named candidates (responses, documents) is the better by the instructions
    and criteria; the answer is the winner's name.

    Asked in both orders by default: which place a candidate is read in sways a small judge
    (position bias), and the mean over the two orders cancels the sway; ``order="given"``
    reads the candidates once, in the order given.
    """

    instructions: Annotated[str, Meta(min_length=1)]
    candidates: Annotated[dict[str, str], Meta(min_length=2, max_length=2)]
    criteria: Criterion = None
    order: Order = "invariant"


Question = NoulQuestion | ChoiceQuestion | ScoreQuestion | PairQuestion


def describe(criterion: Criterion) -> str:
    """A criterion as one line: text as it is; an object's values joined, keys naming them."""
    if criterion is None:
        return ""
    if isinstance(criterion, str):
        return criterion.strip()
    parts = []
    for key, value in criterion.items():
        text = "; ".join(map(str, value)) if isinstance(value, list) else str(value)
        parts.append(text if key == "what" else f"{key.replace('_', ' ')}: {text}")
    return " | ".join(parts)
