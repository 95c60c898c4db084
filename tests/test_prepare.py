"""Prepare once, schedule once: ``Judge.prepare`` and ``run``, and the service around them.

On the real default model: a prepared query's ``tokens`` is exactly what its pass computes;
prepare + run is ``judge``; the server prepares each query once (a counting spy) and every
pass it runs stays within its one budget (a spy on the passes). The fake engine drives the
mechanics that need no model (a fit's many examples, a refused engine).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeEngine
from litestar.testing import TestClient
from server import settled
from server import wait_app_ready as wait_ready

import judge.forward
from judge import DuplicateChoiceError, Judge, Prepared, Query
from judge.engine import shared_query
from judge.packing import row_length
from judge.trie import ChoiceTrie
from service import ServiceConfig, create_app

QUERIES = [
    Query(prompt="Is this SMS spam? WIN a free cruise now!", choices=["spam", "ham"]),
    Query(prompt="Rate the review: great food.", choices=[str(i) for i in range(11)]),
    Query(
        prompt="Which continent is Peru in?",
        choices=["South America", "Europe", "Asia"],
        system="Answer briefly.",
        response_prefix="Answer: ",
        response_suffix="\n",
    ),
    Query(prompt="Polite?", choices=["yes", "no"], feature_layers=(1, 30)),
]
CONTEXT = "The Amazon flows through Peru, Colombia and Brazil. " * 3
QUESTIONS: list[dict[str, Any]] = [
    {"prompt": "Does it flow through Peru?", "choices": ["yes", "no"]},
    {"prompt": "How many countries are named?", "choices": ["1", "2", "3"]},
    {"prompt": "Is it a desert?", "choices": ["yes", "no"]},
]


def fresh(judge: Judge, **options: Any) -> Judge:
    """The session model under a new engine: its own (empty) prefix cache and budgets."""
    return Judge(judge.model, judge.tokenizer, model_id=judge.model_id, **options)


# --- the engine ------------------------------------------------------------------------------


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: q.prompt[:12])
def test_prepared_tokens_are_what_a_cold_pass_computes(judge: Judge, query: Query) -> None:
    for engine in (fresh(judge, prefix_cache_mb=0), fresh(judge)):  # no cache; an empty one
        prepared = engine.prepare(query)
        (result,) = engine.run([prepared])
        assert result.cached_tokens == 0
        assert result.computed_tokens == prepared.tokens == prepared.trie.packed_length
        assert result.prompt == prepared.prompt and result.prompt_tokens == prepared.prompt_tokens
        assert prepared.feature_layers == tuple(sorted(query.feature_layers))
    # Warm, what the cache holds of its prompt is read, not computed: the same total.
    (again,) = engine.run([prepared])
    assert again.cached_tokens + again.computed_tokens == prepared.tokens


def test_prepare_then_run_is_judge(judge: Judge) -> None:
    engine = fresh(judge, prefix_cache_mb=0)
    prepared = [engine.prepare(q) for q in QUERIES]
    for got, q in zip(engine.run(prepared), QUERIES, strict=True):
        want = judge.judge(
            q.prompt,
            q.choices,
            system=q.system,
            response_prefix=q.response_prefix,
            response_suffix=q.response_suffix,
        )
        assert got.prompt == want.prompt
        for c in q.choices:
            assert got.probabilities[c] == pytest.approx(want.probabilities[c], abs=1e-4)
    # The shared-context form: the same questions as judge_shared, from prepared queries.
    questions = [shared_query(CONTEXT, Query(**q)) for q in QUESTIONS]
    shared = engine.run_shared([engine.prepare(q) for q in questions])
    for got, want in zip(shared, judge.judge_shared(CONTEXT, QUESTIONS), strict=True):
        assert got.prompt == want.prompt
        assert got.probabilities == pytest.approx(want.probabilities, abs=1e-4)


def test_prepare_refuses_before_any_model_work(judge: Judge) -> None:
    with pytest.raises(DuplicateChoiceError):
        judge.prepare({"prompt": "x", "choices": ["a", "a"]})
    prepared = judge.prepare({"prompt": "x", "choices": ["a", "b"]})
    assert isinstance(prepared, Prepared) and prepared.choices == ["a", "b"]


# --- the service -----------------------------------------------------------------------------


class Spy:
    """Counts each prepared prompt, and every other way in to tokenizing a query."""

    def __init__(self, engine: Judge | FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.prepared: Counter[str] = Counter()
        self.counted = 0
        prepare, count = engine.prepare, engine.count_tokens

        def counting_prepare(query: Any) -> Prepared:
            result = prepare(query)
            self.prepared[result.prompt] += 1
            return result

        def counting_count(query: Any) -> Any:
            self.counted += 1
            return count(query)

        monkeypatch.setattr(engine, "prepare", counting_prepare)
        monkeypatch.setattr(engine, "count_tokens", counting_count)


def test_the_service_prepares_each_query_once(
    judge: Judge, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = fresh(judge)
    app = create_app(engine, config=ServiceConfig(profiles_dir=tmp_path))
    with TestClient(app=app) as c:
        wait_ready(c)
        spy = Spy(engine, monkeypatch)  # after the warm-up, which judges once
        r = c.post("/judge", json={"prompt": "Is this spam? WIN now", "choices": ["spam", "ham"]})
        assert r.status_code == 200
        assert list(spy.prepared.values()) == [1]
        spy.prepared.clear()
        items = [{"prompt": f"Item {i}: spam?", "choices": ["spam", "ham"]} for i in range(3)] + [
            {"prompt": "bad", "choices": ["a", "a"]}
        ]
        r = c.post("/judge/batch", json={"items": items})
        results = r.json()["results"]
        assert r.status_code == 200 and results[-1]["field"] == "choices"
        assert sorted(spy.prepared.values()) == [1, 1, 1]  # the bad item: refused in prepare
        spy.prepared.clear()
        r = c.post("/judge/batch", json={"context": CONTEXT, "questions": QUESTIONS})
        assert r.status_code == 200 and len(r.json()["results"]) == 3
        assert sorted(spy.prepared.values()) == [1, 1, 1]
        assert all(CONTEXT in p for p in spy.prepared)  # each question with its context
        assert spy.counted == 0  # field attribution only on the way to a 413


def test_a_fit_prepares_each_example_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine()
    spy = Spy(engine, monkeypatch)
    examples = [{"prompt": f"message {i}", "label": ["spam", "ham"][i % 2]} for i in range(30)]
    app = create_app(engine, config=ServiceConfig(profiles_dir=tmp_path))
    with TestClient(app=app) as c:
        wait_ready(c)
        before = sum(spy.prepared.values())  # the warm-up judges through judge(), not prepare
        fit = {"choices": ["spam", "ham"], "examples": examples, "method": "temperature"}
        c.post("/profiles/sms/fit", json=fit)  # uniform fake scores: fitted or refused, either way
        assert sum(spy.prepared.values()) - before == 30
        assert all(spy.prepared[f"message {i}"] == 1 for i in range(30))


def record_passes(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Every forward pass's row lengths (each row's packed tokens), as the engine runs them."""
    passes: list[list[int]] = []
    score_rows = judge.forward.score_rows

    def spy(model: Any, rows: Sequence[Sequence[ChoiceTrie]], *args: Any, **kw: Any) -> Any:
        passes.append([row_length(r) for r in rows])
        return score_rows(model, rows, *args, **kw)

    monkeypatch.setattr(judge.forward, "score_rows", spy)
    return passes


def test_one_budget_bounds_every_pass(
    judge: Judge, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = 160
    engine = fresh(judge, max_batch_tokens=budget)
    config = ServiceConfig(profiles_dir=tmp_path, max_batch_tokens=budget, max_request_tokens=120)
    passes = record_passes(monkeypatch)
    app = create_app(engine, config=config)
    with TestClient(app=app) as c:
        wait_ready(c)
        passes.clear()
        items = [
            {"prompt": f"Item {i}: is it spam?", "choices": ["spam", "ham"]} for i in range(12)
        ]
        r = c.post("/judge/batch", json={"items": items})
        assert r.status_code == 200 and all(x["type"] == "judgment" for x in r.json()["results"])
        assert max(len(p) for p in passes) > 1  # coalesced, and still within the budget
        questions = [
            {"prompt": f"Question {i}: does it flow through Peru?", "choices": ["yes", "no"]}
            for i in range(8)
        ]
        r = c.post("/judge/batch", json={"context": CONTEXT, "questions": questions})
        assert r.status_code == 200
        for p in passes:
            assert len(p) == 1 or len(p) * max(p) <= budget, passes
            assert max(p) <= budget or len(p) == 1
        # Over the request budget: a 413 whose count is the prepared query's exact size.
        long: dict[str, Any] = {"prompt": "word " * 150, "choices": ["a", "b"]}
        r = c.post("/judge", json=long)
        exact = engine.prepare(Query(**long)).tokens
        assert r.status_code == 413 and r.json()["field"] == "prompt"
        assert f"is {exact} tokens" in r.json()["detail"]


def test_the_service_refuses_an_engine_with_another_budget(tmp_path: Path) -> None:
    engine = FakeEngine()
    engine.max_batch_tokens = 8192
    app = create_app(engine, config=ServiceConfig(profiles_dir=tmp_path, max_batch_tokens=4096))
    with TestClient(app=app) as c:
        r = settled(c)
        assert r.status_code == 503 and r.json()["status"] == "failed"
        assert "max_batch_tokens=4096" in r.json()["detail"]
