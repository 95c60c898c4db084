"""The HTTP contract, in process: every endpoint and every 4xx, on the real default model."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from judge import Judge, Judgment
from service import ServiceConfig, create_app

SPAM = "Is this SMS spam? WINNER!! You have won a free cruise, text CLAIM to 80082 now."
EXAMPLES = [
    ("Free entry in a weekly competition to win FA Cup final tickets, text FA to 87121", "spam"),
    ("URGENT! You have won a 1 week FREE membership, call 09061701461 to claim", "spam"),
    ("Congratulations, you have been selected for a cash prize. Reply WIN now", "spam"),
    ("SIX chances to win CASH! From 100 to 20,000 pounds, txt CSH11 to 87575", "spam"),
    (
        "Had your mobile 11 months or more? Update to the latest colour phone for free, call now",
        "spam",
    ),
    ("Ok lar... Joking wif u oni...", "ham"),
    ("I'm gonna be home soon and i don't want to talk about this stuff anymore tonight", "ham"),
    ("Sorry, I'll call later", "ham"),
    ("Did you catch the bus? Are you frying an egg?", "ham"),
    ("Ahhh. Work. I vaguely remember that! What does it feel like?", "ham"),
    ("Is that seriously how you spell his name?", "ham"),
    ("K, I'll be there around 8", "ham"),
]


def wait_ready(client: TestClient[Any]) -> None:
    for _ in range(600):
        if client.get("/ready").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("the app never became ready")


@pytest.fixture(scope="module")
def client(judge: Judge, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient[Any]]:
    profiles = tmp_path_factory.mktemp("profiles")
    app = create_app(judge, config=ServiceConfig(profiles_dir=profiles, max_body_bytes=50_000))
    with TestClient(app=app) as c:
        wait_ready(c)
        yield c


def post(client: TestClient[Any], body: Any, path: str = "/judge") -> tuple[int, dict[str, Any]]:
    r = client.post(path, json=body)
    return r.status_code, r.json()


def test_health_ready_metrics_and_docs(client: TestClient[Any]) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json()["status"] == "ready"
    post(client, {"prompt": SPAM, "choices": ["spam", "ham"]})
    metrics = client.get("/metrics").text
    assert 'judge_http_requests_total{method="POST",route="/judge",status="200"}' in metrics
    assert "judge_batch_size_bucket" in metrics and "judge_decisions_total" in metrics
    assert "/judge" in client.get("/schema/openapi.json").json()["paths"]


def test_judge_matches_the_engine(client: TestClient[Any], judge: Judge) -> None:
    status, body = post(client, {"prompt": SPAM, "choices": ["spam", "ham"], "return_prompt": True})
    assert status == 200
    alone = judge.judge(SPAM, ["spam", "ham"])
    assert body["raw_probabilities"] == pytest.approx(alone.probabilities, abs=1e-6)
    assert body["probabilities"] == body["raw_probabilities"]  # no profile
    assert body["choice"] == alone.choice and body["confidence"] == pytest.approx(alone.confidence)
    assert body["prompt"] == alone.prompt and body["model"] == judge.model_id
    assert body["threshold"] == 0.9 and body["profile"] is None
    assert body["decision"] == ("accept" if alone.confidence >= 0.9 else "escalate")


def test_threshold_routes(client: TestClient[Any]) -> None:
    _, low = post(client, {"prompt": SPAM, "choices": ["spam", "ham"], "threshold": 0.0})
    assert low["decision"] == "accept" and low["reason"] is None
    _, high = post(client, {"prompt": SPAM, "choices": ["spam", "ham"], "threshold": 1.0})
    assert high["decision"] == "escalate" and "below the threshold 1.0000" in high["reason"]
    _, mass = post(
        client,
        {"prompt": SPAM, "choices": ["spam", "ham"], "threshold": 0.0, "min_choice_mass": 1.0},
    )
    assert mass["decision"] == "escalate" and "choice mass" in mass["reason"]


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"prompt": "x"}, 400, "choices"),
        ({"choices": ["a", "b"]}, 400, "prompt"),
        ({"prompt": "x", "choices": []}, 400, "choices"),
        ({"prompt": "x", "choices": ["a"]}, 400, "choices"),
        ({"prompt": "x", "choices": ["a", "a"]}, 400, "choices"),
        ({"prompt": "x", "choices": ["a", ""]}, 400, "choices[1]"),
        ({"prompt": "x", "choices": [str(i) for i in range(1025)]}, 400, "choices"),
        ({"prompt": "x", "choices": "ab"}, 400, "choices"),
        ({"prompt": "x", "choices": ["a", 2]}, 400, "choices[1]"),
        ({"prompt": 3, "choices": ["a", "b"]}, 400, "prompt"),
        ({"prompt": "x", "choices": ["a", "b"], "threshold": 1.5}, 400, "threshold"),
        ({"prompt": "x", "choices": ["a", "b"], "threshold": -0.1}, 400, "threshold"),
        ({"prompt": "x", "choices": ["a", "b"], "surprise": 1}, 400, "surprise"),
        ({"prompt": "x", "choices": ["a", "b"], "profile": "no-such"}, 404, "profile"),
        ({"prompt": "x", "choices": ["a", "b"], "profile": "../etc"}, 400, "profile"),
        ({"prompt": "x", "choices": ["1", "10"], "response_suffix": ""}, 400, "choices"),
    ],
)
def test_bad_requests_name_the_field(
    client: TestClient[Any], body: Any, status: int, field: str
) -> None:
    got, payload = post(client, body)
    assert got == status, payload
    assert payload["field"] == field, payload
    assert payload["detail"]


def test_prompt_too_long_for_the_model(judge: Judge, tmp_path: Path) -> None:
    app = create_app(judge, config=ServiceConfig(profiles_dir=tmp_path))
    with TestClient(app=app) as c:
        wait_ready(c)
        status, body = post(c, {"prompt": "word " * 9000, "choices": ["a", "b"]})
        assert status == 422 and body["field"] == "prompt" and "context window" in body["detail"]


def test_malformed_json_wrong_content_type_and_oversized_body(client: TestClient[Any]) -> None:
    r = client.post("/judge", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["field"] == "body" and r.json()["detail"]
    r = client.post("/judge", content=b"prompt=x", headers={"content-type": "text/plain"})
    assert 400 <= r.status_code < 500
    r = client.post("/judge", json={"prompt": "x" * 60_000, "choices": ["a", "b"]})
    assert r.status_code == 413 and r.json()["field"] == "body"


def test_batch_items_and_shared_context(client: TestClient[Any], judge: Judge) -> None:
    status, body = post(
        client,
        {
            "items": [
                {"prompt": SPAM, "choices": ["spam", "ham"]},
                {"prompt": "x", "choices": ["a", "a"]},
            ]
        },
        "/judge/batch",
    )
    assert status == 200
    first, second = body["results"]
    assert first["type"] == "judgment"
    assert first["raw_probabilities"] == pytest.approx(
        judge.judge(SPAM, ["spam", "ham"]).probabilities, abs=1e-4
    )
    assert second == {
        "type": "error",
        "status_code": 400,
        "detail": "choice 'a' appears more than once; remove the repeat",
        "field": "choices",
    }

    context = "The parcel arrived on Tuesday, two days late, and the box was crushed."
    questions = [
        {"prompt": "Was the parcel late?", "choices": ["yes", "no"]},
        {"prompt": "Which day did it arrive?", "choices": ["Monday", "Tuesday", "Friday"]},
    ]
    status, body = post(client, {"context": context, "questions": questions}, "/judge/batch")
    assert status == 200
    for q, got in zip(questions, body["results"], strict=True):
        alone = judge.judge(f"{context}\n\n{q['prompt']}", q["choices"])
        assert got["raw_probabilities"] == pytest.approx(alone.probabilities, abs=1e-4)
    status, body = post(client, {"context": context}, "/judge/batch")
    assert status == 400 and body["field"] == "items"


def test_profiles_fit_use_list_get_put_delete(client: TestClient[Any], judge: Judge) -> None:
    fit = {"choices": ["spam", "ham"], "examples": [{"prompt": p, "label": y} for p, y in EXAMPLES]}
    r = client.post("/profiles/sms/fit", json=fit)
    assert r.status_code == 200, r.text
    profile = r.json()
    assert profile["name"] == "sms" and profile["n_examples"] == len(EXAMPLES)
    assert profile["model"] == judge.model_id and profile["dtype"] == judge.dtype
    assert [p["name"] for p in client.get("/profiles").json()] == ["sms"]
    assert client.get("/profiles/sms").json() == profile

    status, body = post(client, {"prompt": SPAM, "choices": ["ham", "spam"], "profile": "sms"})
    assert status == 200 and body["profile"] == "sms"
    assert body["temperature"] == profile["temperature"]
    assert sum(body["probabilities"].values()) == pytest.approx(1.0)
    assert body["prediction_set"] is not None

    # The profile was fitted for spam/ham with the default template: anything else is refused.
    status, body = post(
        client, {"prompt": SPAM, "choices": ["spam", "ham", "unsure"], "profile": "sms"}
    )
    assert status == 422 and body["field"] == "choices"
    status, body = post(
        client,
        {
            "prompt": SPAM,
            "choices": ["spam", "ham"],
            "profile": "sms",
            "response_prefix": "Answer: ",
        },
    )
    assert status == 422 and body["field"] == "response_prefix"
    status, body = post(
        client,
        {"prompt": SPAM, "choices": ["spam", "ham"], "profile": "sms", "system": "Be terse."},
    )
    assert status == 422 and body["field"] == "system"

    other = {**profile, "name": "other", "model": "someone-elses-model"}
    assert client.put("/profiles/other", json=other).status_code == 200
    status, body = post(client, {"prompt": SPAM, "choices": ["spam", "ham"], "profile": "other"})
    assert status == 422 and body["field"] == "model"
    assert client.put("/profiles/mismatch", json=other).json()["field"] == "name"
    assert (
        client.put(
            "/profiles/broken", json={**other, "name": "broken", "temperature": -1}
        ).status_code
        == 400
    )
    assert client.put("/profiles/broken", json={"name": "broken"}).status_code == 400

    assert client.delete("/profiles/other").status_code == 204
    assert client.get("/profiles/other").status_code == 404
    assert client.delete("/profiles/other").status_code == 404

    bad = {"choices": ["spam", "ham"], "examples": [{"prompt": "x", "label": "eggs"}] * 10}
    r = client.post("/profiles/x/fit", json=bad)
    assert r.status_code == 400 and r.json()["field"] == "examples[0].label"
    r = client.post("/profiles/x/fit", json={"choices": ["spam", "ham"], "examples": []})
    assert r.status_code == 400 and r.json()["field"] == "examples"


def test_api_key(judge: Judge, tmp_path: Path) -> None:
    app = create_app(judge, config=ServiceConfig(profiles_dir=tmp_path, api_key="s3cret"))
    with TestClient(app=app) as c:
        assert c.get("/health").status_code == 200
        for path in ("/ready", "/metrics", "/profiles", "/schema/openapi.json"):
            r = c.get(path)
            assert r.status_code == 401 and r.json()["field"] == "Authorization"
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        for _ in range(600):
            if c.get("/ready", headers=auth).status_code == 200:
                break
            time.sleep(0.05)
        r = c.post("/judge", json={"prompt": SPAM, "choices": ["spam", "ham"]}, headers=auth)
        assert r.status_code == 200
        assert (
            c.post("/judge", json={"prompt": SPAM, "choices": ["spam", "ham"]}).status_code == 401
        )


class SlowEngine:
    """A stand-in engine for the error paths of the service's own machinery."""

    model_id, weights_sha256, dtype = "fake", None, "float32"
    response_prefix, response_suffix, system = '{"answer": "', '"}', None

    def __init__(self, delay: float, fail: bool = False) -> None:
        self.delay, self.fail = delay, fail

    def judge(self, prompt: str, choices: list[str]) -> Judgment:
        return self._one(choices)

    def judge_each(self, queries: list[Any]) -> list[Judgment]:
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("secret internal detail")
        return [self._one(q.choices) for q in queries]

    def _one(self, choices: list[str]) -> Judgment:
        p = 1 / len(choices)
        return Judgment(
            choice=choices[0],
            confidence=p,
            probabilities=dict.fromkeys(choices, p),
            logits=dict.fromkeys(choices, 0.0),
            choice_mass=1.0,
            prompt="",
            prompt_tokens=1,
            forward_passes=1,
            latency_ms=1.0,
            model="fake",
        )


def test_queue_full_and_timeout_answer_503(tmp_path: Path) -> None:
    config = ServiceConfig(
        profiles_dir=tmp_path, max_queue=1, max_batch_size=1, request_timeout_s=0.5
    )
    app = create_app(SlowEngine(delay=0.3), config=config)  # type: ignore[arg-type]
    with TestClient(app=app) as c:
        wait_ready(c)
        statuses: list[int] = []

        def call() -> None:
            r = c.post("/judge", json={"prompt": "x", "choices": ["a", "b"]})
            statuses.append(r.status_code)
            if r.status_code == 503:
                assert r.headers["Retry-After"] == "1"
                assert "retry later" in r.json()["detail"]

        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert 200 in statuses and 503 in statuses
        assert c.get("/health").status_code == 200


def test_unexpected_errors_are_a_bare_500(tmp_path: Path) -> None:
    app = create_app(SlowEngine(delay=0, fail=True), config=ServiceConfig(profiles_dir=tmp_path))  # type: ignore[arg-type]
    with TestClient(app=app) as c:
        wait_ready(c)
        r = c.post("/judge", json={"prompt": "x", "choices": ["a", "b"]})
        assert r.status_code == 500
        assert r.json() == {"status_code": 500, "detail": "Internal Server Error"}
        assert "secret" not in r.text
        assert c.get("/health").status_code == 200


def test_not_ready_until_loaded(tmp_path: Path, judge: Judge) -> None:
    gate = threading.Event()

    def slow_loader() -> Judge:
        gate.wait(30)
        return judge

    app = create_app(loader=slow_loader, config=ServiceConfig(profiles_dir=tmp_path))
    with TestClient(app=app) as c:
        r = c.get("/ready")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        r = c.post("/judge", json={"prompt": "x", "choices": ["a", "b"]})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert c.get("/health").status_code == 200
        gate.set()
        wait_ready(c)
        assert json.loads(c.get("/ready").text)["model"] == judge.model_id
