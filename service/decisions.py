"""Decisions on typed answers about a state, each by its own gate.

What ``judge decide`` prints and the MCP server's ``decide`` tool returns, in the same wire
form as ``POST /v1/systemone`` (``service.systemone.wire_answer``: one owner): the engine's
typed answers (``judge.answers``) with the verdict their gate gives on the answer's judgment
(``calibration.Gate``: its profile's, else the defaults'), as ``judge ask`` and ``POST /judge``
decide. With a profile, ``probabilities`` (and noul, choice, score, confidence) are the
calibrated ones and ``raw_probabilities`` the model's.

    judge_questions(engine, state, questions, gates={id: gate})  ->  {id: (Answer, Verdict)}
    {id: wire_answer(answer, verdict)}                            ->  the wire form

Errors name the field at fault: ``questions.<id>.<field>`` for a question (an
``InvalidQueryError``, from ``judge.answers``), ``profiles.<id>`` for a profile that does
not fit its question (a ``ProfileMismatchError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from calibration import Gate, NoCertificateError, Overrides, PolicyDefaults, Verdict
from judge import Engine, InvalidQueryError
from judge.answers import (
    MAX_ORDERINGS,
    Answer,
    Question,
    plan_decisions,
)
from service.schemas import JudgeResponse
from service.systemone import SystemOneAnswer, wire_answer

if TYPE_CHECKING:
    from service.cascade.escalation import Escalation

__all__ = ["QuestionDecision", "judge_questions", "question_overrides", "with_order"]


@dataclass(frozen=True)
class QuestionDecision:
    """A question's decision: this engine's answer and verdict and, with a cascade, its
    outcome (``service.cascade.escalation``: who decided, each stage's part, the later
    stage's answer that stands)."""

    answer: Answer
    verdict: Verdict
    escalation: Escalation | None = None

    def wire(self) -> SystemOneAnswer:
        """The answer's wire form (``POST /v1/systemone``)."""
        own = wire_answer(self.answer, self.verdict)
        return own if self.escalation is None else self.escalation.staged(own)

    def response(self, *, return_prompt: bool) -> JudgeResponse:
        """The answer in a judgment's shape (a pair on ``POST /judge``)."""
        own = JudgeResponse.of(
            self.answer.judgment,
            self.verdict,
            choices=list(self.answer.probabilities),  # the request's order of candidates
            return_prompt=return_prompt,
            orderings=self.answer.orderings,
        )
        if self.escalation is None:
            return own
        staged = self.escalation.staged(own)
        # A local later stage keeps its prompt; it is sent only where asked for.
        return staged if return_prompt else msgspec.structs.replace(staged, prompt=None)


Order = Literal["given", "invariant"]


def with_order(
    questions: Mapping[str, Question | Mapping[str, Any]], order: Order
) -> dict[str, Question | Mapping[str, Any]]:
    """``questions``, each without an ``order`` of its own given ``order``."""
    out: dict[str, Question | Mapping[str, Any]] = {}
    for qid, raw in questions.items():
        if isinstance(raw, Question):
            out[qid] = raw if raw.order == order else msgspec.structs.replace(raw, order=order)
        elif isinstance(raw, Mapping) and "order" not in raw:
            out[qid] = {**raw, "order": order}
        else:
            out[qid] = raw
    return out


def question_overrides(qid: str, raw: Question | Mapping[str, Any]) -> Overrides:
    """The gate settings a question's JSON form carries beside the question itself (the
    System One extension's ``threshold``, ``uncertified_threshold``, ``min_choice_mass``, ...):
    the engine's question types do not keep them, so they are read here, and a bad one is
    refused naming ``questions.<id>.<field>``."""
    if not isinstance(raw, Mapping):
        return Overrides()
    given = {f: raw[f] for f in Overrides.__struct_fields__ if f in raw}
    for field, value in given.items():  # one at a time, so that a refusal names its field
        try:
            Gate(None, overrides=msgspec.convert({field: value}, Overrides))
        except NoCertificateError:
            pass  # a threshold is refused or not by the question's profile, when its gate opens
        except (msgspec.ValidationError, ValueError) as exc:
            raise InvalidQueryError(str(exc), field=f"questions.{qid}.{field}") from None
    return msgspec.convert(given, Overrides)


def judge_questions(
    engine: Engine,
    state: object,
    questions: Mapping[str, Question | Mapping[str, Any]],
    *,
    gates: Mapping[str, Gate] | None = None,
    defaults: PolicyDefaults | None = None,
    max_orderings: int = MAX_ORDERINGS,
) -> dict[str, tuple[Answer, Verdict]]:
    """Answer ``questions`` about ``state``, each decided by its gate in ``gates`` (by question
    id), or else by a gate without a profile under ``defaults`` and the question's own
    settings (``question_overrides``).

    Every gate is checked against the engine and its question's choices before any model
    work; a probe's hidden-state layers are read for its question.
    """
    gates = dict(gates or {})
    unknown = sorted(set(gates) - set(questions))
    if unknown:
        raise InvalidQueryError(
            f"a profile is given for question {unknown[0]!r}, which is not asked; "
            f"the questions are {sorted(questions)}",
            field=f"profiles.{unknown[0]}",
        )
    for qid, raw in questions.items():
        gates.setdefault(qid, Gate(None, overrides=question_overrides(qid, raw), defaults=defaults))
    plan = plan_decisions(
        state,
        questions,
        max_orderings=max_orderings,
        feature_layers={qid: g.feature_layers for qid, g in gates.items()},
        span_layers={qid: g.span_layers for qid, g in gates.items()},
        adapters={qid: g.adapter for qid, g in gates.items()},
    )
    for asked in plan.asked:
        gates[asked.id].check_engine(engine, choices=asked.choices, field=f"profiles.{asked.id}")
    answers = plan.answers(engine.run_shared(plan.prepare(engine)))
    return {qid: (answer, gates[qid].decide_answer(answer)) for qid, answer in answers.items()}
