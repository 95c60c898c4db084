"""One gate: a labelled item gets the same verdict on every route that decides.

One profile (fitted for the real model's fingerprint) and one set of server defaults; one item,
asked as a yes/no question about a state. The rendered prompt is the same text on every route
(the System One question's, ``judge.answers.plan_decisions``), so with the batch-invariant
arithmetic every route must give the same decision, reasons, policy_sha256, tokens_sha256 and
the same probabilities to the bit: Python (``Gate.judge``), ``judge ask``, ``POST /judge``, a
batch item, a shared question, ``POST /v1/systemone``, the MCP tools ``judge`` and ``decide``,
and ``judge replay`` of the logged /judge and System One decisions. The System One decision is
also labelled through the API and counted in the profile's health.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fakes import clear_profile
from litestar.testing import TestClient
from server import wait_app_ready as wait_ready

from calibration import CalibrationProfile, PolicyDefaults, save_profile
from calibration.gate import Gate, Overrides
from judge import Judge
from judge.answers import plan_decisions
from service import ServiceConfig, create_app
from service.cli.main import main
from service.log.backends import open_log
from service.profiles import ProfileStore

STATE = (
    "Ticket 4411: I was charged twice for my subscription this month. "
    "Please refund one of the two payments."
)
QUESTION = {"type": "noul", "instructions": "Is this ticket about billing?"}
CHOICES = ["yes", "no"]
# The server's defaults, both away from the built-in ones: a route that ignored them would
# differ in its policy (and, without a profile, in its threshold).
DEFAULTS = PolicyDefaults(uncertified_threshold=0.75, min_choice_mass=0.001)
# What every route must agree on, to the bit: every field of the decision's record that does
# not name this one judgment (its id, its latency, the audit draw made from its id).
SAME = (
    "decision",
    "reasons",
    "reason_codes",
    "policy_sha256",
    "tokens_sha256",
    "model_sha256",
    "profile",
    "profile_etag",
    "probabilities",
    "raw_probabilities",
    "threshold",
    "certified",
    "choice_mass",
    "prediction_set",
    "calibration_method",
    "temperature",
    "feature_layers",
)


@pytest.fixture(scope="module")
def profile(judge: Judge) -> CalibrationProfile:
    """A temperature profile for the real engine's fingerprint, fitted on synthetic scores
    with a clear signal (so it certifies a threshold)."""
    return clear_profile("billing", CHOICES, judge.fingerprint())  # label 0 is "yes"


def _prompt() -> str:
    """The item as the model reads it: the state, a blank line, the rendered question."""
    (query,) = plan_decisions(STATE, {"billing": QUESTION}).queries
    return query.prompt


def _view(answer: dict[str, Any]) -> dict[str, Any]:
    return {key: answer.get(key) for key in SAME}


@pytest.mark.parametrize("with_profile", [True, False], ids=["profile", "defaults"])
def test_every_route_gives_the_same_verdict(
    judge: Judge,
    profile: CalibrationProfile,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    loaded_once: list[dict[str, object]],
    with_profile: bool,
) -> None:
    """With the profile, and without one (then the server's defaults decide: a route that
    ignored them would differ in its threshold and its policy_sha256)."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    path = save_profile(profile, profiles / "billing.json")
    gated = {"profile": "billing"} if with_profile else {}
    prompt = _prompt()
    question = prompt.removeprefix(STATE + "\n\n")
    assert question != prompt

    views: dict[str, dict[str, Any]] = {}

    # Python: a gate opened on the profile under the server's defaults.
    verdict = Gate(profile if with_profile else None, defaults=DEFAULTS).judge(
        judge, prompt, CHOICES
    )
    views["python"] = {
        **{key: getattr(verdict, key) for key in SAME},
        "probabilities": verdict.probabilities,
        "raw_probabilities": verdict.raw_probabilities,
    }

    # judge ask, with the profile file. It has no server, so without a profile its defaults
    # are the built-in ones, not the server's: only the profile's case compares it.
    if with_profile:
        argv = ["ask", prompt, "--choice", "yes", "--choice", "no", "--profile", str(path)]
        assert main(argv) == 0
        views["judge ask"] = _view(json.loads(capsys.readouterr().out))

    log = tmp_path / "decisions.db"
    config = ServiceConfig(
        profiles_dir=profiles,
        decision_log=str(log),
        log_requests=True,
        log_features=True,
        uncertified_threshold=DEFAULTS.uncertified_threshold,
        min_choice_mass=DEFAULTS.min_choice_mass,
    )
    with TestClient(app=create_app(judge, config=config)) as c:
        wait_ready(c)
        item = {"prompt": prompt, "choices": CHOICES, **gated}
        judged = c.post("/judge", json=item)
        assert judged.status_code == 200, judged.text
        views["POST /judge"] = _view(judged.json())
        other = {"prompt": "Is 7 a prime number?", "choices": CHOICES}
        batch = c.post("/judge/batch", json={"items": [other, item]})
        assert batch.status_code == 200, batch.text
        views["batch item"] = _view(batch.json()["results"][1])
        shared = c.post(
            "/judge/batch",
            json={
                "context": STATE,
                "questions": [
                    {"prompt": "Is the customer angry?", "choices": CHOICES},
                    {"prompt": question, "choices": CHOICES, **gated},
                ],
            },
        )
        assert shared.status_code == 200, shared.text
        views["shared question"] = _view(shared.json()["results"][1])
        systemone = c.post(
            "/v1/systemone",
            json={"state": STATE, "questions": {"billing": {**QUESTION, **gated}}},
        )
        assert systemone.status_code == 200, systemone.text
        answer = systemone.json()["answers"]["billing"]
        views["/v1/systemone"] = _view(answer)

        # The System One decision is in the log: it takes a label and counts in the health.
        labelled = c.post(f"/judgments/{answer['judgment_id']}/label", json={"label": "yes"})
        assert labelled.status_code in (200, 201), labelled.text
        logged = c.get(f"/judgments/{answer['judgment_id']}").json()
        assert logged["label"] == "yes" and logged["policy_sha256"] == answer["policy_sha256"]
        if with_profile:
            health = c.get("/profiles/billing/health")
            assert health.status_code == 200, health.text
            # /judge, the batch item, the shared question and the System One answer.
            assert health.json()["n_decisions"] == 4

    # The MCP server too: `make install` brings its SDK, so this runs under `make test`.
    from service.mcp.server import create_server

    mcp_log = tmp_path / "mcp-decisions.db"
    opened = open_log(str(mcp_log))
    server = create_server(
        judge,
        ProfileStore(profiles),
        defaults=DEFAULTS,
        decision_log=opened,
        log_requests=True,
        log_features=True,
    )

    def tool(name: str, arguments: dict[str, Any]) -> Any:
        result: Any = asyncio.run(server.call_tool(name, arguments))
        assert not result.is_error, result.content
        return result.structured_content

    mcp_judged = tool("judge", {"prompt": prompt, "choices": CHOICES, **gated})
    views["MCP judge"] = _view(mcp_judged)
    profiles_of = {"profiles": {"billing": "billing"}} if with_profile else {}
    decided = tool("decide", {"state": STATE, "questions": {"billing": QUESTION}, **profiles_of})
    views["MCP decide"] = _view(decided["billing"])
    # The MCP server's decisions are in its log before the tools answer, and take labels.
    mcp_ids = [mcp_judged["judgment_id"], decided["billing"]["judgment_id"]]
    assert [opened.get(i) is not None for i in mcp_ids] == [True, True]
    assert opened.label(mcp_ids[1], "yes").status == "labeled"
    # With --log-features every route keeps the gated decision's hidden states, the same ones:
    # one prompt, one pass's bits. Without a profile there is nothing to refit, so none.
    with open_log(str(log)) as http_log:
        rows = [r for r in http_log.decisions() + opened.decisions() if r.choices == CHOICES]
    opened.close()
    gated_rows = [r for r in rows if r.profile is not None]
    assert len(gated_rows) == (6 if with_profile else 0)
    states = [r.features.array() for r in gated_rows if r.features is not None]
    assert len(states) == len(gated_rows)
    assert all(np.array_equal(x, states[0]) for x in states)
    assert all(r.features is None for r in rows if r.profile is None)

    # judge replay reopens the logged gate (the request's overrides and the server's defaults).
    for route, judgment_id, kept in (
        ("replay of /judge", judged.json()["judgment_id"], log),
        ("replay of /v1/systemone", answer["judgment_id"], log),
        ("replay of MCP judge", mcp_ids[0], mcp_log),
        ("replay of MCP decide", mcp_ids[1], mcp_log),
    ):
        argv = ["replay", judgment_id, "--log", str(kept), "--profiles-dir", str(profiles)]
        assert main(argv) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["changed"] == [], (route, out)
        views[route] = {
            "decision": out["now"]["decision"],
            "policy_sha256": out["now"]["policy_sha256"],
            "probabilities": out["now"]["probabilities"],
        }

    expected = views["python"]
    assert expected["decision"] in ("accept", "escalate")
    assert expected["threshold"] == (profile.threshold.threshold if with_profile else 0.75)
    for route, view in views.items():
        for key, value in view.items():
            assert value == expected[key], (route, key, value, expected[key])


def test_the_gate_fails_a_route_whose_defaults_differ(
    judge: Judge, profile: CalibrationProfile
) -> None:
    """What the test above rests on: a gate under other defaults or overrides is another
    policy (another sha256), with a profile and without."""
    base = Gate(profile, defaults=DEFAULTS)
    assert Gate(profile, defaults=DEFAULTS).sha256 == base.sha256
    assert Gate(profile, defaults=PolicyDefaults(max_std=1.0)).sha256 != base.sha256
    assert Gate(profile, overrides=Overrides(threshold=0.5), defaults=DEFAULTS).sha256 != (
        base.sha256
    )
    bare = Gate(None, defaults=DEFAULTS)
    assert Gate(None).sha256 != bare.sha256
    # The same threshold from the request's opt-in, not the server's: its source differs.
    assert Gate(None, overrides=Overrides(uncertified_threshold=0.75)).sha256 != bare.sha256


def test_a_gate_reads_the_engine_s_fingerprint_only_to_check_a_profile(
    judge: Judge, profile: CalibrationProfile
) -> None:
    """Opening a gate on every request reads the engine only where a profile needs it."""

    class Counting:
        reads = 0

        def fingerprint(self, **template: Any) -> Any:
            Counting.reads += 1
            return judge.fingerprint(**template)

    engine: Any = Counting()
    Gate(None).check_engine(engine, choices=CHOICES)
    assert Counting.reads == 0
    Gate(profile).check_engine(engine, choices=CHOICES)
    assert Counting.reads == 1
