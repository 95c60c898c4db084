"""No accept without a certificate: with no profile, every route escalates, on the real model.

The prompt is one the default model is sure of (its raw confidence in "spam" is about 0.998,
the README's first example): before, every route accepted it on that uncalibrated number. Now
each route escalates it with the reason code ``uncalibrated``, and the only way to accept on
raw confidence is the loudly named opt-in, a request's ``uncertified_threshold`` or the
server's ``--uncertified-threshold``, whose decisions say ``certified: false``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from server import wait_app_ready as wait_ready

from calibration import Gate, Overrides
from judge import Judge
from service import ServiceConfig, create_app
from service.cli.main import main

SPAM = "Is this SMS spam? WINNER!! Claim your free prize now, text WIN to 80082."
CHOICES = ["spam", "ham"]
NOUL = {"type": "noul", "instructions": "Is this message spam?"}
PAIR = {
    "state": "Which reply is kinder? The customer's parcel is late.",
    "instructions": "Which reply is the kinder one?",
    "candidates": {"a": "Sorry, we will refund you today.", "b": "Not our problem."},
}


def _routes(c: TestClient[Any], extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each route's decision on the same kind of question, with ``extra`` fields in each."""
    out: dict[str, dict[str, Any]] = {}
    r = c.post("/judge", json={"prompt": SPAM, "choices": CHOICES, **extra})
    out["POST /judge"] = r.json()
    items = [{"prompt": SPAM, "choices": CHOICES, **extra}]
    r = c.post("/judge/batch", json={"items": items})
    out["batch item"] = r.json()["results"][0]
    shared = {"context": SPAM, "questions": [{"prompt": " Spam?", "choices": CHOICES, **extra}]}
    out["shared question"] = c.post("/judge/batch", json=shared).json()["results"][0]
    body = {"state": SPAM, "questions": {"q": {**NOUL, **extra}}}
    out["POST /v1/systemone"] = c.post("/v1/systemone", json=body).json()["answers"]["q"]
    out["pair"] = c.post("/judge", json={**PAIR, **extra}).json()
    return out


@pytest.fixture(scope="module")
def served(judge: Judge, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every route's answer: on a server with the defaults, with the request's opt-in, and on
    a server that opted in."""
    folder = tmp_path_factory.mktemp("profiles")
    seen: dict[str, Any] = {}
    with TestClient(app=create_app(judge, config=ServiceConfig(profiles_dir=folder))) as c:
        wait_ready(c)
        seen["default"] = _routes(c, {})
        seen["request opt-in"] = _routes(c, {"uncertified_threshold": 0.0})
        r = c.post("/judge", json={"prompt": SPAM, "choices": CHOICES, "threshold": 0.5})
        seen["threshold alone"] = (r.status_code, r.json())
    config = ServiceConfig(profiles_dir=folder, uncertified_threshold=0.0)
    with TestClient(app=create_app(judge, config=config)) as c:
        wait_ready(c)
        seen["server opt-in"] = _routes(c, {})
    return seen


def test_without_a_profile_every_http_route_escalates(served: dict[str, Any]) -> None:
    for route, answer in served["default"].items():
        assert answer["decision"] == "escalate", (route, answer)
        assert answer["reason_codes"][0] == "uncalibrated", (route, answer)
        assert answer["threshold"] is None and answer["certified"] is False, route
    # The sure answer is sure: it is the certificate, not the confidence, that is missing.
    assert served["default"]["POST /judge"]["confidence"] > 0.9


@pytest.mark.parametrize("opt_in", ["request opt-in", "server opt-in"])
def test_the_opt_in_accepts_on_every_route_and_says_it_is_uncertified(
    served: dict[str, Any], opt_in: str
) -> None:
    for route, answer in served[opt_in].items():
        assert "uncalibrated" not in answer["reason_codes"], (route, answer)
        assert answer["threshold"] == 0.0 and answer["certified"] is False, route
        if route != "pair":  # a pair may still be position_inconsistent
            assert answer["decision"] == "accept", (route, answer)


def test_a_threshold_alone_is_refused_naming_the_opt_in(served: dict[str, Any]) -> None:
    status, body = served["threshold alone"]
    assert status == 422 and body["field"] == "threshold"
    assert "uncertified_threshold" in body["detail"]


def test_python_and_the_command_line_escalate_too(
    judge: Judge,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    verdict = Gate().judge(judge, SPAM, CHOICES)
    assert verdict.decision == "escalate" and verdict.reason_codes == ["uncalibrated"]
    opted = Gate(overrides=Overrides(uncertified_threshold=0.5)).judge(judge, SPAM, CHOICES)
    assert opted.accepted and not opted.certified

    monkeypatch.setattr(Judge, "load", staticmethod(lambda *a, **k: judge))
    state = tmp_path / "state.txt"
    state.write_text(SPAM)
    argv = ["decide", "--state", str(state), "--question", f"q={json.dumps(NOUL)}"]
    assert main(argv) == 0
    answer = json.loads(capsys.readouterr().out)["q"]
    assert answer["decision"] == "escalate" and answer["reason_codes"] == ["uncalibrated"]
    opt_in = json.dumps({**NOUL, "uncertified_threshold": 0.0})
    assert main([*argv[:3], "--question", f"q={opt_in}"]) == 0
    answer = json.loads(capsys.readouterr().out)["q"]
    assert answer["decision"] == "accept" and answer["certified"] is False


@pytest.mark.parametrize(
    ("setting", "value"),
    [("uncertified_threshold", 2), ("min_choice_mass", "high"), ("max_order_spread", -1)],
)
def test_a_question_s_bad_gate_setting_is_refused_by_name(
    judge: Judge,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    setting: str,
    value: object,
) -> None:
    # judge decide reads a question's gate settings too (they were dropped before), so a bad
    # one is a usage error naming questions.<id>.<setting>, before any model work.
    monkeypatch.setattr(Judge, "load", staticmethod(lambda *a, **k: judge))
    state = tmp_path / "state.txt"
    state.write_text(SPAM)
    question = json.dumps({**NOUL, setting: value})
    assert main(["decide", "--state", str(state), "--question", f"q={question}"]) == 2
    assert f"(questions.q.{setting})" in capsys.readouterr().err
