"""Typed answers about a state, each gated by its calibration profile where it has one.

What ``judge decide`` prints and the MCP server's ``decide`` tool returns, in the same wire
form as ``POST /v1/systemone`` (``service.systemone.wire_answer``: one owner): the engine's
typed answers (``judge.decisions``) with the decision its Policy makes on the answer's
judgment (its profile's, else the default policy's), as ``judge ask`` and ``POST /judge``
decide. With a profile, ``probabilities`` (and noul, choice, score, confidence) are the
calibrated ones and ``raw_probabilities`` the model's.

    answer_questions(engine, state, questions, profiles={id: profile})  ->  {id: SystemOneAnswer}

Errors name the field at fault: ``questions.<id>.<field>`` for a question (an
``InvalidQueryError``, from ``judge.decisions``), ``profiles.<id>`` for a profile that does
not fit its question (a ``ProfileMismatchError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from calibration import (
    CalibrationProfile,
    PolicyDefaults,
    ProfileMismatchError,
    make_policy,
)
from judge import Engine, InvalidQueryError
from judge.decisions import (
    MAX_ORDERINGS,
    ChoiceQuestion,
    NoulQuestion,
    Question,
    ScoreQuestion,
    plan_decisions,
)
from service.systemone import SystemOneAnswer, wire_answer

__all__ = ["answer_questions", "with_order"]

Order = Literal["given", "invariant"]


def with_order(
    questions: Mapping[str, Question | Mapping[str, Any]], order: Order
) -> dict[str, Question | Mapping[str, Any]]:
    """``questions``, each without an ``order`` of its own given ``order``."""
    out: dict[str, Question | Mapping[str, Any]] = {}
    for qid, raw in questions.items():
        if isinstance(raw, NoulQuestion | ChoiceQuestion | ScoreQuestion):
            out[qid] = raw if raw.order == order else msgspec.structs.replace(raw, order=order)
        elif isinstance(raw, Mapping) and "order" not in raw:
            out[qid] = {**raw, "order": order}
        else:
            out[qid] = raw
    return out


def answer_questions(
    engine: Engine,
    state: object,
    questions: Mapping[str, Question | Mapping[str, Any]],
    *,
    profiles: Mapping[str, CalibrationProfile] | None = None,
    max_orderings: int = MAX_ORDERINGS,
) -> dict[str, SystemOneAnswer]:
    """Answer ``questions`` about ``state``; gate the answer of each id in ``profiles``.

    Every profile is checked against the engine and its question's choices before any model
    work. A probe profile's hidden-state layers are read for its question.
    """
    profiles = dict(profiles or {})
    unknown = sorted(set(profiles) - set(questions))
    if unknown:
        raise InvalidQueryError(
            f"a profile is given for question {unknown[0]!r}, which is not asked; "
            f"the questions are {sorted(questions)}",
            field=f"profiles.{unknown[0]}",
        )
    # Every question is gated, as POST /v1/systemone gates it: by its profile where it has one,
    # else by the default policy (threshold 0.9, nothing certified).
    policies = {qid: make_policy(profiles.get(qid), defaults=PolicyDefaults()) for qid in questions}
    layers = {qid: p.feature_layers for qid, p in policies.items() if p.feature_layers}
    plan = plan_decisions(state, questions, max_orderings=max_orderings, feature_layers=layers)
    fingerprint = engine.fingerprint() if profiles else None
    for asked in plan.asked:
        profile = profiles.get(asked.id)
        if profile is None or fingerprint is None:
            continue
        try:
            profile.check(fingerprint, choices=asked.choices)
        except ProfileMismatchError as exc:
            raise ProfileMismatchError(f"profiles.{asked.id}", str(exc)) from None
    answers = plan.answers(engine.run_shared(plan.prepare(engine)))
    return {
        qid: wire_answer(
            answer, policies[qid].decide(answer.judgment, order_spread=answer.order_spread)
        )
        for qid, answer in answers.items()
    }
