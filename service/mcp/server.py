"""The judge as a Model Context Protocol server (the official SDK's ``MCPServer``).

Three tools, each with a JSON input schema:

    judge           prompt, choices (2 or more), optional profile, system and the overrides
                    POST /judge takes (threshold, uncertified_threshold, min_choice_mass,
                    values, max_std), or an item alone with its profile: the judgment and
                    the decision on it, field for field as ``POST /judge`` answers
                    (``service.gate_context.respond``), cascaded where the server has one
    decide          state, questions (id -> {"type": "noul" | "choice" | "score" | "pair", ...}),
                    optional profiles (id -> name), order, max_orderings: one typed answer
                    per question (``service.decisions``), all in one run of the model
    list_profiles   the profiles in the profiles directory: name, choices, method, threshold

``create_server(engine, store)`` builds the server around a loaded engine (tests may hand in
their own); ``judge mcp`` loads the model once and serves it over stdio. A call that cannot be
answered comes back as a tool error (``isError``) whose text starts with the argument at fault
(``choices: ...``, ``questions.q1.criteria: ...``). Model work runs on the SDK's worker
threads, one call at a time (the engine is not shared between threads).

The MCP SDK is the ``mcp`` extra (``pip install 'calibrated-judge[mcp]'``), imported only here and by
``judge mcp``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any, Literal

import msgspec
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.tools import Tool
from pydantic import Field

from calibration import (
    CalibrationError,
    CalibrationProfile,
    Overrides,
    PolicyDefaults,
    ProfileError,
)
from calibration.cascade import StageItem
from judge import Engine, JudgeError, Query
from judge.answers import MAX_ORDERINGS, Question, plan_decisions
from judge.judgments import item_span_of
from service.cascade.escalation import escalated
from service.cascade.stages import (
    LocalModel,
    QuestionItem,
    asked_as,
    opened_stages,
)
from service.decisions import (
    QuestionDecision,
    judge_questions,
    question_overrides,
    with_order,
)
from service.gate_context import GateContext, item_prompt
from service.log.decision_log import DecisionLog, DecisionLogError
from service.log.record import LoggedDecision, replayable_question
from service.log.shift_watch import ShiftWatch
from service.planner import plan_judgment
from service.profiles import ProfileStore

__all__ = ["create_server"]

INSTRUCTIONS = (
    "Calibrated finite-choice judgments from one forward pass of a small language model. "
    "`judge` picks one of the given choices for a prompt, with probabilities, and accepts or "
    "escalates the answer (with a calibration profile, under its certified threshold). "
    "`decide` answers typed questions (yes/no, one of named options, a level on a scale) "
    "about one state (a document, a ticket, any JSON). `list_profiles` names the profiles."
)


def create_server(
    engine: Engine,
    store: ProfileStore,
    *,
    defaults: PolicyDefaults | None = None,
    decision_log: DecisionLog | None = None,
    log_requests: bool = False,
    log_features: bool = False,
    audit_rate: float = 0.0,
    audit_rates: Mapping[str, float] | None = None,
    cascade: Mapping[str, LocalModel | str] | None = None,
    stage_name: str = "local",
) -> MCPServer:
    """An MCP server whose tools judge with ``engine`` and gate with ``store``'s profiles.

    With ``decision_log``, every decision of ``judge`` and ``decide`` is appended to it before
    the tool answers, as the HTTP service appends its own (``GateContext.settle``): it can then
    be labelled, audited, counted in its profile's health and (with ``log_requests``, which
    keeps the prompt or state) replayed, and (with ``log_features``, which keeps the hidden
    states) refit a probe. A log that cannot be written fails the call. Gates are opened as
    the HTTP service opens them (``service.gate_context``): ``audit_rate`` (and per profile,
    ``audit_rates``) marks that share of decisions for people to label.

    With ``cascade`` (later stages by name, in order: a loaded model, or another judge
    server's URL), a judgment the ``judge`` tool escalates goes to each later stage in turn
    (``service.cascade.escalation``), and a question ``decide`` escalates as the same
    question, under the profile "P-NAME" where the
    request's is P, as ``judge serve --cascade`` sends them; ``engine`` is the first stage,
    ``stage_name``.
    """
    defaults = defaults or PolicyDefaults()
    # As judge serve does: a version whose traffic's class mix moved escalates until
    # re-certified (service.log.shift_watch).
    watch = None if decision_log is None else ShiftWatch(store, decision_log, every=50)
    context = GateContext(
        store,
        defaults,
        audit_rate=audit_rate,
        audit_rates=dict(audit_rates or {}),
        logging=decision_log is not None,
        log_features=log_features,
        log_requests=log_requests,
        holds=None if watch is None else watch.hold,
    )
    calls = _Tools(engine, store, context, defaults, decision_log, watch, cascade or {}, stage_name)
    judge = Tool.from_function(
        calls.judge, name="judge", description=calls.judge_about, structured_output=True
    )
    decide = Tool.from_function(
        calls.decide, name="decide", description=calls.decide_about, structured_output=True
    )
    _describe_questions(decide.parameters)
    listed = Tool.from_function(
        calls.list_profiles,
        name="list_profiles",
        description=calls.list_about,
        structured_output=True,
    )
    return MCPServer(name="judge", instructions=INSTRUCTIONS, tools=[judge, decide, listed])


class _Tools:
    """The MCP tools of one server (``create_server``): each translates its arguments into a
    call of the decision core and its answer back, under the server's one model lock."""

    def __init__(
        self,
        engine: Engine,
        store: ProfileStore,
        context: GateContext,
        defaults: PolicyDefaults,
        decision_log: DecisionLog | None,
        watch: ShiftWatch | None,
        cascade: Mapping[str, LocalModel | str],
        stage_name: str,
    ) -> None:
        self.engine, self.store, self.context, self.defaults = engine, store, context, defaults
        self.decision_log, self.watch = decision_log, watch
        self.cascade, self.stage_name = cascade, stage_name
        self.model_lock = threading.Lock()

    def keep(self, records: Sequence[LoggedDecision | None]) -> None:
        """Append the call's decisions before it answers; a failed write fails the call."""
        rows = [r for r in records if r is not None]
        if self.decision_log is None or not rows:
            return
        try:
            self.decision_log.append(rows)
        except DecisionLogError as exc:
            raise ToolError(
                f"the decision could not be written to the decision log ({exc}), so it is "
                "not served: retry later"
            ) from None
        if self.watch is not None:
            self.watch.logged(rows)

    judge_about = (
        "Judge a prompt: the probability of each choice, the most probable one, "
        "and the decision to accept it or escalate (with a profile: calibrated, under the "
        "profile's certified threshold; without one, or without a certified threshold, it "
        "escalates unless uncertified_threshold opts in to accepting with no guarantee)."
    )

    def judge(
        self,
        prompt: Annotated[
            str | None,
            Field(
                min_length=1,
                description="the question or item to judge (omit it to send the item alone to "
                "a profile fitted on a task)",
            ),
        ] = None,
        choices: Annotated[
            list[str] | None,
            Field(
                min_length=2,
                description="the answers to choose from, two or more (default: the profile's)",
            ),
        ] = None,
        profile: Annotated[
            str | None,
            Field(description="a calibration profile's name (see list_profiles)"),
        ] = None,
        system: Annotated[
            str | None, Field(description="a system prompt (default: the model's own)")
        ] = None,
        threshold: Annotated[
            float | None,
            Field(
                ge=0.0,
                le=1.0,
                description="accept at this calibrated confidence or above instead of the "
                "profile's certified threshold (refused where there is none); overriding drops "
                "the certification",
            ),
        ] = None,
        uncertified_threshold: Annotated[
            float | None,
            Field(
                ge=0.0,
                le=1.0,
                description="OPT-IN, NO GUARANTEE: where no certified threshold exists (no "
                "profile, or one that certified none), accept at this confidence instead of "
                "escalating",
            ),
        ] = None,
        min_choice_mass: Annotated[
            float | None,
            Field(
                ge=0.0,
                le=1.0,
                description="escalate when the choices' share of the next-token distribution "
                "is below this (default: the profile's, else the server's)",
            ),
        ] = None,
        values: Annotated[
            dict[str, float] | None,
            Field(
                description="a score: each choice's number (default for numeral choices: the "
                "numerals), so that the answer carries the expected value and its spread"
            ),
        ] = None,
        max_std: Annotated[
            float | None,
            Field(
                ge=0.0,
                description="a score: escalate when the standard deviation is above this "
                "(default: the profile's)",
            ),
        ] = None,
        item: Annotated[
            str | None,
            Field(
                description="without a prompt: the item alone, judged in the very prompt its "
                "profile was fitted on (a profile fitted on a task; see list_profiles). With a "
                "prompt: the item's own text inside it (its first occurrence), which a profile "
                "fitted on a task needs"
            ),
        ] = None,
    ) -> dict[str, Any]:
        with _tool_errors():
            # The profile read once: the item's template and the certificate are one version's.
            version = self.context.read(profile)
            fitted = None if version is None else version[0]
            if prompt is None:
                # The item alone: rendered in its profile's prompt, its span marked by
                # construction, between the profile's choices (as POST /judge's ItemRequest).
                prompt, span, choices, system = _item_alone(fitted, item, choices, system)
            else:
                choices = choices if choices is not None else _choices_of(fitted)
                span = None if item is None else item_span_of(prompt, item)
            overrides = Overrides(
                threshold=threshold,
                uncertified_threshold=uncertified_threshold,
                min_choice_mass=min_choice_mass,
                max_std=max_std,
                values=values,
            )
            query = Query(prompt=prompt, choices=list(choices), system=system, item_span=span)
            planned = plan_judgment(
                self.context, self.engine, query, profile, overrides, version=version
            )
            # Each later stage's gate opened and checked before any model work.
            overrides = planned.gate.overrides
            later = opened_stages(
                self.cascade or {},
                profile,
                overrides,
                functools.partial(self.context.open, overrides=overrides),
                choices=choices,
                field="profile",
                context=self.context,
            )
            with self.model_lock:
                judgment = self.engine.judge_batch([planned.query])[0]
            response, verdict, record = planned.respond(
                judgment, self.context, model=self.engine.model_id, choices=choices
            )
            records = [] if record is None else [record]
            if later:  # what this engine escalated goes to the later stages, in turn
                asked = StageItem(query.prompt, list(choices), query.item_span)
                escalation = escalated(self.stage_name, verdict, judgment, choices, later, asked)
                response, records = escalation.staged(response), escalation.logged(records)
            self.keep(records)
        return _plain(response)

    decide_about = (
        "Answer typed questions about one state in one run of the model. A "
        'question is {"type": "noul", "instructions": ...} (yes or no: the answer is P(yes)), '
        '{"type": "choice", "instructions": ..., "criteria": {name: description or null}} '
        '(one of the named options), or {"type": "score", "instructions": ..., "criteria": '
        "[level, ...]} (2-10 levels: the answer is the expected level index), or "
        '{"type": "pair", "instructions": ..., "candidates": {name: text, name: text}} (which '
        "of two candidates is the better: the answer names the winner, judged in both orders). "
        "Each answer has "
        "the probabilities, and with a profile the decision to accept or escalate."
    )

    def decide(
        self,
        state: Annotated[
            Any,
            Field(description="what the questions are about: text, or any JSON value"),
        ],
        questions: Annotated[
            dict[str, dict[str, Any]],
            Field(min_length=1, description="the questions, by id"),
        ],
        profiles: Annotated[
            dict[str, str] | None,
            Field(description="question id -> the profile (by name) that gates its answer"),
        ] = None,
        order: Annotated[
            Literal["given", "invariant"] | None,
            Field(
                description="for questions that set no order: invariant asks under several "
                "listings of the options and averages, so the answer does not depend on "
                "where an option is listed"
            ),
        ] = None,
        max_orderings: Annotated[
            int, Field(ge=1, description="listings of a choice's options under invariant")
        ] = MAX_ORDERINGS,
    ) -> dict[str, Any]:
        # Every question's gate: its profile's where it names one, else the defaults alone.
        with _tool_errors():
            settings = {qid: question_overrides(qid, q) for qid, q in questions.items()}
            names = profiles or {}
            for qid in names.keys() - questions.keys():
                raise ToolError(f"profiles.{qid}: there is no question {qid!r} to gate")
            gates = {
                qid: self.context.open(names.get(qid), settings[qid], field=f"profiles.{qid}")
                for qid in questions
            }
        asked: dict[str, Any] = dict(questions)
        if order is not None:
            asked = with_order(asked, order)
        later = {}
        if self.cascade:  # each later stage's gate opened and checked before any model work
            with _tool_errors():
                plan = plan_decisions(state, asked, max_orderings=max_orderings)
                for a in plan.asked:
                    item = QuestionItem(state, a.id, asked_as(a.question, settings[a.id]))
                    stages = opened_stages(
                        self.cascade,
                        names.get(a.id),
                        settings[a.id],
                        functools.partial(
                            self.context.open, field=f"profiles.{a.id}", overrides=settings[a.id]
                        ),
                        choices=a.choices,
                        field=f"profiles.{a.id}",
                        context=self.context,
                    )
                    later[a.id] = (item, stages)
        with _tool_errors(), self.model_lock:
            judged = judge_questions(
                self.engine,
                state,
                asked,
                gates=gates,
                defaults=self.defaults,
                max_orderings=max_orderings,
            )
        decided, records = {}, []
        for qid, (answer, verdict) in judged.items():
            decided[qid], mine = self.context.answered(
                answer,
                verdict,
                gates[qid],
                model=self.engine.model_id,
                request=functools.partial(replayable_question, state, qid, asked[qid], gates[qid]),
            )
            if qid in later:
                item, stages = later[qid]
                choices = list(answer.probabilities)
                escalation = escalated(
                    self.stage_name, verdict, answer.judgment, choices, stages, item
                )
                decided[qid] = QuestionDecision(answer, verdict, escalation)
                records += escalation.logged([] if mine is None else [mine])
            elif mine is not None:
                records.append(mine)
        self.keep(records)
        return _plain({qid: d.wire() for qid, d in decided.items()})

    list_about = (
        "The calibration profiles a judge or decide call may name: each one's "
        "choices, calibration method and certified threshold (null: none certified)."
    )

    def list_profiles(self) -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        for name in self.store.names():
            try:
                p = self.store.get(name)
            except ProfileError as exc:
                rows.append({"name": name, "error": str(exc)})
                continue
            rows.append(
                {
                    "name": p.name,
                    "choices": p.choices,
                    "method": p.calibration_map.method,
                    "threshold": p.threshold.threshold,
                    "model": p.fingerprint.model,
                    # fitted on a task: judge takes the item alone
                    "task": p.template is not None,
                }
            )
        return {"profiles": rows}


def _item_alone(
    fitted: CalibrationProfile | None,
    item: str | None,
    choices: list[str] | None,
    system: str | None,
) -> tuple[str, tuple[int, int] | None, list[str], str | None]:
    """The prompt, item span, choices and system prompt an item alone stands for, or a
    ToolError naming the argument that is missing or does not fit."""
    if item is None:
        raise ToolError("prompt: give a prompt (with choices), or an item alone with its profile")
    if fitted is None or fitted.template is None:
        raise ToolError(
            "profile: an item alone is judged in the prompt its profile was fitted on: name a "
            "profile fitted on a task (list_profiles says which are), or give the whole prompt"
        )
    if choices is not None and sorted(choices) != sorted(fitted.choices):
        raise ToolError(f"choices: an item alone is judged between its profile's {fitted.choices}")
    if system is not None:
        raise ToolError("system: an item alone is judged in its profile's prompt, system included")
    asked = item_prompt(fitted, item)
    return asked.prompt, asked.item_span, asked.choices, asked.system


def _choices_of(fitted: CalibrationProfile | None) -> list[str]:
    """A prompt's default choices: its profile's, or a ToolError naming ``choices``."""
    if fitted is None:
        raise ToolError("choices: give the choices (two or more), or a profile to take them from")
    return list(fitted.choices)


@contextlib.contextmanager
def _tool_errors() -> Iterator[None]:
    """The judge's own errors as tool errors whose text starts with the field at fault."""
    try:
        yield
    except (JudgeError, CalibrationError) as exc:
        field = getattr(exc, "field", None)
        raise ToolError(f"{field}: {exc}" if isinstance(field, str) else str(exc)) from None


def _plain(value: object) -> dict[str, Any]:
    """A Struct (or a dict of them) as plain JSON data, unset fields left out."""
    data = msgspec.to_builtins(value)
    assert isinstance(data, dict)
    return data


def _describe_questions(parameters: dict[str, Any]) -> None:
    """Put the questions' own schema (``judge.answers.Question``) in ``decide``'s.

    The SDK derives a tool's schema from its signature, where a question is any object; the
    engine checks each question itself (and names the field), so this only tells clients
    what to send.
    """
    (schema,), components = msgspec.json.schema_components(
        [Question], ref_template="#/$defs/{name}"
    )
    properties = parameters["properties"]
    properties["questions"] = {
        "type": "object",
        "description": properties["questions"].get("description", "the questions, by id"),
        "minProperties": 1,
        "additionalProperties": schema,
    }
    parameters.setdefault("$defs", {}).update(components)
