"""The engine's fingerprint: what a judgment was made with, as one value.

A calibration profile holds only for the model, weights, dtype, response template and system
prompt it was fitted with, and a probe only for hidden states of the shape it was fitted on.
``Judge.fingerprint(...)`` gives that value for a call's template; ``calibration.fit_profile``
stores it in the profile, and ``CalibrationProfile.check`` compares the two values and names
the first field that differs. Plain data and no torch, so ``calibration`` imports it.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal, get_args

import msgspec
from msgspec import Meta

__all__ = ["CHOICE_PATHS", "ChoicePaths", "Fingerprint", "check_choice_paths", "sha256_text"]

# Which token paths spell a choice (``Judge(choice_paths=...)``): the tokenizer's canonical
# one, or every path a grammar engine's mask allows (``judge.grammar``). The numbers differ, so
# a profile fitted with one holds only for the same.
ChoicePaths = Literal["canonical", "grammar"]
CHOICE_PATHS: tuple[ChoicePaths, ...] = get_args(ChoicePaths)


def check_choice_paths(value: object) -> ChoicePaths:
    """``value`` if it names a mode of ``CHOICE_PATHS``, else a ValueError naming them."""
    if value not in CHOICE_PATHS:
        raise ValueError(f"choice_paths must be one of {', '.join(CHOICE_PATHS)}, got {value!r}")
    return value  # one of the literals, checked above


def sha256_text(text: str | None) -> str | None:
    """Hash of a system prompt; None stands for the model's default system prompt."""
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


class Fingerprint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The model, its dtype, the effective response template and system prompt, and the shape
    of the hidden states a probe reads. Compared as a value (fields in this order)."""

    model: str
    model_sha256: str | None  # of the weights; None where the loader could not hash them
    dtype: str
    response_prefix: str
    response_suffix: str
    # The system prompt's sha256 (``sha256_text``), so that a profile does not carry the prompt
    # itself; None: the model's default system prompt.
    system_sha256: str | None
    # The shape of the hidden states ``feature_layers`` read; None for an engine without them.
    num_layers: Annotated[int, Meta(ge=1)] | None = None
    hidden_size: Annotated[int, Meta(ge=1)] | None = None
    # Profiles from before the grammar-exact mode were all fitted on canonical paths.
    choice_paths: ChoicePaths = "canonical"

    def first_difference(self, other: Fingerprint) -> str | None:
        """The name of the first field whose value differs from ``other``'s; None if equal."""
        if self == other:
            return None
        return next(f for f in self.__struct_fields__ if getattr(self, f) != getattr(other, f))
