"""The HTTP contract, in process: every endpoint and every 4xx, on the real default model."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from fakes import FakeEngine, judgment_of
from litestar.testing import TestClient
from server import wait_app_ready as wait_ready

from calibration import (
    CalibrationProfile,
    FitSettings,
    LabeledScores,
    Provenance,
    decode_profile,
    fit_profile,
)
from calibration.gate import Gate, Overrides
from calibration.maps.map_types import MAX_PROBE_WEIGHTS, Probe
from calibration.maps.probe import candidate_layers
from calibration.tasks import load_split, load_task, task_prompt
from judge import (
    Engine,
    Fingerprint,
    Judge,
    Judgment,
    Prepared,
    Query,
)
from service import ServiceConfig, create_app
from service.operations import PARAMETER_PATTERN

SPAM = "Is this SMS spam? WINNER!! You have won a free cruise, text CLAIM to 80082 now."
EXAMPLES = [
    ("Free entry in a weekly draw to win concert tickets! Text WIN to 80808 now", "spam"),
    ("URGENT! Your mobile number has won a 2000 pound prize. Call 09061234567 to claim", "spam"),
    ("Congratulations, you have been selected for a cash reward. Reply YES to collect", "spam"),
    ("You have 1 new voicemail. Call 0906 555 0199 now to listen, 1.50 per min", "spam"),
    ("Your phone is due a FREE upgrade to the latest model, call our team today", "spam"),
    ("Claim your 100 pound shopping voucher now! Text SHOP to 85023, T&Cs apply", "spam"),
    ("FINAL NOTICE: your parcel is held, pay the 2.99 fee at the link to release it", "spam"),
    ("Hot singles in your area want to chat! Reply DATE to 69121, 3 pounds per msg", "spam"),
    ("Your bank account has been suspended, verify your details at the link below", "spam"),
    ("You are a WINNER of our weekly quiz, reply with your name to get the prize", "spam"),
    ("Cheap loans approved in minutes, no credit checks! Text LOAN to 60300", "spam"),
    ("Get 50% off ringtones this week only, text TONE to 87070 to subscribe", "spam"),
    ("Ok, see you at the station at 6", "ham"),
    ("I'm running late, the bus hasn't come yet. Start without me", "ham"),
    ("Sorry, I'll call you later, I'm in a meeting", "ham"),
    ("Did you remember to feed the cat this morning?", "ham"),
    ("Happy birthday! Hope you have a lovely day, see you Saturday", "ham"),
    ("Can you pick up some bread and milk on your way home?", "ham"),
    ("The film starts at 8, shall we eat before?", "ham"),
    ("Thanks for lunch today, it was great to catch up", "ham"),
    ("Mum says dinner is at 7, don't be late", "ham"),
    ("Just got home, the traffic was awful. Talk tomorrow?", "ham"),
    ("Is that seriously how you spell his name?", "ham"),
    ("K, I'll be there around 8", "ham"),
]


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
    schema = client.get("/schema/openapi.json").json()
    assert "/judge" in schema["paths"]
    assert "security" not in schema  # no API key, no security scheme


def test_judge_matches_the_engine(client: TestClient[Any], judge: Judge) -> None:
    status, body = post(client, {"prompt": SPAM, "choices": ["spam", "ham"], "return_prompt": True})
    assert status == 200
    alone = judge.judge(SPAM, ["spam", "ham"])
    assert body["raw_probabilities"] == pytest.approx(alone.probabilities, abs=1e-6)
    # No profile: the identity map, softmax of the log-probabilities again (to the last ulp).
    assert body["probabilities"] == pytest.approx(body["raw_probabilities"], rel=1e-12, abs=1e-15)
    assert body["choice"] == alone.choice and body["confidence"] == pytest.approx(alone.confidence)
    assert body["prompt"] == alone.prompt and body["model"] == judge.model_id
    assert body["threshold"] is None and body["profile"] is None and body["certified"] is False
    assert body["prediction_set"] is None and body["temperature"] is None
    # No profile, no certificate: escalated whatever the confidence, with the code that says so.
    assert body["decision"] == "escalate" and body["reason_codes"] == ["uncalibrated"]
    assert len(body["reasons"]) == 1 and "uncertified_threshold" in body["reasons"][0]


def test_threshold_routes(client: TestClient[Any]) -> None:
    # A threshold with no certificate to override is refused, naming the field and the opt-in.
    status, refused = post(client, {"prompt": SPAM, "choices": ["spam", "ham"], "threshold": 0.5})
    assert status == 422 and refused["field"] == "threshold"
    assert "uncertified_threshold" in refused["detail"]
    # The opt-in accepts on uncalibrated confidence, and says it is uncertified.
    opt_in = {"prompt": SPAM, "choices": ["spam", "ham"], "uncertified_threshold": 0.0}
    _, low = post(client, opt_in)
    assert low["decision"] == "accept" and low["reasons"] == [] and low["reason_codes"] == []
    assert low["certified"] is False
    _, high = post(client, {**opt_in, "uncertified_threshold": 1.0})
    assert high["decision"] == "escalate" and high["reason_codes"] == ["below_threshold"]
    assert "below the threshold 1.0000" in high["reasons"][0]
    assert high["threshold"] == 1.0 and high["certified"] is False
    _, mass = post(
        client,
        {**opt_in, "min_choice_mass": 1.0},
    )
    assert mass["decision"] == "escalate" and mass["reason_codes"] == ["low_choice_mass"]
    assert "choice mass" in mass["reasons"][0]


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"prompt": "x"}, 400, "choices"),
        ({"choices": ["a", "b"]}, 400, "prompt"),
        ({"prompt": "x", "choices": []}, 400, "choices"),
        ({"prompt": "x", "choices": ["a"]}, 400, "choices"),
        ({"prompt": "x", "choices": ["a", "a"]}, 400, "choices"),  # uniqueItems in the schema
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
        # Schema-valid, but "1" is a prefix of "10" with nothing after: cannot be told apart.
        ({"prompt": "x", "choices": ["1", "10"], "response_suffix": ""}, 422, "choices"),
        # Strict types: a number as a string is not a number.
        ({"prompt": "x", "choices": ["a", "b"], "threshold": "0.5"}, 400, "threshold"),
        ({"prompt": "x", "choices": ["a", "b"], "return_prompt": "true"}, 400, "return_prompt"),
        ({}, 400, "prompt"),
        ([], 400, "body"),
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
    # A budget above the model's window (8192), so that the model's own limit is what refuses.
    config = ServiceConfig(
        profiles_dir=tmp_path, max_request_tokens=20_000, max_batch_tokens=20_000
    )
    # The engine packs to the server's budget: one number everywhere.
    engine = Judge(judge.model, judge.tokenizer, model_id=judge.model_id, max_batch_tokens=20_000)
    app = create_app(engine, config=config)
    with TestClient(app=app) as c:
        wait_ready(c)
        status, body = post(c, {"prompt": "word " * 9000, "choices": ["a", "b"]})
        assert status == 422 and body["field"] == "prompt" and "context window" in body["detail"]
        # The overflow is the system prompt's: the error says so.
        status, body = post(c, {"prompt": "x", "system": "word " * 9000, "choices": ["a", "b"]})
        assert status == 422 and body["field"] == "system"


def test_token_budget_refuses_before_any_work(client: TestClient[Any]) -> None:
    long = "word " * 5000  # about 5,000 tokens: over the default budget of 4,096
    status, body = post(client, {"prompt": long, "choices": ["a", "b"]})
    assert status == 413 and body["field"] == "prompt" and "4096" in body["detail"]
    # Longer than the model's context window (8,192) as well: still the server's 413, since
    # its budget is the smaller limit, not the engine's 422.
    status, body = post(client, {"prompt": "word " * 9000, "choices": ["a", "b"]})
    assert status == 413 and body["field"] == "prompt" and "4096" in body["detail"], body
    # The budget counts what the pass feeds: choices that share a long head before they differ
    # feed it all; a long tail after the choices part ways is never fed, and costs nothing.
    dense = "a " * 5000  # 5,000 tokens in 10 kB: two fit under the body limit
    status, body = post(client, {"prompt": "x", "choices": [dense + "x", dense + "y"]})
    assert status == 413 and body["field"] == "choices"
    status, body = post(client, {"prompt": "x", "choices": ["a", long]})
    assert status == 200
    status, body = post(client, {"prompt": "x", "response_prefix": long, "choices": ["a", "b"]})
    assert status == 413 and body["field"] == "response_prefix"
    # In a batch, the long item gets its 413 in its place; the other is judged.
    status, body = post(
        client,
        {
            "items": [
                {"prompt": long, "choices": ["a", "b"]},
                {"prompt": SPAM, "choices": ["a", "b"]},
            ]
        },
        "/judge/batch",
    )
    first, second = body["results"]
    assert status == 200 and first["status_code"] == 413 and second["type"] == "judgment"
    status, body = post(
        client,
        {"context": long, "questions": [{"prompt": "Is it long?", "choices": ["yes", "no"]}]},
        "/judge/batch",
    )
    assert status == 413 and body["field"] == "context"
    before = client.get("/metrics").text
    assert 'judge_model_jobs{outcome="run"}' in before


def test_malformed_json_wrong_content_type_and_oversized_body(client: TestClient[Any]) -> None:
    r = client.post("/judge", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["field"] == "body" and r.json()["detail"]
    r = client.post("/judge", content=b"prompt=x", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["field"] == "content-type"
    body = b'{"prompt": "x", "choices": ["a", "b"]}'
    r = client.post("/judge", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 415  # JSON in disguise is still not declared JSON
    r = client.post("/judge", content=b"", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["field"] == "body" and "empty" in r.json()["detail"]
    # Deep nesting was a RecursionError and a bare 500; decoding into the schema's types
    # stops at the first value of the wrong type instead.
    for deep, field in [
        (b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b', "choices": ["a", "b"]}', "prompt"),
        (b"[" * 20_000 + b"]" * 20_000, "body"),
        (b'{"a":' * 5_000 + b"1" + b"}" * 5_000, "a"),
    ]:
        r = client.post("/judge", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["field"] == field
    r = client.post("/judge", json={"prompt": "x" * 60_000, "choices": ["a", "b"]})
    assert r.status_code == 413 and r.json()["field"] == "body"


@pytest.mark.parametrize(
    ("method", "path", "headers", "field"),
    [
        ("POST", "/profiles/)/fit", {}, "name"),
        ("POST", f"/profiles/{'x' * 65}/fit", {}, "name"),
        ("POST", "/judgments/.hidden/label", {}, "judgment_id"),
        ("POST", "/judge", {"X-Request-Timeout": "soon"}, "X-Request-Timeout"),
        ("POST", "/profiles/sms/fit", {"X-Request-Timeout": "0"}, "X-Request-Timeout"),
        ("GET", "/profiles/)", {}, "name"),
        ("DELETE", "/profiles/)", {}, "name"),
        ("GET", "/profiles/-sms/health", {}, "name"),
        ("GET", "/judgments/)", {}, "judgment_id"),
    ],
)
def test_a_path_parameter_or_header_the_schema_refuses_is_a_400_before_the_body(
    client: TestClient[Any], method: str, path: str, headers: dict[str, str], field: str
) -> None:
    # A POST's body is over the module's max_body_bytes (50,000): read first, it would be a
    # 413 for the body, and the fault the schema names would go unsaid (`make fuzz` found it).
    content = b"x" * 60_000 if method == "POST" else b""
    r = client.request(
        method, path, content=content, headers={"content-type": "application/json", **headers}
    )
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field and r.json()["detail"], r.json()
    if field != "X-Request-Timeout":  # the pattern the document declares (see the next test)
        assert PARAMETER_PATTERN in r.json()["detail"]


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
    assert status == 400 and body["field"] == "questions"  # the shared shape, incomplete
    status, body = post(client, {"items": [], "context": context}, "/judge/batch")
    assert status == 400 and body["field"] == "items"  # both shapes


@pytest.fixture(scope="module")
def fitted(client: TestClient[Any]) -> dict[str, Any]:
    """The "sms" profile, fitted over HTTP on EXAMPLES with the default template."""
    fit = {"choices": ["spam", "ham"], "examples": [{"prompt": p, "label": y} for p, y in EXAMPLES]}
    r = client.post("/profiles/sms/fit", json=fit)
    assert r.status_code == 200, r.text
    profile: dict[str, Any] = r.json()
    return profile


def test_profiles_fit_use_list_get_put_delete(
    client: TestClient[Any], judge: Judge, fitted: dict[str, Any]
) -> None:
    profile = fitted
    assert profile["name"] == "sms" and profile["n_examples"] == len(EXAMPLES)
    assert profile["fingerprint"] == msgspec.to_builtins(judge.fingerprint())
    summaries = {p["name"]: p for p in client.get("/profiles").json()}
    assert summaries["sms"]["calibration_map"] == {
        "method": profile["calibration_map"]["method"],
        "temperature": decode_profile(json.dumps(profile)).calibration_map.temperature,
    }
    assert client.get("/profiles/sms").json() == profile

    status, body = post(client, {"prompt": SPAM, "choices": ["ham", "spam"], "profile": "sms"})
    assert status == 200 and body["profile"] == "sms"
    assert body["temperature"] == summaries["sms"]["calibration_map"]["temperature"]
    assert sum(body["probabilities"].values()) == pytest.approx(1.0)
    assert list(body["probabilities"]) == list(body["raw_probabilities"]) == ["ham", "spam"]
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

    elsewhere = {**profile["fingerprint"], "model": "someone-elses-model"}
    other = {**profile, "name": "other", "fingerprint": elsewhere}
    assert client.put("/profiles/other", json=other).status_code == 200
    status, body = post(client, {"prompt": SPAM, "choices": ["spam", "ham"], "profile": "other"})
    assert status == 422 and body["field"] == "model"
    assert client.put("/profiles/mismatch", json=other).json()["field"] == "name"
    # Issue 10: nonsense that PUT used to store and serve. Breaking a type's constraint is a
    # 400 naming the field; breaking a rule across fields (or finiteness) is a 422.
    changes: list[tuple[dict[str, Any], int, str]] = [
        ({"threshold": {**profile["threshold"], "threshold": -5.0}}, 400, "threshold.threshold"),
        ({"n_examples": -1}, 400, "n_examples"),
        ({"calibration_map": {"method": "temperature", "temperature": 1e-300}}, 400,
         "calibration_map.temperature"),
        ({"calibration_map": {"method": "bias_temperature", "temperature": 1.0,
                              "bias": [1e308, -1e308]}}, 400, "calibration_map.bias[0]"),
        ({"calibration_map": {"method": "bias_temperature", "temperature": 1.0,
                              "bias": [0.0, 0.0, 0.0]}}, 422, "body"),
        ({"split": {**profile["split"], "fit": 10**6}}, 422, "split"),
    ]  # fmt: skip
    for change, status, field in changes:
        r = client.put("/profiles/other", json={**other, **change})
        assert (r.status_code, r.json()["field"]) == (status, field), r.text
    broken = {
        **other,
        "name": "broken",
        "calibration_map": {"method": "temperature", "temperature": -1},
    }
    assert client.put("/profiles/broken", json=broken).status_code == 400
    assert client.put("/profiles/broken", json={"name": "broken"}).status_code == 400
    # A profile saved by the previous version (format 2: the fingerprint's fields at the top
    # level) is accepted and stored in this format, as files are.
    rest = {k: v for k, v in profile.items() if k != "fingerprint"}
    flat = {**rest, **profile["fingerprint"], "name": "old", "format_version": 2}
    assert client.put("/profiles/old", json=flat).status_code == 200
    stored = client.get("/profiles/old").json()
    assert stored["format_version"] == 3 and stored["fingerprint"] == profile["fingerprint"]

    assert client.delete("/profiles/other").status_code == 204
    assert client.get("/profiles/other").status_code == 404
    assert client.delete("/profiles/other").status_code == 404

    bad = {"choices": ["spam", "ham"], "examples": [{"prompt": "x", "label": "eggs"}] * 20}
    r = client.post("/profiles/x/fit", json=bad)
    assert r.status_code == 422 and r.json()["field"] == "examples[0].label"
    few = {"choices": ["spam", "ham"], "examples": [{"prompt": "x", "label": "spam"}] * 19}
    r = client.post("/profiles/x/fit", json=few)
    assert r.status_code == 400 and r.json()["field"] == "examples"
    r = client.post("/profiles/x/fit", json={"choices": ["spam", "ham"], "examples": []})
    assert r.status_code == 400 and r.json()["field"] == "examples"
    one_label = [{"prompt": p, "label": "ham"} for p, y in EXAMPLES if y == "ham"] * 2
    r = client.post("/profiles/x/fit", json={"choices": ["spam", "ham"], "examples": one_label})
    assert r.status_code == 422 and r.json()["field"] == "examples"
    assert "have the label" in r.json()["detail"]
    assert client.get("/profiles/x").status_code == 404


def test_the_response_is_the_profiles_own_decision(
    client: TestClient[Any], judge: Judge, fitted: dict[str, Any]
) -> None:
    """One object decides: the service answers what a Gate says, in Python, directly."""
    profile = decode_profile(client.get("/profiles/sms").content)
    prompts = [SPAM, "Is this SMS spam? See you at 8 for dinner?"]
    overrides: list[dict[str, float]] = [
        {},
        {"uncertified_threshold": 0.5},
        {"min_choice_mass": 0.5},
    ]
    for prompt in prompts:
        for override in overrides:
            request = {"prompt": prompt, "choices": ["ham", "spam"], "profile": "sms", **override}
            status, body = post(client, request)
            assert status == 200, body
            expected = Gate(
                profile,
                overrides=Overrides(
                    uncertified_threshold=override.get("uncertified_threshold"),
                    min_choice_mass=override.get("min_choice_mass"),
                ),
            ).decide(judge.judge(prompt, ["ham", "spam"]))
            assert body["decision"] == expected.decision
            assert body["reasons"] == expected.reasons
            assert body["reason_codes"] == expected.reason_codes
            assert body["threshold"] == expected.threshold
            assert body["certified"] == expected.certified
            assert body["prediction_set"] == expected.prediction_set
            assert body["choice"] == expected.choice
            assert body["confidence"] == pytest.approx(expected.confidence, abs=1e-6)
            assert body["probabilities"] == pytest.approx(expected.probabilities, abs=1e-6)
            assert body["choice_mass"] == pytest.approx(expected.choice_mass, abs=1e-6)


def test_threshold_precedence_and_certification(
    client: TestClient[Any], fitted: dict[str, Any]
) -> None:
    ask = {"prompt": SPAM, "choices": ["spam", "ham"]}
    # The fitted profile's own threshold applies when the request sets none.
    _, body = post(client, {**ask, "profile": "sms"})
    certified = fitted["threshold"]["threshold"]
    if certified is None:  # too few examples to certify one: everything escalates
        assert body["threshold"] is None and body["certified"] is False
        assert body["decision"] == "escalate"
        assert "no_certified_threshold" in body["reason_codes"]
    else:
        assert body["threshold"] == certified and body["certified"] is True

    # Both cases, whatever the fit gave: a profile that certifies 0.6, one that certifies none.
    uncertified = {"feasible": False, "threshold": None, "reason": "too few examples"}
    profiles = {
        "certified": {**fitted["threshold"], "feasible": True, "threshold": 0.6},
        "uncertified": {**fitted["threshold"], **uncertified},
    }
    for name, threshold in profiles.items():
        r = client.put(f"/profiles/{name}", json={**fitted, "name": name, "threshold": threshold})
        assert r.status_code == 200, r.text
    try:
        _, body = post(client, {**ask, "profile": "certified"})
        assert body["threshold"] == 0.6 and body["certified"] is True
        assert "no_certified_threshold" not in body["reason_codes"]
        # The server keeps the gate it opened; a new version of the profile is another gate.
        again = {**fitted["threshold"], "feasible": True, "threshold": 0.7}
        r = client.put(
            "/profiles/certified", json={**fitted, "name": "certified", "threshold": again}
        )
        _, replaced = post(client, {**ask, "profile": "certified"})
        assert replaced["threshold"] == 0.7 and replaced["profile_etag"] == r.headers["etag"]
        assert replaced["profile_etag"] != body["profile_etag"]
        back = {**fitted, "name": "certified", "threshold": profiles["certified"]}
        assert client.put("/profiles/certified", json=back).headers["etag"] == body["profile_etag"]
        _, body = post(client, {**ask, "profile": "certified", "threshold": 0.75})
        assert body["threshold"] == 0.75 and body["certified"] is False
        _, body = post(client, {**ask, "profile": "certified", "min_choice_mass": 0.01})
        assert body["threshold"] == 0.6 and body["certified"] is False

        _, body = post(client, {**ask, "profile": "uncertified"})
        assert body["threshold"] is None and body["certified"] is False
        assert body["decision"] == "escalate"
        assert body["reason_codes"][0] == "no_certified_threshold"
        assert "too few examples" in body["reasons"][0]
        status, body = post(client, {**ask, "profile": "uncertified", "threshold": 0.0})
        assert status == 422 and body["field"] == "threshold"
        opt_in = {**ask, "profile": "uncertified", "uncertified_threshold": 0.0}
        _, body = post(client, opt_in)
        assert body["threshold"] == 0.0 and body["certified"] is False
        assert "no_certified_threshold" not in body["reason_codes"]
        # Where a certificate exists, the opt-in does not apply: the certified rule does.
        _, body = post(client, {**opt_in, "profile": "certified"})
        assert body["threshold"] == 0.6 and body["certified"] is True
    finally:
        for name in profiles:
            client.delete(f"/profiles/{name}")


def test_api_key(judge: Judge, tmp_path: Path) -> None:
    app = create_app(judge, config=ServiceConfig(profiles_dir=tmp_path, api_key="s3cret"))
    refused = {
        "status_code": 401,
        "detail": "missing or wrong API key: send 'Authorization: Bearer <key>'",
        "field": "Authorization",
    }
    with TestClient(app=app) as c:
        assert c.get("/health").status_code == 200
        for path in ("/ready", "/metrics", "/profiles", "/schema/openapi.json", "/schema"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = c.get(path, headers=headers)
                assert r.status_code == 401 and r.json() == refused, (path, r.text)
                assert r.headers["WWW-Authenticate"] == "Bearer"
        # The guard runs before the body is read: a broken or oversized body is still a 401.
        for content in (b'{"prompt": ', b"x" * 2_000_000):
            r = c.post("/judge", content=content, headers={"content-type": "application/json"})
            assert r.status_code == 401 and r.json() == refused
        auth = {"Authorization": "Bearer s3cret"}
        wait_ready(c, auth)
        r = c.post("/judge", json={"prompt": SPAM, "choices": ["spam", "ham"]}, headers=auth)
        assert r.status_code == 200
        r = c.post("/judge", json={"prompt": SPAM, "choices": ["spam", "ham"]})
        assert r.status_code == 401 and r.json() == refused
        schema = c.get("/schema/openapi.json", headers=auth).json()
        assert schema["components"]["securitySchemes"] == {
            "BearerAuth": {"type": "http", "scheme": "bearer"}
        }
        assert schema["security"] == [{"BearerAuth": []}]
        assert 'route="/judge",status="401"' in c.get("/metrics", headers=auth).text


class SlowEngine(FakeEngine):
    """A stand-in engine for the error paths of the service's own machinery."""

    def __init__(self, delay: float, fail: bool = False) -> None:
        self.delay, self.fail = delay, fail

    def run(self, prepared: Sequence[Prepared]) -> list[Judgment]:
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("secret internal detail")
        return super().run(prepared)


def test_queue_full_and_timeout_answer_503(tmp_path: Path) -> None:
    # One place, passes of 1 s, 8 requests at once: those still at the door after its 2 s
    # wait get a 503, and whatever else runs out of the 3 s deadline too. The first request
    # has 2 s to spare on any machine (a 0.5 s deadline over 0.3 s passes left 0.2 s, which a
    # busy machine could spend before the first pass ended, and then no request got a 200).
    config = ServiceConfig(
        profiles_dir=tmp_path, max_queue=1, max_batch_size=1, request_timeout_s=3.0
    )
    app = create_app(SlowEngine(delay=1.0), config=config)
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
    app = create_app(SlowEngine(delay=0, fail=True), config=ServiceConfig(profiles_dir=tmp_path))
    with TestClient(app=app) as c:
        wait_ready(c)
        r = c.post("/judge", json={"prompt": "x", "choices": ["a", "b"]})
        assert r.status_code == 500
        assert r.json() == {"status_code": 500, "detail": "Internal Server Error"}
        assert "secret" not in r.text
        assert c.get("/health").status_code == 200


class _Lines(logging.Handler):
    """The messages of one logger, kept (the app's logging set-up may replace the root's
    handlers, pytest's included)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


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
        logger, lines = logging.getLogger("judge.service"), _Lines()
        level, logger.level = logger.level, logging.INFO
        logger.addHandler(lines)
        try:
            gate.set()
            wait_ready(c)
        finally:
            logger.removeHandler(lines)
            logger.setLevel(level)
        body = json.loads(c.get("/ready").text)
        assert body["model"] == judge.model_id
    # The ready line names the decoder: the default model takes the lean pass.
    ready = [line for line in lines.lines if line.startswith("ready:")]
    assert len(ready) == 1 and "batch-invariant True, lean pass; arithmetic " in ready[0], ready
    # It and /ready say which chunk and block sizes this machine's kernels measured.
    arithmetic = body["arithmetic"]
    assert arithmetic == judge.arithmetic and ready[0].endswith(arithmetic)
    assert re.search(
        r"products \((oneDNN|MKL|F\.linear)( and \w+)*\) in chunks of \d+( or \d+)* rows"
        r"( \(a pass's last rows in products of [\d, -]+ rows\))?, attention in "
        r"blocks of \d+ queries, (short blocks read [\d, -]+ keys|keys in blocks of 512)",
        arithmetic,
    )


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_config_refuses_defaults_outside_0_1(value: float) -> None:
    with pytest.raises(ValueError, match="uncertified_threshold"):
        ServiceConfig(uncertified_threshold=value)
    with pytest.raises(ValueError, match="min_choice_mass"):
        ServiceConfig(min_choice_mass=value)


def test_a_fake_engine_serves_the_same_contract(tmp_path: Path) -> None:
    engine: Engine = SlowEngine(delay=0)  # satisfies the protocol, no type: ignore
    app = create_app(engine, config=ServiceConfig(profiles_dir=tmp_path, uncertified_threshold=0.4))
    with TestClient(app=app) as c:
        wait_ready(c)
        status, body = post(c, {"prompt": "x", "choices": ["a", "b"]})
        assert status == 200 and body["decision"] == "accept" and body["threshold"] == 0.4
        status, body = post(c, {"prompt": "x", "choices": ["a", "b", "c"]})
        assert body["decision"] == "escalate" and body["reason_codes"] == ["below_threshold"]
        assert c.get("/ready").json() == {
            "status": "ready",
            "model": "fake",
            "dtype": "float32",
            "batch_invariant": True,
        }


def test_metrics_export_the_prefix_cache(client: TestClient[Any], judge: Judge) -> None:
    def value(text: str, name: str) -> float:
        match = re.search(rf"^{name} (\S+)$", text, re.M)
        assert match, f"{name} is not exported"
        return float(match.group(1))

    before = client.get("/metrics").text
    for _ in range(2):
        assert post(client, {"prompt": SPAM + " Reply now.", "choices": ["spam", "ham"]})[0] == 200
    after = client.get("/metrics").text
    assert value(after, "judge_prefix_cache_hits_total") > value(
        before, "judge_prefix_cache_hits_total"
    )
    assert value(after, "judge_prefix_cache_tokens_reused_total") > 0
    assert (
        0
        < value(after, "judge_prefix_cache_bytes")
        <= value(after, "judge_prefix_cache_budget_bytes")
    )
    assert judge.prefix_cache is not None
    assert value(after, "judge_prefix_cache_bytes") == judge.prefix_cache.stats().bytes
    assert (
        "judge_prefix_cache_evictions_total" in after and "judge_prefix_cache_misses_total" in after
    )


def test_scores_over_http(client: TestClient[Any], judge: Judge) -> None:
    prompt = "Rate from 1 to 5 how much this message sounds like spam: WIN A FREE CRUISE NOW"
    grades = ["1", "2", "3", "4", "5"]
    status, body = post(client, {"prompt": prompt, "choices": ["yes", "no"]})
    assert status == 200 and "expected_value" not in body  # not numerals, no values: no score
    status, body = post(client, {"prompt": prompt, "choices": grades, "max_std": 10.0})
    p = judge.judge(prompt, grades).probabilities
    mean = sum(float(c) * q for c, q in p.items())
    assert status == 200 and body["expected_value"] == pytest.approx(mean, abs=1e-4)
    assert body["std"] == pytest.approx(
        sum(q * (float(c) - mean) ** 2 for c, q in p.items()) ** 0.5, abs=1e-4
    )
    assert body["max_std"] == 10.0 and "high_std" not in body["reason_codes"]
    values = {"1": 0.0, "2": 25.0, "3": 50.0, "4": 75.0, "5": 100.0}
    status, body = post(
        client, {"prompt": prompt, "choices": grades, "values": values, "max_std": 0.0}
    )
    assert body["expected_value"] == pytest.approx(25 * (mean - 1), abs=1e-3)
    assert body["decision"] == "escalate" and "high_std" in body["reason_codes"]
    bad_requests: list[tuple[dict[str, Any], str]] = [
        ({"choices": ["yes", "no"], "max_std": 1.0}, "values"),  # not numerals, no values
        ({"choices": grades, "values": {"1": 1.0}}, "values"),  # misses choices
        ({"choices": grades, "values": values, "max_std": -1.0}, "max_std"),
    ]
    for bad, field in bad_requests:
        status, body = post(client, {"prompt": prompt, **bad})
        assert 400 <= status < 500 and body["field"] == field, body


# --- probe profiles: a learned head on the hidden state, served and fitted over HTTP --------

H = 8  # the fake's hidden size
NUM_LAYERS = 4
JSON = {"content-type": "application/json"}


def hidden_state(prompt: str, layer: int, size: int = H) -> np.ndarray:
    """The fake's hidden state of ``layer`` for ``prompt``: the same every time it is asked."""
    return np.random.default_rng([zlib.crc32(prompt.encode()), layer]).standard_normal(size)


class FeatureEngine(FakeEngine):
    """A fake with ``num_layers`` blocks of ``hidden_size``: judgments carry hidden states.

    Probabilities and hidden states are drawn from the prompt, so a query always gets the same
    numbers; the ``feature_layers`` of every query judged are recorded in ``asked``. The
    mean over the item of a ``span_layers`` layer is drawn from the item's text (the marked
    span, else the whole prompt).
    """

    def __init__(self, num_layers: int = NUM_LAYERS, hidden_size: int = H) -> None:
        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.asked: list[tuple[int, ...]] = []

    def fingerprint(
        self,
        *,
        system: str | None = None,
        response_prefix: str | None = None,
        response_suffix: str | None = None,
    ) -> Fingerprint:
        fingerprint = super().fingerprint(
            system=system, response_prefix=response_prefix, response_suffix=response_suffix
        )
        shape = {"num_layers": self.num_layers, "hidden_size": self.hidden_size}
        return msgspec.structs.replace(fingerprint, **shape)

    def judgment(self, query: Query) -> Judgment:
        self.asked.append(tuple(query.feature_layers))
        rng = np.random.default_rng(zlib.crc32(query.prompt.encode()))
        p = rng.dirichlet(np.ones(len(query.choices)))
        made = judgment_of(dict(zip(query.choices, p.tolist(), strict=True)), prompt=query.prompt)
        features = {
            n: hidden_state(query.prompt, n, self.hidden_size).tolist()
            for n in query.feature_layers
        }
        span = query.item_span or (0, len(query.prompt))
        item = "mean over " + query.prompt[span[0] : span[1]]
        means = {n: hidden_state(item, n, self.hidden_size).tolist() for n in query.span_layers}
        return msgspec.structs.replace(
            made, features=features or None, span_features=means or None, item_span=query.item_span
        )


def probe_profile(name: str = "probe", n: int = 150) -> CalibrationProfile:
    """A probe on layer 2 of the fake, fitted on synthetic hidden states whose first value
    decides the label, with log-probabilities that carry no signal."""
    rng = np.random.default_rng(0)
    features = rng.standard_normal((n, 1, H))  # (n, m, H)
    y = (features[:, 0, 0] + 0.3 * rng.standard_normal(n) > 0).astype(int)
    z = np.log(rng.dirichlet(np.ones(2), n))  # (n, k)
    profile = fit_profile(
        name,
        LabeledScores(z, np.ones(len(y)), y, features=features, feature_layers=(2,)),
        ["yes", "no"],
        Provenance(
            fingerprint=FeatureEngine().fingerprint(), dataset="synthetic", dataset_sha256="0" * 64
        ),
        FitSettings(methods=["probe"]),
    ).profile
    assert profile.calibration_map.method == "probe" and profile.feature_layers == (2,)
    assert (profile.fingerprint.num_layers, profile.fingerprint.hidden_size) == (NUM_LAYERS, H)
    return profile


@pytest.fixture(scope="module")
def probe() -> CalibrationProfile:
    return probe_profile()


def served(engine: Engine, tmp_path: Path, **options: Any) -> TestClient[Any]:
    return TestClient(
        app=create_app(engine, config=ServiceConfig(profiles_dir=tmp_path, **options))
    )


def put(c: TestClient[Any], profile: CalibrationProfile | bytes, name: str = "probe") -> Any:
    body = profile if isinstance(profile, bytes) else msgspec.json.encode(profile)
    return c.put(f"/profiles/{name}", content=body, headers=JSON)


def test_a_probe_profile_is_served_with_the_hidden_states_it_reads(
    probe: CalibrationProfile, tmp_path: Path
) -> None:
    engine = FeatureEngine()
    choices = ["no", "yes"]  # the profile's, in another order

    def expected(prompt: str) -> Any:
        query = Query(prompt=prompt, choices=choices, feature_layers=probe.feature_layers)
        return Gate(probe).decide(engine.judgment(query))

    with served(engine, tmp_path) as c:
        wait_ready(c)
        assert put(c, probe).status_code == 200
        prompts = ["Is it so?", "Is it not?", "Who knows?"]
        for prompt in prompts:
            engine.asked.clear()
            status, body = post(c, {"prompt": prompt, "choices": choices, "profile": "probe"})
            assert status == 200, body
            assert engine.asked == [(2,)]  # exactly the probe's layers, once
            want = expected(prompt)
            assert body["probabilities"] == pytest.approx(want.probabilities, rel=1e-12)
            assert list(body["probabilities"]) == choices
            assert body["probabilities"] != pytest.approx(body["raw_probabilities"], abs=1e-3)
            assert (body["choice"], body["decision"]) == (want.choice, want.decision)
            assert body["threshold"] == want.threshold and body["certified"] == want.certified
            assert body["prediction_set"] == want.prediction_set
            # Honest about what calibrated it, and the hidden states stay on the server.
            assert body["calibration_method"] == "probe" and body["feature_layers"] == [2]
            assert body["temperature"] is None and "features" not in body

        # Without a profile, or with a temperature profile, no hidden state is asked for.
        engine.asked.clear()
        status, body = post(c, {"prompt": prompts[0], "choices": choices})
        assert status == 200 and engine.asked == [()]
        assert "calibration_method" not in body and "feature_layers" not in body

        # A batch: each item asks for what its own policy reads.
        engine.asked.clear()
        items = [{"prompt": p, "choices": choices, "profile": "probe"} for p in prompts]
        status, body = post(
            c, {"items": [*items, {"prompt": "x", "choices": choices}]}, "/judge/batch"
        )
        assert status == 200 and sorted(engine.asked) == [(), (2,), (2,), (2,)]
        for prompt, got in zip(prompts, body["results"], strict=False):
            assert got["probabilities"] == pytest.approx(expected(prompt).probabilities, rel=1e-12)

        # Questions about a shared context (the fake judges the context and the question).
        engine.asked.clear()
        questions = [{"prompt": p, "choices": choices, "profile": "probe"} for p in prompts]
        status, body = post(c, {"context": "Some context.", "questions": questions}, "/judge/batch")
        assert status == 200, body
        assert engine.asked == [(2,)] * len(prompts)
        for prompt, got in zip(prompts, body["results"], strict=True):
            want = expected(f"Some context.\n\n{prompt}")
            assert got["probabilities"] == pytest.approx(want.probabilities, rel=1e-12)
            assert "features" not in got

        # Fitted with the default template: another one is refused, as for any profile.
        engine.asked.clear()
        ask = {"prompt": "x", "choices": choices, "profile": "probe"}
        for change, field in [({"response_prefix": "Answer: "}, "response_prefix"),
                              ({"system": "Be terse."}, "system")]:  # fmt: skip
            status, body = post(c, {**ask, **change})
            assert status == 422 and body["field"] == field, body
        assert engine.asked == []

        summary = next(p for p in c.get("/profiles").json() if p["name"] == "probe")
        assert summary["calibration_map"] == {"method": "probe", "temperature": None, "layers": [2]}


@pytest.mark.parametrize(
    ("engine", "field"),
    [
        (FeatureEngine(num_layers=6), "num_layers"),
        (FeatureEngine(hidden_size=16), "hidden_size"),
        (FakeEngine(), "num_layers"),  # no hidden states at all
    ],
)
def test_a_probe_profile_for_another_shape_of_model_is_refused(
    probe: CalibrationProfile, tmp_path: Path, engine: FakeEngine, field: str
) -> None:
    with served(engine, tmp_path) as c:
        wait_ready(c)
        assert put(c, probe).status_code == 200
        asked = getattr(engine, "asked", [])
        asked.clear()
        status, body = post(c, {"prompt": "x", "choices": ["yes", "no"], "profile": "probe"})
        assert status == 422 and body["field"] == field, body
        assert asked == []  # refused before any model work


def _probe_json(profile: CalibrationProfile, **changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(profile)
    nested = {
        key: {**data[key], **changes.pop(key, {})} for key in ("calibration_map", "fingerprint")
    }
    return {**data, **changes, **nested}


def test_uploaded_probe_weights_are_checked_and_named(
    probe: CalibrationProfile, tmp_path: Path
) -> None:
    w = msgspec.to_builtins(probe)["calibration_map"]["weights"]
    width = len(w[0])
    changes: list[tuple[dict[str, Any], int, str]] = [
        ({"calibration_map": {"weights": [w[0], w[1][:-1]]}}, 422, "calibration_map.weights"),
        ({"calibration_map": {"weights": [*w, w[0]]}}, 422, "calibration_map.weights"),
        ({"calibration_map": {"weights": [[1e7] * width, w[1]]}}, 422, "calibration_map.weights"),
        ({"calibration_map": {"intercept": [1e7, 0.0]}}, 422, "calibration_map.intercept"),
        ({"calibration_map": {"layers": [5]}}, 422, "calibration_map.layers"),
        ({"calibration_map": {"weights": [w[0], "x"]}}, 400, "calibration_map.weights[1]"),
        ({"fingerprint": {"num_layers": 6}}, 422, "fingerprint.num_layers"),
        ({"fingerprint": {"hidden_size": 9}}, 422, "fingerprint.hidden_size"),
    ]
    with served(FeatureEngine(), tmp_path) as c:
        wait_ready(c)
        for change, status, field in changes:
            r = put(c, msgspec.json.encode(_probe_json(probe, **change)))
            assert (r.status_code, r.json()["field"]) == (status, field), (change, r.text)
            assert r.json()["detail"]
        # JSON has no NaN or infinity; a number too large for a float is out of range.
        body = msgspec.json.encode(_probe_json(probe, calibration_map={"weights": ["W", w[1]]}))
        r = put(c, body.replace(b'"W"', b"[" + b",".join([b"1e400"] * width) + b"]"))
        assert (r.status_code, r.json()["field"]) == (400, "calibration_map.weights[0][0]"), r.text
        assert c.get("/profiles/probe").status_code == 404  # nothing was stored
        # JSON Schema's integer includes 4.0, in an optional field too (as num_layers is).
        shape = {"num_layers": 4.0, "hidden_size": 8.0}
        r = put(c, msgspec.json.encode(_probe_json(probe, fingerprint=shape)))
        assert r.status_code == 200 and r.json()["fingerprint"]["num_layers"] == 4, r.text


def test_a_probe_at_the_weight_limit_fits_under_the_profile_body_limit(
    probe: CalibrationProfile, tmp_path: Path
) -> None:
    def widest(extra: int) -> bytes:
        dim = MAX_PROBE_WEIGHTS // 2 - 2 + extra  # 2 choices: 2 * (dim + 2) weights
        weights = np.random.default_rng(1).normal(0, 1e-3, (2, dim + 2)).tolist()
        return msgspec.json.encode(
            _probe_json(
                probe,
                fingerprint={"hidden_size": dim},
                calibration_map={"feature_dim": dim, "weights": weights},
            )
        )

    at_limit, over_limit = widest(0), widest(1)
    config = ServiceConfig()
    assert config.max_body_bytes < len(at_limit) < config.max_profile_bytes
    with served(FeatureEngine(), tmp_path) as c:
        wait_ready(c)
        r = put(c, at_limit)
        assert r.status_code == 200, r.text[:500]
        stored = c.get("/profiles/probe").json()["calibration_map"]
        assert len(stored["weights"]) * len(stored["weights"][0]) == MAX_PROBE_WEIGHTS
        r = put(c, over_limit)
        assert r.status_code == 422 and r.json()["field"] == "calibration_map.weights"
        assert str(MAX_PROBE_WEIGHTS) in r.json()["detail"]
        # Other bodies keep the server's own limit, and its 413 says what it is.
        r = c.post("/judge", json={"prompt": "x" * config.max_body_bytes, "choices": ["a", "b"]})
        assert r.status_code == 413 and r.json()["field"] == "body"
        assert str(config.max_body_bytes) in r.json()["detail"]
    limit = len(at_limit) - 1
    with served(FeatureEngine(), tmp_path / "small", max_profile_bytes=limit) as c:
        wait_ready(c)
        r = put(c, at_limit)
        assert r.status_code == 413 and r.json()["field"] == "body"
        assert str(limit) in r.json()["detail"] and "max_profile_bytes" in r.json()["detail"]
        assert c.get("/profiles/probe").status_code == 404


def probe_examples(n: int) -> list[dict[str, str]]:
    """Prompts whose label is the sign of the fake's layer-2 hidden state: a probe's to find."""
    prompts = [f"Example {i}?" for i in range(n)]
    return [{"prompt": p, "label": "yes" if hidden_state(p, 2)[0] > 0 else "no"} for p in prompts]


def test_fit_a_probe_over_http(tmp_path: Path) -> None:
    engine = FeatureEngine()
    with served(engine, tmp_path) as c:
        wait_ready(c)
        engine.asked.clear()
        few = {"choices": ["yes", "no"], "examples": probe_examples(30), "method": "probe"}
        r = c.post("/profiles/p/fit", json=few)
        assert r.status_code == 422 and r.json()["field"] == "method", r.text
        assert "'probe'" in r.json()["detail"] and "got 30" in r.json()["detail"]
        assert engine.asked == []  # refused before any model work
        r = c.post("/profiles/p/fit", json={**few, "method": "isotonic"})
        assert r.status_code == 400 and r.json()["field"] == "method"

        fit = {"choices": ["yes", "no"], "examples": probe_examples(150), "method": "probe"}
        r = c.post("/profiles/p/fit", json=fit)
        assert r.status_code == 200, r.text
        profile = decode_profile(r.content)
        # The examples were judged with every layer a probe may be chosen among.
        assert set(engine.asked) == {candidate_layers(NUM_LAYERS)} and len(engine.asked) == 150
        assert profile.calibration_map.method == "probe" and profile.feature_layers == (2,)
        assert profile.baseline is not None and profile.fingerprint.num_layers == NUM_LAYERS
        status, body = post(c, {"prompt": "Is it?", "choices": ["yes", "no"], "profile": "p"})
        assert status == 200, body
        query = Query(prompt="Is it?", choices=["yes", "no"], feature_layers=(2,))
        assert body["probabilities"] == pytest.approx(
            Gate(profile).decide(engine.judgment(query)).probabilities, rel=1e-12
        )

        engine.asked.clear()
        r = c.post("/profiles/t/fit", json={**fit, "method": "temperature"})
        assert r.status_code == 200 and set(engine.asked) == {()}
        assert r.json()["calibration_map"]["method"] in ("none", "temperature")

    # An engine without hidden states: "probe" is refused, "auto" fits without one.
    with served(FakeEngine(), tmp_path / "plain") as c:
        wait_ready(c)
        r = c.post("/profiles/p/fit", json=fit)
        assert r.status_code == 422 and r.json()["field"] == "method"
        assert "hidden states" in r.json()["detail"]
        r = c.post("/profiles/p/fit", json={**fit, "method": "auto"})
        assert r.status_code == 200 and "probe not tried" in r.json()["note"]


def test_fit_a_probe_on_marked_items_over_http(tmp_path: Path) -> None:
    """Examples that mark their item: the probe may read the mean over it, and then every
    request to the profile must mark its item too."""
    engine = FeatureEngine()
    items = [f"item number {i}" for i in range(150)]
    examples = [
        {
            "prompt": f"Is this one good? {text} Answer yes or no.",
            "item_span": [18, 18 + len(text)],
            "label": "yes" if hidden_state("mean over " + text, 2)[0] > 0 else "no",
        }
        for text in items
    ]
    with served(engine, tmp_path) as c:
        wait_ready(c)
        mixed = [{**examples[0], "item_span": None}, *examples[1:]]
        fit = {"choices": ["yes", "no"], "method": "probe"}
        r = c.post("/profiles/p/fit", json={**fit, "examples": mixed})
        assert r.status_code == 422 and r.json()["field"] == "examples", r.text
        past = [{**examples[0], "item_span": [0, 999]}, *examples[1:]]
        r = c.post("/profiles/p/fit", json={**fit, "examples": past})
        assert r.status_code == 422 and r.json()["field"] == "examples[0].item_span", r.text
        r = c.post("/profiles/p/fit", json={**fit, "examples": examples})
        assert r.status_code == 200, r.text
        profile = decode_profile(r.content)
        probe = profile.calibration_map
        assert isinstance(probe, Probe)
        assert (probe.layers, probe.reads, probe.span) == ([2], "mean", "item")
        text = "a new item"
        prompt = f"Is this one good? {text} Answer yes or no."
        body = {"prompt": prompt, "choices": ["yes", "no"], "profile": "p"}
        status, refused = post(c, body)
        assert status == 422 and refused["field"] == "item_span", refused
        status, answer = post(c, {**body, "item_span": [18, 18 + len(text)]})
        assert status == 200, answer
        query = Query(
            prompt=prompt, choices=["yes", "no"], span_layers=(2,), item_span=(18, 18 + len(text))
        )
        assert answer["probabilities"] == pytest.approx(
            Gate(profile).decide(engine.judgment(query)).probabilities, rel=1e-12
        )


SST2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2"


@pytest.mark.skipif(not SST2.exists(), reason="the shared datasets are not beside this checkout")
def test_a_probe_fitted_over_http_decides_as_the_profile_does(judge: Judge, tmp_path: Path) -> None:
    """On the real model: fit a probe over HTTP on 120 sst2 items, then judge with it."""
    began = time.perf_counter()
    task = load_task(SST2)
    items, _ = load_split(task, "calibration", limit=123)
    examples = [{"prompt": task_prompt(task, i.text), "label": i.label} for i in items[:120]]
    with served(judge, tmp_path) as c:
        wait_ready(c)
        fit = {"choices": task.choices, "examples": examples, "method": "probe"}
        r = c.post("/profiles/sst2/fit", json=fit)
        assert r.status_code == 200, r.text
        profile = decode_profile(r.content)
        assert profile.calibration_map.method == "probe" and profile.baseline is not None
        shape = (profile.fingerprint.num_layers, profile.fingerprint.hidden_size)
        assert shape == (judge.num_layers, judge.hidden_size)
        fitted = time.perf_counter() - began
        # A pass that reads part of its prompt from the prefix cache differs from one that
        # computes it by float32 noise (about 1e-5 on hidden states of size 100), which the
        # probe's weights carry past 1e-6; from an empty cache both passes compute the same.
        assert judge.prefix_cache is not None
        for item in items[120:]:
            prompt = task_prompt(task, item.text)
            judge.prefix_cache.clear()
            status, body = post(c, {"prompt": prompt, "choices": task.choices, "profile": "sst2"})
            assert status == 200, body
            judge.prefix_cache.clear()
            expected = Gate(profile).judge(judge, prompt, task.choices)
            assert body["probabilities"] == pytest.approx(expected.probabilities, abs=1e-6)
            assert (body["choice"], body["decision"]) == (expected.choice, expected.decision)
            assert body["calibration_method"] == "probe" and body["temperature"] is None
    print(f"probe over HTTP: fitted in {fitted:.1f} s, {time.perf_counter() - began:.1f} s in all")


# --- the table of operations (service.operations) is the one description of the API -------


def test_the_app_s_routes_are_the_operation_table(tmp_path: Path) -> None:
    from service.operations import OPERATIONS, allowed

    app = create_app(FakeEngine(), config=ServiceConfig(profiles_dir=tmp_path))
    served_ops = {
        (method, handler.name, route.path)
        for route in app.routes
        for handler in getattr(route, "route_handlers", [])
        for method in handler.http_methods
        if handler.name is not None and not handler.name.startswith(("options ", "playground"))
    }
    assert served_ops == {(op.method, op.name, op.route) for op in OPERATIONS}
    with TestClient(app=app) as c:
        for op in OPERATIONS:
            path = op.url(**dict.fromkeys(op.parameters, "sms"))
            r = c.options(path)
            assert r.status_code == 204 and r.headers["allow"] == allowed(op.path), path


def test_the_openapi_paths_are_the_operation_table() -> None:
    from service.operations import OPERATIONS
    from service.web.openapi import openapi_document

    for secured in (False, True):
        document = openapi_document(secured=secured)
        got = {
            (method.upper(), path, op["operationId"], op["summary"])
            for path, ops in document["paths"].items()
            for method, op in ops.items()
        }
        documented = [op for op in OPERATIONS if op.documented]
        assert got == {(op.method, op.path, op.operation_id, op.summary) for op in documented}
        for op in documented:
            answers = document["paths"][op.path][op.method.lower()]["responses"]
            auth = () if op.public or not secured else (401,)
            assert set(answers) == {str(s) for s in (op.ok[0], *op.errors, *auth)}
            assert ("requestBody" in document["paths"][op.path][op.method.lower()]) == (
                op.body is not None
            )
            # Every path parameter has the one pattern the front door refuses a value against.
            parameters = document["paths"][op.path][op.method.lower()].get("parameters", [])
            assert [p["name"] for p in parameters if p["in"] == "path"] == list(op.parameters)
            assert all(
                p["schema"]["pattern"] == PARAMETER_PATTERN for p in parameters if p["in"] == "path"
            )
    # The batch body: one of two shapes, each a Struct of its own.
    batch = document["paths"]["/judge/batch"]["post"]["requestBody"]["content"]
    assert batch["application/json"]["schema"] == {
        "oneOf": [
            {"$ref": "#/components/schemas/ItemsBatch"},
            {"$ref": "#/components/schemas/SharedBatch"},
        ]
    }
    # A batch answers an item's repeated choices in its place (200), so its items may repeat;
    # an item is a whole request or an item alone, as POST /judge's bodies are.
    schemas = document["components"]["schemas"]
    assert schemas["JudgeRequest"]["properties"]["choices"]["uniqueItems"] is True
    assert "uniqueItems" not in schemas["BatchJudgeRequest"]["properties"]["choices"]
    assert schemas["ItemsBatch"]["properties"]["items"]["items"] == {
        "oneOf": [
            {"$ref": "#/components/schemas/BatchJudgeRequest"},
            {"$ref": "#/components/schemas/ItemRequest"},
        ]
    }


def test_metric_labels_are_the_operations_paths(tmp_path: Path) -> None:
    """A request's route label is the path template of the operation its route serves; one
    that no operation serves (no such path, or not that method) is "other"."""
    asked = [
        ("GET", "/profiles", "/profiles"),
        ("GET", "/profiles/sms", "/profiles/{name}"),  # a 404: still that operation's
        ("POST", "/profiles/sms/fit", "/profiles/{name}/fit"),  # a 400
        ("GET", "/schema/openapi.json", "/schema/openapi.json"),
        ("GET", "/playground", "other"),
        ("GET", "/profiles/a/b/c", "other"),
        ("DELETE", "/judge", "other"),  # a 405: no route serves it
    ]
    app = create_app(FakeEngine(), config=ServiceConfig(profiles_dir=tmp_path))
    with TestClient(app=app) as c:
        wait_ready(c)
        statuses = [c.request(method, path).status_code for method, path, _ in asked]
        metrics = c.get("/metrics").text
    for (method, _, label), status in zip(asked, statuses, strict=True):
        line = f'judge_http_requests_total{{method="{method}",route="{label}",status="{status}"}}'
        assert line in metrics, line


@pytest.mark.parametrize(
    ("body", "shape", "field"),
    [
        ({"items": []}, "ItemsBatch", None),
        ({"items": [], "context": None, "questions": None}, "ItemsBatch", None),  # older clients
        ({"context": "c", "questions": []}, "SharedBatch", None),
        ({"context": "c", "questions": [], "items": None}, "SharedBatch", None),
        ({}, None, "items"),
        ({"items": None}, None, "items"),
        ({"items": [], "context": "c", "questions": []}, None, "items"),
        ({"items": [], "context": "c"}, None, "items"),
        ({"context": "c"}, None, "questions"),
        ({"questions": []}, None, "context"),
        ({"items": [], "extra": 1}, None, "extra"),
        ([], None, "body"),
    ],
)
def test_a_batch_body_is_one_of_two_shapes(body: Any, shape: str | None, field: str) -> None:
    from service.bodies import BodyError, decode_body
    from service.schemas import BatchRequest

    raw = msgspec.json.encode(body)
    if shape is not None:
        assert type(decode_body(raw, "application/json", BatchRequest)).__name__ == shape
        return
    with pytest.raises(BodyError) as refused:
        decode_body(raw, "application/json", BatchRequest)
    assert refused.value.status == 400 and refused.value.field == field
