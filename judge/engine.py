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
import functools
import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from judge.adapters import Adapter
from judge.base_engine import BaseEngine, adapter_key
from judge.errors import (
    InvalidQueryError,
    ModelLoadError,
)
from judge.fingerprint import ChoicePaths
from judge.judgments import (
    Judgment,
    Prepared,
    Query,
    json_escape,
    shared_query,
    validate_choices,
)
from judge.limits import MAX_CHOICES
from judge.packing import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_BATCH_TOKENS,
    passes,
    row_length,
)
from judge.prefix_cache import PrefixCache, cacheable
from judge.trie import common_prefix_length

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
    "json_escape",
    "parameters_sha256",
    "shared_query",
    "validate_choices",
]

log = logging.getLogger("judge")

DEFAULT_RESPONSE_PREFIX = '{"answer": "'
DEFAULT_RESPONSE_SUFFIX = '"}'
DEFAULT_PREFIX_CACHE_MB = 256


class Judge(BaseEngine):
    """Scores a fixed set of choices with a causal language model loaded here.

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

        super().__init__(
            tokenizer,
            system=system,
            response_prefix=response_prefix,
            response_suffix=response_suffix,
            context_window=_context_window(model, tokenizer),
            num_layers=int(getattr(model.config, "num_hidden_layers", 0) or 0) or None,
            choice_paths=choice_paths,
        )
        self.model = model
        self.model_id = model_id or str(getattr(model.config, "name_or_path", "") or "custom")
        self.weights_sha256 = weights_sha256
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
        pad = tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else (tokenizer.eos_token_id or 0))
        self.hidden_size = int(getattr(model.config, "hidden_size", 0) or 0) or None
        # The adapter merged into this judge's blocks (None: the model as loaded), and the
        # judges with one merged that this one made (``adapted``).
        self.adapter: Adapter | None = None
        # Keyed by the adapter's sha256 and the choice paths read: a judge switched to the
        # other mode (``with_choice_paths``) shares this table and must not take this one's.
        self._adapters: OrderedDict[tuple[str, str], Judge] = OrderedDict()
        self._adapters_lock = threading.Lock()

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

    serves_adapters = True

    def check_adapter(self, adapter: Adapter | None) -> None:
        """Refuse an adapter that breaks its own rules or was trained on other weights
        than this engine's."""
        if adapter is None:
            return
        kept = self._adapters.get((adapter.sha256, self.choice_paths))
        if kept is not None and kept.adapter is adapter:
            return  # this very object was checked when it was merged (hashing it costs ms)
        problems = adapter.problems()
        if problems:
            raise InvalidQueryError("; ".join(problems), field="adapter")
        if adapter.model_sha256 != self.model_sha256:
            raise InvalidQueryError(
                f"adapter {adapter.short} was trained on weights with sha256 "
                f"{adapter.model_sha256[:12]}, not this model's ({self.model_sha256[:12]}); "
                "fit the adapter on this model",
                field="adapter",
            )

    def adapted(self, adapter: Adapter) -> Judge:
        """This judge with ``adapter`` merged into copies of its blocks (``judge.adapted``):
        the same tokenizer and settings, a prefix cache of its own. Kept, ``MAX_ADAPTERS`` at a
        time (least recently used out), so that each adapter is merged once."""
        from judge.adapted import MAX_ADAPTERS, merged_blocks, model_with_blocks

        if self.adapter is not None:  # merged already: never one adapter on top of another
            if adapter.sha256 == self.adapter.sha256:
                return self
            raise InvalidQueryError(
                f"this judge runs adapter {self.adapter.short}; adapter {adapter.short} is "
                "merged into the base model's judge, not into another adapter's",
                field="adapter",
            )
        self.check_adapter(adapter)
        key = (adapter.sha256, self.choice_paths)
        with self._adapters_lock:
            kept = self._adapters.get(key)
            if kept is not None:
                self._adapters.move_to_end(key)
                return kept
        other = self._copied(model_with_blocks(self.model, merged_blocks(self.model, adapter)))
        other.adapter = adapter  # an adapted judge adapts nothing further
        with self._adapters_lock:
            kept = self._adapters.setdefault(key, other)
            self._adapters.move_to_end(key)
            while len(self._adapters) > MAX_ADAPTERS:
                self._adapters.popitem(last=False)
        return kept

    def sibling(self) -> Judge:
        """This judge's weights and settings with caches of its own: for judging on another
        thread (a server's background refit) while this one serves. The weights are shared
        and only read; the prefix cache and the merged adapters are not shared."""
        return self._copied(self.model)

    def _copied(self, model: Any) -> Judge:
        """A copy of this judge on ``model`` (its blocks, or copies of them), its prefix
        cache and adapter table new and empty."""
        other = copy.copy(self)
        other.model = model
        if self._lean is not None:
            other._lean = self._lean.with_model(model)
        if self.prefix_cache is not None:
            other.prefix_cache = PrefixCache(
                self.prefix_cache.budget_bytes, self.prefix_cache.block_tokens
            )
        other._adapters = OrderedDict()
        other._adapters_lock = threading.Lock()
        return other

    def _score(self, rows: list[list[Prepared]], start: float) -> list[Judgment]:
        """Run ``rows`` in bounded passes, in order: each row on the model with its queries'
        adapter merged (``_rows`` keeps one adapter per row), or on this one."""
        groups: dict[str, list[int]] = {}  # rows by their adapter's sha256 ("": none)
        for i, row in enumerate(rows):
            groups.setdefault(adapter_key(row[0]), []).append(i)
        if list(groups) == [""]:
            return self._score_rows(rows, start)
        by_row: list[list[Judgment]] = [[] for _ in rows]
        for mine in groups.values():
            adapter = rows[mine[0]][0].adapter
            engine = self if adapter is None else self.adapted(adapter)
            judged = iter(engine._score_rows([rows[i] for i in mine], start))
            for i in mine:
                by_row[i] = [next(judged) for _ in rows[i]]
        return [j for row in by_row for j in row]

    def _score_rows(self, rows: list[list[Prepared]], start: float) -> list[Judgment]:
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

    def _result(
        self, prepared: Prepared, scores: Any, latency_ms: float, passes: int = 1
    ) -> Judgment:
        return self._judgment(
            prepared,
            prepared.trie.choice_logprobs(scores.node_logits),
            choice_mass=scores.root_mass,
            cached_tokens=scores.cached_tokens,
            computed_tokens=prepared.tokens - scores.cached_tokens,
            forward_passes=passes,
            latency_ms=latency_ms,
            **_hidden_states(prepared, scores),
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


def _hidden_states(prepared: Prepared, scores: Any) -> dict[str, Any]:
    """The judgment's hidden-state fields: each asked layer's state at the decision point and
    mean over the item (None where none was asked)."""
    return {
        "features": {n: scores.features[n].tolist() for n in prepared.feature_layers} or None,
        "span_features": {n: scores.span_means[n].tolist() for n in prepared.span_layers} or None,
    }


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
