"""What the rest of the project needs from an engine, as a structural type.

``tasks``, ``service`` and ``cli`` are written against ``Engine`` rather than ``Judge``, so a
test can hand in a small fake (or another backend can stand in) without inheriting from
``Judge`` or silencing the type checker. ``Judge`` satisfies it structurally; nothing
subclasses it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from judge.engine import Configuration, Judgment, Query, TokenCount
from judge.errors import JudgeError

__all__ = ["Engine"]


@runtime_checkable
class Engine(Protocol):
    """An engine that judges prompts against finite sets of choices.

    The properties are read-only here, so a plain attribute or a property both satisfy them.
    """

    @property
    def model_id(self) -> str:
        """Names the model in results and in calibration profiles."""
        ...

    @property
    def dtype(self) -> str:
        """The weights' floating-point type (``"float32"``, ``"bfloat16"``, ...)."""
        ...

    def configuration(
        self,
        *,
        system: str | None = None,
        response_prefix: str | None = None,
        response_suffix: str | None = None,
    ) -> Configuration:
        """What a calibration profile must match; None arguments take the engine's defaults."""
        ...

    def count_tokens(self, query: Query | Mapping[str, Any]) -> TokenCount:
        """How many tokens ``query`` feeds the model, without model work (for budgets)."""
        ...

    def judge(
        self,
        prompt: str,
        choices: Sequence[str],
        *,
        system: str | None = None,
        response_prefix: str | None = None,
        response_suffix: str | None = None,
        feature_layers: Sequence[int] = (),
    ) -> Judgment:
        """Judge one prompt; ``feature_layers`` come back as ``Judgment.features``."""
        ...

    def judge_batch(self, queries: Sequence[Query | Mapping[str, Any]]) -> list[Judgment]:
        """Judge many items; one bad item fails the whole call before any work is done."""
        ...

    def judge_each(
        self, queries: Sequence[Query | Mapping[str, Any]]
    ) -> list[Judgment | JudgeError]:
        """Judge many items; a bad item gets its error in its place and the rest run."""
        ...

    def judge_shared(
        self, context: str, questions: Sequence[Query | Mapping[str, Any]]
    ) -> list[Judgment]:
        """Judge many questions about one context."""
        ...
