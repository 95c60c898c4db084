"""`judge mcp`, driven as a client would: the MCP SDK's stdio client against the real command.

One server process (the real default model, float32 like the session's) answers one
conversation, held for the module; each test checks one part of it against the engine in
this process.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from calibration import CalibrationProfile, fit_profile, make_policy, save_profile
from calibration.fit_data import LabeledScores, Provenance
from calibration.template import PromptTemplate
from judge import Judge
from judge.answers import decide
from service.cli.main import main, parser

try:
    import anyio
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client
except ImportError:  # the tests that need it skip; the one for its absence runs
    SDK = False
else:
    SDK = True

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Is this SMS spam? WINNER!! Claim your free prize now, text WIN to 80082."
STATE = {"subject": "Invoice #123 charged twice", "body": "Please refund one of the charges."}
QUESTIONS: dict[str, Any] = {
    "billing": {"type": "noul", "instructions": "Is this about billing?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should handle it?",
        "criteria": {"payments": "invoices, refunds", "support": "bugs", "sales": None},
        "order": "invariant",
    },
}

# The conversation's tests need the SDK, and load the real model (in `judge mcp` and here).
needs_sdk = pytest.mark.skipif(
    not SDK, reason="the MCP SDK is not installed: pip install -e '.[mcp]'"
)


def _profile(name: str, choices: list[str], judge: Judge) -> CalibrationProfile:
    """A profile for the session model, fitted cheaply on synthetic log-probabilities."""
    rng = np.random.default_rng(0)
    n = 400
    labels = rng.integers(0, 2, n)
    p_right = rng.beta(8, 2, n)
    p = np.where(labels == 0, p_right, 1 - p_right)
    return fit_profile(
        name,
        LabeledScores(np.log(np.stack([p, 1 - p], axis=1)), np.full(n, 0.9), labels),
        choices,
        Provenance(fingerprint=judge.fingerprint(), dataset="synthetic", dataset_sha256="0" * 64),
    ).profile


CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    "judge": ("judge", {"prompt": PROMPT, "choices": ["spam", "ham"]}),
    "judge_profile": ("judge", {"prompt": PROMPT, "choices": ["ham", "spam"], "profile": "sms"}),
    "decide": ("decide", {"state": STATE, "questions": QUESTIONS, "profiles": {"billing": "yn"}}),
    "list_profiles": ("list_profiles", {}),
    "one_choice": ("judge", {"prompt": PROMPT, "choices": ["spam"]}),
    "unknown_profile": ("judge", {"prompt": PROMPT, "choices": ["spam", "ham"], "profile": "no"}),
    "bad_question": (
        "decide",
        {
            "state": "text",
            "questions": {
                "q1": {"type": "choice", "instructions": "Which?", "criteria": {"a": None}}
            },
        },
    ),
    "mismatched_profile": (
        "decide",
        {"state": "text", "questions": QUESTIONS, "profiles": {"team": "sms"}},
    ),
    # A profile fitted on a task: the prompt must mark its item, and is flagged when it is not
    # the task's prompt.
    "task_unmarked": ("judge", {"prompt": PROMPT, "choices": ["spam", "ham"], "profile": "task"}),
    "task_outside": (
        "judge",
        {"prompt": PROMPT, "choices": ["spam", "ham"], "profile": "task", "item": "WINNER!!"},
    ),
    # The item alone, judged in the task's prompt; and that prompt sent whole, item marked.
    "task_alone": ("judge", {"item": "WINNER!!", "profile": "task"}),
    "task_whole": (
        "judge",
        {
            "prompt": "Spam?\n\nWINNER!!\n\nAnswer: spam or ham.",
            "choices": ["spam", "ham"],
            "profile": "task",
            "item": "WINNER!!",
        },
    ),
    "alone_without_task": ("judge", {"item": "WINNER!!", "profile": "sms"}),
    "nothing_to_judge": ("judge", {"choices": ["spam", "ham"]}),
}


@pytest.fixture(scope="module")
def profiles(judge: Judge) -> dict[str, CalibrationProfile]:
    return {
        "sms": _profile("sms", ["spam", "ham"], judge),
        "yn": _profile("yn", ["yes", "no"], judge),
        "task": msgspec.structs.replace(
            _profile("task", ["spam", "ham"], judge),
            template=PromptTemplate(before="Spam?\n\n", after="\n\nAnswer: spam or ham."),
        ),
    }


@pytest.fixture(scope="module")
def profiles_dir(
    profiles: dict[str, CalibrationProfile], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    directory = tmp_path_factory.mktemp("profiles")
    for name, profile in profiles.items():
        save_profile(profile, directory / f"{name}.json")
    return directory


@pytest.fixture(scope="module")
def conversation(profiles_dir: Path) -> dict[str, Any]:
    """The tools listed and each of CALLS made, over one stdio session with `judge mcp`."""
    server = StdioServerParameters(
        command=sys.executable,
        args=[
            "-m",
            "service.cli.main",
            "mcp",
            "--dtype",
            "float32",
            "--profiles-dir",
            str(profiles_dir),
        ],
        env=dict(os.environ),
        cwd=str(ROOT),
    )

    async def talk() -> dict[str, Any]:
        with anyio.fail_after(120):
            async with (
                stdio_client(server) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()
                out: dict[str, Any] = {"tools": (await session.list_tools()).tools}
                for key, (tool, arguments) in CALLS.items():
                    out[key] = await session.call_tool(tool, arguments)
                return out

    return anyio.run(talk)


def _data(result: Any) -> dict[str, Any]:
    assert not result.is_error, result.content
    data: dict[str, Any] = result.structured_content
    # The text content says the same, for clients that read only text.
    assert json.loads(result.content[0].text) == data
    return data


def _error(result: Any) -> str:
    assert result.is_error
    text: str = result.content[0].text
    return text


@pytest.mark.slow
@needs_sdk
def test_the_tools_and_their_schemas(conversation: dict[str, Any]) -> None:
    tools = {tool.name: tool for tool in conversation["tools"]}
    assert set(tools) == {"judge", "decide", "list_profiles"}
    assert all(tool.description for tool in tools.values())
    judge_schema = tools["judge"].input_schema
    # A prompt with choices, or an item alone to a profile fitted on a task: neither required.
    assert judge_schema.get("required", []) == []
    choices = judge_schema["properties"]["choices"]["anyOf"]
    assert {"type": "null"} in choices and any(c.get("minItems") == 2 for c in choices)
    assert {"prompt", "item", "profile", "system", "threshold", "uncertified_threshold"} <= set(
        judge_schema["properties"]
    )
    decide_schema = tools["decide"].input_schema
    assert set(decide_schema["required"]) == {"state", "questions"}
    question = decide_schema["properties"]["questions"]["additionalProperties"]
    # The engine's own question schema: a union tagged by "type".
    assert {ref["$ref"].rsplit("/", 1)[1] for ref in question["anyOf"]} == {
        "NoulQuestion",
        "ChoiceQuestion",
        "ScoreQuestion",
        "PairQuestion",
    }
    assert "NoulQuestion" in decide_schema["$defs"]
    assert tools["list_profiles"].input_schema.get("required", []) == []


@pytest.mark.slow
@needs_sdk
def test_judge_is_the_engine_s_judgment(conversation: dict[str, Any], judge: Judge) -> None:
    out = _data(conversation["judge"])
    expected = judge.judge(PROMPT, ["spam", "ham"])
    assert out["choice"] == expected.choice and out["profile"] is None
    for choice in ("spam", "ham"):
        assert out["raw_probabilities"][choice] == pytest.approx(
            expected.probabilities[choice], abs=1e-4
        )
    assert sum(out["probabilities"].values()) == pytest.approx(1.0)
    # No profile: no certificate, so it escalates, saying why.
    assert out["decision"] == "escalate" and out["reason_codes"] == ["uncalibrated"]


@pytest.mark.slow
@needs_sdk
def test_judge_with_a_profile_is_the_policy_s_decision(
    conversation: dict[str, Any], judge: Judge, profiles: dict[str, CalibrationProfile]
) -> None:
    out = _data(conversation["judge_profile"])
    profile = profiles["sms"]
    reference = make_policy(profile).decide(judge.judge(PROMPT, ["ham", "spam"]))
    assert out["profile"] == "sms" and out["certified"] == reference.certified
    assert out["decision"] == reference.decision and out["choice"] == reference.choice
    assert out["threshold"] == pytest.approx(profile.threshold.threshold)
    assert list(out["probabilities"]) == ["ham", "spam"]  # the call's order
    for choice in ("spam", "ham"):
        assert out["probabilities"][choice] == pytest.approx(
            reference.probabilities[choice], abs=1e-4
        )


@pytest.mark.slow
@needs_sdk
def test_decide_gives_typed_answers_gated_by_profile(
    conversation: dict[str, Any], judge: Judge, profiles: dict[str, CalibrationProfile]
) -> None:
    out = _data(conversation["decide"])
    reference = decide(judge, STATE, QUESTIONS)
    billing, team = out["billing"], out["team"]
    assert billing["type"] == "noul" and "choice" not in billing
    assert billing["raw_probabilities"]["yes"] == pytest.approx(
        reference["billing"].probabilities["yes"], abs=1e-4
    )
    decision = make_policy(profiles["yn"]).decide(reference["billing"].judgment)
    assert billing["profile"] == "yn" and billing["decision"] == decision.decision
    assert team["type"] == "choice" and team["orderings"] == 3
    assert team["choice"] == max(team["probabilities"], key=team["probabilities"].get)
    for name, p in reference["team"].probabilities.items():
        assert team["probabilities"][name] == pytest.approx(p, abs=1e-4)
    assert team["profile"] is None and team["certified"] is False  # the default policy


@pytest.mark.slow
@needs_sdk
def test_list_profiles(
    conversation: dict[str, Any], profiles: dict[str, CalibrationProfile]
) -> None:
    rows = {row["name"]: row for row in _data(conversation["list_profiles"])["profiles"]}
    assert set(rows) == set(profiles)
    profile = profiles["sms"]
    assert rows["sms"]["choices"] == ["spam", "ham"]
    assert rows["sms"]["method"] == profile.calibration_map.method
    assert rows["sms"]["threshold"] == pytest.approx(profile.threshold.threshold)


@pytest.mark.slow
@needs_sdk
@pytest.mark.parametrize(
    ("call", "field"),
    [
        ("one_choice", "choices"),
        ("unknown_profile", "profile:"),
        ("bad_question", "questions.q1.criteria"),
        ("mismatched_profile", "profiles.team"),
        ("task_unmarked", "item_span:"),
        ("alone_without_task", "profile:"),
        ("nothing_to_judge", "prompt:"),
    ],
)
def test_a_bad_call_is_a_tool_error_naming_the_field(
    conversation: dict[str, Any], call: str, field: str
) -> None:
    assert field in _error(conversation[call])


def test_without_the_sdk_judge_mcp_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from importlib import util

    find_spec = util.find_spec
    monkeypatch.setattr(
        util, "find_spec", lambda name, *a: None if name == "mcp" else find_spec(name, *a)
    )

    def fail(*_: object, **__: object) -> Judge:
        pytest.fail("the model was loaded without the SDK")

    monkeypatch.setattr(Judge, "load", staticmethod(fail))
    assert main(["mcp"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "pip install 'calibrated-judge[mcp]'" in lines[0]


def test_the_readme_s_client_configuration_starts_judge_mcp() -> None:
    page = (ROOT / "docs" / "cli.md").read_text()
    section = page[page.index("## MCP server: `judge mcp`") :]
    block = re.search(r"```json\n(.*?)```", section, re.S)
    assert block, "the section shows a client configuration"
    server = json.loads(block.group(1))["mcpServers"]["judge"]
    assert server["command"] == "judge"
    args = parser().parse_args(server["args"])
    assert args.command == "mcp" and args.profiles_dir == Path("profiles")


@pytest.mark.slow
@needs_sdk
def test_a_prompt_outside_the_profile_s_task_is_flagged(conversation: dict[str, Any]) -> None:
    out = _data(conversation["task_outside"])
    assert out["profile"] == "task" and out["outside_template"] is True
    assert "outside_template" not in _data(conversation["judge_profile"])


@pytest.mark.slow
@needs_sdk
def test_the_item_alone_is_judged_in_its_profile_s_prompt(conversation: dict[str, Any]) -> None:
    alone, whole = _data(conversation["task_alone"]), _data(conversation["task_whole"])
    assert "outside_template" not in alone and "outside_template" not in whole
    assert list(alone["probabilities"]) == ["spam", "ham"]  # the profile's choices
    assert alone["probabilities"] == pytest.approx(whole["probabilities"], abs=1e-6)
    assert alone["decision"] == whole["decision"] and alone["profile"] == "task"
    rows = {r["name"]: r for r in _data(conversation["list_profiles"])["profiles"]}
    assert rows["task"]["task"] is True and rows["sms"]["task"] is False


@needs_sdk
def test_mcp_decisions_enter_the_audit_sample(
    judge: Judge, profiles_dir: Path, tmp_path: Path
) -> None:
    """`judge mcp --audit-rate` marks that share of the tools' decisions for people to label,
    per profile as `judge serve` does: here every decision under `sms`, none of the rest."""
    import asyncio

    from service.command_line import audit_rates
    from service.log.backends import open_log
    from service.mcp.server import create_server
    from service.profiles import ProfileStore

    args = parser().parse_args(["mcp", "--audit-rate", "0", "--audit-rate", "sms=1"])
    assert audit_rates(args.audit_rate) == {"audit_rate": 0.0, "audit_rates": {"sms": 1.0}}
    log = open_log(str(tmp_path / "decisions.db"))
    server = create_server(
        judge, ProfileStore(profiles_dir), decision_log=log, **audit_rates(args.audit_rate)
    )

    def tool(name: str, arguments: dict[str, Any]) -> Any:
        result: Any = asyncio.run(server.call_tool(name, arguments))
        assert not result.is_error, result.content
        return result.structured_content

    sms = tool("judge", {"prompt": PROMPT, "choices": ["spam", "ham"], "profile": "sms"})
    plain = tool("judge", {"prompt": PROMPT, "choices": ["spam", "ham"]})
    decided = tool(
        "decide", {"state": STATE, "questions": QUESTIONS, "profiles": {"billing": "yn"}}
    )
    assert sms["audit"] is True and not plain.get("audit")
    assert not any(a.get("audit") for a in decided.values())
    audited = log.decisions(audit=True)
    assert [r.judgment_id for r in audited] == [sms["judgment_id"]]
    log.close()


def test_decide_escalates_through_a_cascade(judge: Judge, tmp_path: Path) -> None:
    """`judge mcp --cascade`: a question decide's model escalates goes to each later stage as
    the same question under "P-NAME", as `judge serve --cascade` sends it; the answer names
    who decided and lists every stage, and each local stage's decision is logged with it."""
    import asyncio

    from test_cascade_service import coin_profile

    from service.cascade.stages import LocalModel
    from service.log.backends import open_log
    from service.mcp.server import create_server
    from service.profiles import ProfileStore

    for name, right, seed in [("coin", 0.5, 1), ("coin-second", 0.99, 2)]:
        save_profile(coin_profile(name, judge, right, seed), tmp_path / f"{name}.json")
    log = open_log(str(tmp_path / "decisions.db"))
    cascade: dict[str, LocalModel | str] = {
        "second": LocalModel(judge),
        "down": "http://127.0.0.1:9",
    }
    server = create_server(judge, ProfileStore(tmp_path), decision_log=log, cascade=cascade)

    def decide(arguments: dict[str, Any]) -> Any:
        result: Any = asyncio.run(server.call_tool("decide", arguments))
        assert not result.is_error, result.content
        return result.structured_content

    question: dict[str, Any] = {"type": "choice", "instructions": "Is this SMS spam?"}
    question["criteria"] = {"spam": "advertising", "ham": "a normal message"}
    gated = decide({"state": PROMPT, "questions": {"q": question}, "profiles": {"q": "coin"}})
    answer = gated["q"]
    assert answer["decided_by"] == "second" and answer["decision"] == "accept"
    assert [s["stage"] for s in answer["cascade"]] == ["local", "second"]  # none after
    assert answer["profile"] == "coin-second"
    assert answer["judgment_id"] == answer["cascade"][1]["answer"]["judgment_id"]
    for part in answer["cascade"]:
        row = log.get(part["answer"]["judgment_id"])
        assert row is not None and row.cascade is not None
        assert row.cascade.decided_by == "second"
    # No profile: no stage certifies, the remote one is down, and a person decides.
    plain = decide({"state": PROMPT, "questions": {"q": question}})["q"]
    assert [s["stage"] for s in plain["cascade"]] == ["local", "second", "down"]
    assert plain["cascade"][2]["failure"] == "stage_failed" and plain["decided_by"] is None
    # A later stage's missing profile is refused before any model work, naming the field:
    # under "coin-second" the second stage's is "coin-second-second".
    from mcp.server.mcpserver.exceptions import ToolError

    before = len(log.decisions())
    arguments = {"state": PROMPT, "questions": {"q": question}, "profiles": {"q": "coin-second"}}
    with pytest.raises(ToolError, match=r"profiles\.q: no profile named 'coin-second-second'"):
        asyncio.run(server.call_tool("decide", arguments))
    assert len(log.decisions()) == before
    log.close()


def test_judge_mcp_s_stages_need_names_of_their_own(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mcp", "--stage-name", "a", "--cascade", "a=x.gguf"]) == 2
    assert "each stage needs a name of its own" in capsys.readouterr().err


def test_judge_mcp_keeps_its_log_as_judge_serve_keeps_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, judge: Judge
) -> None:
    """`judge mcp`'s log settings reach the server it starts: the log opened with the
    retention its flags give, the audit rates, the opt-in and the choice mass as defaults."""
    from service.log import backends, decision_log
    from service.mcp import server as mcp_server

    opened: dict[str, Any] = {}
    real_open = backends.open_log

    def open_log(target: str, **options: Any) -> decision_log.DecisionLog:
        opened["retention"] = options.get("retention")
        return real_open(target, **options)

    class Started:
        def run(self, transport: str) -> None:
            opened["transport"] = transport

    def create_server(engine: object, store: object, **options: Any) -> Started:
        opened["options"] = options
        return Started()

    monkeypatch.setattr(backends, "open_log", open_log)
    monkeypatch.setattr(mcp_server, "create_server", create_server)
    monkeypatch.setattr("judge.engines.open_engine", lambda *_, **__: judge)
    argv = ["mcp", "--decision-log", str(tmp_path / "log.db"), "--log-max-rows", "5"]
    argv += ["--log-max-age-days", "2", "--audit-rate", "sms=1", "--min-choice-mass", "0.2"]
    assert main(argv) == 0
    assert opened["retention"] == decision_log.Retention(max_age_days=2.0, max_rows=5)
    options = opened["options"]
    assert options["audit_rates"] == {"sms": 1.0} and options["audit_rate"] == 0.0
    assert options["defaults"].min_choice_mass == 0.2
    assert opened["transport"] == "stdio"
