"""Pairs (``judge.answers.PairQuestion``): two candidates judged in both orders in one run, the
mean over the orders, and the position-consistency gate (``position_inconsistent``).

The mechanics run on a fake that prefers whichever candidate it reads in place A, as a small
model may; the real model shows that both orders are the two given orders judged alike, in one
row that holds the state once; then the routes that answer typed questions (``POST
/v1/systemone``, ``judge decide``) answer a pair.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from fakes import FakeEngine, judgment_of
from litestar.testing import TestClient
from server import wait_app_ready

from calibration import (
    CalibrationProfile,
    FitSettings,
    Gate,
    LabeledScores,
    Overrides,
    Provenance,
    fit_profile,
    make_policy,
)
from judge import InvalidQueryError, Judge, Judgment, Query
from judge.answers import PairAnswer, PairQuestion, decide, plan_decisions
from judge.packing import pack_rows, row_length
from service import ServiceConfig, create_app
from service.cli.main import main

# Each text's own weight; the fake multiplies the one read in place A by PLACE_A.
OWN = {"right": 3.0, "wrong": 1.0}
PLACE_A = 3.0
STATE = "Question: what is the capital of France?"
INSTRUCTIONS = "Which answer is right?"


def read(prompt: str) -> tuple[str, str]:
    """The texts a pair's prompt reads in place A and in place B."""
    a = prompt.split("Candidate A:\n", 1)[1].split("\n\nCandidate B:", 1)[0]
    b = prompt.split("Candidate B:\n", 1)[1].split("\n\nAnswer", 1)[0]
    return a, b


class PlaceBiased(FakeEngine):
    """P(A) in proportion to OWN[text read as A] * PLACE_A, P(B) to OWN[text read as B]."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    def judgment(self, query: Query) -> Judgment:
        if "Candidate A:" not in query.prompt:  # the server's warm-up
            return super().judgment(query)
        self.prompts.append(query.prompt)
        a, b = read(query.prompt)
        wa, wb = OWN[a] * PLACE_A, OWN[b]
        return judgment_of({"A": wa / (wa + wb), "B": wb / (wa + wb)}, prompt=query.prompt)


def pair(candidates: dict[str, str], **fields: Any) -> PairQuestion:
    return PairQuestion(instructions=INSTRUCTIONS, candidates=candidates, **fields)


def answered(engine: Any, question: Any) -> PairAnswer:
    """The answer to one pair question about STATE."""
    answer = decide(engine, STATE, {"p": question})["p"]
    assert isinstance(answer, PairAnswer)
    return answer


# Read first, "right" gets 9/10; read second, 3/6. The mean is 0.7, the spread 0.4.
BOTH = {"x": 0.7, "y": 0.3}


def test_a_pair_is_read_in_both_orders_and_averaged() -> None:
    engine = PlaceBiased()
    answer = answered(engine, pair({"x": "right", "y": "wrong"}))
    assert [read(p) for p in engine.prompts] == [("right", "wrong"), ("wrong", "right")]
    assert answer.probabilities == pytest.approx(BOTH, abs=1e-12)
    assert (answer.winner, answer.confidence) == ("x", pytest.approx(0.7))
    assert (answer.orderings, answer.order_spread) == (2, pytest.approx(0.4))
    # What the gate decides on is by candidate name, not by the labels the model read.
    assert answer.judgment.choices == ["x", "y"] and answer.judgment.choice == "x"
    assert answer.judgment.probs == pytest.approx([0.7, 0.3])


def test_given_order_reads_the_pair_once() -> None:
    engine = PlaceBiased()
    answer = decide(engine, STATE, {"p": pair({"x": "wrong", "y": "right"}, order="given")})["p"]
    assert [read(p) for p in engine.prompts] == [("wrong", "right")]
    assert answer.probabilities == pytest.approx({"x": 0.5, "y": 0.5})
    assert (answer.orderings, answer.order_spread) == (1, 0.0)


def test_the_labels_name_places_not_candidates() -> None:
    # Candidates named like the labels, given B first: each keeps its own name throughout.
    answer = answered(PlaceBiased(), pair({"B": "right", "A": "wrong"}))
    assert answer.probabilities == pytest.approx({"B": 0.7, "A": 0.3})
    assert list(answer.probabilities) == ["B", "A"] and answer.winner == "B"


def test_the_prompt_reads_state_instructions_criteria_then_the_candidates() -> None:
    plan = plan_decisions(STATE, {"p": pair({"x": " Paris ", "y": "Lyon"}, criteria="be exact")})
    first, second = (q.prompt for q in plan.queries)
    assert first == (
        f"{STATE}\n\n{INSTRUCTIONS}\nCriteria: be exact\n\nCandidate A:\nParis\n\n"
        "Candidate B:\nLyon\n\nAnswer A or B."
    )
    assert second == first.replace("Paris", "@").replace("Lyon", "Paris").replace("@", "Lyon")
    assert all(q.choices == ["A", "B"] for q in plan.queries)


@pytest.mark.parametrize(
    "candidates",
    [
        {"x": "one"},
        {"x": "one", "y": "two", "z": "three"},
        {"x": "one", "y": "  "},
        {"": "a", "y": "b"},
    ],
)
def test_a_bad_pair_names_its_candidates(candidates: dict[str, str]) -> None:
    question = {"type": "pair", "instructions": INSTRUCTIONS, "candidates": candidates}
    with pytest.raises(InvalidQueryError) as info:
        plan_decisions(STATE, {"p": question})
    assert info.value.field == "questions.p.candidates"


def test_the_gate_bounds_a_pair_s_orders_by_default() -> None:
    answer = decide(PlaceBiased(), STATE, {"p": pair({"x": "right", "y": "wrong"})})["p"]
    verdict = Gate(None, overrides=Overrides(uncertified_threshold=0.0)).decide_answer(answer)
    assert verdict.decision == "escalate"
    assert verdict.reason_codes == ["position_inconsistent"]
    assert "0.4000" in verdict.reasons[0] and verdict.max_order_spread == 0.2
    loose = Gate(None, overrides=Overrides(uncertified_threshold=0.0, max_order_spread=0.5))
    assert loose.decide_answer(answer).decision == "accept"
    # The same spread on a question that is not a pair is bounded only when asked.
    assert (
        Gate(None, overrides=Overrides(uncertified_threshold=0.0))
        .decide(answer.judgment, order_spread=answer.order_spread)
        .decision
        == "accept"
    )
    bounded = Gate(None, overrides=Overrides(uncertified_threshold=0.0, max_order_spread=0.1))
    assert bounded.decide(answer.judgment, order_spread=0.4).reason_codes == ["order_sensitive"]


# --- the real model ----------------------------------------------------------------------------

CANDIDATES = {"paris": "Paris is the capital of France.", "lyon": "Lyon is the capital of France."}


@pytest.fixture(scope="module")
def cold(judge: Judge) -> Judge:
    """The session's model with the prefix cache off: every call computes its state anew."""
    return Judge(judge.model, judge.tokenizer, model_id=judge.model_id, prefix_cache_mb=0)


@pytest.mark.slow
def test_both_orders_are_the_two_given_orders_judged_alike(cold: Judge) -> None:
    swapped = dict(reversed(CANDIDATES.items()))
    answers = decide(
        cold,
        STATE,
        {
            "both": pair(CANDIDATES),
            "given": pair(CANDIDATES, order="given"),
            "swapped": pair(swapped, order="given"),
        },
    )
    both, given, swapped_answer = answers["both"], answers["given"], answers["swapped"]
    # In one run the rows pack otherwise than alone: float32 rounding, 1e-5 at most.
    for name in CANDIDATES:
        mean = (given.probabilities[name] + swapped_answer.probabilities[name]) / 2
        assert both.probabilities[name] == pytest.approx(mean, abs=1e-5)
    gap = abs(given.probabilities["paris"] - swapped_answer.probabilities["paris"])
    assert both.order_spread == pytest.approx(gap, abs=1e-5)
    assert sum(both.probabilities.values()) == pytest.approx(1.0, abs=1e-9)
    assert both.judgment.choices == list(CANDIDATES)


@pytest.mark.slow
def test_both_orders_share_one_row_and_cost_less_than_twice_one(cold: Judge) -> None:
    def fed(question: PairQuestion) -> tuple[int, int]:
        plan = plan_decisions(STATE, {"p": question})
        tries = [cold.prepare(q).trie for q in plan.queries]
        rows = pack_rows(tries, cold.max_batch_tokens)
        return len(rows), sum(row_length([tries[i] for i in row]) for row in rows)

    rows, both = fed(pair(CANDIDATES))
    _, one = fed(pair(CANDIDATES, order="given"))
    # The state, the instructions and the first label are fed once for both orders.
    assert rows == 1 and one < both < 2 * one


# --- the routes --------------------------------------------------------------------------------


@contextlib.contextmanager
def served(tmp_path: Path) -> Iterator[TestClient[Any]]:
    """The app around the place-biased fake, ready."""
    config = ServiceConfig(profiles_dir=tmp_path)
    with TestClient(app=create_app(PlaceBiased(), config=config)) as client:
        yield wait_app_ready(client)


def test_post_systemone_answers_and_gates_a_pair(tmp_path: Path) -> None:
    body: dict[str, Any] = {
        "state": STATE,
        "questions": {
            "p": {
                "type": "pair",
                "instructions": INSTRUCTIONS,
                "candidates": {"x": "right", "y": "wrong"},
                "uncertified_threshold": 0.0,
            },
            "loose": {
                "type": "pair",
                "instructions": INSTRUCTIONS,
                "candidates": {"x": "right", "y": "wrong"},
                "uncertified_threshold": 0.0,
                "max_order_spread": 0.5,
            },
        },
    }
    with served(tmp_path) as client:
        r = client.post("/v1/systemone", json=body)
        assert r.status_code == 200, r.text
        answers = r.json()["answers"]
        p = answers["p"]
        assert p["type"] == "pair" and p["winner"] == "x"
        assert p["probabilities"] == pytest.approx(BOTH)
        assert p["orderings"] == 2 and p["order_spread"] == pytest.approx(0.4)
        assert p["decision"] == "escalate" and p["reason_codes"] == ["position_inconsistent"]
        assert p["max_order_spread"] == 0.2
        assert answers["loose"]["decision"] == "accept"
        bad = {**body["questions"]["p"], "candidates": {"x": "right"}}
        r = client.post("/v1/systemone", json={"state": STATE, "questions": {"p": bad}})
        assert r.status_code == 400 and "questions.p.candidates" in r.text


def test_post_judge_takes_a_pair_and_answers_as_a_judgment(tmp_path: Path) -> None:
    pair_body = {
        "state": STATE,
        "instructions": INSTRUCTIONS,
        "candidates": {"x": "right", "y": "wrong"},
        "uncertified_threshold": 0.0,
        "return_prompt": True,
    }
    with served(tmp_path) as client:
        r = client.post("/judge", json=pair_body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["type"] == "judgment" and out["choice"] == "x"
        assert out["probabilities"] == pytest.approx(BOTH)
        assert list(out["probabilities"]) == ["x", "y"]
        assert (out["orderings"], out["order_spread"]) == (2, pytest.approx(0.4))
        assert out["reason_codes"] == ["position_inconsistent"] and out["max_order_spread"] == 0.2
        assert read(out["prompt"]) == ("right", "wrong")  # the first order's
        given = client.post("/judge", json={**pair_body, "order": "given"}).json()
        assert given["orderings"] == 1 and given["probabilities"]["x"] == pytest.approx(0.9)
        assert given["decision"] == "accept"
        # A plain judgment carries none of a pair's fields.
        plain = client.post("/judge", json={"prompt": "Is it?", "choices": ["yes", "no"]})
        assert plain.status_code == 200 and "orderings" not in plain.json()
        # Refusals name the request's own fields.
        for body, field in (
            ({**pair_body, "candidates": {"x": "right"}}, "candidates"),
            ({**pair_body, "candidates": {"x": "right", "y": " "}}, "candidates"),
            ({**pair_body, "prompt": "Is it?", "choices": ["a", "b"]}, "prompt"),
            ({**pair_body, "max_order_spread": 2}, "max_order_spread"),
            ({**pair_body, "profile": "missing"}, "profile"),
        ):
            r = client.post("/judge", json=body)
            assert 400 <= r.status_code < 500 and r.json()["field"] == field, (body, r.text)


def pair_profile(name: str = "xy") -> CalibrationProfile:
    """A temperature profile for candidates named x and y, on synthetic scores with a signal."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400)
    logits = np.stack([np.where(y == 0, 1.0, -1.0), np.zeros(400)], axis=1)
    logits += 0.3 * rng.standard_normal((400, 2))
    z = logits - np.logaddexp(logits[:, 0], logits[:, 1])[:, None]
    return fit_profile(
        name,
        LabeledScores(z, np.ones(len(y)), y),
        ["x", "y"],
        Provenance(
            fingerprint=FakeEngine().fingerprint(), dataset="synthetic", dataset_sha256="0" * 64
        ),
        FitSettings(methods=["temperature"]),
    ).profile


def test_a_profile_for_the_names_gates_a_pair_on_both_routes(tmp_path: Path) -> None:
    profile = pair_profile()
    candidates = {"x": "right", "y": "wrong"}
    # What the routes must give: the profile's policy on the mean over the orders, bounded.
    expected = make_policy(profile).decide(judgment_of(BOTH), order_spread=0.4, pair=True)
    with served(tmp_path) as client:
        r = client.put(f"/profiles/{profile.name}", content=msgspec.json.encode(profile))
        assert r.status_code == 200, r.text
        body = {"state": STATE, "instructions": INSTRUCTIONS, "candidates": candidates}
        judged = client.post("/judge", json={**body, "profile": profile.name}).json()
        question = {"type": "pair", **body, "profile": profile.name}
        del question["state"]
        answered_ = client.post(
            "/v1/systemone", json={"state": STATE, "questions": {"p": question}}
        ).json()["answers"]["p"]
        # Candidates with other names: the profile does not fit them, named as each route names it.
        other = {"a": "right", "b": "wrong"}
        refused = client.post("/judge", json={**body, "candidates": other, "profile": "xy"})
        assert (refused.status_code, refused.json()["field"]) == (422, "profile")
        refused = client.post(
            "/v1/systemone",
            json={"state": STATE, "questions": {"p": {**question, "candidates": other}}},
        )
        assert (refused.status_code, refused.json()["field"]) == (422, "questions.p.profile")
    for got in (judged, answered_):
        assert got["profile"] == "xy" and got["raw_probabilities"] == pytest.approx(BOTH)
        assert got["probabilities"] == pytest.approx(expected.probabilities, abs=1e-12)
        assert got["probabilities"]["x"] > BOTH["x"]  # the fitted temperature sharpens
        assert got["decision"] == expected.decision
        assert got["reason_codes"] == expected.reason_codes
        assert "position_inconsistent" in got["reason_codes"]
        assert got["certified"] == expected.certified
    assert judged["choice"] == answered_["winner"] == "x"


@pytest.mark.slow
def test_judge_decide_answers_a_pair(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    judge: Judge,
    tmp_path: Path,
) -> None:
    monkeypatch.setattr(Judge, "load", staticmethod(lambda *_, **__: judge))
    state = tmp_path / "state.txt"
    state.write_text(STATE)
    question = {"type": "pair", "instructions": INSTRUCTIONS, "candidates": CANDIDATES}
    argv = ["decide", "--state", str(state), "--question", f"p={json.dumps(question)}"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)["p"]
    reference = answered(judge, question)
    assert out["type"] == "pair" and out["winner"] == reference.winner
    assert out["orderings"] == 2
    for name, p in reference.probabilities.items():
        assert out["probabilities"][name] == pytest.approx(p, abs=1e-4)
    assert out["max_order_spread"] == 0.2


@pytest.mark.slow
def test_the_readme_example_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], judge: Judge
) -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    section = page[page.index("## Pairs: which of two is better") :]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    monkeypatch.setattr(Judge, "load", staticmethod(lambda *_, **__: judge))
    exec(compile(code, "docs/cli.md", "exec"), {})
    winner, confidence, orderings, spread = capsys.readouterr().out.split()
    assert winner in ("paris", "lyon") and 0.5 <= float(confidence) <= 1.0
    assert orderings == "2" and 0.0 <= float(spread) <= 1.0
