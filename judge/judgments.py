"""The engine's plain data: what a judgment is asked (``Query``), what it is once checked and
tokenized (``Prepared``), and what it answers (``Judgment``), with the checks and the one
composition (``shared_query``) every caller shares.

Plain msgspec Structs, no tensors and no torch: ``judge.answers``, ``judge.protocol``, the
calibration package and the service read them without loading the engine. ``judge.engine``
re-exports them, so ``from judge.engine import Judgment`` still works.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping, Sequence
from typing import TypedDict

import msgspec

from judge.adapters import Adapter
from judge.errors import (
    ChoiceTypeError,
    DuplicateChoiceError,
    EmptyChoiceError,
    InvalidQueryError,
    TooFewChoicesError,
    TooManyChoicesError,
)
from judge.limits import MAX_CHOICES
from judge.scores import Score, score_of
from judge.trie import ChoiceTrie

__all__ = [
    "Judgment",
    "Prepared",
    "Query",
    "QueryOptions",
    "QueryTemplate",
    "TemplateOptions",
    "TokenCount",
    "check_feature_layers",
    "check_item_span",
    "item_span_of",
    "json_escape",
    "shared_query",
    "validate_choices",
]


class Query(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One item for ``Judge.judge_batch``; None fields take the judge's defaults."""

    prompt: str
    choices: list[str]
    system: str | None = None
    response_prefix: str | None = None
    response_suffix: str | None = None
    # Layers whose hidden state at the decision point comes back in ``Judgment.features``:
    # 1..num_layers, the residual stream after that many decoder blocks (num_layers: the last
    # block's output after the final norm, as the LM head reads it). Empty: none, at no cost.
    feature_layers: tuple[int, ...] = ()
    # Layers whose hidden states, averaged over the item's own tokens, come back in
    # ``Judgment.span_features`` (numbered as ``feature_layers``). The item is ``item_span``:
    # the [start, end) characters of ``prompt`` that hold it (the text judged, not the
    # instruction or rubric around it); None: the whole prompt (``shared_query`` marks the
    # shared context). Every token with a character in the span counts. The prefix cache then
    # serves only the tokens before the span, whose hidden states the mean does not read.
    span_layers: tuple[int, ...] = ()
    item_span: tuple[int, int] | None = None
    # Low-rank adapters to judge under (``judge.adapters``): the pass runs the model with them
    # merged into its blocks. None: the model as loaded. A profile that carries one sets it
    # (``calibration.Gate.asks``); an engine that cannot run one refuses the query.
    adapter: Adapter | None = None


class TemplateOptions(TypedDict, total=False):
    """The template a judgment is asked under, by keyword; None (or left out) takes the
    engine's defaults (``Engine.fingerprint``)."""

    system: str | None
    response_prefix: str | None
    response_suffix: str | None


class QueryTemplate(TemplateOptions, total=False):
    """A ``Query``'s fields that a batch of prompts shares (``labeled_queries``), by keyword."""

    feature_layers: Sequence[int]
    span_layers: Sequence[int]


class QueryOptions(QueryTemplate, total=False):
    """A ``Query``'s fields beside its prompt and choices: what ``Engine.judge`` takes by
    keyword (one place says what a query takes; ``Query`` says what each field means)."""

    item_span: tuple[int, int] | None
    adapter: Adapter | None


class Judgment(msgspec.Struct, frozen=True, kw_only=True):
    """The result of one judgment: plain data, no tensors."""

    choice: str  # the most probable choice
    confidence: float  # its probability
    choices: list[str]  # every choice, in the order given
    probs: list[float]  # each choice's probability, in ``choices`` order; sums to 1
    # log P(choice) under decoding constrained to the choices, in ``choices`` order; probs are
    # their softmax
    log_probs: list[float]
    choice_mass: float  # full-vocabulary probability of the choices' first tokens
    prompt: str  # the exact text fed to the model, ending with the response prefix
    prompt_tokens: int  # tokens of ``prompt``
    # Leading prompt tokens read from the prefix cache, and the tokens of this judgment's
    # packed input (prompt and choice trie) computed in its pass; a context shared by several
    # questions counts for each of them.
    cached_tokens: int
    computed_tokens: int
    forward_passes: int
    latency_ms: float  # wall time of the call that produced this judgment
    model: str
    # For each of the query's ``feature_layers``: the hidden state (float32, hidden_size
    # values) at the decision point, the position whose next-token logits the root reads.
    # None when the query asked for none. A learned head (``calibration.Probe``) reads these.
    features: dict[int, list[float]] | None = None
    # For each of the query's ``span_layers``: the mean of the hidden states (float32) over the
    # item's tokens (None when the query asked for none), and the item they cover: the query's
    # ``item_span``, characters of the query's prompt (not of the rendered ``prompt`` here);
    # None: the whole of it.
    span_features: dict[int, list[float]] | None = None
    item_span: tuple[int, int] | None = None
    # What pins this judgment (``judge.identity``): a fresh UUID version 7, unique and
    # time-ordered; the sha256 of the token ids fed for it (``identity.tokens_sha256``); the
    # sha256 of the weights (``Judge.model_sha256``). An engine always fills them; the empty
    # defaults are only for Judgments built by hand.
    judgment_id: str = ""
    tokens_sha256: str = ""
    model_sha256: str = ""
    # The sha256 of the adapter it was judged under (``Query.adapter``); "" for none.
    adapter_sha256: str = ""
    # An upper bound on the share of the choices' probability that is not known: 0 where
    # every step's children were read (always, for a model loaded here). A served model read
    # from its top next tokens only (``ServerEngine``, read "top") leaves out a choice's token
    # that is not among them; ``probs`` are then those of the choices read, and the gate
    # escalates where the unknown share could change its decision (``partial_logprobs``).
    unknown_mass: float = 0.0

    @property
    def probabilities(self) -> dict[str, float]:
        """Each choice's probability, keyed by choice in the order given (a view of ``probs``)."""
        return dict(zip(self.choices, self.probs, strict=True))

    @property
    def log_probabilities(self) -> dict[str, float]:
        """Each choice's log-probability, keyed by choice in the order given (of ``log_probs``)."""
        return dict(zip(self.choices, self.log_probs, strict=True))

    @property
    def logits(self) -> dict[str, float]:
        """The old name of ``log_probabilities`` (same values), kept so existing code runs.

        They were never raw logits but normalized log-probabilities, hence the new name. Not
        part of the JSON form, which carries ``choices`` and ``log_probs``.
        """
        return self.log_probabilities

    def score(self, values: Mapping[str, float] | None = None) -> Score:
        """This judgment as a score: expected value, std, most likely value, distribution.

        ``values`` maps every choice to a number; None: the choices' own numerals ("0".."10").
        A ValuesError (field ``values``) says what is missing. On the model's own
        probabilities; a calibration profile's ``decide`` gives the calibrated ones.
        """
        return score_of(self.probabilities, values)


class TokenCount(msgspec.Struct, frozen=True, kw_only=True):
    """The size of a query in tokens, each field counted alone, without any model work.

    ``parts`` names the field to blame when a query is too long; the exact size of what runs
    is ``Prepared.tokens``, which a server checks against its budget.
    """

    total: int  # the rendered prompt (template, system, prompt, response prefix) + longest choice
    # Each field's own tokens: prompt, system, response_prefix, response_suffix, and choices
    # (the longest choice).
    parts: dict[str, int]

    @property
    def largest(self) -> str:
        """The field with the most tokens: the one to shorten."""
        return max(self.parts, key=self.parts.__getitem__)


def validate_choices(choices: object) -> list[str]:
    """Return ``choices`` as a list, or raise the ChoicesError that says what is wrong."""
    if isinstance(choices, str) or not isinstance(choices, Sequence):
        raise ChoiceTypeError(f"choices must be a list of strings, got {type(choices).__name__}")
    if len(choices) < 2:
        raise TooFewChoicesError(f"need at least 2 choices to judge between, got {len(choices)}")
    if len(choices) > MAX_CHOICES:
        raise TooManyChoicesError(
            f"got {len(choices)} choices, at most {MAX_CHOICES} are accepted; split the question"
        )
    seen: set[str] = set()
    for i, choice in enumerate(choices):
        if not isinstance(choice, str):
            raise ChoiceTypeError(
                f"choice {i} must be a string, got {type(choice).__name__}: {choice!r}"
            )
        if not choice:
            raise EmptyChoiceError(f"choice {i} is the empty string; every choice needs text")
        if choice in seen:
            raise DuplicateChoiceError(
                f"choice {choice!r} appears more than once; remove the repeat"
            )
        seen.add(choice)
    return list(choices)


def json_escape(text: str) -> str:
    """``text`` as it appears inside a JSON string (non-ASCII kept as is)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def shared_query(context: str, query: Query) -> Query:
    """``query`` asked about ``context``: its prompt is the context, a blank line, then its own.

    How ``Judge.judge_shared`` composes its questions; a server that prepares them itself uses
    it too, so both feed the model the same text. The item (``Query.item_span``) is the span the
    question marked in its own prompt, moved along, else the context.
    """
    if not isinstance(context, str):
        raise InvalidQueryError(f"context must be a string, got {type(context).__name__}")
    span = check_item_span(query.item_span, query.prompt)
    if span is not None:  # the question marked its item in its own prompt: it moves along
        span = (span[0] + len(context) + 2, span[1] + len(context) + 2)
    elif context:  # else the item is the context the questions are asked about
        span = (0, len(context))
    return msgspec.structs.replace(query, prompt=f"{context}\n\n{query.prompt}", item_span=span)


class Prepared(msgspec.Struct, frozen=True):
    """A query ready for its forward pass: validated, rendered and tokenized, no model work.

    ``Judge.prepare`` makes one and ``Judge.run`` (or ``run_shared``) scores it, so a server
    can check its size against a budget and queue it without the model doing the work twice.
    """

    choices: list[str]  # validated, in the order given
    prompt: str  # the exact text fed to the model, ending with the response prefix
    prompt_tokens: int  # tokens of ``prompt``
    trie: ChoiceTrie  # the choices' token paths, packed: what the pass feeds the model
    tokens_sha256: str  # of the prompt's ids and each choice's path (``identity.tokens_sha256``)
    # Tokens its pass computes for it alone on a cold cache: the prompt and choice trie
    # (``trie.packed_length``, counted once here). Exact: a judgment made alone with nothing
    # cached has this ``computed_tokens``; a server checks it against its budget.
    tokens: int
    feature_layers: tuple[int, ...] = ()  # checked against the model's depth, sorted
    span_layers: tuple[int, ...] = ()  # as feature_layers; the trie's span says over what
    item_span: tuple[int, int] | None = None  # the query's, checked
    # Each choice's text after ``prompt`` (escaped choice and response suffix), in choice
    # order: what an engine that sends text rather than token ids (``ServerEngine``) feeds.
    endings: tuple[str, ...] = ()
    adapter: Adapter | None = None  # the query's


def check_feature_layers(
    layers: object, num_layers: int | None, field: str = "feature_layers"
) -> tuple[int, ...]:
    """A query's feature layers (or span layers: ``field``), checked against the model's depth
    (``num_layers``; None: not known), without repeats, sorted."""
    if not isinstance(layers, Sequence) or isinstance(layers, str):
        raise InvalidQueryError(
            f"{field} must be a list of layer numbers, got {type(layers).__name__}",
            field=field,
        )
    if not layers:
        return ()
    if num_layers is None:
        raise InvalidQueryError(
            "this model does not say how many layers it has (no num_hidden_layers in its "
            "config), so it cannot return hidden-state features; ask for none",
            field=field,
        )
    for n in layers:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise InvalidQueryError(
                f"feature layer {n!r} is not a layer number: give integers from 1 to {num_layers}",
                field=field,
            )
        if not 1 <= int(n) <= num_layers:
            raise InvalidQueryError(
                f"feature layer {n!r} is not a layer of this model: give numbers from 1 to "
                f"{num_layers} (the residual stream after that many blocks)",
                field=field,
            )
    return tuple(sorted({int(n) for n in layers}))


def item_span_of(prompt: str, item: str) -> tuple[int, int]:
    """Where ``item`` first occurs in ``prompt``: its [start, end) characters, the span a
    caller that knows the item's text rather than its place gives (``Query.item_span``)."""
    start = prompt.find(item) if item else -1
    if start < 0:
        raise InvalidQueryError(f"item {item!r} does not occur in the prompt", field="item")
    return start, start + len(item)


def check_item_span(span: object, prompt: str) -> tuple[int, int] | None:
    """A query's ``item_span`` checked against its prompt: None, or [start, end) character
    offsets with 0 <= start < end <= len(prompt)."""
    if span is None:
        return None
    if (
        not isinstance(span, Sequence)
        or isinstance(span, str)
        or len(span) != 2
        or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in span)
    ):
        raise InvalidQueryError(
            f"item_span must be two character offsets [start, end] into the prompt, got {span!r}",
            field="item_span",
        )
    start, end = int(span[0]), int(span[1])
    if not 0 <= start < end <= len(prompt):
        raise InvalidQueryError(
            f"item_span [{start}, {end}] is not a span of the prompt's {len(prompt)} characters: "
            "give 0 <= start < end <= the prompt's length",
            field="item_span",
        )
    return start, end
