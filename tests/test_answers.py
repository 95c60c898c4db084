"""Typed decisions over one state (``judge.answers``): listings, averaging, checks, the model.

The mechanics (which listings are judged, that the answer is their mean) run on a fake engine
whose probabilities depend on where each option is listed; the real model then shows that a
decision is exactly the judgments of its prompts, with the state computed once.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import pytest
from fakes import FakeEngine, judgment_of

from judge import (
    InvalidQueryError,
    Judge,
    Judgment,
    Prepared,
    PromptTooLongError,
    Query,
    TooManyChoicesError,
    forward,
)
from judge.answers import (
    MAX_LEVELS,
    MAX_OPTIONS,
    MAX_ORDERINGS,
    ChoiceAnswer,
    ChoiceQuestion,
    NoulAnswer,
    NoulQuestion,
    ScoreAnswer,
    ScoreQuestion,
    decide,
    describe,
    plan_decisions,
    render_state,
)
from judge.identity import listings_sha256
from judge.packing import row_length
from judge.trie import common_prefix_length

# --- a fake whose probabilities depend on the listing ------------------------------------------

# The weight of the option listed at each place (first, second, ...) and each option's own.
PLACE = [8.0, 5.0, 3.0, 2.0, 1.5, 1.25, 1.0]
OWN = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 5.0, "e": 7.0, "f": 11.0, "g": 13.0}
OWN.update({"yes": 3.0, "no": 1.0, "0": 1.0, "1": 2.0, "2": 4.0, "3": 3.0})


def listed(prompt: str) -> list[str]:
    """The choices in the order the question's prompt lists them (what the model reads)."""
    lines = prompt.splitlines()
    last = lines[-1]
    if last.startswith("Answer ") and " or " in last and "one" not in last:  # yes/no
        return last.removeprefix("Answer ").removesuffix(".").split(" or ")
    head = max(i for i, line in enumerate(lines) if line in ("Options:", "Levels:"))
    items = lines[head + 1 : -1]
    if lines[head] == "Options:":
        return [line.removeprefix("- ").split(":")[0] for line in items]
    return [line.split(":")[0] for line in items]


def by_place(order: Sequence[str]) -> dict[str, float]:
    """The fake model's probabilities for a listing: own weight times the place's weight."""
    weights = {c: OWN[c] * PLACE[i] for i, c in enumerate(order)}
    total = sum(weights.values())
    return {c: w / total for c, w in weights.items()}


class ListingEngine(FakeEngine):
    """Judges a query by the order its prompt lists the options; records every query run."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.shared_calls: list[int] = []

    def judgment(self, query: Query) -> Judgment:
        self.prompts.append(query.prompt)
        probs = by_place(listed(query.prompt))
        return judgment_of({c: probs[c] for c in query.choices}, prompt=query.prompt)

    def run_shared(self, prepared: Sequence[Prepared]) -> list[Judgment]:
        self.shared_calls.append(len(prepared))
        return super().run_shared(prepared)


def expected(
    listings: Sequence[Sequence[str]], choices: Sequence[str]
) -> tuple[list[float], float]:
    """The mean over ``listings`` of each choice's probability, and the largest spread."""
    each = [by_place(order) for order in listings]
    mean = [sum(p[c] for p in each) / len(each) for c in choices]
    spread = max(max(p[c] for p in each) - min(p[c] for p in each) for c in choices)
    return mean, spread


def shifts(names: Sequence[str], starts: Sequence[int]) -> list[tuple[str, ...]]:
    return [tuple(names[s:]) + tuple(names[:s]) for s in starts]


def ran(engine: ListingEngine) -> Counter[tuple[str, ...]]:
    return Counter(tuple(listed(p)) for p in engine.prompts)


STATE = {"ticket": "My card was charged twice for one order.", "customer": "Ana"}


def test_given_order_judges_one_listing() -> None:
    engine = ListingEngine()
    names = list("abcde")
    question = ChoiceQuestion(instructions="Which?", criteria=dict.fromkeys(names))
    answer = decide(engine, STATE, {"q": question})["q"]
    assert ran(engine) == Counter({tuple(names): 1})
    assert isinstance(answer, ChoiceAnswer)
    assert (answer.orderings, answer.order_spread) == (1, 0.0)
    assert answer.probabilities == pytest.approx(by_place(names), rel=1e-12)
    assert answer.choice == "e" and answer.confidence == max(by_place(names).values())


def test_choice_is_the_mean_over_every_cyclic_shift() -> None:
    engine = ListingEngine()
    names = list("abcde")
    criteria: dict[str, Any] = {n: f"option {n}" for n in names}
    question = ChoiceQuestion(instructions="Which?", criteria=criteria, order="invariant")
    answer = decide(engine, STATE, {"q": question})["q"]
    listings = shifts(names, range(5))
    assert ran(engine) == Counter(dict.fromkeys(listings, 1))  # each shift once, no other
    assert engine.shared_calls == [5]  # one run, every listing in it
    mean, spread = expected(listings, names)
    assert isinstance(answer, ChoiceAnswer)
    assert answer.orderings == 5
    assert list(answer.probabilities) == names  # the given order, whatever the listing
    assert list(answer.probabilities.values()) == pytest.approx(mean, rel=1e-12)
    assert answer.order_spread == pytest.approx(spread, rel=1e-12)
    best = max(names, key=answer.probabilities.__getitem__)
    assert (answer.choice, answer.confidence) == (best, answer.probabilities[best])
    # The judgment a policy gates on carries the same mean.
    j = answer.judgment
    assert j.choices == names and j.probs == list(answer.probabilities.values())
    assert j.log_probs == pytest.approx([math.log(p) for p in mean], rel=1e-12)
    assert (j.choice, j.confidence) == (answer.choice, answer.confidence)
    assert j.computed_tokens == 5  # the fake's 1 per listing, summed


def test_the_cap_takes_evenly_spaced_shifts() -> None:
    engine = ListingEngine()
    names = list("abcdefg")
    question = ChoiceQuestion(
        instructions="Which?", criteria=dict.fromkeys(names), order="invariant"
    )
    answer = decide(engine, STATE, {"q": question}, max_orderings=3)["q"]
    # 7 options, 3 listings: shifts 0, 7/3 and 14/3 rounded; gaps of 2, 3 and 2 places.
    listings = shifts(names, [0, 2, 5])
    assert ran(engine) == Counter(dict.fromkeys(listings, 1))
    mean, spread = expected(listings, names)
    assert answer.orderings == 3
    assert list(answer.probabilities.values()) == pytest.approx(mean, rel=1e-12)
    assert answer.order_spread == pytest.approx(spread, rel=1e-12)


def test_the_default_cap_is_five_listings() -> None:
    engine = ListingEngine()
    names = list("abcdefg")
    question = ChoiceQuestion(
        instructions="Which?", criteria=dict.fromkeys(names), order="invariant"
    )
    answer = decide(engine, STATE, {"q": question})["q"]
    assert MAX_ORDERINGS == 5 and answer.orderings == 5
    assert ran(engine) == Counter(dict.fromkeys(shifts(names, [0, 1, 3, 4, 6]), 1))


def test_fewer_options_than_the_cap_take_every_shift() -> None:
    engine = ListingEngine()
    question = ChoiceQuestion(
        instructions="Which?", criteria=dict.fromkeys("abc"), order="invariant"
    )
    assert decide(engine, STATE, {"q": question})["q"].orderings == 3
    assert ran(engine) == Counter(dict.fromkeys(shifts("abc", range(3)), 1))


def test_noul_is_the_mean_of_yes_no_and_no_yes() -> None:
    engine = ListingEngine()
    question = NoulQuestion(instructions="Is it a billing issue?", order="invariant")
    answer = decide(engine, STATE, {"q": question})["q"]
    listings = [("yes", "no"), ("no", "yes")]
    assert ran(engine) == Counter(dict.fromkeys(listings, 1))
    mean, spread = expected(listings, ["yes", "no"])
    assert isinstance(answer, NoulAnswer)
    assert answer.orderings == 2
    assert answer.noul == pytest.approx(mean[0], rel=1e-12)
    assert answer.probabilities == pytest.approx({"yes": mean[0], "no": mean[1]}, rel=1e-12)
    assert answer.order_spread == pytest.approx(spread, rel=1e-12)
    # Given order: yes first, one listing.
    given = decide(ListingEngine(), STATE, {"q": NoulQuestion(instructions="Billing?")})["q"]
    assert isinstance(given, NoulAnswer)
    assert given.noul == pytest.approx(by_place(["yes", "no"])["yes"], rel=1e-12)


def test_score_is_the_mean_of_the_scale_up_and_down() -> None:
    engine = ListingEngine()
    levels: list[Any] = ["none", "some", "much", "all"]
    question = ScoreQuestion(instructions="How urgent?", criteria=levels, order="invariant")
    answer = decide(engine, STATE, {"q": question})["q"]
    listings = [("0", "1", "2", "3"), ("3", "2", "1", "0")]
    assert ran(engine) == Counter(dict.fromkeys(listings, 1))
    mean, spread = expected(listings, ["0", "1", "2", "3"])
    assert isinstance(answer, ScoreAnswer)
    assert answer.orderings == 2
    assert list(answer.probabilities.values()) == pytest.approx(mean, rel=1e-12)
    assert answer.score == pytest.approx(sum(i * p for i, p in enumerate(mean)), rel=1e-12)
    assert answer.confidence == pytest.approx(max(mean), rel=1e-12)
    assert answer.order_spread == pytest.approx(spread, rel=1e-12)
    assert answer.legend == {"0": "none", "1": "some", "2": "much", "3": "all"}
    # Each level keeps its number in either direction: the reversed listing reads "3: all".
    down = next(p for p in engine.prompts if listed(p)[0] == "3")
    assert "\n3: all\n2: much\n1: some\n0: none\n" in down


def test_one_run_holds_every_question_and_listing() -> None:
    engine = ListingEngine()
    questions: dict[str, Any] = {
        "billing": {"type": "noul", "instructions": "Billing?", "order": "invariant"},
        "team": {"type": "choice", "instructions": "Team?", "criteria": {"a": None, "b": "x"}},
        "urgency": {"type": "score", "instructions": "Urgency?", "criteria": ["lo", "mid", "hi"]},
        "who": {
            "type": "choice",
            "instructions": "Who?",
            "criteria": dict.fromkeys("abcd"),
            "order": "invariant",
        },
    }
    answers = decide(engine, STATE, questions)
    assert engine.shared_calls == [2 + 1 + 1 + 4]
    assert list(answers) == list(questions)
    assert [a.orderings for a in answers.values()] == [2, 1, 1, 4]
    plan = plan_decisions(STATE, questions)
    assert [plan.question_of(i) for i in range(8)] == ["billing"] * 2 + ["team", "urgency"] + [
        "who"
    ] * 4
    # Every query is the state, a blank line, then its question: the head run_shared shares.
    assert all(q.prompt.startswith(plan.context + "\n\n") for q in plan.queries)
    assert msgspec.json.decode(msgspec.json.encode(answers["who"]), type=ChoiceAnswer)
    with pytest.raises(ValueError, match="3 judgments for 8 queries"):
        plan.answers([judgment_of({"a": 0.5, "b": 0.5})] * 3)


def test_the_prompt_lists_descriptions_and_criteria() -> None:
    plan = plan_decisions(
        "S",
        {
            "c": ChoiceQuestion(
                instructions="  Which team?  ",
                criteria={
                    "billing": {"what": "money", "examples": ["refund", "charge"]},
                    "other": None,
                },
            ),
            "n": NoulQuestion(instructions="Spam?", criteria="unsolicited ads"),
        },
    )
    assert plan.queries[0].prompt == (
        "S\n\nWhich team?\nOptions:\n- billing: money | examples: refund; charge\n- other\n"
        "Answer with the name of one option."
    )
    assert plan.queries[0].choices == ["billing", "other"]
    assert plan.queries[1].prompt == "S\n\nSpam?\nCriteria: unsolicited ads\nAnswer yes or no."
    assert plan.queries[1].choices == ["yes", "no"]


def test_describe() -> None:
    assert describe(None) == ""
    assert describe("  text ") == "text"
    assert describe({"what": "a", "must_have": ["x", "y"], "n": 3}) == "a | must have: x; y | n: 3"


# --- rendering the state ----------------------------------------------------------------------


def test_a_string_state_is_read_as_it_is() -> None:
    text = '  {"not": "parsed"}\nline two  '
    assert render_state(text) == text
    plan = plan_decisions(text, {"q": NoulQuestion(instructions="Ok?")})
    assert plan.context == text and plan.queries[0].prompt.startswith(text + "\n\n")


@pytest.mark.parametrize("state", [STATE, ["a", {"b": 1.5}], 42, None, {"café": "é"}])
def test_any_other_state_is_indented_json(state: object) -> None:
    rendered = render_state(state)
    assert rendered == json.dumps(state, indent=2, ensure_ascii=False)
    assert json.loads(rendered) == state


# --- checks -------------------------------------------------------------------------------------


def _circular() -> dict[str, Any]:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    return loop


@pytest.mark.parametrize(
    "state",
    [object(), {1, 2}, float("nan"), {"x": float("inf")}, {(1, 2): "tuple key"}, _circular()],
)
def test_a_state_that_is_not_json_is_refused(state: object) -> None:
    with pytest.raises(InvalidQueryError, match="state is not JSON") as exc:
        plan_decisions(state, {"q": NoulQuestion(instructions="Ok?")})
    assert exc.value.field == "state"


def _choice(criteria: object, **fields: object) -> dict[str, object]:
    return {"type": "choice", "instructions": "Which?", "criteria": criteria, **fields}


def _score(levels: int) -> dict[str, object]:
    return {
        "type": "score",
        "instructions": "How much?",
        "criteria": [f"l{i}" for i in range(levels)],
    }


BAD: dict[str, tuple[Any, str]] = {
    "one option": (_choice({"a": None}), "criteria"),
    "256 options": (_choice({f"o{i}": None for i in range(MAX_OPTIONS + 1)}), "criteria"),
    "no options": (_choice({}), "criteria"),
    "options as a list": (_choice(["a", "b"]), "criteria"),
    "11 levels": (_score(MAX_LEVELS + 1), "criteria"),
    "1 level": (_score(1), "criteria"),
    "empty option name": (_choice({"a": None, "": "nameless"}), "criteria"),
    "blank option name": (_choice({"a": None, "  ": "nameless"}), "criteria"),
    "empty instructions": ({"type": "noul", "instructions": ""}, "instructions"),
    "blank instructions": ({"type": "noul", "instructions": " \n "}, "instructions"),
    "no instructions": ({"type": "noul"}, ""),
    "unknown type": ({"type": "ranking", "instructions": "Rank?"}, "type"),
    "no type": ({"instructions": "Rank?"}, ""),
    "unknown order": ({"type": "noul", "instructions": "Ok?", "order": "random"}, "order"),
    "criterion of a bad type": ({"type": "noul", "instructions": "Ok?", "criteria": 5}, "criteria"),
    "not an object": ("Is it spam?", ""),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_question_names_its_field(name: str) -> None:
    raw, field = BAD[name]
    with pytest.raises(InvalidQueryError, match="question 'q7'") as exc:
        plan_decisions(STATE, {"ok": {"type": "noul", "instructions": "Ok?"}, "q7": raw})
    assert exc.value.field == "questions.q7" + (f".{field}" if field else "")


@pytest.mark.parametrize(
    ("question", "field"),
    [
        (ChoiceQuestion(instructions="Which?", criteria={"a": None}), "criteria"),
        (ChoiceQuestion(instructions="Which?", criteria={"a": None, " ": None}), "criteria"),
        (ScoreQuestion(instructions="How?", criteria=[None] * (MAX_LEVELS + 1)), "criteria"),
        (NoulQuestion(instructions=""), "instructions"),
        (ChoiceQuestion(instructions="Which?", criteria={"a": {"what": object()}, "b": None}), ""),
    ],
)
def test_a_built_question_is_checked_as_its_json_form_is(question: Any, field: str) -> None:
    # A Struct's constructor checks no constraints; the plan does.
    with pytest.raises(InvalidQueryError) as exc:
        plan_decisions(STATE, {"q": question})
    assert exc.value.field == "questions.q" + (f".{field}" if field else "")


@pytest.mark.parametrize("questions", [{}, [], None, "q"])
def test_no_questions_is_refused(questions: Any) -> None:
    with pytest.raises(InvalidQueryError, match="at least one question") as exc:
        plan_decisions(STATE, questions)
    assert exc.value.field == "questions"


def test_a_question_id_must_be_a_non_empty_string() -> None:
    with pytest.raises(InvalidQueryError, match="non-empty string") as exc:
        plan_decisions(STATE, {"": NoulQuestion(instructions="Ok?")})
    assert exc.value.field == "questions"


def test_max_orderings_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_orderings must be >= 1"):
        plan_decisions(STATE, {"q": NoulQuestion(instructions="Ok?")}, max_orderings=0)
    one = plan_decisions(
        STATE, {"q": NoulQuestion(instructions="Ok?", order="invariant")}, max_orderings=1
    )
    assert len(one.queries) == 1


class TwoChoices(FakeEngine):
    def prepare(self, query: Query | Mapping[str, Any]) -> Prepared:
        raise TooManyChoicesError("no more than one", field="choices")


def test_an_engine_error_names_the_question() -> None:
    class Refusing(FakeEngine):
        def prepare(self, query: Query | Mapping[str, Any]) -> Prepared:
            if "Second?" in str(getattr(query, "prompt", "")):
                raise PromptTooLongError("too long", field="prompt")
            return super().prepare(query)

    questions = {
        "a": NoulQuestion(instructions="First?"),
        "b": NoulQuestion(instructions="Second?"),
    }
    with pytest.raises(PromptTooLongError) as exc:
        decide(Refusing(), STATE, questions)
    assert exc.value.field == "questions.b.prompt"
    # The engine's choices are the question's criteria.
    clash = {"a": ChoiceQuestion(instructions="Which?", criteria={"x": None, "y": None})}
    with pytest.raises(TooManyChoicesError) as many:
        decide(TwoChoices(), STATE, clash)
    assert many.value.field == "questions.a.criteria"


# --- the real model ---------------------------------------------------------------------------

TICKET = {
    "subject": "Charged twice",
    "body": "Hello, my card was charged twice for order 4417 yesterday. Please refund one.",
    "customer": {"name": "Ana", "plan": "pro"},
}
QUESTIONS: dict[str, Any] = {
    "billing": NoulQuestion(instructions="Is this ticket about billing?"),
    "team": ChoiceQuestion(
        instructions="Which team should handle this ticket?",
        criteria={"payments": "charges and refunds", "shipping": None, "accounts": "logins"},
    ),
    "urgency": ScoreQuestion(
        instructions="How urgent is this ticket?", criteria=["not urgent", "soon", "today", "now"]
    ),
}


@pytest.fixture(scope="module")
def cold(judge: Judge) -> Judge:
    """The session's model with the prefix cache off: every call computes its state anew."""
    return Judge(judge.model, judge.tokenizer, model_id=judge.model_id, prefix_cache_mb=0)


@pytest.mark.slow
def test_a_decision_is_the_judgments_of_its_prompts(judge: Judge, cold: Judge) -> None:
    answers = decide(cold, TICKET, QUESTIONS)
    plan = plan_decisions(TICKET, QUESTIONS)
    context = render_state(TICKET)
    own = [
        Query(prompt=q.prompt.removeprefix(context + "\n\n"), choices=q.choices)
        for q in plan.queries
    ]
    shared = cold.judge_shared(context, own)
    alone = [judge.judge(q.prompt, q.choices) for q in plan.queries]
    for a, s, one in zip(answers.values(), shared, alone, strict=True):
        assert a.judgment.prompt == s.prompt == one.prompt
        # The same queries in the same row: the same numbers. Alone, in a row of its own, a
        # query's sums run in another order: float32 rounding, a few 1e-6 at most.
        assert a.judgment.probs == pytest.approx(s.probs, abs=1e-6)
        assert a.judgment.probs == pytest.approx(one.probs, abs=1e-5)
        assert a.judgment.choice_mass == pytest.approx(s.choice_mass, rel=1e-6)
    billing, team, urgency = answers.values()
    assert isinstance(billing, NoulAnswer) and billing.noul == pytest.approx(
        alone[0].probs[0], abs=1e-5
    )
    assert isinstance(team, ChoiceAnswer) and team.choice == alone[1].choice
    assert isinstance(urgency, ScoreAnswer)
    assert urgency.score == pytest.approx(
        sum(i * p for i, p in enumerate(alone[2].probs)), abs=1e-5
    )


@pytest.mark.slow
def test_the_state_is_computed_once(cold: Judge, monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[int] = []
    rows: list[list[list[Any]]] = []
    run_shared, score_rows = cold.run_shared, forward.score_rows

    def spy_run(prepared: Sequence[Prepared]) -> list[Judgment]:
        runs.append(len(prepared))
        return run_shared(prepared)

    def spy_rows(model: Any, batch: list[list[Any]], *args: Any, **kwargs: Any) -> Any:
        rows.append(batch)
        return score_rows(model, batch, *args, **kwargs)

    monkeypatch.setattr(cold, "run_shared", spy_run)
    monkeypatch.setattr(forward, "score_rows", spy_rows)
    questions = {**QUESTIONS, "who": ChoiceQuestion(
        instructions="Who wrote it?", criteria=dict.fromkeys(["Ana", "Bo", "Cy"]), order="invariant"
    )}  # fmt: skip
    answers = decide(cold, TICKET, questions)
    assert runs == [1 + 1 + 1 + 3]  # one run with every listing of every question
    assert len(rows) == 1 and len(rows[0]) == 1  # one pass, one row
    tries = rows[0][0]
    assert len(tries) == 6
    # The row feeds the shared head once, and that head holds the whole state.
    shared = min(common_prefix_length(tries[0].context, t.context) for t in tries)
    head = cold.tokenizer.decode(tries[0].context[:shared])
    assert render_state(TICKET) in head
    assert row_length(tries) == sum(t.packed_length for t in tries) - 5 * shared
    # Each judgment counts its own listing's tokens, the state included (nothing was cached).
    for a in answers.values():
        assert a.judgment.cached_tokens == 0
    assert sum(a.judgment.computed_tokens for a in answers.values()) == sum(
        t.packed_length for t in tries
    )


@pytest.mark.slow
def test_order_invariant_is_the_mean_of_its_listings(cold: Judge) -> None:
    names = ["payments", "shipping", "accounts", "security"]
    criteria: dict[str, Any] = dict.fromkeys(names)
    invariant = ChoiceQuestion(instructions="Which team?", criteria=criteria, order="invariant")
    # Each cyclic shift asked in the given order: the same prompt as that listing's.
    rotated = {
        f"s{s}": ChoiceQuestion(
            instructions="Which team?", criteria=dict.fromkeys(names[s:] + names[:s])
        )
        for s in range(4)
    }
    answers = decide(cold, TICKET, {"inv": invariant, **rotated})
    inv = answers.pop("inv")
    assert isinstance(inv, ChoiceAnswer) and inv.orderings == 4
    plan = plan_decisions(TICKET, {"inv": invariant, **rotated})
    assert [q.prompt for q in plan.queries[:4]] == [q.prompt for q in plan.queries[4:]]
    # Each shift's choices are rotated too, so its trie (and float32 rounding) differs: 1e-5.
    for n in names:
        each = [a.probabilities[n] for a in answers.values()]
        assert inv.probabilities[n] == pytest.approx(sum(each) / 4, abs=1e-5)
    spread = max(
        max(a.probabilities[n] for a in answers.values())
        - min(a.probabilities[n] for a in answers.values())
        for n in names
    )
    assert inv.order_spread == pytest.approx(spread, abs=1e-5)
    assert sum(inv.probabilities.values()) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.slow
def test_noul_and_score_invariant_on_the_model(cold: Judge) -> None:
    # The reversed listings written out by hand, judged in the given order by judge_shared.
    context = render_state(TICKET)
    levels: list[Any] = ["not urgent", "soon", "today", "now"]
    answers = decide(
        cold,
        TICKET,
        {
            "billing": NoulQuestion(
                instructions="Is this ticket about billing?", order="invariant"
            ),
            "urgency": ScoreQuestion(
                instructions="How urgent?", criteria=levels, order="invariant"
            ),
        },
    )
    up = "How urgent?\nLevels:\n" + "".join(f"{i}: {t}\n" for i, t in enumerate(levels))
    down = "How urgent?\nLevels:\n" + "".join(f"{i}: {levels[i]}\n" for i in (3, 2, 1, 0))
    ask = "Answer with the number of one level."
    yes_no, no_yes, s_up, s_down = cold.judge_shared(
        context,
        [
            Query(prompt="Is this ticket about billing?\nAnswer yes or no.", choices=["yes", "no"]),
            Query(prompt="Is this ticket about billing?\nAnswer no or yes.", choices=["yes", "no"]),
            Query(prompt=up + ask, choices=["0", "1", "2", "3"]),
            Query(prompt=down + ask, choices=["0", "1", "2", "3"]),
        ],
    )
    billing, urgency = answers["billing"], answers["urgency"]
    assert isinstance(billing, NoulAnswer) and billing.orderings == 2
    assert billing.noul == pytest.approx((yes_no.probs[0] + no_yes.probs[0]) / 2, abs=1e-6)
    assert billing.order_spread == pytest.approx(abs(yes_no.probs[0] - no_yes.probs[0]), abs=1e-6)
    assert isinstance(urgency, ScoreAnswer) and urgency.orderings == 2
    mean = [(a + b) / 2 for a, b in zip(s_up.probs, s_down.probs, strict=True)]
    assert list(urgency.probabilities.values()) == pytest.approx(mean, abs=1e-6)
    assert urgency.score == pytest.approx(sum(i * p for i, p in enumerate(mean)), abs=1e-5)


def test_an_answer_s_tokens_hash_pins_every_listing(judge: Judge) -> None:
    """On the real model: one listing keeps its own tokens_sha256; an answer over several
    listings carries the sha256 of their hashes in listing order, so each listing is pinned."""
    questions = {
        "many": NoulQuestion(instructions="Is it a billing issue?", order="invariant"),
        "one": NoulQuestion(instructions="Is the customer angry?"),
    }
    plan = plan_decisions(STATE, questions)
    judgments = judge.run_shared(plan.prepare(judge))
    answers = plan.answers(judgments)
    many = [j.tokens_sha256 for j in judgments[:2]]
    assert answers["many"].judgment.tokens_sha256 == listings_sha256(many)
    assert listings_sha256(many) not in many and listings_sha256(many[::-1]) != listings_sha256(
        many
    )
    assert answers["one"].judgment.tokens_sha256 == judgments[2].tokens_sha256
