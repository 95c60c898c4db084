"""A gate is opened once and kept: per stored version and overrides on a server, its engine
checks once per template and choices, a score's numerals once per choices.

What a request under a profile did each time before (issue 46, bench_path): resolve the policy
(``make_policy``), check the profile against the engine's fingerprint, work out whether the
choices are numerals, and call the app's service provider; the same answers for every
request. Each test fails where that work comes back on every request.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any, NamedTuple, Unpack

import msgspec
import pytest
from fakes import FakeEngine
from litestar.testing import TestClient
from server import wait_app_ready
from test_profile_store import fake_profile

import calibration.policy as policy_module
import service.gate_context as gate_context
from calibration import CalibrationProfile, ProfileMismatchError
from calibration.gate import Gate, Overrides
from judge import Fingerprint
from judge.judgments import TemplateOptions
from service import ServiceConfig, create_app
from service.gate_context import GateContext
from service.profiles import LocalDirectory, ProfileStore

CHOICES = ["ham", "spam"]
PACKAGES = ("judge", "calibration", "service")


class Counting(FakeEngine):
    """The fake engine, its fingerprint's reads counted."""

    def __init__(self) -> None:
        self.reads = 0

    def fingerprint(self, **template: Unpack[TemplateOptions]) -> Fingerprint:
        self.reads += 1
        return super().fingerprint(**template)


@pytest.fixture(scope="module")
def profile() -> CalibrationProfile:
    return fake_profile()


def test_a_gate_checks_an_engine_once_per_template_and_choices(
    profile: CalibrationProfile,
) -> None:
    gate = Gate(profile)
    engine = Counting()
    for _ in range(3):
        gate.check_engine(engine, choices=CHOICES)
    assert engine.reads == 1
    gate.check_engine(engine, choices=CHOICES[::-1])  # other choices: checked anew
    gate.check_engine(engine, choices=CHOICES, response_suffix='"}')
    assert engine.reads == 3
    other = Counting()  # another engine: checked anew
    gate.check_engine(other, choices=CHOICES)
    assert other.reads == 1
    # A check that fails is made, and fails, every time.
    for reads in (1, 2):
        with pytest.raises(ProfileMismatchError):
            gate.check_engine(engine, choices=CHOICES, system="another system prompt")
        assert engine.reads == 3 + reads
    with pytest.raises(ProfileMismatchError):
        gate.check_engine(engine, choices=["ham", "eggs"])


def test_a_server_opens_a_gate_once_per_version_and_overrides(
    profile: CalibrationProfile, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ProfileStore(LocalDirectory(tmp_path))
    store.put(profile)
    context = GateContext(store)
    first = context.open("sms")
    assert context.open("sms") is first and context.open("sms", Overrides()) is first
    stricter = context.open("sms", Overrides(threshold=0.99))
    assert stricter is not first and stricter.sha256 != first.sha256
    assert context.open("sms", Overrides(threshold=0.99)) is stricter
    assert context.open(None) is context.open(None) and context.open(None) is not first
    # A new version of the profile is another gate, with its own ETag.
    store.put(msgspec.structs.replace(profile, note=profile.note + " (edited)"))
    edited = context.open("sms")
    assert edited is not first and edited.policy.profile_etag != first.policy.profile_etag
    # Bounded: past OPEN_GATES the least recently used is opened anew.
    monkeypatch.setattr(gate_context, "OPEN_GATES", 2)
    bounded = GateContext(store)
    a, b = bounded.open("sms"), bounded.open(None)
    bounded.open("sms")  # a is the most recent now
    bounded.open("sms", Overrides(threshold=0.99))  # b goes
    assert bounded.open("sms") is a and bounded.open(None) is not b


def test_a_score_s_numerals_are_worked_out_once_per_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[str, ...]] = []
    real = policy_module.numeral_values

    def counted(choices: Any) -> Any:
        seen.append(tuple(choices))
        return real(choices)

    monkeypatch.setattr(policy_module, "numeral_values", counted)
    policy_module._numerals.cache_clear()
    policy = policy_module.make_policy(None)
    for _ in range(3):
        values = policy.values_for(["1", "10", "2.5"])
        assert values is not None and list(values) == [1.0, 10.0, 2.5]
        assert policy.values_for(CHOICES) is None
    assert seen == [("1", "10", "2.5"), tuple(CHOICES)]
    # Values given by the request are checked on every call, not cached.
    given = policy_module.make_policy(None, values={"ham": 0.0, "spam": 1.0})
    values = given.values_for(CHOICES)
    assert values is not None and list(values) == [0.0, 1.0]
    assert len(seen) == 2


# Functions that answer the same for every request under one gate (or app), so a warm request
# must not call them: resolving the policy, checking the profile against the engine, reading
# the engine's fingerprint, working out numerals, providing the app's service.
ONCE = {
    ("calibration/gate.py", "Gate.__init__"),
    ("calibration/policy.py", "make_policy"),
    ("calibration/profile.py", "CalibrationProfile.check"),
    ("judge/fingerprint.py", "Fingerprint.first_difference"),
    ("judge/fingerprint.py", "sha256_text"),
    ("judge/scores.py", "numeral_values"),
    ("service/web/app.py", "create_app.<locals>.provide_service"),
}


class Warm(NamedTuple):
    """A warm ``POST /judge`` under a profile (the fake engine), traced: the project's
    functions it called, as (file, qualified name), and the cold and warm responses."""

    called: set[tuple[str, str]]
    cold: dict[str, Any]
    warm: dict[str, Any]


@pytest.fixture(scope="module")
def warm(profile: CalibrationProfile, tmp_path_factory: pytest.TempPathFactory) -> Warm:
    root = str(Path(__file__).resolve().parent.parent) + "/"
    called: set[tuple[str, str]] = set()
    tracing = threading.Event()

    def trace(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if tracing.is_set() and event == "call" and code.co_filename.startswith(root):
            called.add((code.co_filename[len(root) :], code.co_qualname))

    ask = {"prompt": "Spam? WIN a prize", "choices": CHOICES, "profile": "sms"}
    folder = tmp_path_factory.mktemp("profiles")
    app = create_app(FakeEngine(), config=ServiceConfig(profiles_dir=folder))
    # Set before the client starts its threads (the event loop's), so that they report too.
    threading.setprofile(trace)
    sys.setprofile(trace)
    try:
        with TestClient(app=app) as client:
            wait_app_ready(client)
            put = client.put("/profiles/sms", content=msgspec.json.encode(profile))
            assert put.status_code == 200
            cold = client.post("/judge", json=ask)
            tracing.set()
            warm = client.post("/judge", json=ask)
            tracing.clear()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert cold.status_code == warm.status_code == 200, warm.text
    assert ("calibration/policy.py", "Policy.decide_many") in called  # the trace saw the decision
    return Warm(called, cold.json(), warm.json())


def test_a_warm_request_under_a_profile_opens_and_checks_nothing_again(warm: Warm) -> None:
    assert warm.called & ONCE == set()
    fresh = {k: v for k, v in warm.warm.items() if k not in ("judgment_id", "latency_ms")}
    assert fresh == {k: v for k, v in warm.cold.items() if k in fresh}


# The project files a warm POST /judge under a profile reads on the fake engine (the real
# model's pass adds judge's engine, packing, forward, prefix cache, attention, decoder and
# batch-invariant files: benchmarks/bench_path.py). A file joining the path is a choice to
# make here, not a drift: issue 46 asked for fewer (33 on the real model before the gates
# were kept open, 29 after). policy_checks.py was cut out of policy.py (issue 68): one file's
# work in two, not a new step; so is service/planner.py, the steps HTTP, MCP and the command
# line each took in their own words, taken once (issue 68).
PATH_FILES = {
    "calibration/carry.py",
    "calibration/certificates/conformal.py",
    "calibration/gate.py",
    "calibration/maps/map_types.py",
    "calibration/policy.py",
    "calibration/policy_checks.py",
    "calibration/validation.py",
    "judge/identity.py",
    "judge/judgments.py",
    "judge/trie.py",
    "service/gate_context.py",
    "service/planner.py",
    "service/metrics.py",
    "service/profiles.py",
    "service/schemas.py",
    "service/web/batcher.py",
    "service/bodies.py",
    "service/web/frontdoor.py",
    "service/operations.py",
    "service/web/routes.py",
    "service/web/serving_core.py",
    "service/web/serving_judge.py",
}


def test_a_warm_post_judge_reads_only_the_files_it_did(warm: Warm) -> None:
    files = {file for file, _ in warm.called if file.split("/")[0] in PACKAGES}
    assert files <= PATH_FILES, f"new on the path: {sorted(files - PATH_FILES)}"
