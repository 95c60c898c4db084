"""The core every operation family shares (``service.web.serving``): the engine, its budget and its
readiness, the batcher, the profile store, the metrics, the decision log, and the steps of a
request.

A request goes: its gate opened (``GateContext.opened``: the stored profile by name and its ETag,
checked against the engine's fingerprint and the request's choices; the request's overrides
over the profile's over this server's defaults, ``calibration.Gate``; a probe's feature layers
added to the query), with no model work; then its queries prepared once (``prepare``:
``Engine.prepare`` checks, renders and tokenizes) and their exact size (``Prepared.tokens``)
checked against the budget (``max_request_tokens``: a 413 that names the largest field); then
each prepared query joins the batcher's queue under the request's ``Ticket`` (or, sharing a
context, one job per packed row: ``run_rows``), and the model's thread only runs its pass,
coalesced with whatever else is waiting; then the gate decides (``Gate.decide``, a
``Verdict``), the verdicts' rows (``LoggedDecision.of``) are appended to the decision log
(``append_to_log``), and only then is the response sent. Every accept/escalate decision on
every route is a gate's: nothing here compares a confidence with a threshold.

A request's jobs share one ticket: its owner (the batcher takes owners in turn, so a large
batch or a fit interleaves with everyone else) and its deadline (the server's, or a shorter
one the client asked for). A batch item that misses the deadline gets a 503 in its place; the
items done are kept.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio.to_thread

from judge import (
    Engine,
    Judge,
    JudgeError,
    Judgment,
    PrefixCache,
    Prepared,
    PromptTooLongError,
    Query,
)
from judge.packing import pack_rows
from service.config import ServiceConfig
from service.errors import (
    LogUnavailableError,
    NotReadyError,
    TooLargeError,
)
from service.gate_context import GateContext
from service.log.backends import open_log
from service.log.decision_log import DecisionLog, DecisionLogError, Retention
from service.log.record import LoggedDecision
from service.log.shift_watch import ShiftWatch
from service.metrics import ServiceMetrics
from service.profiles import ProfileStore
from service.web.background_refit import BackgroundRefit
from service.web.batcher import Batcher
from service.web.frontdoor import Admission

if TYPE_CHECKING:
    pass

__all__ = ["ServiceCore", "Ticket"]

log = logging.getLogger("judge.service")

# Queries of at most this many characters are prepared on the event loop: rendering and
# tokenizing 1,000 characters took 0.8 ms, a hand-off to a worker thread and back about 1 ms
# (measured in judge serve, 2 cores); a longer query goes to a thread so that it cannot hold
# the loop (16,000 characters took 9 ms).
INLINE_PREPARE_CHARS = 1000


def _text_size(query: Query) -> int:
    """The characters ``prepare`` renders and tokenizes for ``query``."""
    texts = [query.prompt, query.system, query.response_prefix, query.response_suffix]
    return sum(len(t) for t in texts if isinstance(t, str)) + sum(
        len(c) for c in query.choices if isinstance(c, str)
    )


WARM_UP = ("Warm-up: is this a test?", ["yes", "no"])


@dataclass(frozen=True)
class Ticket:
    """One request's claim on the model: who it is (for turns) and until when it is wanted."""

    deadline: float  # time.monotonic()
    owner: Hashable = field(default_factory=object)


class ServiceCore:
    """What every operation family shares: the engine and its readiness, the batcher, the
    profile store, the metrics, the decision log, and the steps of a request (its gate, its
    queries prepared within the budget, its shared rows, its log records)."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.store = ProfileStore(config.profiles_dir)
        self.metrics = ServiceMetrics()
        self.loaded: Engine | None = None  # set once the engine has loaded and judged once
        self._training: Judge | None = None  # a sibling of it for background retraining
        self.failure: str | None = None  # why loading failed
        self.admission = Admission(config.max_queue, config.admission_wait_s)
        # Opened (and written to once) here, so that a log that cannot be written stops the
        # server at start, not at its first decision.
        self.decision_log: DecisionLog | None = None
        if config.decision_log is not None:
            self.decision_log = open_log(
                config.decision_log,
                retention=Retention(
                    max_age_days=config.log_max_age_days, max_rows=config.log_max_rows
                ),
            )
        # Labels that arrive refit their profile in the background (``--refit-every``).
        self.refitter: BackgroundRefit | None = None
        if config.refit_every is not None and self.decision_log is not None:
            assert config.decision_log is not None
            self.refitter = BackgroundRefit(
                self.store,
                self.decision_log,
                config.decision_log,
                config.refit_every,
                trainer=self._trainer if config.refit_adapters else None,
            )
        # A version whose traffic's class mix moved escalates until re-certified.
        self.shift_watch: ShiftWatch | None = None
        if self.decision_log is not None:
            self.shift_watch = ShiftWatch(
                self.store,
                self.decision_log,
                every=config.shift_check_every,
                alpha=config.alpha_prior,
                correct=config.correct_prior,
            )
        # Every gate is opened through this, as the MCP server opens its own (one context).
        self.gates = GateContext(
            self.store,
            config.policy_defaults,
            audit_rate=config.audit_rate,
            audit_rates=config.audit_rates,
            logging=self.decision_log is not None,
            log_features=config.log_features,
            log_requests=config.log_requests,
            holds=None if self.shift_watch is None else self.shift_watch.hold,
        )
        self.batcher = Batcher(
            lambda prepared: self.engine().run(prepared),
            max_batch_size=config.max_batch_size,
            max_batch_tokens=config.max_batch_tokens,
            max_wait_ms=config.max_wait_ms,
            max_jobs=config.max_jobs,
            on_batch=self.metrics.batch_size.observe,
        )

    def _trainer(self) -> Judge | None:
        """What a background refit retrains adapters with: a sibling of the served judge (its
        weights, caches of its own), made once; None until it loads, or where the model is
        served elsewhere (an adapter trains on weights loaded here)."""
        if self._training is None and isinstance(self.loaded, Judge) and not self.loaded.adapter:
            self._training = self.loaded.sibling()
        return self._training

    def engine(self) -> Engine:
        if self.loaded is None:
            raise NotReadyError("the model is still loading")
        return self.loaded

    async def warm_up(self, load: Callable[[], Engine]) -> None:
        """Load the engine and judge once, on the model's thread; then the service is ready."""
        try:
            engine = await self.batcher.on_model_thread(load)
            self._check_budget(engine)
            await self.batcher.on_model_thread(functools.partial(engine.judge, *WARM_UP))
        except Exception as exc:
            log.exception("loading the model failed")
            self.failure = f"{type(exc).__name__}: {exc}"
            return
        try:
            await self.load_more(engine)
        except Exception as exc:
            log.exception("loading a cascade stage failed")
            self.failure = f"{type(exc).__name__}: {exc}"
            return
        cache = getattr(engine, "prefix_cache", None)  # a Judge's; other engines may have none
        if isinstance(cache, PrefixCache):
            self.metrics.watch_prefix_cache(cache.stats)
        self.loaded = engine
        # Coalesce by the rule the engine packs by: the lean pass pads nothing.
        self.batcher.padded = getattr(engine, "decoder_pass", "generic") != "lean"
        log.info(
            "ready: model %s, dtype %s, batch-invariant %s, %s pass%s",
            engine.model_id,
            engine.dtype,
            getattr(engine, "batch_invariant", False),
            getattr(engine, "decoder_pass", "generic"),
            f"; arithmetic {a}" if (a := getattr(engine, "arithmetic", None)) else "",
        )

    async def load_more(self, engine: Engine) -> None:
        """What else must load before the service is ready (a cascade's stages): nothing
        here; ``service.web.serving.Service`` loads its cascade."""

    def _check_budget(self, engine: Engine) -> None:
        """Refuse an engine that packs passes to another budget than this server's.

        One number bounds every pass: the batcher coalesces and ``_shared`` splits to
        ``max_batch_tokens``, and the engine packs to its own (``Judge(max_batch_tokens=...)``,
        which ``judge serve`` sets from ``--max-batch-tokens``); a job is then one pass.
        """
        if engine.max_batch_tokens != self.config.max_batch_tokens:
            raise ValueError(
                f"the engine packs passes to {engine.max_batch_tokens} tokens but the server's "
                f"max_batch_tokens is {self.config.max_batch_tokens}: build the engine with "
                f"max_batch_tokens={self.config.max_batch_tokens}"
            )

    def ticket(self, timeout_s: float | None, limit_s: float | None = None) -> Ticket:
        """A new request's ticket: the shorter of its own timeout and the server's."""
        limit = self.config.request_timeout_s if limit_s is None else limit_s
        timeout = limit if timeout_s is None else min(timeout_s, limit)
        return Ticket(deadline=time.monotonic() + timeout)

    def render_metrics(self) -> bytes:
        self.metrics.queue_depth.set(self.batcher.depth)
        self.metrics.admission_waiting.set(self.admission.waiting)
        self.metrics.jobs.labels("run").set(self.batcher.run)
        self.metrics.jobs.labels("dropped").set(self.batcher.dropped)
        return self.metrics.render()

    async def append_to_log(self, records: Sequence[LoggedDecision]) -> None:
        """Append a request's decisions to the log, in one transaction, before its response
        is sent: a decision the client has seen is one the log kept (a kill -9 after this
        loses none). A log that cannot be written fails the request with a 503 that says so,
        counted in ``judge_decision_log_errors_total``: a decision is never served unlogged.
        """
        if self.decision_log is None or not records:
            return
        try:
            await anyio.to_thread.run_sync(self.decision_log.append, records)
        except DecisionLogError as exc:
            self.metrics.decision_log_errors.inc()
            log.error("the decision log could not be written: %s", exc)
            raise LogUnavailableError(
                f"the decision could not be written to the decision log ({exc}), so it is "
                "not served: retry later"
            ) from exc
        self.metrics.decisions_logged.inc(len(records))
        if self.shift_watch is not None:
            self.shift_watch.logged(records)

    async def prepare(
        self, engine: Engine, queries: Sequence[Query], fields: Sequence[str | None] = ()
    ) -> list[Prepared | JudgeError | TooLargeError]:
        """Each query prepared for its pass and within the budget, or the error refusing it.

        ``Engine.prepare`` checks, renders and tokenizes each query once, on a worker thread
        (not the model's), so a long prompt holds neither the event loop nor the model. A query
        over ``max_request_tokens`` (its exact ``Prepared.tokens``) is a 413 naming
        ``fields[i]`` if given, else its largest field.
        """

        def prepare() -> list[Prepared | JudgeError | TooLargeError]:
            results: list[Prepared | JudgeError | TooLargeError] = []
            for i, query in enumerate(queries):
                field = fields[i] if fields else None
                try:
                    prepared = engine.prepare(query)
                    self._check_size(engine, query, prepared, field)
                except PromptTooLongError as exc:
                    results.append(self._over_window(engine, exc, field))
                except (JudgeError, TooLargeError) as exc:
                    results.append(exc)
                else:
                    results.append(prepared)
            return results

        if sum(_text_size(q) for q in queries) <= INLINE_PREPARE_CHARS:
            return prepare()  # cheaper here than the hand-off to a thread
        return await anyio.to_thread.run_sync(prepare)

    def _check_size(
        self, engine: Engine, query: Query, prepared: Prepared, field: str | None
    ) -> None:
        """Refuse ``prepared`` over the budget, naming ``field`` or the query's largest field.

        The field attribution (``Engine.count_tokens``, each field tokenized alone) is computed
        only here, on the way to the 413; the count in the message is the exact one.
        """
        budget = self.config.max_request_tokens
        if prepared.tokens <= budget:
            return
        parts = engine.count_tokens(query)
        name = field or parts.largest
        raise TooLargeError(
            name,
            f"the judgment is {prepared.tokens} tokens, over this server's budget of {budget} "
            f"(--max-request-tokens); {name} is the largest part "
            f"({parts.parts.get(parts.largest, 0)} tokens): shorten it or split the work",
        )

    def _over_window(
        self, engine: Engine, exc: PromptTooLongError, field: str | None
    ) -> PromptTooLongError | TooLargeError:
        """Longer than the model's context window: where the server's budget is the smaller
        limit, that is over the budget too, and a 413 as for any judgment over it; else the
        engine's own refusal (422) stands."""
        budget = self.config.max_request_tokens
        window = getattr(engine, "context_window", None)
        if window is None or budget >= window:
            return exc
        name = field or exc.field or "prompt"
        return TooLargeError(
            name,
            f"the judgment is longer than the model's context window of {window} tokens, so "
            f"over this server's budget of {budget} (--max-request-tokens); {name} is the "
            "largest part: shorten it or split the work",
        )

    async def run_rows(
        self, engine: Engine, ready: Sequence[Prepared], ticket: Ticket
    ) -> list[Judgment]:
        """Prepared queries that share a context, judged in order: one job per packed row."""
        results: list[Judgment] = []
        for row in pack_rows([p.trie for p in ready], self.config.max_batch_tokens):
            results += await self.batcher.call(
                functools.partial(engine.run_shared, [ready[i] for i in row]),
                owner=ticket.owner,
                deadline=ticket.deadline,
            )
            self.metrics.batch_size.observe(len(row))
        return results
