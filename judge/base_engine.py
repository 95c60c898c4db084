"""What every engine does before the model: render, check, tokenize, build the choice trie.

An engine judges in two steps (``judge.engine``): ``prepare`` turns a query into a
``Prepared`` (rendered, checked, tokenized, its trie built: no model work) and ``_score`` turns
rows of prepared queries into judgments. ``BaseEngine`` is the first step, the engine's
fingerprint and the calls made of both (``judge``, ``judge_batch``, ``judge_each``,
``judge_shared``, ``run``, ``run_shared``); an engine adds how it scores rows and what it knows
of its model: ``Judge`` runs a model loaded here, ``ServerEngine`` (``judge.server_engine``)
asks a model served over HTTP for the same numbers.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self, Unpack

import msgspec
import numpy as np

from judge.adapters import Adapter
from judge.errors import InvalidQueryError, JudgeError, PromptTooLongError, TokenizerRoundTripError
from judge.fingerprint import ChoicePaths, Fingerprint, check_choice_paths, sha256_text
from judge.grammar import GrammarVocabulary, choice_targets
from judge.identity import new_judgment_id, tokens_sha256
from judge.judgments import (
    Judgment,
    Prepared,
    Query,
    QueryOptions,
    TemplateOptions,
    TokenCount,
    check_feature_layers,
    check_item_span,
    json_escape,
    shared_query,
    validate_choices,
)
from judge.packing import pack_rows
from judge.tokens import PathEncoder
from judge.trie import build_trie, logsumexp

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["BaseEngine"]


class BaseEngine:
    """An engine's tokenizer side and the calls made of ``prepare`` and ``_score``.

    Attributes an engine sets besides those of ``__init__``: ``model_id``, ``weights_sha256``
    (None where the weights are not hashed), ``dtype``, ``hidden_size`` (None without hidden
    states), ``max_batch_size`` and ``max_batch_tokens``.
    """

    model_id: str
    weights_sha256: str | None
    hidden_size: int | None
    max_batch_size: int
    max_batch_tokens: int

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        system: str | None,
        response_prefix: str,
        response_suffix: str,
        context_window: int | None,
        num_layers: int | None,
        choice_paths: ChoicePaths,
    ) -> None:
        self.tokenizer = tokenizer
        self.system = system
        self.response_prefix = response_prefix
        self.response_suffix = response_suffix
        self.context_window = context_window
        self.num_layers = num_layers
        self._encoder = PathEncoder(tokenizer)
        self._read_choices_on(choice_paths)
        # A plain-text prompt gets the BOS token the tokenizer would add by default.
        bos = tokenizer.bos_token
        adds_bos = bos is not None and tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id]
        self._plain_bos = str(bos) if adds_bos else ""

    @property
    def dtype(self) -> str:
        raise NotImplementedError

    # Whether this engine runs a query's low-rank adapter (``Query.adapter``): one that holds
    # the model's weights merges it; a model served elsewhere cannot.
    serves_adapters = False

    def check_adapter(self, adapter: Adapter | None) -> None:
        """Refuse an adapter this engine cannot run (InvalidQueryError naming "adapter")."""
        if adapter is not None and not self.serves_adapters:
            raise InvalidQueryError(
                f"adapter {adapter.short}: {self.model_id} cannot judge under a low-rank "
                "adapter (its weights are not here to merge it into); load the model this "
                "process can hold, or use a profile without an adapter",
                field="adapter",
            )

    def _read_choices_on(self, choice_paths: ChoicePaths) -> None:
        """Which token paths spell a choice: the tokenizer's own one ("canonical", the trie)
        or every path a grammar engine's mask allows ("grammar", judge.grammar)."""
        self.choice_paths: ChoicePaths = check_choice_paths(choice_paths)
        # Read the vocabulary now: a tokenizer that is not byte-level fails here, not later.
        self._grammar = GrammarVocabulary.of(self.tokenizer) if choice_paths == "grammar" else None

    def with_choice_paths(self, choice_paths: ChoicePaths) -> Self:
        """This judge reading the choices on ``choice_paths`` instead: the same model,
        tokenizer, settings and prefix cache (a cached prefix is the same whatever is read
        after it), for comparing the two modes without loading the model twice."""
        other = copy.copy(self)
        other._read_choices_on(choice_paths)
        return other

    def fingerprint(self, **template: Unpack[TemplateOptions]) -> Fingerprint:
        """What a calibration profile must match: the model, its dtype, the effective template.

        None arguments take the judge's defaults, as ``judge()`` does. ``calibration.fit_profile``
        stores this value in the profile, and ``CalibrationProfile.check`` compares it.
        """
        system = template.get("system")
        prefix, suffix = template.get("response_prefix"), template.get("response_suffix")
        return Fingerprint(
            model=self.model_id,
            model_sha256=self.weights_sha256,
            dtype=self.dtype,
            response_prefix=self.response_prefix if prefix is None else prefix,
            response_suffix=self.response_suffix if suffix is None else suffix,
            system_sha256=sha256_text(self.system if system is None else system),
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            choice_paths=self.choice_paths,
        )

    def render(
        self, prompt: str, *, system: str | None = None, response_prefix: str | None = None
    ) -> str:
        """The exact text fed to the model, up to and including the response prefix."""
        system = self.system if system is None else system
        prefix = self.response_prefix if response_prefix is None else response_prefix
        if self.tokenizer.chat_template:
            messages = [{"role": "user", "content": prompt}]
            if system is not None:
                messages.insert(0, {"role": "system", "content": system})
            rendered = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return str(rendered) + prefix
        head = f"{system}\n\n" if system else ""
        return f"{self._plain_bos}{head}{prompt}\n{prefix}"

    def count_tokens(self, query: Query | Mapping[str, Any]) -> TokenCount:
        """How many tokens ``query`` feeds the model, and each field's share; no model work.

        ``total`` is the rendered prompt's tokens plus the longest choice ending's (each
        tokenized alone, so it may differ from what runs: ``prepare(query).tokens`` is exact).
        Servers use it to name the largest field of a query over their budget.
        """
        query = _as_query(query)
        _, rendered, suffix, endings = self._rendered(query)
        fields = _text_fields(query, suffix)
        ids = self.tokenizer([rendered, *fields.values(), *endings], add_special_tokens=False)
        lengths = [len(i) for i in ids.input_ids]
        parts = dict(zip(fields, lengths[1:5], strict=True))
        parts["choices"] = max(lengths[5:]) - parts["response_suffix"]
        return TokenCount(total=lengths[0] + max(lengths[5:]), parts=parts)

    def judge(
        self, prompt: str, choices: Sequence[str], **options: Unpack[QueryOptions]
    ) -> Judgment:
        """Judge one prompt; see ``Judgment`` for what comes back. ``options`` are ``Query``'s
        other fields (``feature_layers``, ``span_layers`` and ``item_span``: what a probe
        profile reads), checked as a query's are."""
        # Unchecked here: ``prepare`` checks the query and names what is wrong with it.
        query = Query(prompt=prompt, choices=choices, **options)  # type: ignore[arg-type]
        return self.judge_batch([query])[0]

    def judge_batch(self, queries: Sequence[Query | Mapping[str, Any]]) -> list[Judgment]:
        """Judge many items; items run together in batched passes within the budget.

        Every item is prepared before any forward pass runs, so one bad item fails the call
        without wasting work.
        """
        start = time.perf_counter()
        return self._score([[self.prepare(q)] for q in queries], start)

    def judge_each(
        self, queries: Sequence[Query | Mapping[str, Any]]
    ) -> list[Judgment | JudgeError]:
        """Like ``judge_batch``, but a bad item gets its error in its place and the rest run."""
        start = time.perf_counter()
        prepared: list[Prepared | JudgeError] = []
        for q in queries:
            try:
                prepared.append(self.prepare(q))
            except JudgeError as exc:
                prepared.append(exc)
        valid = [[p] for p in prepared if isinstance(p, Prepared)]
        results = iter(self._score(valid, start))
        return [p if isinstance(p, JudgeError) else next(results) for p in prepared]

    def judge_shared(
        self, context: str, questions: Sequence[Query | Mapping[str, Any]]
    ) -> list[Judgment]:
        """Judge many questions about one context, computing the shared prompt once.

        Each question's prompt is ``context``, a blank line, then the question's own prompt
        (``shared_query``). The questions' rendered prompts share their leading tokens; those
        are fed to the model once, with every question's remainder and choice trie packed
        after them (``run_shared``).
        """
        start = time.perf_counter()
        prepared = [self.prepare(shared_query(context, _as_query(q))) for q in questions]
        return self._score(self._rows(prepared), start)

    def prepare(self, query: Query | Mapping[str, Any]) -> Prepared:
        """``query`` validated, rendered and tokenized for ``run``: every check, no model work.

        Raises the JudgeError that says what is wrong with it (a ``PromptTooLongError`` names
        the largest field). ``Prepared.tokens`` is its exact size.
        """
        query = _as_query(query)
        choices, prompt, suffix, endings = self._rendered(query)
        encoded = self._encoder.encode_paths(prompt, endings)

        _check_window(self, max(len(p) for p in encoded.paths), query)
        failures = self._encoder.round_trip_failures(prompt, endings, encoded)
        if failures:
            i = failures[0]
            text = prompt + endings[i]
            back = self._encoder.decode([encoded.paths[i]])[0]
            raise TokenizerRoundTripError(
                f"the tokenizer does not encode the rendered text back to itself: "
                f"{_first_difference(text, back)}; use a tokenizer whose decode inverts "
                "its encode (a byte-level BPE), or avoid the characters it normalizes",
                field=_round_trip_field(self.tokenizer, query, suffix, choices),
            )
        if self._grammar is None:
            trie = build_trie(
                encoded.paths, encoded.prompt_ids, choices, shared=encoded.head_length
            )
        else:
            tree = self._grammar.tree(choice_targets(choices, suffix))
            trie = tree.packed(encoded.prompt_ids)
            # A path of short tokens can run deeper than the longest canonical one.
            _check_window(self, len(trie.context) + max(trie.tree_depths, default=0), query)
        layers = check_feature_layers(query.feature_layers, self.num_layers)
        item_span = check_item_span(query.item_span, query.prompt)
        span_layers = check_feature_layers(query.span_layers, self.num_layers, "span_layers")
        self.check_adapter(query.adapter)
        if span_layers:
            ids, context = encoded.prompt_ids, len(trie.context)
            span = self._encoder.item_tokens(query.prompt, item_span, prompt, ids, context)
            trie = dataclasses.replace(trie, span=span)
        return Prepared(
            choices,
            prompt,
            len(encoded.prompt_ids),
            trie,
            tokens_sha256(encoded.prompt_ids, encoded.paths, self.choice_paths),
            trie.packed_length,
            layers,
            span_layers,
            item_span,
            tuple(endings),
            query.adapter,
        )

    def run(self, prepared: Sequence[Prepared]) -> list[Judgment]:
        """Judge prepared queries, each in a row of its own, in passes within the budget.

        Passes hold at most ``max_batch_size`` rows and ``max_batch_tokens`` tokens, counted as
        this engine's pass feeds them (``judge.packing.passes``: the rows' sum in the lean pass,
        padding included in the generic one); queries that fit in one pass together run as one.
        """
        return self._score([[p] for p in prepared], time.perf_counter())

    def run_shared(self, prepared: Sequence[Prepared]) -> list[Judgment]:
        """Judge prepared queries whose prompts share a head: the head is fed once per row.

        Consecutive queries are packed into rows of at most ``max_batch_tokens`` tokens
        (``judge.packing.pack_rows``), each row holding the shared tokens once and every
        query's remainder and choice trie after them.
        """
        return self._score(self._rows(prepared), time.perf_counter())

    def _rows(self, prepared: Sequence[Prepared]) -> list[list[Prepared]]:
        # A row is one model's pass: queries under different adapters never share one.
        rows: list[list[Prepared]] = []
        for _, group in itertools.groupby(prepared, key=adapter_key):
            run = list(group)
            packed = pack_rows([p.trie for p in run], self.max_batch_tokens)
            rows += [[run[i] for i in row] for row in packed]
        return rows

    def _judgment(self, prepared: Prepared, logps: np.ndarray, **measured: Any) -> Judgment:
        """The judgment of ``prepared`` whose choices' log-probabilities are ``logps``;
        ``measured``: the rest of its fields, as the engine measured them (choice mass,
        tokens, passes, latency, hidden states, the weights' hash)."""
        probs = np.exp(logps - logsumexp(logps))
        best = int(np.argmax(probs))
        return Judgment(
            choice=prepared.choices[best],
            confidence=float(probs[best]),
            choices=prepared.choices,
            probs=probs.tolist(),
            log_probs=logps.tolist(),
            prompt=prepared.prompt,
            prompt_tokens=prepared.prompt_tokens,
            model=self.model_id,
            item_span=prepared.item_span,
            judgment_id=new_judgment_id(),
            tokens_sha256=prepared.tokens_sha256,
            adapter_sha256=adapter_key(prepared),
            **measured,
        )

    def _score(self, rows: list[list[Prepared]], start: float) -> list[Judgment]:
        """Judge ``rows`` of prepared queries (the queries of a row share its pass), in order;
        ``start``: when the call began (``perf_counter``), for the judgments' latency."""
        raise NotImplementedError

    def _rendered(self, query: Query) -> tuple[list[str], str, str, list[str]]:
        """The query checked and rendered: its choices, the text up to the decision point,
        the response suffix in force and each choice's ending (escaped choice + suffix)."""
        choices = validate_choices(query.choices)
        if not isinstance(query.prompt, str):
            raise InvalidQueryError(f"prompt must be a string, got {type(query.prompt).__name__}")
        prompt = self.render(
            query.prompt, system=query.system, response_prefix=query.response_prefix
        )
        suffix = self.response_suffix if query.response_suffix is None else query.response_suffix
        return choices, prompt, suffix, [json_escape(c) + suffix for c in choices]


def adapter_key(prepared: Prepared) -> str:
    """The sha256 of the adapter ``prepared`` is judged under; "" for none."""
    return "" if prepared.adapter is None else prepared.adapter.sha256


def _check_window(judge: BaseEngine, longest: int, query: Query) -> None:
    """Raise PromptTooLongError, naming the largest field, when ``longest`` tokens (the
    deepest position the pass reads) do not fit the judge's context window."""
    window = judge.context_window
    if window is not None and longest > window:
        raise PromptTooLongError(
            f"the prompt with the response prefix and the longest choice is {longest} tokens, "
            f"but the model's context window is {window}; shorten the prompt "
            f"by at least {longest - window} tokens (it is never truncated, "
            "so the decision point is never cut away)",
            field=judge.count_tokens(query).largest,
        )


def _text_fields(query: Query, suffix: str) -> dict[str, str]:
    """The query's own texts by field name, to tell which one is at fault (or largest)."""
    return {
        "prompt": query.prompt,
        "system": query.system or "",
        "response_prefix": query.response_prefix or "",
        "response_suffix": suffix,
    }


def _round_trip_field(
    tokenizer: PreTrainedTokenizerBase, query: Query, suffix: str, choices: Sequence[str]
) -> str | None:
    """The first field whose own text the tokenizer does not give back, if any does not."""
    fields = {
        **_text_fields(query, suffix),
        **{f"choices[{i}]": json_escape(c) for i, c in enumerate(choices)},
    }
    ids = tokenizer(list(fields.values()), add_special_tokens=False).input_ids
    back = tokenizer.batch_decode(ids)
    return next(
        (name for (name, text), b in zip(fields.items(), back, strict=True) if b != text),
        None,
    )


def _as_query(item: Query | Mapping[str, Any]) -> Query:
    if isinstance(item, Query):
        return item
    try:
        return msgspec.convert(item, Query)
    except msgspec.ValidationError as exc:
        # msgspec names the path ("... - at `$.feature_layers[0]`"): its first key is the field.
        path = re.search(r"at `\$\.(\w+)", str(exc))
        field = path.group(1) if path else None
        raise InvalidQueryError(f"invalid query: {exc}", field=field) from exc


def _first_difference(a: str, b: str) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"at character {i}, {a[i : i + 20]!r} came back as {b[i : i + 20]!r}"
