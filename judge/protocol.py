"""What the rest of the project needs from an engine, as a structural type.

``tasks``, ``service`` and ``cli`` are written against ``Engine`` rather than ``Judge``, so a
test can hand in a small fake (or another backend can stand in) without inheriting from
``Judge`` or silencing the type checker. ``Judge`` satisfies it structurally; nothing
subclasses it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, Unpack, runtime_checkable

from judge.errors import JudgeError
from judge.fingerprint import Fingerprint
from judge.judgments import Judgment, Prepared, Query, QueryOptions, TemplateOptions, TokenCount

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
    def model_sha256(self) -> str:
        """The sha256 of the weights every judgment carries; "" where the engine cannot hash
        them (a model served elsewhere)."""
        ...

    @property
    def dtype(self) -> str:
        """The weights' floating-point type (``"float32"``, ``"bfloat16"``, ...)."""
        ...

    @property
    def max_batch_size(self) -> int:
        """Rows one forward pass may hold."""
        ...

    @property
    def max_batch_tokens(self) -> int:
        """Tokens one forward pass may feed the model (``judge.packing.pass_tokens``: any
        padding included): the budget ``run`` packs to."""
        ...

    def fingerprint(self, **template: Unpack[TemplateOptions]) -> Fingerprint:
        """What a calibration profile must match; None arguments take the engine's defaults."""
        ...

    def count_tokens(self, query: Query | Mapping[str, Any]) -> TokenCount:
        """Each field's share of ``query``'s tokens, without model work: the one to blame."""
        ...

    def prepare(self, query: Query | Mapping[str, Any]) -> Prepared:
        """``query`` checked and tokenized for ``run``; ``Prepared.tokens`` is its exact size."""
        ...

    def run(self, prepared: Sequence[Prepared]) -> list[Judgment]:
        """Judge prepared queries, each alone in its row, in passes within the budget."""
        ...

    def run_shared(self, prepared: Sequence[Prepared]) -> list[Judgment]:
        """Judge prepared queries that share a head (``shared_query``), the head fed once."""
        ...

    def judge(
        self, prompt: str, choices: Sequence[str], **options: Unpack[QueryOptions]
    ) -> Judgment:
        """Judge one prompt; ``feature_layers`` come back as ``Judgment.features``, the means
        of ``span_layers`` over ``item_span`` (None: the whole prompt) as
        ``Judgment.span_features``."""
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
