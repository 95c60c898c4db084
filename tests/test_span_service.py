"""A probe on the mean over the item, served: every route marks the item and decides alike.

The profile's probe reads the mean hidden state over the item's own tokens (``reads`` "mean",
``span`` "item"), so a request must say where its item is: ``item_span`` on ``POST /judge``
and a batch item, ``--item`` for ``judge ask``, ``item`` for the MCP tool; a shared context
and a System One state are the item by themselves. With the item marked, every route gives
the bits the Python gate gives; without it, the request is refused naming ``item_span``.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import closing
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from fakes import clear_profile
from litestar.testing import TestClient
from server import wait_app_ready as wait_ready
from test_one_gate import CHOICES, DEFAULTS, QUESTION, SAME, STATE, _prompt, _view

from calibration import CalibrationProfile, save_profile
from calibration.gate import Gate
from calibration.maps.map_types import Probe
from judge import Judge
from service import ServiceConfig, create_app
from service.cli.main import main
from service.log.backends import open_log
from service.profiles import ProfileStore

LAYER = 15


@pytest.fixture(scope="module")
def profile(judge: Judge) -> CalibrationProfile:
    """A temperature profile for the real engine, its map swapped for a probe that reads the
    mean over the item at one layer (small random weights: what is tested is the routing)."""
    fitted = clear_profile("billing", CHOICES, judge.fingerprint())
    rng = np.random.default_rng(5)
    width = (judge.hidden_size or 0) + len(CHOICES)
    probe = Probe(
        layers=[LAYER],
        num_layers=judge.num_layers or 0,
        feature_dim=judge.hidden_size or 0,
        weights=rng.normal(0.0, 0.01, size=(len(CHOICES), width)).tolist(),
        intercept=[0.5, -0.5],
        l2=1.0,
        reads="mean",
        span="item",
    )
    return msgspec.structs.replace(fitted, calibration_map=probe)


def test_every_route_marks_the_item_and_gives_the_same_verdict(
    judge: Judge,
    profile: CalibrationProfile,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    views = every_route(judge, profile, tmp_path, capsys)
    expected = views["python"]
    for route, view in views.items():
        for key, value in view.items():
            assert value == expected[key], (route, key, value, expected[key])


def every_route(
    judge: Judge,
    profile: CalibrationProfile,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> dict[str, dict[str, Any]]:
    """The verdict on one item under ``profile`` (named "billing", its probe reading the mean
    over the item) by every route: the Python gate, ``judge ask``, ``POST /judge``, a batch
    item, a shared question, System One, ``judge replay``, MCP's ``judge`` and ``decide``."""
    profiles = tmp_path / "profiles"
    profiles.mkdir(parents=True)
    path = save_profile(profile, profiles / "billing.json")
    prompt = _prompt()  # the state, a blank line, the rendered question
    question = prompt.removeprefix(STATE + "\n\n")
    span = [0, len(STATE)]
    views: dict[str, dict[str, Any]] = {}

    gate = Gate(profile, defaults=DEFAULTS)
    assert gate.span_layers == (LAYER,) and gate.feature_layers == ()
    verdict = gate.judge(judge, prompt, CHOICES, item_span=(0, len(STATE)))
    views["python"] = {
        **{key: getattr(verdict, key) for key in SAME},
        "probabilities": verdict.probabilities,
        "raw_probabilities": verdict.raw_probabilities,
        "adapter_sha256": verdict.adapter_sha256,
    }
    argv = ["ask", prompt, "--item", STATE, "--choice", "yes", "--choice", "no"]
    assert main([*argv, "--profile", str(path)]) == 0
    views["judge ask"] = _view(json.loads(capsys.readouterr().out))

    log = tmp_path / "decisions.db"
    config = ServiceConfig(
        profiles_dir=profiles,
        decision_log=str(log),
        log_requests=True,
        uncertified_threshold=DEFAULTS.uncertified_threshold,
        min_choice_mass=DEFAULTS.min_choice_mass,
    )
    with TestClient(app=create_app(judge, config=config)) as c:
        wait_ready(c)
        item = {"prompt": prompt, "choices": CHOICES, "profile": "billing", "item_span": span}
        judged = c.post("/judge", json=item)
        assert judged.status_code == 200, judged.text
        # The response names the layer the probe read, though it read no decision point.
        assert judged.json()["feature_layers"] == [LAYER]
        views["POST /judge"] = _view(judged.json())
        other = {"prompt": "Is 7 a prime number?", "choices": CHOICES}
        batch = c.post("/judge/batch", json={"items": [other, item]})
        assert batch.status_code == 200, batch.text
        views["batch item"] = _view(batch.json()["results"][1])
        shared = c.post(
            "/judge/batch",
            json={
                "context": STATE,
                "questions": [{"prompt": question, "choices": CHOICES, "profile": "billing"}],
            },
        )
        assert shared.status_code == 200, shared.text
        views["shared question"] = _view(shared.json()["results"][0])
        systemone = c.post(
            "/v1/systemone",
            json={"state": STATE, "questions": {"billing": {**QUESTION, "profile": "billing"}}},
        )
        assert systemone.status_code == 200, systemone.text
        views["/v1/systemone"] = _view(systemone.json()["answers"]["billing"])

        # The item unmarked, or marked past the prompt's end: refused, naming the field.
        for body in (
            {**item, "item_span": None},
            {**item, "item_span": [0, len(prompt) + 1]},
        ):
            refused = c.post("/judge", json=body)
            assert 400 <= refused.status_code < 500, refused.text
            assert refused.json()["field"] == "item_span", refused.text

    # The log's row names what decided it, the adapter included.
    with closing(open_log(str(log))) as opened:
        logged = opened.get(judged.json()["judgment_id"])
    assert logged is not None
    views["decision log"] = {
        "decision": logged.decision,
        "probabilities": logged.probabilities,
        "adapter_sha256": logged.adapter_sha256,
    }
    # The logged request keeps its item: judge replay decides it again, the same.
    argv = ["replay", judged.json()["judgment_id"], "--log", str(log), "--profiles-dir"]
    assert main([*argv, str(profiles)]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["changed"] == [], replayed
    views["replay of /judge"] = {
        "decision": replayed["now"]["decision"],
        "probabilities": replayed["now"]["probabilities"],
    }

    pytest.importorskip("mcp")
    from service.mcp.server import create_server

    server = create_server(judge, ProfileStore(profiles), defaults=DEFAULTS)
    called: Any = asyncio.run(
        server.call_tool(
            "judge", {"prompt": prompt, "choices": CHOICES, "profile": "billing", "item": STATE}
        )
    )
    assert not called.is_error, called.content
    views["MCP judge"] = _view(called.structured_content)
    asked = {"state": STATE, "questions": {"billing": QUESTION}, "profiles": {"billing": "billing"}}
    decided: Any = asyncio.run(server.call_tool("decide", asked))
    assert not decided.is_error, decided.content
    views["MCP decide"] = _view(decided.structured_content["billing"])
    return views
