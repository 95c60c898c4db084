"""`judge serve --cascade`: POST /judge escalates to a second local model, logs both stages and
counts who decided; the real model at both stages."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from litestar.testing import TestClient
from server import settled

from calibration import (
    CalibrationProfile,
    Gate,
    LabeledScores,
    Provenance,
    fit_profile,
    save_profile,
)
from judge import Judge
from judge.loading import default_model_path
from service import ServiceConfig, create_app
from service.cli.main import main

SPAM = "Is this SMS spam? WINNER!! Claim your free prize now, text WIN to 80082."
CHOICES = ["spam", "ham"]


def coin_profile(name: str, judge: Judge, right: float, seed: int) -> CalibrationProfile:
    """A profile for the session model on synthetic scores: right in about ``right`` of the
    items, sure of itself (0.5: a coin, which certifies no threshold)."""
    rng = np.random.default_rng(seed)
    n = 400
    labels = rng.integers(0, 2, n)
    hit = rng.random(n) < right
    p = np.where(hit == (labels == 0), 0.95, 0.05)  # P(spam)
    z = np.log(np.stack([p, 1 - p], axis=1))
    return fit_profile(
        name,
        LabeledScores(z, np.full(n, 0.9), labels),
        CHOICES,
        Provenance(fingerprint=judge.fingerprint(), dataset="synthetic", dataset_sha256="0" * 64),
    ).profile


@pytest.fixture(scope="module")
def profiles(judge: Judge, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("profiles")
    made = {
        "coin": coin_profile("coin", judge, 0.5, seed=1),  # the first stage's: escalates all
        "coin-second": coin_profile("coin-second", judge, 0.99, seed=2),
    }
    for name, profile in made.items():
        save_profile(profile, folder / f"{name}.json")
    return {"folder": folder, **made}


@pytest.fixture(scope="module")
def client(
    judge: Judge, profiles: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestClient[Any]]:
    log = tmp_path_factory.mktemp("log") / "decisions.sqlite"
    config = ServiceConfig(
        profiles_dir=profiles["folder"],
        cascade={"second": str(default_model_path())},
        decision_log=str(log),
        log_features=True,
    )
    with TestClient(app=create_app(judge, config=config)) as c:
        assert settled(c).json()["cascade"] == ["local", "second"]
        yield c


def test_an_item_the_first_stage_escalates_is_decided_by_the_second(
    client: TestClient[Any], judge: Judge, profiles: dict[str, Any]
) -> None:
    assert profiles["coin"].threshold.threshold is None  # the first stage certifies nothing
    r = client.post("/judge", json={"prompt": SPAM, "choices": CHOICES, "profile": "coin"})
    assert r.status_code == 200, r.text
    body = r.json()
    first, second = body["cascade"]
    assert first["stage"] == "local" and second["stage"] == "second"
    assert first["answer"]["decision"] == "escalate"
    assert "no_certified_threshold" in first["answer"]["reason_codes"]
    assert first["answer"]["profile"] == "coin" and second["answer"]["profile"] == "coin-second"
    # The second stage's own decision, exactly as its gate makes it in Python.
    alone = Gate(profiles["coin-second"]).judge(judge, SPAM, CHOICES)
    assert second["answer"]["probabilities"] == alone.probabilities
    assert second["answer"]["decision"] == alone.decision == "accept"
    # The response is the deciding stage's judgment, and names it.
    assert body["decided_by"] == "second" and body["decision"] == "accept"
    assert body["profile"] == "coin-second" and body["choice"] == alone.choice
    assert body["judgment_id"] == second["answer"]["judgment_id"]
    assert first["answer"]["prompt_tokens"] == second["answer"]["prompt_tokens"] > 0
    # Each stage's decision is logged, each with the cascade's outcome and (--log-features)
    # the hidden states a refit of that stage's probe would read: both stages.
    for stage in (first, second):
        row = client.get(f"/judgments/{stage['answer']['judgment_id']}").json()
        assert row["cascade"]["decided_by"] == "second"
        assert [s["stage"] for s in row["cascade"]["stages"]] == ["local", "second"]
        assert row["features"] is not None and row["features"]["width"] == judge.hidden_size
    assert row["profile"] == "coin-second" and row["decision"] == "accept"
    metrics = client.get("/metrics").text
    assert 'judge_cascade_decisions_total{stage="second"}' in metrics


def test_what_no_stage_accepts_goes_to_a_person(client: TestClient[Any]) -> None:
    # Without a profile no stage has a certificate, so none accepts: each escalates as
    # uncalibrated, and the item goes to a person.
    r = client.post("/judge", json={"prompt": SPAM, "choices": CHOICES})
    body = r.json()
    assert r.status_code == 200 and body["decision"] == "escalate"
    assert [s["answer"]["reason_codes"] for s in body["cascade"]] == [["uncalibrated"]] * 2
    assert "decided_by" not in body or body["decided_by"] is None
    assert [s["answer"]["decision"] for s in body["cascade"]] == ["escalate", "escalate"]
    # The last stage's view of the item is the response.
    assert body["judgment_id"] == body["cascade"][1]["answer"]["judgment_id"]
    assert 'judge_cascade_decisions_total{stage="person"}' in client.get("/metrics").text


def test_a_batch_item_cascades_too_and_a_missing_stage_profile_is_refused(
    client: TestClient[Any],
) -> None:
    items = [{"prompt": SPAM, "choices": CHOICES, "profile": "coin"}]
    items.append({"prompt": SPAM, "choices": CHOICES, "profile": "coin-second"})
    r = client.post("/judge/batch", json={"items": items})
    assert r.status_code == 200
    ok, refused = r.json()["results"]
    assert ok["decided_by"] == "second"
    # "coin-second" is the first stage's profile here, so the second stage needs
    # "coin-second-second": there is none, and the item is refused before any model work.
    assert refused["status_code"] == 404 and refused["field"] == "profile"
    assert "coin-second-second" in refused["detail"]


def test_the_ready_line_waits_for_every_stage(tmp_path: Path, judge: Judge) -> None:
    config = ServiceConfig(profiles_dir=tmp_path, cascade={"gone": str(tmp_path / "no.gguf")})
    with TestClient(app=create_app(judge, config=config)) as c:
        ready = settled(c)
        assert ready.status_code == 503 and ready.json()["status"] == "failed"
        assert "no.gguf" in ready.json()["detail"]


def test_a_cascade_s_stages_need_names_of_their_own(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="stage 'local' is this server's"):
        ServiceConfig(cascade={"local": "x.gguf"})
    with pytest.raises(ValueError, match="a stage's name must match"):
        ServiceConfig(cascade={"two words": "x.gguf"})
    assert main(["serve", "--cascade", "a=x.gguf", "--cascade", "a=y.gguf"]) == 2
    assert "each stage needs a name of its own" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--cascade", "no-target"])
    assert "give NAME=MODEL or NAME=URL" in capsys.readouterr().err


# Every route that decides escalates through the stages (issue 49): a question about a shared
# context, a typed question on POST /v1/systemone and a pair on POST /judge, each decided by
# the second stage under "coin-second" where the first stage's "coin" certifies nothing.
CHOICE = {"type": "choice", "instructions": "Is this SMS spam?", "profile": "coin"}
CRITERIA: dict[str, Any] = {"spam": "unsolicited advertising", "ham": "a normal message"}


def _second_decided(body: dict[str, Any], client: TestClient[Any]) -> None:
    """What every route's escalated answer says: the second stage decided, each stage's part
    is listed, and both stages' rows are logged with the outcome."""
    first, second = body["cascade"]
    assert (first["stage"], second["stage"]) == ("local", "second")
    assert first["answer"]["decision"] == "escalate"
    assert "no_certified_threshold" in first["answer"]["reason_codes"]
    assert first["answer"]["profile"] == "coin" and second["answer"]["profile"] == "coin-second"
    assert body["decided_by"] == "second" and body["decision"] == "accept"
    assert body["profile"] == "coin-second"
    assert body["judgment_id"] == second["answer"]["judgment_id"]
    assert body["probabilities"] == second["answer"]["probabilities"]
    for stage in (first, second):
        row = client.get(f"/judgments/{stage['answer']['judgment_id']}").json()
        assert row["cascade"]["decided_by"] == "second"
        assert [s["stage"] for s in row["cascade"]["stages"]] == ["local", "second"]


def test_a_shared_question_escalates_through_the_stages(
    client: TestClient[Any], judge: Judge, profiles: dict[str, Any]
) -> None:
    context = "WINNER!! Claim your free prize now, text WIN to 80082."
    question = {"prompt": "Is this SMS spam?", "choices": CHOICES, "profile": "coin"}
    r = client.post("/judge/batch", json={"context": context, "questions": [question]})
    assert r.status_code == 200, r.text
    (body,) = r.json()["results"]
    _second_decided(body, client)
    # The second stage was asked the prompt the first judged: the context and the question.
    alone = Gate(profiles["coin-second"]).judge(judge, f"{context}\n\nIs this SMS spam?", CHOICES)
    assert body["probabilities"] == alone.probabilities


def test_a_typed_question_escalates_through_the_stages(
    client: TestClient[Any], judge: Judge, profiles: dict[str, Any]
) -> None:
    questions = {"q": {**CHOICE, "criteria": CRITERIA}}
    r = client.post("/v1/systemone", json={"state": SPAM, "questions": questions})
    assert r.status_code == 200, r.text
    answer = r.json()["answers"]["q"]
    _second_decided(answer, client)
    assert (
        answer["type"] == "choice" and answer["choice"] == answer["cascade"][1]["answer"]["choice"]
    )
    # The second stage's own answer, as its gate gives it in Python on the same question.
    from judge.answers import ChoiceQuestion
    from service.decisions import judge_questions

    asked = ChoiceQuestion(instructions="Is this SMS spam?", criteria=CRITERIA)
    alone = judge_questions(judge, SPAM, {"q": asked}, gates={"q": Gate(profiles["coin-second"])})
    assert answer["probabilities"] == alone["q"][1].probabilities
    # A question the first stage accepts is its own, named as decided by it.
    r = client.post(
        "/v1/systemone",
        json={"state": SPAM, "questions": {"q": {**questions["q"], "profile": "coin-second"}}},
    )
    assert r.status_code == 404 and r.json()["field"] == "questions.q.profile"  # no stage's


def test_a_pair_escalates_through_the_stages(client: TestClient[Any]) -> None:
    pair = {
        "state": "Which of the two messages is the spam?",
        "instructions": "Pick the unsolicited advertising.",
        "candidates": {"spam": "WINNER!! Claim your prize now.", "ham": "See you at 5."},
        "profile": "coin",
    }
    r = client.post("/judge", json=pair)
    assert r.status_code == 200, r.text
    body = r.json()
    _second_decided(body, client)
    assert body["orderings"] == 2 and body["choice"] in ("spam", "ham")
    # A stage's missing profile is refused naming the request's own field, before any work.
    r = client.post("/judge", json={**pair, "profile": "coin-second"})
    assert r.status_code == 404 and r.json()["field"] == "profile"
