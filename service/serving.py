"""What each endpoint does between the request body and the response body.

A judgment request goes: its plan (profile lookup and ``profile.check`` against the engine's
fingerprint and the request's choices, the policy built by ``calibration.make_policy``, a
probe's feature layers added to the query), with no model work; then the query prepared once
(``Engine.prepare``: checked, rendered, tokenized) on a worker thread, and its exact size
(``Prepared.tokens``) checked against the budget (``max_request_tokens``: a 413 that names
the largest field); then the prepared query joins the batcher's queue under the request's
``Ticket``, and the model's thread only runs its pass, coalesced with whatever else is
waiting; then the policy decides. Every accept/escalate
decision is ``Policy.decide``: nothing here compares a confidence with a threshold. A probe
profile's policy reads the hidden state of its layers (``Policy.feature_layers``), so its plan
asks the engine for them (``Query.feature_layers``); they reach the decision and go no further.

A request's jobs share one ticket: its owner (the batcher takes owners in turn, so a large
batch or a fit interleaves with everyone else) and its deadline (the server's, or a shorter
one the client asked for). A batch item that misses the deadline gets a 503 in its place; the
items done are kept. A fit judges its examples through the same queue and fits on a worker
thread (``tasks.fit_labeled``); if its client leaves, the request is cancelled and nothing is
written. A fit whose method may be a probe ("auto", "probe") judges its examples with the
hidden states of ``calibration.probe.candidate_layers``; a probe that cannot be fitted is
refused (``method``) before any model work.

``POST /v1/systemone`` (``service.systemone``) is typed questions about one state: each
question's listings are rendered by ``judge.decisions.plan_decisions`` and served as a shared
context is (``_prepare``, then ``_run_rows``); each answer is gated by its own Policy, with the
question's order spread (``Policy.decide(..., order_spread=...)``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import re
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import anyio.to_thread
import msgspec
import numpy as np

from calibration import (
    CalibrationError,
    CalibrationProfile,
    Decision,
    FitError,
    Policy,
    ProfileError,
    ProfileMismatchError,
    make_policy,
)
from calibration.fitting import resolve_methods
from calibration.maps import CalibrationMap, Probe
from calibration.probe import candidate_layers, probe_weights
from calibration.profile import NAME_PATTERN
from calibration.tasks import fit_labeled, labeled_queries, scores_from_judgments
from judge import (
    Engine,
    Fingerprint,
    JudgeError,
    Judgment,
    PrefixCache,
    Prepared,
    PromptTooLongError,
    Query,
)
from judge.decisions import plan_decisions
from judge.engine import shared_query
from judge.packing import pack_rows
from judge.scores import check_values
from service.batcher import Batcher, DeadlineError, QueueFullError
from service.config import ServiceConfig
from service.decision_log import (
    DecisionLog,
    DecisionLogError,
    LabelFailure,
    LoggedDecision,
    Retention,
    UnknownJudgmentError,
    open_log,
)
from service.errors import (
    BadFieldError,
    LogUnavailableError,
    NoLogError,
    NotReadyError,
    TooLargeError,
    UnprocessableError,
    error_of,
)
from service.frontdoor import Admission
from service.health import ProfileHealth, profile_health
from service.metrics import ServiceMetrics
from service.profiles import ProfileStore
from service.schemas import (
    BatchRequest,
    BatchResponse,
    CalibrationMapSummary,
    ErrorBody,
    FitRequest,
    ItemsBatch,
    JudgeRequest,
    JudgeResponse,
    LabelRequest,
    LabelResult,
    LabelsRequest,
    LabelsResponse,
    ProfileSummary,
    SharedQuestion,
)
from service.systemone import (
    SystemOneAnswer,
    SystemOneQuestion,
    SystemOneRequest,
    SystemOneResponse,
    Usage,
    wire_answer,
)

__all__ = ["Service"]

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
HEALTH_TTL_S = 30.0  # /metrics reads the profiles' health at most this often
# A refused label in a batch: the status the same label alone would have got.
_LABEL_FAILURES = {"unknown_judgment": 404, "not_a_choice": 422, "relabel": 409}


@dataclass(frozen=True)
class Ticket:
    """One request's claim on the model: who it is (for turns) and until when it is wanted."""

    deadline: float  # time.monotonic()
    owner: Hashable = field(default_factory=object)


@dataclass(frozen=True)
class _Plan:
    """What a judgment request needs before its model work: the query and its policy."""

    query: Query
    profile: CalibrationProfile | None
    policy: Policy


class Service:
    """The engine behind the endpoints: its batcher, profile store, metrics and readiness."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.store = ProfileStore(config.profiles_dir)
        self.metrics = ServiceMetrics()
        self.loaded: Engine | None = None  # set once the engine has loaded and judged once
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
        self._health: tuple[float, list[ProfileHealth]] | None = None
        if self.decision_log is not None:
            self.metrics.watch_health(self.health_all)
        self.batcher = Batcher(
            lambda prepared: self.engine().run(prepared),
            max_batch_size=config.max_batch_size,
            max_batch_tokens=config.max_batch_tokens,
            max_wait_ms=config.max_wait_ms,
            max_jobs=config.max_jobs,
            on_batch=self.metrics.batch_size.observe,
        )

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
        cache = getattr(engine, "prefix_cache", None)  # a Judge's; other engines may have none
        if isinstance(cache, PrefixCache):
            self.metrics.watch_prefix_cache(cache.stats)
        self.loaded = engine
        log.info(
            "ready: model %s, dtype %s, batch-invariant %s, %s pass",
            engine.model_id,
            engine.dtype,
            getattr(engine, "batch_invariant", False),
            getattr(engine, "decoder_pass", "generic"),
        )

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

    # --- judging -----------------------------------------------------------------------------

    async def judge(self, request: JudgeRequest, ticket: Ticket) -> JudgeResponse:
        engine = self.engine()
        query = request.query()
        plan = self._plan(engine, request, query)
        (prepared,) = await self._prepare(engine, [plan.query])
        if not isinstance(prepared, Prepared):
            raise prepared
        result = await self.batcher.judge(prepared, owner=ticket.owner, deadline=ticket.deadline)
        records: list[LoggedDecision] = []
        response = self._respond(engine, result, request, plan, records)
        await self._log(records)
        return response

    async def judge_batch(self, request: BatchRequest, ticket: Ticket) -> BatchResponse:
        engine = self.engine()
        records: list[LoggedDecision] = []
        if isinstance(request, ItemsBatch):
            items = await self._items(engine, request.items, ticket, records)
            await self._log(records)
            return BatchResponse(results=list(items))
        results = await self._shared(engine, request.context, request.questions, ticket, records)
        await self._log(records)
        return BatchResponse(results=list(results))

    async def _log(self, records: Sequence[LoggedDecision]) -> None:
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

    async def _prepare(
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

    def _plan(
        self,
        engine: Engine,
        request: JudgeRequest | SharedQuestion,
        query: Query,
    ) -> _Plan:
        """Check the request's profile and build its policy: no model work, no tokenizing."""
        profile = etag = None
        if request.profile is not None:
            # The ETag of the very bytes decoded: what GET /profiles/{name} answers.
            profile, etag = self.store.get_tagged(request.profile)
            fingerprint = engine.fingerprint(
                system=query.system,
                response_prefix=query.response_prefix,
                response_suffix=query.response_suffix,
            )
            profile.check(fingerprint, choices=request.choices)
        values = getattr(request, "values", None)
        max_std = getattr(request, "max_std", None)
        if values is not None or (max_std is not None and profile is None):
            values = check_values(values, request.choices)  # numerals by default
        policy = make_policy(
            profile,
            threshold=request.threshold,
            min_choice_mass=request.min_choice_mass,
            max_std=max_std,
            values=values,
            defaults=self.config.policy_defaults,
            profile_etag=etag,
            audit_rate=self.config.audit_rate_for(request.profile),
        )
        if policy.feature_layers:  # a probe reads the pass's hidden state: ask for it
            query = msgspec.structs.replace(query, feature_layers=policy.feature_layers)
        return _Plan(query, profile, policy)

    def _respond(
        self,
        engine: Engine,
        result: Judgment,
        request: JudgeRequest | SharedQuestion,
        plan: _Plan,
        records: list[LoggedDecision],
    ) -> JudgeResponse:
        """The response to one judgment; its decision's log record joins ``records``."""
        decision = plan.policy.decide(result)
        self.metrics.decisions.labels(decision.decision).inc()
        if self.decision_log is not None:
            records.append(self._record(engine, result, decision, request, plan))
        return JudgeResponse.of(
            result,
            decision,
            choices=request.choices,  # the decision keeps the profile's order; this, the request's
            calibration_map=plan.profile.calibration_map if plan.profile else None,
            feature_layers=plan.policy.feature_layers,
            return_prompt=request.return_prompt,
        )

    def _record(
        self,
        engine: Engine,
        judgment: Judgment,
        decision: Decision,
        request: JudgeRequest | SharedQuestion,
        plan: _Plan,
    ) -> LoggedDecision:
        """What the log keeps of one decision; the request only with ``log_requests``."""
        kept = None
        if self.config.log_requests:
            query = msgspec.structs.replace(plan.query, feature_layers=())
            overrides = {
                name: getattr(request, name, None)
                for name in ("threshold", "min_choice_mass", "max_std", "values")
            }
            kept = {
                "query": msgspec.to_builtins(query),
                "profile": request.profile,
                **{k: v for k, v in overrides.items() if v is not None},
            }
        return LoggedDecision(
            judgment_id=judgment.judgment_id,
            created_at=time.time(),
            model=engine.model_id,
            model_sha256=judgment.model_sha256,
            tokens_sha256=judgment.tokens_sha256,
            policy_sha256=decision.policy_sha256 or "",
            profile=decision.profile,
            profile_etag=decision.profile_etag,
            choices=list(judgment.choices),
            log_probs=list(judgment.log_probs),
            choice_mass=judgment.choice_mass,
            probabilities=decision.probabilities,
            choice=decision.choice,
            confidence=decision.confidence,
            decision=decision.decision,
            reason_codes=list(decision.reason_codes),
            threshold=decision.threshold,
            certified=decision.certified,
            audit=decision.audit,
            request=kept,
        )

    async def _items(
        self,
        engine: Engine,
        items: Sequence[JudgeRequest],
        ticket: Ticket,
        records: list[LoggedDecision],
    ) -> list[JudgeResponse | ErrorBody]:
        """A batch's items: each planned, all prepared in one trip to a worker thread, then
        each judged; an item refused on the way gets its error in its place."""
        plans: list[_Plan | Exception] = []
        for item in items:
            try:
                plans.append(self._plan(engine, item, item.query()))
            except Exception as exc:  # _item decides: a 4xx in its place, else it fails all
                plans.append(exc)
        planned = [p for p in plans if isinstance(p, _Plan)]
        prepared = iter(await self._prepare(engine, [p.query for p in planned]))
        staged = [p if isinstance(p, Exception) else (p, next(prepared)) for p in plans]
        return list(
            await asyncio.gather(
                *(
                    self._item(engine, item, s, ticket, records)
                    for item, s in zip(items, staged, strict=True)
                )
            )
        )

    async def _item(
        self,
        engine: Engine,
        item: JudgeRequest,
        staged: tuple[_Plan, Prepared | JudgeError | TooLargeError] | Exception,
        ticket: Ticket,
        records: list[LoggedDecision],
    ) -> JudgeResponse | ErrorBody:
        """One item of a batch: its 4xx, or a 503 when out of time, in its place.

        Any other 5xx fails the whole request.
        """
        try:
            if isinstance(staged, Exception):
                raise staged
            plan, prepared = staged
            if not isinstance(prepared, Prepared):
                raise prepared
            result = await self.batcher.judge(
                prepared, owner=ticket.owner, deadline=ticket.deadline
            )
            return self._respond(engine, result, item, plan, records)
        except Exception as exc:
            error = error_of(exc)
            if error.status_code >= 500 and not isinstance(exc, DeadlineError | QueueFullError):
                raise
            return error

    async def _shared(
        self,
        engine: Engine,
        context: str,
        questions: Sequence[SharedQuestion],
        ticket: Ticket,
        records: list[LoggedDecision],
    ) -> list[JudgeResponse]:
        """Questions about one context: each prepared once, then judged row by row.

        Each question's query is the context and the question (``shared_query``), rendered
        and tokenized once. The prepared questions are split with the engine's own row packing
        (``judge.packing.pack_rows``, to the same ``max_batch_tokens``), and each row is one
        job, one ``run_shared`` call that packs it into the same single row: one pass, so the
        model is never held for long and other requests take their turns between rows. A row
        after the first finds the context in the engine's prefix cache, so splitting costs
        little.
        """
        queries = [shared_query(context, q.query()) for q in questions]
        plans = [self._plan(engine, q, query) for q, query in zip(questions, queries, strict=True)]
        # The field a 413 names: the context, unless this question's own prompt is longer.
        fields = [
            "context" if len(context) >= len(q.prompt) else f"questions[{i}].prompt"
            for i, q in enumerate(questions)
        ]
        ready: list[Prepared] = []
        for prepared in await self._prepare(engine, [p.query for p in plans], fields):
            if not isinstance(prepared, Prepared):
                raise prepared
            ready.append(prepared)
        results = await self._run_rows(engine, ready, ticket)
        return [
            self._respond(engine, r, q, p, records)
            for r, q, p in zip(results, questions, plans, strict=True)
        ]

    async def _run_rows(
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

    # --- System One ---------------------------------------------------------------------------

    async def systemone(self, request: SystemOneRequest, ticket: Ticket) -> SystemOneResponse:
        """Typed questions about one state (``service.systemone``), as ``_shared`` serves them.

        Everything is checked before any model work: the model's name, how many questions,
        each question (``judge.decisions.plan_decisions``), its profile against the engine and
        its choices, and each listing's size against the budget (``_prepare``); every refusal
        names ``questions.<id>.<field>``. Then the listings run as shared rows, the state
        computed once where the budget allows, and each answer is gated by its own Policy.
        """
        started = time.perf_counter()
        engine = self.engine()
        if request.model is not None and request.model != engine.model_id:
            raise UnprocessableError(
                "model",
                f"this server serves {engine.model_id!r}, not {request.model!r}; "
                "leave model out or name that one",
            )
        limit = self.config.max_questions
        if len(request.questions) > limit:
            raise TooLargeError(
                "questions",
                f"{len(request.questions)} questions, over this server's limit of {limit} "
                "(--max-questions): split them over several requests",
            )
        questions = {qid: q.question() for qid, q in request.questions.items()}
        plan = plan_decisions(request.state, questions)
        policies = {
            asked.id: self._systemone_policy(
                engine, asked.id, request.questions[asked.id], asked.choices
            )
            for asked in plan.asked
        }
        layers = {qid: p.feature_layers for qid, p in policies.items() if p.feature_layers}
        if layers:  # a probe reads the pass's hidden state: ask for it
            plan = plan_decisions(request.state, questions, feature_layers=layers)
        owners = [plan.question_of(i) for i in range(len(plan.queries))]
        fields = [_systemone_field(plan.context, q, request.questions[q]) for q in owners]
        ready: list[Prepared] = []
        for i, (field_name, prepared) in enumerate(
            zip(fields, await self._prepare(engine, plan.queries, fields), strict=True)
        ):
            if not isinstance(prepared, Prepared):
                # The engine names the query's fields: its choices are the question's criteria,
                # its prompt the state and the question.
                if prepared.field in (None, "choices"):
                    prepared.field = plan.field_of(i, prepared.field)
                elif not prepared.field.startswith(("questions.", "state")):
                    prepared.field = field_name
                raise prepared
            ready.append(prepared)
        judgments = await self._run_rows(engine, ready, ticket)
        answers: dict[str, SystemOneAnswer] = {}
        for qid, answer in plan.answers(judgments).items():
            decision = policies[qid].decide(answer.judgment, order_spread=answer.order_spread)
            self.metrics.decisions.labels(decision.decision).inc()
            answers[qid] = wire_answer(answer, decision)
        return SystemOneResponse(
            model=engine.model_id,
            answers=answers,
            usage=Usage(input_tokens=sum(j.computed_tokens for j in judgments)),
            latency_ms=(time.perf_counter() - started) * 1000,
        )

    def _systemone_policy(
        self, engine: Engine, qid: str, question: SystemOneQuestion, choices: list[str]
    ) -> Policy:
        """The question's Policy: its profile (checked against the engine and the question's
        choices) under its overrides, as ``_plan`` builds one for ``POST /judge``."""
        profile = etag = None
        if question.profile is not None:
            try:
                profile, etag = self.store.get_tagged(question.profile)
                profile.check(engine.fingerprint(), choices=choices)
            except ProfileMismatchError as exc:
                exc.field = f"questions.{qid}.profile"
                raise
            except ProfileError as exc:  # no such profile, or unreadable: error_of reads field
                exc.field = f"questions.{qid}.profile"  # type: ignore[attr-defined]
                raise
        return make_policy(
            profile,
            threshold=question.threshold,
            min_choice_mass=question.min_choice_mass,
            max_order_spread=question.max_order_spread,
            defaults=self.config.policy_defaults,
            profile_etag=etag,
        )

    # --- profiles -----------------------------------------------------------------------------

    async def fit(self, name: str, request: FitRequest, ticket: Ticket) -> CalibrationProfile:
        """Judge the labeled examples, fit a profile on them, save it and return it."""
        engine = self.engine()
        if not re.fullmatch(NAME_PATTERN, name):
            raise BadFieldError("name", f"profile name {name!r} must match {NAME_PATTERN}")
        for i, example in enumerate(request.examples):
            if example.label not in request.choices:
                raise UnprocessableError(
                    f"examples[{i}].label",
                    f"label {example.label!r} is not one of the choices {request.choices}",
                )
        labels = {e.label for e in request.examples}
        if len(labels) < 2:
            raise UnprocessableError(
                "examples",
                f"all {len(request.examples)} examples have the label {labels.pop()!r}: "
                "calibration needs examples of at least two choices",
            )
        template = {
            "system": request.system,
            "response_prefix": request.response_prefix,
            "response_suffix": request.response_suffix,
        }
        fingerprint = engine.fingerprint(**template)
        layers = _fit_layers(request, fingerprint)  # refuses an impossible probe up front
        queries = labeled_queries(
            [e.prompt for e in request.examples],
            request.choices,
            feature_layers=layers,
            **template,
        )
        fields = [f"examples[{i}].prompt" for i in range(len(queries))]
        ready: list[Prepared] = []
        for i, prepared in enumerate(await self._prepare(engine, queries, fields)):
            if not isinstance(prepared, Prepared):
                if prepared.field in (None, "prompt"):  # the engine's name for the field
                    prepared.field = fields[i]
                raise prepared
            ready.append(prepared)
        judgments: list[Judgment] = []
        # The hidden states, kept as one float32 array rather than in the judgments: as lists
        # of Python floats, 20,000 examples at 5 layers of 576 would take about 2 GB.
        features: np.ndarray | None = None  # (n, m, H)
        wave = 4 * self.config.max_batch_size  # jobs queued at once: a bounded share of the queue
        for start in range(0, len(ready), wave):
            results = await asyncio.gather(
                *(
                    self.batcher.judge(ready[i], owner=ticket.owner, deadline=ticket.deadline)
                    for i in range(start, min(start + wave, len(ready)))
                )
            )
            for i, result in enumerate(results, start):
                if layers:
                    row = _features_of(result, layers)  # (m, H)
                    if features is None:
                        features = np.empty((len(queries), *row.shape), dtype=np.float32)
                    features[i] = row
                    result = msgspec.structs.replace(result, features=None)
                judgments.append(result)
        scores = scores_from_judgments(
            judgments, [e.label for e in request.examples], request.choices
        )
        if features is not None:
            scores = dataclasses.replace(scores, features=features, feature_layers=layers)
        fit = functools.partial(
            fit_labeled,
            name,
            scores,
            request.choices,
            fingerprint,
            dataset=f"POST /profiles/{name}/fit",
            dataset_sha256=hashlib.sha256(msgspec.json.encode(request.examples)).hexdigest(),
            target_precision=request.target_precision,
            delta=request.delta,
            alpha=request.alpha,
            methods=_FIT_METHODS[request.method],
        )
        try:
            profile = await anyio.to_thread.run_sync(fit)
        except (CalibrationError, ValueError) as exc:  # e.g. every example has the same label
            # The fitter's own refusals of a method ("method 'probe' needs ...") name it.
            field = "method" if str(exc).startswith("method ") else "examples"
            raise UnprocessableError(
                field, f"cannot fit a profile on these examples: {exc}"
            ) from exc
        self.store.put(profile)
        return profile

    # --- the decision log: feedback and health ----------------------------------------------

    def _log_or_404(self) -> DecisionLog:
        if self.decision_log is None:
            raise NoLogError(
                "this server keeps no decision log: start it with --decision-log to keep "
                "decisions, take their labels and check profiles' health"
            )
        return self.decision_log

    async def judgment(self, judgment_id: str) -> LoggedDecision:
        """The logged decision ``judgment_id``, with its label if it has one."""
        found = await anyio.to_thread.run_sync(self._log_or_404().get, judgment_id)
        if found is None:
            raise UnknownJudgmentError(judgment_id)
        return found

    async def label(self, judgment_id: str, request: LabelRequest) -> LabelResult:
        """Store the true label of one logged decision (4xx: unknown, not a choice, relabel)."""
        label = functools.partial(
            self._log_or_404().label, judgment_id, request.label, replace=request.replace
        )
        outcome = await anyio.to_thread.run_sync(label)
        self.metrics.labels.labels(outcome.status).inc()
        return LabelResult(
            judgment_id=outcome.judgment_id,
            label=outcome.label,
            status=outcome.status,
            previous=outcome.previous,
        )

    async def labels(self, request: LabelsRequest) -> LabelsResponse:
        """Labels of many decisions, each stored or refused in its place."""
        label_many = functools.partial(
            self._log_or_404().label_many,
            [(item.judgment_id, item.label) for item in request.labels],
            replace=request.replace,
        )
        results = []
        for outcome in await anyio.to_thread.run_sync(label_many):
            if isinstance(outcome, LabelFailure):
                status = _LABEL_FAILURES[outcome.error]
                results.append(
                    LabelResult(
                        judgment_id=outcome.judgment_id,
                        label=outcome.label,
                        status="error",
                        status_code=status,
                        detail=outcome.detail,
                    )
                )
                self.metrics.labels.labels("error").inc()
            else:
                results.append(
                    LabelResult(
                        judgment_id=outcome.judgment_id,
                        label=outcome.label,
                        status=outcome.status,
                        previous=outcome.previous,
                    )
                )
                self.metrics.labels.labels(outcome.status).inc()
        return LabelsResponse(results=results)

    async def health(self, name: str) -> ProfileHealth:
        """The health of the stored profile ``name`` (its current version) from the log."""
        decision_log = self._log_or_404()
        profile, etag = self.store.get_tagged(name)
        current = getattr(self.loaded, "model_sha256", None)
        check = functools.partial(
            profile_health, decision_log, profile, etag, current_model_sha256=current or None
        )
        return await anyio.to_thread.run_sync(check)

    def health_all(self) -> list[ProfileHealth]:
        """The health of every stored profile that has logged decisions; for /metrics, read
        at most every ``HEALTH_TTL_S`` seconds (each read scans the log's recent decisions)."""
        now = time.monotonic()
        if self._health is not None and now - self._health[0] < HEALTH_TTL_S:
            return self._health[1]
        out = []
        if self.decision_log is not None:
            current = getattr(self.loaded, "model_sha256", None)
            for name in self.store.names():
                try:
                    profile, etag = self.store.get_tagged(name)
                    health = profile_health(
                        self.decision_log, profile, etag, current_model_sha256=current or None
                    )
                except (ProfileError, DecisionLogError):
                    continue  # unreadable: its own GET says why
                if health.n_decisions:
                    out.append(health)
        self._health = (now, out)
        return out

    def profile_summaries(self) -> list[ProfileSummary]:
        summaries = []
        for name in self.store.names():
            try:
                p = self.store.get(name)
            except ProfileError:
                continue  # an unreadable file is not a profile; GET /profiles/{name} says why
            summaries.append(
                ProfileSummary(
                    name=p.name,
                    model=p.fingerprint.model,
                    choices=p.choices,
                    calibration_map=_map_summary(p.calibration_map),
                    threshold=p.threshold,
                    metrics_after=p.metrics_after,
                    n_examples=p.n_examples,
                    created_at=p.created_at,
                    signal=p.signal,
                    label_free=p.label_free,
                    values=p.values,
                    max_std=p.max_std,
                )
            )
        return summaries

    def put_profile(
        self,
        name: str,
        profile: CalibrationProfile,
        *,
        if_match: Sequence[str] | None = None,
        if_none_match: Sequence[str] | None = None,
    ) -> str:
        """Store ``profile`` under ``name`` and return its ETag.

        ``if_match`` replaces only one of those versions, ``if_none_match`` (``["*"]``) only
        creates; the store compares and writes in one step, under its lock, so it may block
        while another writer holds it (call it off the event loop).
        """
        if profile.name != name:
            raise UnprocessableError(
                "name", f"the profile is named {profile.name!r} but the path says {name!r}"
            )
        return self.store.put(profile, if_match=if_match, if_none_match=if_none_match)


def _systemone_field(context: str, qid: str, question: SystemOneQuestion) -> str:
    """The field a 413 names for a question's listing: the state, unless the question's own
    text (its instructions, or its criteria) is longer."""
    criteria = len(msgspec.json.encode(question.criteria))
    instructions = len(question.instructions)
    if len(context) >= max(instructions, criteria):
        return "state"
    return f"questions.{qid}." + ("instructions" if instructions >= criteria else "criteria")


# FitRequest.method -> fit_labeled's methods: the candidates that compete with no scaling.
_FIT_METHODS: dict[str, str | list[str]] = {
    "auto": "auto",
    "temperature": ["temperature"],
    "bias_temperature": ["temperature", "bias_temperature"],
    "probe": ["probe"],
}


def _fit_layers(request: FitRequest, fingerprint: Fingerprint) -> tuple[int, ...]:
    """The hidden-state layers to judge a fit's examples with: a probe's candidates, or none.

    An explicit probe that cannot be fitted (no hidden states, too few examples, more weights
    than a profile may hold: ``calibration.fitting.resolve_methods``) is refused here, naming
    ``method``, before any model work; "auto" fits without one, and its profile's note says
    why.
    """
    if request.method not in ("auto", "probe"):
        return ()
    num_layers, hidden_size = fingerprint.num_layers, fingerprint.hidden_size
    if num_layers is None or hidden_size is None:
        if request.method == "probe":
            raise UnprocessableError(
                "method",
                f"method 'probe' reads the model's hidden states, and this server's engine "
                f"({fingerprint.model}) exposes none; use method auto or temperature",
            )
        return ()
    if request.method == "probe":
        try:  # the fitter's own rules for when a probe can be fitted, before any model work
            weights = probe_weights(len(request.choices), hidden_size)
            resolve_methods(["probe"], len(request.examples), weights)
        except FitError as exc:
            raise UnprocessableError("method", str(exc)) from exc
    # "auto": the fitter decides whether the probe can compete, and its note says why not.
    return candidate_layers(num_layers)


def _features_of(judgment: Judgment, layers: Sequence[int]) -> np.ndarray:
    """(m, H) float32: the judgment's hidden states of ``layers``, in that order."""
    features = judgment.features or {}
    missing = [n for n in layers if n not in features]
    if missing:  # the engine broke its contract: Query.feature_layers come back in features
        raise RuntimeError(f"the engine returned no features for layers {missing}")
    return np.asarray([features[n] for n in layers], dtype=np.float32)


def _temperature(calibration_map: CalibrationMap) -> float | None:
    """The map's temperature; None for a probe, which has none (its ``temperature`` is 1)."""
    return None if isinstance(calibration_map, Probe) else calibration_map.temperature


def _map_summary(calibration_map: CalibrationMap) -> CalibrationMapSummary:
    layers = list(calibration_map.layers) if isinstance(calibration_map, Probe) else None
    return CalibrationMapSummary(
        method=calibration_map.method, temperature=_temperature(calibration_map), layers=layers
    )
