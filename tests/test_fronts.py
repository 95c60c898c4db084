"""Three fronts, one answer: the same request through ``POST /judge``, a batch item, ``judge
ask`` and the MCP ``judge`` tool gives the same response, field for field, under each override
every front takes and with a cascade.

Every front translates its request into the decision core's (``service.gate_context``) and its
response out of it, so nothing may differ but what names the one judgment (its id, its
latency). The server runs on the built-in defaults, which are ``judge ask``'s too. On the real
default model: one prompt is one pass's bits on every route (the batch-invariant arithmetic).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fakes import clear_profile
from litestar.testing import TestClient
from server import wait_app_ready as wait_ready

from calibration import CalibrationProfile, PolicyDefaults, save_profile
from judge import Judge
from service import ServiceConfig, create_app
from service.cli.main import main
from service.profiles import ProfileStore

PROMPT = "Is this SMS spam? WINNER!! Claim your free prize now, text WIN to 80082."
CHOICES = ["spam", "ham"]
GRADES = ["1", "2", "3"]
GRADED = "On a scale of 1 to 3, how urgent is this ticket? My card was charged twice today."
# What names the one judgment, and nothing else: every other field must agree.
OWN = {"judgment_id", "latency_ms"}
# A remote later stage nobody listens on: an escalated item reaches it and fails there, the
# same way on every front (a stage that fails is an escalation with a reason code).
DEAD = "http://127.0.0.1:9"

# Each case: the request's fields (profile included or not), and judge ask's flags for them.
CASES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "profile": ({"profile": "sms"}, []),
    "threshold": ({"profile": "sms", "threshold": 0.6}, ["--threshold", "0.6"]),
    "min_choice_mass": (
        {"profile": "sms", "min_choice_mass": 0.5},
        ["--min-choice-mass", "0.5"],
    ),
    "uncertified_threshold": (
        {"uncertified_threshold": 0.55},
        ["--uncertified-threshold", "0.55"],
    ),
    "values and max_std": (
        {"prompt": GRADED, "choices": GRADES, "values": {"1": 1, "2": 2, "3": 5}, "max_std": 0.8},
        ["--value", "1=1", "--value", "2=2", "--value", "3=5", "--max-std", "0.8"],
    ),
    "the request's order": ({"profile": "sms", "choices": ["ham", "spam"]}, []),
}


@pytest.fixture(scope="module")
def profiles(judge: Judge, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A profile for the real engine that certifies a threshold (``fakes.clear_profile``)."""
    profile = clear_profile("sms", CHOICES, judge.fingerprint(), seed=3)
    assert profile.threshold.threshold is not None
    folder = tmp_path_factory.mktemp("profiles")
    save_profile(profile, folder / "sms.json")
    return folder


def _request(fields: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": PROMPT, "choices": CHOICES, **fields}


def _same(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer without what names its one judgment (a cascade's parts too)."""
    kept = {key: value for key, value in answer.items() if key not in OWN}
    if kept.get("cascade") is not None:
        kept["cascade"] = [_part(part) for part in kept["cascade"]]
    return kept


def _part(part: dict[str, Any]) -> dict[str, Any]:
    """A cascade's part without its judgment's own: a stage's answer also counts the tokens
    its pass computed, fewer where the prefix cache held the prompt (a route asked after
    another)."""
    kept = {key: value for key, value in part.items() if key not in OWN}
    if kept.get("answer") is not None:
        own = OWN | {"computed_tokens"}
        kept["answer"] = {k: v for k, v in kept["answer"].items() if k not in own}
    return kept


def _ask_argv(request: dict[str, Any], flags: list[str], profiles: Path) -> list[str]:
    argv = ["ask", request["prompt"]]
    for choice in request["choices"]:
        argv += ["--choice", choice]
    if "profile" in request:
        argv += ["--profile", str(profiles / f"{request['profile']}.json")]
    return argv + flags


def _through_every_front(
    judge: Judge,
    profiles: Path,
    request: dict[str, Any],
    flags: list[str],
    capsys: pytest.CaptureFixture[str],
    cascade: dict[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    answers: dict[str, dict[str, Any]] = {}
    config = ServiceConfig(profiles_dir=profiles, cascade=cascade or {})
    with TestClient(app=create_app(judge, config=config)) as client:
        wait_ready(client)
        judged = client.post("/judge", json=request)
        assert judged.status_code == 200, judged.text
        answers["POST /judge"] = judged.json()
        other = {"prompt": "Is 7 a prime number?", "choices": ["yes", "no"]}
        batch = client.post("/judge/batch", json={"items": [other, request]})
        assert batch.status_code == 200, batch.text
        answers["batch item"] = batch.json()["results"][1]

    stages = [f"--cascade=big={target}" for target in (cascade or {}).values()]
    capsys.readouterr()
    assert main(_ask_argv(request, flags, profiles) + stages) == 0
    answers["judge ask"] = json.loads(capsys.readouterr().out)

    from service.mcp.server import create_server

    server = create_server(
        judge, ProfileStore(profiles), defaults=PolicyDefaults(), cascade=cascade or {}
    )
    result: Any = asyncio.run(server.call_tool("judge", request))
    assert not result.is_error, result.content
    answers["MCP judge"] = result.structured_content
    return answers


@pytest.mark.parametrize("case", list(CASES))
def test_every_front_gives_the_same_answer(
    judge: Judge,
    profiles: Path,
    capsys: pytest.CaptureFixture[str],
    loaded_once: list[dict[str, object]],
    case: str,
) -> None:
    fields, flags = CASES[case]
    request = _request(fields)
    answers = _through_every_front(judge, profiles, request, flags, capsys)
    expected = _same(answers["POST /judge"])
    # The request's order of choices, on every front.
    assert list(expected["probabilities"]) == request["choices"]
    for front, answer in answers.items():
        assert _same(answer) == expected, front
    if "max_std" in request:
        assert expected["expected_value"] is not None and expected["std"] is not None
    # Each override is in force, not only passed along.
    if "threshold" in request:
        assert expected["threshold"] == 0.6 and expected["certified"] is False
    if "min_choice_mass" in request:
        assert "low_choice_mass" in expected["reason_codes"]
    if "uncertified_threshold" in request:
        assert expected["threshold"] == 0.55 and expected["certified"] is False


def test_every_front_cascades_the_same_way(
    judge: Judge,
    profiles: Path,
    capsys: pytest.CaptureFixture[str],
    loaded_once: list[dict[str, object]],
) -> None:
    """With a cascade whose later stage is down: the first stage escalates (the choices'
    share of the next token is far below 0.9), the stage fails, and every front says so in
    the same words."""
    request = _request({"profile": "sms", "min_choice_mass": 0.9})
    answers = _through_every_front(
        judge, profiles, request, ["--min-choice-mass", "0.9"], capsys, cascade={"big": DEAD}
    )
    expected = _same(answers["POST /judge"])
    assert expected["decision"] == "escalate" and expected.get("decided_by") is None
    assert [part["stage"] for part in expected["cascade"]] == ["local", "big"]
    for front, answer in answers.items():
        assert _same(answer) == expected, front


def test_an_item_alone_reads_its_profile_once(
    judge: Judge,
    profiles: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An item sent alone is rendered in its profile's template and decided under its
    certificate: one read of the store, so a version stored in between cannot split the two
    (the template of one version, the certificate of another). The same on every front that
    takes an item alone, and the answers agree."""
    from calibration import load_profile
    from calibration.template import PromptTemplate

    template = PromptTemplate(before="Is this SMS spam? ", after="\nAnswer spam or ham.")
    task = msgspec.structs.replace(load_profile(profiles / "sms.json"), template=template)
    folder = tmp_path / "profiles"
    folder.mkdir()
    save_profile(task, folder / "sms.json")
    reads: list[str] = []
    original = ProfileStore.get_tagged

    def counted(self: ProfileStore, name: str) -> tuple[CalibrationProfile, str]:
        reads.append(name)
        return original(self, name)

    monkeypatch.setattr(ProfileStore, "get_tagged", counted)
    request = {"profile": "sms", "item": "WINNER!! Claim your free prize now."}
    with TestClient(app=create_app(judge, config=ServiceConfig(profiles_dir=folder))) as client:
        wait_ready(client)
        reads.clear()
        judged = client.post("/judge", json=request)
        assert judged.status_code == 200, judged.text
        assert reads == ["sms"]
    from service.mcp.server import create_server

    server = create_server(judge, ProfileStore(folder), defaults=PolicyDefaults())
    reads.clear()
    result: Any = asyncio.run(server.call_tool("judge", request))
    assert not result.is_error, result.content
    assert reads == ["sms"]
    assert _same(result.structured_content) == _same(judged.json())
    assert judged.json()["certified"] is True and "outside_template" not in judged.json()


def test_a_typed_question_cascades_the_same_way_on_every_front(
    judge: Judge,
    profiles: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    loaded_once: list[dict[str, object]],
) -> None:
    """``POST /v1/systemone``, the MCP ``decide`` tool and ``judge decide``, each with a cascade
    whose later stage is down: the question escalates (no profile, no certificate), the stage
    fails, and the three answers agree field for field."""
    state = "Ticket 4411: I was charged twice for my subscription this month."
    question = {"type": "noul", "instructions": "Is this ticket about billing?"}
    answers: dict[str, dict[str, Any]] = {}
    config = ServiceConfig(profiles_dir=profiles, cascade={"big": DEAD})
    with TestClient(app=create_app(judge, config=config)) as client:
        wait_ready(client)
        asked = client.post("/v1/systemone", json={"state": state, "questions": {"q": question}})
        assert asked.status_code == 200, asked.text
        answers["POST /v1/systemone"] = asked.json()["answers"]["q"]
    from service.mcp.server import create_server

    server = create_server(
        judge, ProfileStore(profiles), defaults=PolicyDefaults(), cascade={"big": DEAD}
    )
    result: Any = asyncio.run(
        server.call_tool("decide", {"state": state, "questions": {"q": question}})
    )
    assert not result.is_error, result.content
    answers["MCP decide"] = result.structured_content["q"]
    (tmp_path / "state.txt").write_text(state)
    argv = ["decide", "--state", str(tmp_path / "state.txt"), "--question"]
    argv += [f"q={json.dumps(question)}", "--cascade", f"big={DEAD}"]
    capsys.readouterr()
    assert main(argv) == 0
    answers["judge decide"] = json.loads(capsys.readouterr().out)["q"]
    expected = _same(answers["POST /v1/systemone"])
    assert expected["decision"] == "escalate" and expected.get("decided_by") is None
    assert [part["stage"] for part in expected["cascade"]] == ["local", "big"]
    assert expected["cascade"][1]["failure"] == "stage_failed"
    for front, answer in answers.items():
        assert _same(answer) == expected, front
