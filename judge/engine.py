"""The judge: exact choice probabilities from one forward pass.

A judgment renders the chat prompt, prefills the response prefix, and reads the probability
that decoding constrained to the choices would emit each one, in one of two modes
(``choice_paths``). "canonical": each choice's token path is the tokenizer's own encoding of
``prompt + escape(choice) + suffix``, never prompt and choice tokenized apart; the paths form a
trie (``judge.trie``), and a choice's probability is that of its one path under decoding
masked to the trie. "grammar": every token path a grammar engine's mask allows spells its
choice (``s`` + ``pam`` as well as ``spam``), each step renormalised over the allowed tokens,
and a choice's probability sums all of them (``judge.grammar``): what grammar-constrained
decoding emits. Either way one forward pass scores the tree.

Judging is two steps: ``prepare`` checks, renders and tokenizes a query (no model work) into a
``Prepared`` that knows its exact size, and ``run`` scores prepared queries in passes packed
to ``max_batch_tokens`` (``judge.packing``). ``judge``, ``judge_batch``, ``judge_each`` and
``judge_shared`` are the two in one call; a server calls them apart, to check and schedule a
query before the model sees it, without preparing it twice.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Unpack

import msgspec
import numpy as np

from judge.errors import (
    InvalidQueryError,
    JudgeError,
    ModelLoadError,
    PromptTooLongError,
    TokenizerRoundTripError,
)
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
from judge.limits import MAX_CHOICES
from judge.packing import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_BATCH_TOKENS,
    pack_rows,
    passes,
    row_length,
)
from judge.prefix_cache import PrefixCache, cacheable
from judge.tokens import PathEncoder
from judge.trie import build_trie, common_prefix_length, logsumexp

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from judge.loading import DType

__all__ = [
    "DEFAULT_PREFIX_CACHE_MB",
    "DEFAULT_RESPONSE_PREFIX",
    "DEFAULT_RESPONSE_SUFFIX",
    "MAX_CHOICES",
    "Judge",
    "Judgment",
    "Prepared",
    "Query",
    "parameters_sha256",
    "shared_query",
    "validate_choices",
]

log = logging.getLogger("judge")

DEFAULT_RESPONSE_PREFIX = '{"answer": "'
DEFAULT_RESPONSE_SUFFIX = '"}'
DEFAULT_PREFIX_CACHE_MB = 256


class Judge:
    """Scores a fixed set of choices with a causal language model.

    Build it with ``Judge.load(...)``, or hand in a loaded model and tokenizer.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_id: str | None = None,
        weights_sha256: str | None = None,
        system: str | None = None,
        response_prefix: str = DEFAULT_RESPONSE_PREFIX,
        response_suffix: str = DEFAULT_RESPONSE_SUFFIX,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
        prefix_cache_block: int = 32,
        batch_invariant: bool = True,
        lean: bool = True,
        choice_paths: ChoicePaths = "canonical",
    ) -> None:
        from judge.decoder import lean_decoder, lean_unsupported

        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id or str(getattr(model.config, "name_or_path", "") or "custom")
        self.weights_sha256 = weights_sha256
        self.system = system
        self.response_prefix = response_prefix
        self.response_suffix = response_suffix
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        # True: a judgment's numbers do not depend on its batch or on the prefix cache
        # (judge.batch_invariant); False: the faster arithmetic, without that guarantee.
        self.batch_invariant = batch_invariant
        # The lean pass (judge.decoder) where the architecture has one, else the model's own
        # decoder (``lean=False`` asks for that generic pass; both are exact).
        reason = lean_unsupported(model) if lean else "lean=False"
        self._lean = lean_decoder(model, batch_invariant) if reason is None else None
        if self._lean is None:
            log.info("%s takes the generic pass: %s", type(model).__name__, reason)
            if batch_invariant:
                _use_sdpa(model)
        if not (isinstance(prefix_cache_mb, int | float) and prefix_cache_mb >= 0):
            raise ValueError(f"prefix_cache_mb must be a number >= 0, got {prefix_cache_mb!r}")
        # None: off (a budget of 0, or a model with layers that are not attention).
        self.prefix_cache = (
            PrefixCache(int(prefix_cache_mb * 2**20), prefix_cache_block)
            if prefix_cache_mb > 0 and cacheable(model.config)
            else None
        )
        self.context_window = _context_window(model, tokenizer)
        self._encoder = PathEncoder(tokenizer)
        self._read_choices_on(choice_paths)
        pad = tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else (tokenizer.eos_token_id or 0))
        # A plain-text prompt gets the BOS token the tokenizer would add by default.
        bos = tokenizer.bos_token
        adds_bos = bos is not None and tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id]
        self._plain_bos = str(bos) if adds_bos else ""
        self.num_layers = int(getattr(model.config, "num_hidden_layers", 0) or 0) or None
        self.hidden_size = int(getattr(model.config, "hidden_size", 0) or 0) or None

    def _read_choices_on(self, choice_paths: ChoicePaths) -> None:
        """Which token paths spell a choice: the tokenizer's own one ("canonical", the trie)
        or every path a grammar engine's mask allows ("grammar", judge.grammar)."""
        self.choice_paths: ChoicePaths = check_choice_paths(choice_paths)
        # Read the vocabulary now: a tokenizer that is not byte-level fails here, not later.
        self._grammar = GrammarVocabulary.of(self.tokenizer) if choice_paths == "grammar" else None

    def with_choice_paths(self, choice_paths: ChoicePaths) -> Judge:
        """This judge reading the choices on ``choice_paths`` instead: the same model,
        tokenizer, settings and prefix cache (a cached prefix is the same whatever is read
        after it), for comparing the two modes without loading the model twice."""
        other = copy.copy(self)
        other._read_choices_on(choice_paths)
        return other

    @classmethod
    def load(
        cls,
        model: str | os.PathLike[str] | None = None,
        *,
        dtype: DType = "auto",
        device: str = "cpu",
        **options: Any,
    ) -> Judge:
        """Load ``model`` (None: the embedded SmolLM2-135M-Instruct) and build a judge.

        ``options`` are passed to the constructor (system, response_prefix, ...).
        """
        from judge.loading import load_model

        loaded = load_model(model, dtype, device)
        return cls(
            loaded.model,
            loaded.tokenizer,
            model_id=loaded.model_id,
            weights_sha256=loaded.weights_sha256,
            **options,
        )

    @property
    def dtype(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")

    @property
    def decoder_pass(self) -> str:
        """Which decoder runs the passes: "lean" (``judge.decoder``) or "generic" (the
        model's own)."""
        return "generic" if self._lean is None else "lean"

    @property
    def arithmetic(self) -> str:
        """Which arithmetic the passes run, in words (what ``/ready`` and the server's ready
        line say): for the lean pass, the sizes measured for this machine's kernels."""
        from judge.batch_invariant import GENERIC_INVARIANT, ORDINARY

        if self._lean is not None:
            return self._lean.arithmetic()
        return GENERIC_INVARIANT if self.batch_invariant else ORDINARY

    @functools.cached_property
    def model_sha256(self) -> str:
        """The sha256 of the weights every judgment carries: the GGUF file's, where the model
        came from one (``weights_sha256``), else the loaded parameters' (``parameters_sha256``),
        hashed on first use and kept (the model is not expected to change under a judge)."""
        return self.weights_sha256 or parameters_sha256(self.model)

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
        if span_layers:
            ids, context = encoded.prompt_ids, len(trie.context)
            span = self._encoder.item_tokens(query.prompt, item_span, prompt, ids, context)
            trie = dataclasses.replace(trie, span=span)
        tokens = tokens_sha256(encoded.prompt_ids, encoded.paths, self.choice_paths)
        n = len(encoded.prompt_ids)
        return Prepared(choices, prompt, n, trie, tokens, layers, span_layers, item_span)

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
        rows = pack_rows([p.trie for p in prepared], self.max_batch_tokens)
        return [[prepared[i] for i in row] for row in rows]

    def _score(self, rows: list[list[Prepared]], start: float) -> list[Judgment]:
        """Run ``rows`` (each packed into one batch row) in bounded passes, in order."""
        from judge.forward import prefill, score_rows

        scores: list[list[Any]] = [[] for _ in rows]
        n_passes = [1] * len(rows)
        lengths = [row_length([p.trie for p in row]) for row in rows]
        padded = self._lean is None  # the generic pass left-pads; the lean one lays rows flat
        for chunk in passes(lengths, self.max_batch_size, self.max_batch_tokens, padded=padded):
            batch = [[p.trie for p in rows[i]] for i in chunk]
            layers = sorted({n for i in chunk for p in rows[i] for n in p.feature_layers})
            span_layers = sorted({n for i in chunk for p in rows[i] for n in p.span_layers})
            if self.prefix_cache is not None and len(batch) > 1:
                # Rows that share a head not cached yet (concurrent requests with one rubric):
                # compute the head once, in a pass of its own, so that every row reads it.
                head = batch[0][0].context
                shared = min(common_prefix_length(head, t.context) for r in batch for t in r)
                if prefill(
                    self.model, head[:shared], self.prefix_cache, self.batch_invariant, self._lean
                ):
                    for i in chunk:
                        n_passes[i] = 2
            scored = score_rows(
                self.model,
                batch,
                self._pad_id,
                self.prefix_cache,
                layers,
                self.batch_invariant,
                self._lean,
                span_layers,
            )
            for i, s in zip(chunk, scored, strict=True):
                scores[i] = s
        latency_ms = (time.perf_counter() - start) * 1000
        return [
            self._result(p, s, latency_ms, n)
            for row, row_scores, n in zip(rows, scores, n_passes, strict=True)
            for p, s in zip(row, row_scores, strict=True)
        ]

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

    def _result(
        self, prepared: Prepared, scores: Any, latency_ms: float, passes: int = 1
    ) -> Judgment:
        logps = prepared.trie.choice_logprobs(scores.node_logits)
        probs = np.exp(logps - logsumexp(logps))
        best = int(np.argmax(probs))
        return Judgment(
            choice=prepared.choices[best],
            confidence=float(probs[best]),
            choices=prepared.choices,
            probs=probs.tolist(),
            log_probs=logps.tolist(),
            choice_mass=scores.root_mass,
            prompt=prepared.prompt,
            prompt_tokens=prepared.prompt_tokens,
            cached_tokens=scores.cached_tokens,
            computed_tokens=prepared.trie.packed_length - scores.cached_tokens,
            forward_passes=passes,
            latency_ms=latency_ms,
            model=self.model_id,
            **_hidden_states(prepared, scores),
            judgment_id=new_judgment_id(),
            tokens_sha256=prepared.tokens_sha256,
            model_sha256=self.model_sha256,
        )


def parameters_sha256(model: PreTrainedModel) -> str:
    """The sha256 (hex) of a model's parameters and buffers, in ``state_dict`` order.

    For each entry: ``f"{name}|{dtype}|{tuple(shape)}|"`` as UTF-8 (dtype as torch writes it,
    ``torch.float32``), then the tensor's raw bytes, contiguous, in the machine's byte order.
    Another dtype or value changes it, the device does not; a tensor that tied weights share
    is hashed under each of its names.
    """
    import torch

    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        # As bytes: numpy has no bfloat16 (nor float8), and bytes are all a hash needs.
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _check_window(judge: Judge, longest: int, query: Query) -> None:
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


def _hidden_states(prepared: Prepared, scores: Any) -> dict[str, Any]:
    """The judgment's hidden-state fields: each asked layer's state at the decision point and
    mean over the item (None where none was asked), and the item's span."""
    return {
        "features": {n: scores.features[n].tolist() for n in prepared.feature_layers} or None,
        "span_features": {n: scores.span_means[n].tolist() for n in prepared.span_layers} or None,
        "item_span": prepared.item_span,
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


def _use_sdpa(model: PreTrainedModel) -> None:
    """Route the model's attention through scaled_dot_product_attention, which the
    batch-invariant arithmetic replaces; a model that cannot must opt out of it."""
    if getattr(model.config, "_attn_implementation", "sdpa") == "sdpa":
        return
    try:
        model.set_attn_implementation("sdpa")
    except (ValueError, ImportError, AttributeError) as e:
        raise ModelLoadError(
            f"{type(model).__name__} cannot run its attention through "
            "scaled_dot_product_attention, which batch-invariant judgments need; "
            "load it with batch_invariant=False (judge serve --batch-variant) to judge "
            f"without that guarantee ({e})"
        ) from e


def _context_window(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int | None:
    window = getattr(model.config, "max_position_embeddings", None)
    if isinstance(window, int) and window > 0:
        return window
    limit = getattr(tokenizer, "model_max_length", None)
    # Tokenizers without a limit report a huge sentinel.
    return limit if isinstance(limit, int) and 0 < limit < 10**8 else None


def _first_difference(a: str, b: str) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"at character {i}, {a[i : i + 20]!r} came back as {b[i : i + 20]!r}"
