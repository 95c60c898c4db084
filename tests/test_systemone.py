"""POST /v1/systemone: the System One wire format, spoken by the real ``systemone-client``.

Against a live ``judge serve`` on the default model: the package's sync and async clients get
noul, choice and score answers, several at once, whose probabilities are POST /judge's on the
same rendered prompts; its error carries our detail. In process, with a fake engine: every
refusal names the question and field before any model work, and each answer is gated by the
same Policy as POST /judge (a profile, a threshold, the order-spread bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
from fakes import FakeEngine, judgment_of
from litestar.testing import TestClient
from server import Server
from server import wait_app_ready as ready

from calibration import (
    CalibrationProfile,
    FitSettings,
    LabeledScores,
    Provenance,
    fit_profile,
    make_policy,
)
from judge import Judgment, Query
from judge.answers import plan_decisions
from service import ServiceConfig, create_app
from service.client import AsyncJudgeClient, ClientError, JudgeClient
from service.systemone import (
    SystemOneChoice,
    SystemOneChoiceAnswer,
    SystemOneNoul,
    SystemOneQuestion,
    SystemOneResponse,
)

systemone = pytest.importorskip("systemone", reason="pip install systemone-client==0.1.0")

STATE = {"ticket": "I was charged twice for my subscription this month. Please refund one."}
QUESTIONS: dict[str, dict[str, Any]] = {
    "billing": {"type": "noul", "instructions": "Is this about billing?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should handle it?",
        "criteria": {
            "billing": "payments, refunds and invoices",
            "technical": "bugs, outages and errors",
            "sales": None,
        },
    },
    "urgency": {
        "type": "score",
        "instructions": "How urgent is it?",
        "criteria": ["not urgent", {"what": "soon", "examples": ["a refund"]}, "right now"],
    },
}


# --- in process, a fake engine ---------------------------------------------------------------


class Counting(FakeEngine):
    """Counts the judgments it makes: a refusal must come before any."""

    def __init__(self) -> None:
        self.runs = 0

    def run(self, prepared: Any) -> list[Judgment]:
        self.runs += len(prepared)
        return super().run(prepared)


class FirstListed(Counting):
    """Prefers whichever option its prompt lists first (0.8), as a small model may."""

    def judgment(self, query: Query) -> Judgment:
        if "\n\n" not in query.prompt:  # the warm-up: not a question about a state
            return super().judgment(query)
        position = {c: _position(query.prompt, c) for c in query.choices}
        first = min(query.choices, key=position.__getitem__)
        rest = (1 - 0.8) / (len(query.choices) - 1)
        return judgment_of({c: 0.8 if c == first else rest for c in query.choices})


def _position(prompt: str, choice: str) -> int:
    """Where the question (after the state) lists ``choice``: "Answer yes or no." or "- name"."""
    question = prompt.rsplit("\n\n", 1)[-1]
    for marker in (f"- {choice}", f" {choice} ", f" {choice}."):
        if marker in question:
            return question.index(marker)
    raise AssertionError(f"{choice!r} is not listed in {question!r}")


def serve(engine: FakeEngine, tmp_path: Path, **options: Any) -> TestClient[Any]:
    config = ServiceConfig(profiles_dir=tmp_path, **options)
    return TestClient(app=create_app(engine, config=config))


@pytest.fixture
def engine() -> Counting:
    return Counting()


@pytest.fixture
def app(engine: Counting, tmp_path: Path) -> Iterator[TestClient[Any]]:
    with serve(engine, tmp_path, max_questions=3, max_request_tokens=400) as c:
        yield ready(c)


def ask(client: TestClient[Any], body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = client.post("/v1/systemone", json=body)
    return r.status_code, r.json()


def test_answers_carry_the_wire_fields_and_the_policy_s(
    app: TestClient[Any], engine: Counting
) -> None:
    status, body = ask(app, {"state": STATE, "questions": QUESTIONS})
    assert status == 200, body
    response = msgspec.convert(body, SystemOneResponse)  # the schema's own types
    assert response.model == "fake" and set(body["answers"]) == set(QUESTIONS)
    billing, team, urgency = (body["answers"][q] for q in QUESTIONS)
    assert billing["type"] == "noul" and billing["noul"] == pytest.approx(0.5)
    assert team["type"] == "choice" and list(team["probabilities"]) == list(
        QUESTIONS["team"]["criteria"]
    )
    assert team["confidence"] == pytest.approx(1 / 3) and team["choice"] == "billing"
    assert urgency["type"] == "score" and list(urgency["probabilities"]) == ["0", "1", "2"]
    assert urgency["score"] == pytest.approx(1.0)  # uniform over 0, 1, 2
    assert urgency["legend"] == {
        "0": "not urgent",
        "1": "soon | examples: a refund",
        "2": "right now",
    }
    for answer in body["answers"].values():
        # No profile, so no certificate: each answer escalates as uncalibrated.
        assert answer["decision"] == "escalate" and answer["reason_codes"] == ["uncalibrated"]
        assert answer["threshold"] is None and not answer["certified"]
        assert answer["profile"] is None and answer["prediction_set"] is None
        assert answer["orderings"] == 1 and answer["order_spread"] == 0.0
        assert answer["raw_probabilities"] == answer["probabilities"]
    # One listing per question, each one judgment; the fake computes 1 token per judgment.
    assert engine.runs == 3
    assert body["usage"] == {"input_tokens": 3, "output_tokens": 0}
    assert body["latency_ms"] > 0


def test_a_threshold_per_question_accepts(app: TestClient[Any]) -> None:
    questions = {
        "low": {**QUESTIONS["billing"], "uncertified_threshold": 0.4},
        "high": {**QUESTIONS["billing"], "uncertified_threshold": 0.6},
    }
    status, body = ask(app, {"state": "text", "questions": questions})
    assert status == 200, body
    assert body["answers"]["low"]["decision"] == "accept"
    assert body["answers"]["low"]["reasons"] == [] and body["answers"]["low"]["threshold"] == 0.4
    assert body["answers"]["high"]["decision"] == "escalate"


@pytest.mark.parametrize(
    ("questions", "extra", "status", "field"),
    [
        (dict.fromkeys("abcd", QUESTIONS["billing"]), {}, 413, "questions"),  # max_questions=3
        (
            {
                "team": {
                    "type": "choice",
                    "instructions": "?",
                    "criteria": dict.fromkeys(map(str, range(256))),
                }
            },
            {},
            400,
            "questions.team.criteria",
        ),
        (
            {"u": {"type": "score", "instructions": "?", "criteria": ["a"] * 11}},
            {},
            400,
            "questions.u.criteria",
        ),
        (
            {"u": {"type": "score", "instructions": "?", "criteria": ["a"]}},
            {},
            400,
            "questions.u.criteria",
        ),
        (
            {"u": {"type": "score", "instructions": "?", "criteria": [1, 2]}},
            {},
            400,
            "questions.u.criteria[0]",
        ),
        (
            {"team": {"type": "choice", "instructions": "?", "criteria": {" ": None, "b": None}}},
            {},
            400,
            "questions.team.criteria",
        ),
        ({"q": {"type": "noul", "instructions": "  "}}, {}, 400, "questions.q.instructions"),
        ({"q": {"type": "yes_no", "instructions": "?"}}, {}, 400, "questions.q.type"),
        ({"q": {"instructions": "?"}}, {}, 400, "questions.q.type"),
        ({"q": {"type": "noul", "instructions": "?", "colour": 1}}, {}, 400, "questions.q.colour"),
        (
            {"q": {"type": "noul", "instructions": "?", "order": "random"}},
            {},
            400,
            "questions.q.order",
        ),
        (
            {"q": {"type": "noul", "instructions": "?", "threshold": 2}},
            {},
            400,
            "questions.q.threshold",
        ),
        (
            {"q": {"type": "noul", "instructions": "?", "profile": "absent"}},
            {},
            404,
            "questions.q.profile",
        ),
        ({"": QUESTIONS["billing"]}, {}, 400, "questions"),
        ({}, {}, 400, "questions"),
        ({"q": QUESTIONS["billing"]}, {"model": "another-model"}, 422, "model"),
        ({"q": QUESTIONS["billing"]}, {"state": "x" * 500}, 413, "state"),
        ({"q": {"type": "noul", "instructions": "?" * 500}}, {}, 413, "questions.q.instructions"),
        (
            {"q": {"type": "noul", "instructions": "?", "criteria": "c" * 500}},
            {},
            413,
            "questions.q.criteria",
        ),
    ],
)
def test_refusals_name_the_question_and_field_before_any_model_work(
    app: TestClient[Any],
    engine: Counting,
    questions: dict[str, Any],
    extra: dict[str, Any],
    status: int,
    field: str,
) -> None:
    got, body = ask(app, {"state": "text", "questions": questions, **extra})
    assert (got, body["field"]) == (status, field), body
    assert body["detail"] and engine.runs == 0


def test_a_question_refused_among_good_ones_refuses_the_request(
    app: TestClient[Any], engine: Counting
) -> None:
    questions = {"a": QUESTIONS["billing"], "b": {"type": "noul", "instructions": "?" * 500}}
    got, body = ask(app, {"state": "text", "questions": questions})
    assert (got, body["field"]) == (413, "questions.b.instructions") and engine.runs == 0


def test_the_served_model_may_be_named(app: TestClient[Any]) -> None:
    status, body = ask(
        app, {"state": "t", "questions": {"q": QUESTIONS["billing"]}, "model": "fake"}
    )
    assert status == 200 and body["model"] == "fake"


def test_the_order_spread_bound_escalates_an_order_sensitive_answer(tmp_path: Path) -> None:
    engine = FirstListed()
    invariant = {**QUESTIONS["billing"], "order": "invariant", "uncertified_threshold": 0.0}
    questions = {
        "bounded": {**invariant, "max_order_spread": 0.1},
        "loose": {**invariant, "max_order_spread": 0.7},
        "unbounded": invariant,
        "given": {**QUESTIONS["billing"], "uncertified_threshold": 0.0, "max_order_spread": 0.1},
        "team": {
            **QUESTIONS["team"],
            "order": "invariant",
            "uncertified_threshold": 0.0,
            "max_order_spread": 0.5,
        },
    }
    with serve(engine, tmp_path) as c:
        status, body = ask(ready(c), {"state": "text", "questions": questions})
    assert status == 200, body
    answers = body["answers"]
    bounded = answers["bounded"]
    # Listed yes/no it says yes (0.8), listed no/yes it says no: the mean is 0.5, spread 0.6.
    assert bounded["orderings"] == 2 and bounded["noul"] == pytest.approx(0.5)
    assert bounded["order_spread"] == pytest.approx(0.6)
    assert bounded["decision"] == "escalate" and bounded["reason_codes"] == ["order_sensitive"]
    assert "0.6000" in bounded["reasons"][0] and bounded["max_order_spread"] == 0.1
    assert answers["loose"]["decision"] == "accept" and answers["loose"]["max_order_spread"] == 0.7
    assert answers["unbounded"]["decision"] == "accept"
    assert answers["unbounded"]["max_order_spread"] is None
    # Asked in one order only: no spread to bound.
    assert answers["given"]["orderings"] == 1 and answers["given"]["order_spread"] == 0.0
    assert (
        answers["given"]["noul"] == pytest.approx(0.8) and answers["given"]["decision"] == "accept"
    )
    # Three options, three cyclic listings: each option is first once.
    team = answers["team"]
    assert team["orderings"] == 3 and team["order_spread"] == pytest.approx(0.7)
    assert team["probabilities"] == pytest.approx(
        dict.fromkeys(QUESTIONS["team"]["criteria"], 1 / 3)
    )
    assert team["reason_codes"] == ["order_sensitive"]
    # Two listings each for the three invariant yes/no questions, one given, three for team.
    assert engine.runs == 2 * 3 + 1 + 3
    assert body["usage"]["input_tokens"] == engine.runs


def yes_no_profile(name: str = "yesno") -> CalibrationProfile:
    """A profile for yes/no on the fake, fitted on synthetic scores with a signal."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400)
    logits = np.stack([np.where(y == 0, 1.5, -1.5), np.zeros(400)], axis=1)
    logits += rng.standard_normal((400, 2))
    z = logits - np.logaddexp(logits[:, 0], logits[:, 1])[:, None]  # (n, 2) log-probabilities
    return fit_profile(
        name,
        LabeledScores(z, np.ones(len(y)), y),
        ["yes", "no"],
        Provenance(
            fingerprint=FakeEngine().fingerprint(), dataset="synthetic", dataset_sha256="0" * 64
        ),
        FitSettings(methods=["temperature"]),
    ).profile


class Leaning(Counting):
    """P(yes) = 0.7 for a yes/no question; uniform otherwise."""

    def judgment(self, query: Query) -> Judgment:
        if sorted(query.choices) == ["no", "yes"]:
            return judgment_of({c: 0.7 if c == "yes" else 0.3 for c in query.choices})
        return super().judgment(query)


def test_a_profile_gates_the_answer_as_post_judge_does(tmp_path: Path) -> None:
    profile = yes_no_profile()
    engine = Leaning()
    with serve(engine, tmp_path) as c:
        ready(c)
        r = c.put(f"/profiles/{profile.name}", content=msgspec.json.encode(profile))
        assert r.status_code == 200, r.text
        question = {**QUESTIONS["billing"], "profile": profile.name}
        status, body = ask(c, {"state": "text", "questions": {"q": question}})
        assert status == 200, body
        judged = c.post(
            "/judge",
            json={
                "prompt": "text\n\nIs this about billing?\nAnswer yes or no.",
                "choices": ["yes", "no"],
                "profile": profile.name,
            },
        ).json()
        # A profile for other choices, on a choice or a score: refused, naming it.
        for other in ("team", "urgency"):
            refused = {**QUESTIONS[other], "profile": profile.name}
            got, error = ask(c, {"state": "text", "questions": {other: refused}})
            assert (got, error["field"]) == (422, f"questions.{other}.profile"), error
    answer = body["answers"]["q"]
    expected = make_policy(profile).decide(judgment_of({"yes": 0.7, "no": 0.3}))
    assert answer["profile"] == profile.name and answer["raw_probabilities"][
        "yes"
    ] == pytest.approx(0.7)
    assert answer["probabilities"] == pytest.approx(expected.probabilities, abs=1e-12)
    assert answer["noul"] == pytest.approx(expected.probabilities["yes"], abs=1e-12)
    assert answer["decision"] == expected.decision == judged["decision"]
    assert answer["reason_codes"] == expected.reason_codes == judged["reason_codes"]
    assert answer["certified"] == expected.certified == judged["certified"]
    assert answer["threshold"] == expected.threshold == judged["threshold"]
    assert answer["prediction_set"] == expected.prediction_set == judged["prediction_set"]
    assert answer["probabilities"] == pytest.approx(judged["probabilities"], abs=1e-12)


def test_the_question_count_limit_is_a_setting(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_questions"):
        ServiceConfig(profiles_dir=tmp_path, max_questions=0)
    with serve(Counting(), tmp_path, max_questions=1) as c:
        status, body = ask(
            ready(c), {"state": "t", "questions": dict.fromkeys("ab", QUESTIONS["billing"])}
        )
    assert (status, body["field"]) == (413, "questions") and "--max-questions" in body["detail"]


def test_the_openapi_document_describes_the_operation(app: TestClient[Any]) -> None:
    document = app.get("/schema/openapi.json").json()
    operation = document["paths"]["/v1/systemone"]["post"]
    assert operation["operationId"] == "post_v1_systemone"
    assert {"200", "400", "404", "413", "422", "503"} <= set(operation["responses"])
    schemas = document["components"]["schemas"]
    request = schemas["SystemOneRequest"]
    assert (
        request["required"] == ["state", "questions"] and request["additionalProperties"] is False
    )
    choice = schemas["SystemOneChoice"]["properties"]["criteria"]
    assert choice["maxProperties"] == 255 and choice["minProperties"] == 2
    assert schemas["SystemOneScore"]["properties"]["criteria"]["maxItems"] == 10
    assert "max_order_spread" in schemas["SystemOneNoul"]["properties"]
    assert "order_sensitive" in str(schemas["SystemOneNoulAnswer"])


def test_our_clients_send_the_wire_request_and_decode_the_answer(app: TestClient[Any]) -> None:
    """The client's core, on a transport that hands each request to the in-process app."""
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append({"method": request.method, "path": request.url.path, "body": body})
        r = app.post(request.url.path, json=body)
        return httpx.Response(r.status_code, content=r.content, headers=dict(r.headers))

    typed: dict[str, SystemOneQuestion | dict[str, Any]] = {
        "billing": SystemOneNoul(instructions="Is this about billing?", uncertified_threshold=0.4),
        "team": QUESTIONS["team"],
    }
    with JudgeClient("http://judge.test", transport=httpx.MockTransport(handler)) as client:
        got = client.systemone(STATE, typed, model="fake")
        with pytest.raises(ClientError) as caught:
            client.systemone(STATE, {"q": {**QUESTIONS["billing"], "profile": "absent"}})

    async def go() -> SystemOneResponse:
        transport = httpx.MockTransport(handler)
        async with AsyncJudgeClient("http://judge.test", transport=transport) as client:
            return await client.systemone(STATE, typed)

    assert sent[0]["method"] == "POST" and sent[0]["path"] == "/v1/systemone"
    assert sent[0]["body"]["model"] == "fake" and sent[0]["body"]["state"] == STATE
    assert sent[0]["body"]["questions"] == {
        "billing": {
            "type": "noul",
            "instructions": "Is this about billing?",
            "uncertified_threshold": 0.4,
        },
        "team": QUESTIONS["team"],
    }
    assert got.model == "fake" and got.answers["billing"].decision == "accept"
    assert isinstance(got.answers["team"], SystemOneChoiceAnswer)
    assert (caught.value.status_code, caught.value.field) == (404, "questions.q.profile")
    again = asyncio.run(go()).answers
    # The same answers, each a judgment of its own (its own id) under the same policy.
    assert {q: msgspec.structs.replace(a, judgment_id=None) for q, a in again.items()} == {
        q: msgspec.structs.replace(a, judgment_id=None) for q, a in got.answers.items()
    }
    assert all(
        a.judgment_id and a.judgment_id != got.answers[q].judgment_id for q, a in again.items()
    )


# --- against the real server, with the real systemone-client ------------------------------------


@pytest.fixture
def server(model_server: Server) -> Server:
    """The session's `judge serve` on the real model (tests/conftest.py)."""
    return model_server


def judged(url: str, state: Any, questions: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each question's probabilities from POST /judge, one call per listing of the plan, the
    mean over listings: what POST /v1/systemone computes in one shared run."""
    plan = plan_decisions(state, questions)
    out = {}
    for asked in plan.asked:
        listings = []
        for query in plan.queries[asked.start : asked.start + asked.count]:
            body = {"prompt": query.prompt, "choices": query.choices}
            r = httpx.post(f"{url}/judge", json=body, timeout=120)
            assert r.status_code == 200, r.text
            listings.append(r.json()["raw_probabilities"])
        out[asked.id] = {c: sum(p[c] for p in listings) / len(listings) for c in asked.choices}
    return out


# float32 noise: the shared run packs the state and every listing into one row, POST /judge
# runs each prompt alone (or from the prefix cache), so sums are taken in another order; the
# differences seen are about 1e-6 (1.2e-6 the largest): a bound of 1e-6 fails on them.
TOLERANCE = 1e-5


def close(got: dict[str, float], want: dict[str, float], tol: float = TOLERANCE) -> None:
    assert list(got) == list(want)
    assert all(math.isclose(got[c], want[c], abs_tol=tol) for c in want), (got, want)


@pytest.mark.slow
def test_the_systemone_client_gets_typed_answers_equal_to_post_judge(server: Server) -> None:
    from systemone import Choice, Client, Noul, Score
    from systemone.types import Question

    questions: dict[str, Question] = {
        "billing": Noul("Is this about billing?"),
        "team": Choice("Which team should handle it?", QUESTIONS["team"]["criteria"]),
        "urgency": Score("How urgent is it?", QUESTIONS["urgency"]["criteria"]),
    }
    with Client(server.url, api_key="ignored-without-a-server-key", timeout=120) as client:
        r = client.system_one(STATE, questions)
    reference = judged(server.url, STATE, {k: q.to_dict() for k, q in questions.items()})
    assert r.model and r.model == r.raw["model"]
    assert r.usage.input_tokens > 0 and r.usage.output_tokens == 0
    assert r.latency_ms is not None and r.latency_ms > 0
    close({"yes": r.nouls["billing"].noul}, {"yes": reference["billing"]["yes"]})
    team = r.choices["team"]
    close(team.probabilities, reference["team"])
    assert team.choice == max(team.probabilities, key=team.probabilities.__getitem__)
    assert team.confidence == team.probabilities[team.choice]
    urgency = r.scores["urgency"]
    close(urgency.probabilities, reference["urgency"])
    assert urgency.score == pytest.approx(
        sum(int(k) * p for k, p in reference["urgency"].items()), abs=TOLERANCE
    )
    assert urgency.legend == {"0": "not urgent", "1": "soon | examples: a refund", "2": "right now"}
    assert sum(urgency.probabilities.values()) == pytest.approx(1.0, abs=1e-6)
    for answer in r.raw["answers"].values():  # judge's own fields ride along
        assert answer["decision"] in ("accept", "escalate") and answer["orderings"] == 1


@pytest.mark.slow
def test_the_async_client_and_an_invariant_order(server: Server) -> None:
    from systemone import AsyncClient

    questions = {
        "billing": {**QUESTIONS["billing"], "order": "invariant"},
        "team": {**QUESTIONS["team"], "order": "invariant", "max_order_spread": 0.0},
    }

    async def go() -> Any:
        async with AsyncClient(server.url, timeout=120) as client:
            return await client.system_one("I was charged twice.", questions)

    r = asyncio.run(go())
    reference = judged(server.url, "I was charged twice.", questions)
    close({"yes": r.nouls["billing"].noul}, {"yes": reference["billing"]["yes"]})
    close(r.choices["team"].probabilities, reference["team"])
    team = r.raw["answers"]["team"]
    assert team["orderings"] == 3 and team["order_spread"] > 0
    assert "order_sensitive" in team["reason_codes"] and team["decision"] == "escalate"
    assert r.raw["answers"]["billing"]["orderings"] == 2


@pytest.mark.slow
def test_our_clients_get_what_the_systemone_client_gets(server: Server) -> None:
    from systemone import Client

    with Client(server.url, timeout=120) as client:
        theirs = client.system_one(STATE, QUESTIONS).raw
    typed: dict[str, SystemOneQuestion | dict[str, Any]] = {
        "billing": SystemOneNoul(instructions="Is this about billing?"),
        "team": SystemOneChoice(
            instructions="Which team should handle it?", criteria=QUESTIONS["team"]["criteria"]
        ),
        "urgency": QUESTIONS["urgency"],
    }
    with JudgeClient(server.url, timeout=120) as ours:
        sync = ours.systemone(STATE, typed)

    async def go() -> SystemOneResponse:
        async with AsyncJudgeClient(server.url, timeout=120) as client:
            return await client.systemone(STATE, QUESTIONS)

    for got in (sync, asyncio.run(go())):
        assert got.model == theirs["model"]
        for qid, answer in got.answers.items():
            close(answer.probabilities, theirs["answers"][qid]["probabilities"])
            assert answer.decision == theirs["answers"][qid]["decision"]


@pytest.mark.slow
def test_an_error_carries_our_detail(server: Server) -> None:
    from systemone import Client, SystemOneError

    with Client(server.url, timeout=120) as client:
        with pytest.raises(SystemOneError) as caught:
            client.system_one(
                "text", {"u": {"type": "score", "instructions": "?", "criteria": ["a"] * 11}}
            )
        assert caught.value.status == 400
        assert caught.value.detail.startswith("questions.u.criteria:")
        with pytest.raises(SystemOneError) as caught:
            client.system_one("text", {"q": {**QUESTIONS["billing"], "profile": "absent"}})
        assert caught.value.status == 404 and "absent" in caught.value.detail
        with pytest.raises(SystemOneError) as caught:
            client.system_one("text", {"q": QUESTIONS["billing"]}, model="another-model")
        assert caught.value.status == 422 and "another-model" in caught.value.detail


@pytest.mark.slow
def test_the_readme_example_runs(server: Server) -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "http.md").read_text()
    section = page[page.index("## System One wire format") :]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace("http://127.0.0.1:8000", server.url), "docs/http.md", "exec"), {})
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"[01]\.\d{3} (billing|technical) [0-2]\.\d\d", lines[0]), lines
    assert lines[1:] in (["accept"], ["escalate"])
