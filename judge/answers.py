"""Typed answers about one state: yes/no, one of named options, a level on a scale.

The System One wire format's model of a request (``POST /v1/systemone``): a *state* (a
document, a ticket, any JSON) and several typed questions about it. Here each question becomes
ordinary judge queries whose prompt is the rendered state, a blank line, then the question
(``judge.judgments.shared_query``), so the state's tokens are computed once for all questions
(``Judge.run_shared`` packs them into shared rows, within the token budget).

    noul    "Is this about billing?"            choices yes / no;      answer: P(yes)
    choice  options {name: description | None}  choices the names;    answer: the name
    score   levels [level, ...] (2-10)          choices "0".."n-1";   answer: sum i * P(i)
    pair    candidates {name: text} (2)          reads "A" / "B";      answer: the winner's name

(``noul`` is the System One wire format's own name for a yes/no question, kept so that
requests and answers match other System One servers; its answer is the probability of yes.)

**Order invariance.** A small model prefers options by where they are listed (first, last).
With ``order="invariant"`` a question is asked under several listings of its options (cyclic
shifts for a choice, up to ``max_orderings``; both directions for yes/no and for a scale), all
in the same run as the others, and its probabilities are the mean over the listings; the
answer's ``order_spread`` says how far the listings disagreed (the largest difference, across
listings, in the probability of one option). The choices the model reads stay the same in
every listing: only the prompt's order changes, so the mean is over the same choice set.

**Pairs.** A pair question compares two candidates against the state and its instructions.
The model reads them as "Candidate A" and "Candidate B" and answers "A" or "B": the labels
name places, not candidates, so swapping the candidates (the second listing, asked by default)
moves both the place and the label a candidate is read under, and the mean over the two
orders cancels a preference for either. Its probabilities are by candidate name; its
``order_spread`` is how far the two orders disagreed on the winner's probability, which the
gate bounds (``position_inconsistent``). Both orders share the state and the instructions in
one packed row (``Judge.run_shared``), so they cost less than twice one order.

Three steps, so that a server can prepare and schedule the queries itself:

    plan = plan_decisions(state, questions)          # checked, rendered prompts; no model
    judgments = engine.run_shared([engine.prepare(q) for q in plan.queries])
    answers = plan.answers(judgments)                # typed answers, one per question id

``decide(engine, state, questions)`` does all three. A leaf of the engine layer: it imports
no torch itself and nothing from ``calibration`` (gating an answer is the caller's, with the
answer's ``judgment``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from judge.adapters import Adapter
from judge.errors import InvalidQueryError, JudgeError
from judge.identity import listings_sha256
from judge.judgments import Judgment, Query, shared_query
from judge.questions import (
    MAX_LEVELS,
    MAX_OPTIONS,
    ChoiceQuestion,
    NoulQuestion,
    PairQuestion,
    Question,
    ScoreQuestion,
    describe,
)

if TYPE_CHECKING:
    from judge.judgments import Prepared
    from judge.protocol import Engine

__all__ = [
    "MAX_LEVELS",
    "MAX_OPTIONS",
    "MAX_ORDERINGS",
    "Answer",
    "ChoiceAnswer",
    "ChoiceQuestion",
    "DecisionPlan",
    "NoulAnswer",
    "NoulQuestion",
    "PairAnswer",
    "PairQuestion",
    "Question",
    "ScoreAnswer",
    "ScoreQuestion",
    "decide",
    "describe",
    "plan_decisions",
    "render_state",
]

MAX_ORDERINGS = 5  # listings of a choice question's options under order="invariant"


class _Answered(msgspec.Struct, frozen=True, kw_only=True):
    """What every answer carries besides its typed value."""

    # The choices the model read, and the mean probability of each over the listings.
    probabilities: dict[str, float]
    # The question's judgment: over its listings, the mean probabilities (log_probs their
    # logarithms) and the mean choice mass; prompt, id and features of the first listing;
    # its tokens_sha256 pins every listing (``judge.identity.listings_sha256``).
    # What a calibration Policy decides on.
    judgment: Judgment
    orderings: int  # listings of the options judged (1 unless order="invariant")
    order_spread: float  # largest difference across listings in one choice's probability
    # A pair's answer: its listings are the candidates' two orders (what the gate bounds as
    # ``position_inconsistent``).
    pair: ClassVar[bool] = False


class NoulAnswer(_Answered, frozen=True, kw_only=True, tag="noul", tag_field="type"):
    noul: float  # P(yes)


class ChoiceAnswer(_Answered, frozen=True, kw_only=True, tag="choice", tag_field="type"):
    choice: str
    confidence: float  # the probability of ``choice``


class ScoreAnswer(_Answered, frozen=True, kw_only=True, tag="score", tag_field="type"):
    score: float  # sum over levels of index * probability (0..n-1)
    confidence: float  # the probability of the most likely level
    legend: dict[str, str]  # level index -> its description


class PairAnswer(_Answered, frozen=True, kw_only=True, tag="pair", tag_field="type"):
    pair: ClassVar[bool] = True
    winner: str  # the name of the candidate more probably the better
    confidence: float  # its probability


Answer = NoulAnswer | ChoiceAnswer | ScoreAnswer | PairAnswer

# The labels a pair's candidates are read under, by place: what the model answers with.
PAIR_LABELS = ("A", "B")


def render_state(state: object) -> str:
    """The state as the model reads it: a string as it is, anything else as indented JSON."""
    if isinstance(state, str):
        return state
    try:
        # allow_nan=False: NaN and Infinity are not JSON, and the model should not read them.
        return json.dumps(state, indent=2, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidQueryError(f"state is not JSON: {exc}", field="state") from None


class _Asked(msgspec.Struct, frozen=True):
    """One question of a plan: where its listings' queries sit in ``DecisionPlan.queries``."""

    id: str
    question: Question
    choices: list[str]  # the answer's choices, in canonical order (a pair's: its candidates)
    start: int
    count: int  # listings
    # Per listing, for each choice the model reads, the index in ``choices`` it stands for:
    # the identity, except for a pair's swapped order, whose "A" is the second candidate.
    reads: list[list[int]]


class DecisionPlan(msgspec.Struct, frozen=True):
    """The queries of a decision request, in order, and how to read their judgments back."""

    context: str  # the rendered state, shared by every query
    queries: list[Query]  # each already holds the context (shared_query)
    asked: list[_Asked]

    def question_of(self, index: int) -> str:
        """The id of the question whose listing is ``queries[index]``."""
        return self._asked_of(index).id

    def _asked_of(self, index: int) -> _Asked:
        return next(a for a in self.asked if a.start <= index < a.start + a.count)

    def field_of(self, index: int, field: str | None) -> str:
        """A field the engine named for ``queries[index]``, as the question's own: its
        choices are the question's criteria (``questions.<id>.criteria``), a pair's its
        candidates."""
        asked = self._asked_of(index)
        if field in (None, "choices"):
            field = "candidates" if isinstance(asked.question, PairQuestion) else "criteria"
        return f"questions.{asked.id}.{field}"

    def prepare(self, engine: Engine) -> list[Prepared]:
        """Every query prepared by ``engine``; a refusal names the question (``field_of``)."""
        prepared = []
        for i, query in enumerate(self.queries):
            try:
                prepared.append(engine.prepare(query))
            except JudgeError as exc:
                exc.field = self.field_of(i, exc.field)
                raise
        return prepared

    def answers(self, judgments: Sequence[Judgment]) -> dict[str, Answer]:
        """Each question's typed answer, from the judgments of ``queries`` in order."""
        if len(judgments) != len(self.queries):
            raise ValueError(f"{len(judgments)} judgments for {len(self.queries)} queries")
        return {a.id: _answer(a, list(judgments[a.start : a.start + a.count])) for a in self.asked}


def plan_decisions(
    state: object,
    questions: Mapping[str, Question | Mapping[str, Any]],
    *,
    max_orderings: int = MAX_ORDERINGS,
    response_prefix: str | None = None,
    feature_layers: Mapping[str, Sequence[int]] | None = None,
    span_layers: Mapping[str, Sequence[int]] | None = None,
    adapters: Mapping[str, Adapter | None] | None = None,
) -> DecisionPlan:
    """Check ``questions`` and render every listing's query; no model work.

    ``questions`` maps an id to a question (or its JSON form, ``{"type": ...}``). A bad one
    raises ``InvalidQueryError`` whose field names it (``questions.<id>.criteria``).
    ``feature_layers``: hidden-state layers to read per question id (a probe's);
    ``span_layers``, those whose mean over the state (the item) to read; ``adapters``, the
    low-rank adapters to judge each question under (``Query.adapter``: a profile's).
    """
    if max_orderings < 1:
        raise ValueError(f"max_orderings must be >= 1, got {max_orderings}")
    if not isinstance(questions, Mapping) or not questions:
        raise InvalidQueryError("ask at least one question", field="questions")
    context = render_state(state)
    queries: list[Query] = []
    asked: list[_Asked] = []
    for qid, raw in questions.items():
        question = _as_question(qid, raw)
        choices = _choices(qid, question)
        listings = _listings(question, max_orderings)
        layers = tuple((feature_layers or {}).get(qid, ()))
        spans = tuple((span_layers or {}).get(qid, ()))
        adapter = (adapters or {}).get(qid)
        pair = isinstance(question, PairQuestion)
        # A pair's labels stand for places: listing [1, 0] reads the second candidate as "A".
        reads = [list(listing) if pair else list(range(len(choices))) for listing in listings]
        asked.append(_Asked(qid, question, choices, len(queries), len(listings), reads))
        for listing in listings:
            prompt = _prompt(question, listing)
            query = Query(
                prompt=prompt,
                choices=list(PAIR_LABELS) if pair else choices,
                response_prefix=response_prefix,
                feature_layers=layers,
                span_layers=spans,
                adapter=adapter,
            )
            queries.append(shared_query(context, query))
    return DecisionPlan(context, queries, asked)


def decide(
    engine: Engine,
    state: object,
    questions: Mapping[str, Question | Mapping[str, Any]],
    *,
    max_orderings: int = MAX_ORDERINGS,
) -> dict[str, Answer]:
    """Answer typed ``questions`` about ``state`` with ``engine``, the state computed once."""
    plan = plan_decisions(state, questions, max_orderings=max_orderings)
    return plan.answers(engine.run_shared(plan.prepare(engine)))


def _as_question(qid: object, raw: Question | Mapping[str, Any]) -> Question:
    if not isinstance(qid, str) or not qid:
        raise InvalidQueryError(
            f"a question id must be a non-empty string, got {qid!r}", field="questions"
        )
    try:
        if isinstance(raw, Question):
            # A Struct's constructor checks no constraints: check a built one as its JSON form.
            raw = msgspec.to_builtins(raw)
        question = msgspec.convert(raw, Question)
    except (msgspec.ValidationError, TypeError) as exc:
        # msgspec says "... - at `$.criteria`": name the question's field.
        text = str(exc)
        path = text.rsplit("at `$.", 1)[1].split("`")[0] if "at `$." in text else ""
        field = f"questions.{qid}" + (f".{path.split('[')[0].split('.')[0]}" if path else "")
        raise InvalidQueryError(f"question {qid!r}: {text}", field=field) from None
    if not question.instructions.strip():
        raise InvalidQueryError(
            f"question {qid!r}: the instructions are blank; say what to decide",
            field=f"questions.{qid}.instructions",
        )
    return question


def _choices(qid: str, question: Question) -> list[str]:
    if isinstance(question, NoulQuestion):
        return ["yes", "no"]
    if isinstance(question, ScoreQuestion):
        return [str(i) for i in range(len(question.criteria))]
    if isinstance(question, PairQuestion):
        for name, text in question.candidates.items():
            if not name.strip():
                raise InvalidQueryError(
                    f"question {qid!r}: a candidate's name is empty; name both candidates",
                    field=f"questions.{qid}.candidates",
                )
            if not text.strip():
                raise InvalidQueryError(
                    f"question {qid!r}: candidate {name!r} is blank; give its text",
                    field=f"questions.{qid}.candidates",
                )
        return list(question.candidates)
    names = list(question.criteria)
    for name in names:
        if not name.strip():
            raise InvalidQueryError(
                f"question {qid!r}: an option's name is empty; name every option",
                field=f"questions.{qid}.criteria",
            )
    return names


def _listings(question: Question, max_orderings: int) -> list[list[int]]:
    """The orders in which the question's options are listed: indices into its options."""
    n = 2 if isinstance(question, NoulQuestion | PairQuestion) else len(question.criteria)
    given = list(range(n))
    if question.order == "given" or max_orderings == 1:
        return [given]
    if isinstance(question, ChoiceQuestion):
        # Cyclic shifts, evenly spaced when capped: every option takes several positions.
        count = min(n, max_orderings)
        shifts = sorted({round(i * n / count) % n for i in range(count)})
        return [given[s:] + given[:s] for s in shifts]
    return [given, given[::-1]]  # yes/no and no/yes; a scale up and down; a pair swapped


def _prompt(question: Question, listing: Sequence[int]) -> str:
    """The question as the model reads it, its options listed in ``listing``'s order."""
    lines = [question.instructions.strip()]
    if isinstance(question, NoulQuestion):
        criteria = describe(question.criteria)
        if criteria:
            lines.append(f"Criteria: {criteria}")
        words = [["yes", "no"][i] for i in listing]
        lines.append(f"Answer {words[0]} or {words[1]}.")
    elif isinstance(question, PairQuestion):
        criteria = describe(question.criteria)
        if criteria:
            lines.append(f"Criteria: {criteria}")
        texts = list(question.candidates.values())
        for label, i in zip(PAIR_LABELS, listing, strict=True):
            lines += ["", f"Candidate {label}:", texts[i].strip()]
        lines += ["", f"Answer {PAIR_LABELS[0]} or {PAIR_LABELS[1]}."]
    elif isinstance(question, ChoiceQuestion):
        names = list(question.criteria)
        lines.append("Options:")
        for i in listing:
            text = describe(question.criteria[names[i]])
            lines.append(f"- {names[i]}: {text}" if text else f"- {names[i]}")
        lines.append("Answer with the name of one option.")
    else:
        lines.append("Levels:")
        lines += [f"{i}: {describe(question.criteria[i])}" for i in listing]
        lines.append("Answer with the number of one level.")
    return "\n".join(lines)


def _answer(asked: _Asked, judgments: list[Judgment]) -> Answer:
    """The question's answer: the mean over its listings' judgments."""
    k = len(asked.choices)
    # Each listing's probabilities by the answer's choices (a pair's swapped order reordered).
    by_listing = []
    for judgment, reads in zip(judgments, asked.reads, strict=True):
        row = [0.0] * k
        for position, index in enumerate(reads):
            row[index] = judgment.probs[position]
        by_listing.append(row)
    probs = [sum(row[c] for row in by_listing) / len(by_listing) for c in range(k)]
    spread = max(
        max(row[c] for row in by_listing) - min(row[c] for row in by_listing) for c in range(k)
    )
    first = judgments[0]
    best = max(range(len(probs)), key=probs.__getitem__)
    judgment = msgspec.structs.replace(
        first,
        choices=list(asked.choices),
        choice=asked.choices[best],
        confidence=probs[best],
        probs=probs,
        # log of the mean; a probability that underflowed to 0 stays finite for the gates
        log_probs=[math.log(max(p, 1e-300)) for p in probs],
        choice_mass=sum(j.choice_mass for j in judgments) / len(judgments),
        computed_tokens=sum(j.computed_tokens for j in judgments),
        cached_tokens=sum(j.cached_tokens for j in judgments),
        # One listing: its own hash; several: the hash of theirs, so every listing is pinned.
        tokens_sha256=first.tokens_sha256
        if len(judgments) == 1
        else listings_sha256([j.tokens_sha256 for j in judgments]),
    )
    # What every answer carries besides its own reading of the probabilities.
    shared: dict[str, Any] = {
        "probabilities": dict(zip(asked.choices, probs, strict=True)),
        "judgment": judgment,
        "orderings": len(judgments),
        "order_spread": spread,
    }
    question = asked.question
    if isinstance(question, NoulQuestion):
        return NoulAnswer(noul=probs[0], **shared)
    if isinstance(question, PairQuestion):
        return PairAnswer(winner=asked.choices[best], confidence=probs[best], **shared)
    if isinstance(question, ChoiceQuestion):
        return ChoiceAnswer(choice=asked.choices[best], confidence=probs[best], **shared)
    legend = {str(i): describe(level) for i, level in enumerate(question.criteria)}
    score = sum(i * p for i, p in enumerate(probs))
    return ScoreAnswer(score=score, confidence=probs[best], legend=legend, **shared)
