"""`judge decide`, in process: typed answers with the session's real model, and the errors
that stop before any model loads."""

from __future__ import annotations

import io
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from calibration import CalibrationProfile, fit_profile, make_policy, save_profile
from calibration.fit_data import LabeledScores, Provenance
from judge import Judge
from judge.answers import decide
from service.cli.main import main

STATE = {
    "from": "ann@example.com",
    "subject": "Invoice #123 charged twice",
    "body": "I was billed twice for March. Please refund one of the charges.",
}
QUESTIONS: dict[str, Any] = {
    "billing": {"type": "noul", "instructions": "Is this about billing?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should handle it?",
        "criteria": {"payments": "invoices, refunds", "support": "bugs, outages", "sales": None},
    },
    "urgency": {
        "type": "score",
        "instructions": "How urgent is it?",
        "criteria": ["not urgent", "somewhat urgent", "very urgent"],
    },
}
NOUL = json.dumps(QUESTIONS["billing"])


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch, judge: Judge) -> list[dict[str, object]]:
    """Judge.load hands out the session model and logs its calls."""
    calls: list[dict[str, object]] = []

    def fake_load(model: object = None, **options: Any) -> Judge:
        calls.append({"model": model, **options})
        return judge

    monkeypatch.setattr(Judge, "load", staticmethod(fake_load))
    return calls


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to load a model fails the test: the error must come first."""

    def fail(*_: object, **__: object) -> Judge:
        pytest.fail("the model was loaded before the input was checked")

    monkeypatch.setattr(Judge, "load", staticmethod(fail))


@pytest.fixture
def state_file(tmp_path: Path) -> Path:
    path = tmp_path / "state.json"
    path.write_text(json.dumps(STATE))
    return path


@pytest.fixture(scope="module")
def yes_no_profile(judge: Judge) -> CalibrationProfile:
    """A yes/no profile for the session model, fitted cheaply on synthetic log-probabilities."""
    rng = np.random.default_rng(0)
    n = 400
    labels = rng.integers(0, 2, n)
    p_right = rng.beta(8, 2, n)
    p = np.where(labels == 0, p_right, 1 - p_right)  # P(yes)
    return fit_profile(
        "billing",
        LabeledScores(np.log(np.stack([p, 1 - p], axis=1)), np.full(n, 0.9), labels),
        ["yes", "no"],
        Provenance(fingerprint=judge.fingerprint(), dataset="synthetic", dataset_sha256="0" * 64),
    ).profile


def _decide(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["decide", *argv]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one line a refused command prints; its exit status is 2 and stdout is empty."""
    assert main(["decide", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("judge: error")
    return lines[0]


@pytest.mark.slow
def test_decide_answers_typed_questions_as_the_engine_does(
    loaded: list[dict[str, object]],
    capsys: pytest.CaptureFixture[str],
    judge: Judge,
    state_file: Path,
    tmp_path: Path,
) -> None:
    more = tmp_path / "questions.json"
    more.write_text(json.dumps({k: QUESTIONS[k] for k in ("team", "urgency")}))
    out = _decide(
        capsys,
        *("--state", str(state_file), "--question", f"billing={NOUL}"),
        *("--questions", str(more), "--order", "invariant"),
    )
    invariant = {qid: {**q, "order": "invariant"} for qid, q in QUESTIONS.items()}
    reference = decide(judge, STATE, invariant)
    assert list(out) == ["team", "urgency", "billing"]  # the file's, then the command line's
    for qid, answer in out.items():
        assert answer["type"] == QUESTIONS[qid]["type"]
        assert sum(answer["probabilities"].values()) == pytest.approx(1.0)
        for choice, p in reference[qid].probabilities.items():
            # within the engine's tolerance: the rows are packed otherwise in another order
            assert answer["probabilities"][choice] == pytest.approx(p, abs=1e-4)
        assert answer["orderings"] == reference[qid].orderings
        assert answer["order_spread"] == pytest.approx(reference[qid].order_spread, abs=1e-4)
        # No profile: gated by the default policy, on the model's own probabilities.
        assert answer["profile"] is None and answer["certified"] is False
        assert answer["raw_probabilities"] == pytest.approx(answer["probabilities"], abs=1e-12)
        top = max(answer["probabilities"].values())
        assert answer["decision"] == ("accept" if top >= 0.9 else "escalate")
    billing, team, urgency = out["billing"], out["team"], out["urgency"]
    assert billing["noul"] == pytest.approx(billing["probabilities"]["yes"])
    assert "confidence" not in billing and "choice" not in billing
    assert team["orderings"] == 3 and team["choice"] in QUESTIONS["team"]["criteria"]
    assert team["confidence"] == pytest.approx(max(team["probabilities"].values()))
    assert urgency["score"] == pytest.approx(
        sum(i * urgency["probabilities"][str(i)] for i in range(3))
    )
    assert urgency["legend"] == {"0": "not urgent", "1": "somewhat urgent", "2": "very urgent"}
    assert loaded == [
        {
            "model": None,
            "dtype": "auto",
            "device": "cpu",
            "response_prefix": judge.response_prefix,
            "response_suffix": judge.response_suffix,
            "choice_paths": "canonical",
        }
    ]


@pytest.mark.slow
def test_a_profile_gates_its_question(
    loaded: list[dict[str, object]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    judge: Judge,
    yes_no_profile: CalibrationProfile,
    tmp_path: Path,
) -> None:
    save_profile(yes_no_profile, tmp_path / "billing.json")
    text = "Hi, my invoice shows a charge I do not recognise."
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))  # not JSON: the state is the text
    out = _decide(
        capsys,
        *("--state", "-", "--question", f"billing={NOUL}"),
        *("--profile", "billing=billing", "--profiles-dir", str(tmp_path)),
    )
    reference = decide(judge, text, {"billing": QUESTIONS["billing"]})["billing"]
    decision = make_policy(yes_no_profile).decide(reference.judgment)
    billing = out["billing"]
    # Gated: the answer's numbers are the calibrated ones, the model's are raw_probabilities.
    assert billing["raw_probabilities"]["yes"] == pytest.approx(
        reference.probabilities["yes"], abs=1e-6
    )
    assert billing["noul"] == pytest.approx(decision.probabilities["yes"], abs=1e-6)
    assert billing["profile"] == "billing" and billing["decision"] == decision.decision
    assert billing["reason_codes"] == decision.reason_codes
    assert billing["certified"] == decision.certified
    assert billing["threshold"] == decision.threshold
    assert billing["prediction_set"] == decision.prediction_set
    for choice, p in decision.probabilities.items():
        assert billing["probabilities"][choice] == pytest.approx(p, abs=1e-6)
    assert loaded[0]["dtype"] == yes_no_profile.fingerprint.dtype  # the profile's


@pytest.mark.slow
def test_a_profile_for_other_choices_is_refused_naming_the_question(
    no_model: None,
    capsys: pytest.CaptureFixture[str],
    yes_no_profile: CalibrationProfile,
    state_file: Path,
    tmp_path: Path,
) -> None:
    save_profile(yes_no_profile, tmp_path / "billing.json")
    line = _error(
        capsys,
        *("--state", str(state_file), "--question", f"team={json.dumps(QUESTIONS['team'])}"),
        *("--profile", "team=billing", "--profiles-dir", str(tmp_path)),
    )
    assert line.startswith("judge: error (profiles.team): ") and "choices" in line


@pytest.mark.parametrize(
    ("question", "field"),
    [
        ('{"type": "noul"', "questions.q1"),  # not JSON
        ('{"type": "maybe", "instructions": "?"}', "questions.q1.type"),
        ('{"type": "noul", "instructions": ""}', "questions.q1.instructions"),
        (
            '{"type": "choice", "instructions": "?", "criteria": {"a": null}}',
            "questions.q1.criteria",
        ),
        ('{"type": "score", "instructions": "?", "criteria": ["low"]}', "questions.q1.criteria"),
        (
            '{"type": "choice", "instructions": "?", "criteria": {" ": 1, "b": 2}}',
            "questions.q1.criteria",
        ),
    ],
)
def test_a_bad_question_is_one_line_naming_it(
    no_model: None,
    capsys: pytest.CaptureFixture[str],
    state_file: Path,
    question: str,
    field: str,
) -> None:
    line = _error(capsys, "--state", str(state_file), "--question", f"q1={question}")
    assert line.startswith(f"judge: error ({field}): ")


def test_bad_arguments_are_one_line_naming_the_input(
    no_model: None, capsys: pytest.CaptureFixture[str], state_file: Path, tmp_path: Path
) -> None:
    state = ("--state", str(state_file))
    q1 = ("--question", f"q1={NOUL}")
    assert "(questions)" in _error(capsys, *state)  # no question
    assert "(state)" in _error(capsys, "--state", str(tmp_path / "missing.json"), *q1)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert "(state)" in _error(capsys, "--state", str(empty), *q1)
    assert "(questions.q1)" in _error(capsys, *state, *q1, *q1)  # asked twice
    assert "expected ID=JSON" in _error(capsys, *state, "--question", NOUL)
    listed = tmp_path / "list.json"
    listed.write_text("[]")
    assert "(questions)" in _error(capsys, *state, "--questions", str(listed))
    # Profiles: for a question not asked, by a name not stored.
    assert "(profiles.q2)" in _error(capsys, *state, *q1, "--profile", "q2=billing")
    line = _error(capsys, *state, *q1, "--profile", "q1=nope", "--profiles-dir", str(tmp_path))
    assert line.startswith("judge: error (profiles.q1): ") and "'nope'" in line


@pytest.mark.parametrize(
    "argv",
    [
        ["--question", f"q1={NOUL}"],  # no --state
        ["--state", "-", "--order", "sideways"],
        ["--state", "-", "--max-orderings", "0"],
    ],
)
def test_usage_errors(no_model: None, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["decide", *argv])
    assert exit.value.code == 2
    assert "judge decide: error:" in capsys.readouterr().err


def _readme_section(heading: str) -> str:
    page = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    start = page.index(heading)
    return page[start : page.index("\n#", start + len(heading))]


@pytest.mark.slow
def test_the_readme_example(
    loaded: list[dict[str, object]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    section = _readme_section("## Typed questions: `judge decide`")
    command = re.search(r"```sh\n(.*?)```", section, re.S)
    shown = re.search(r"```json\n(.*?)```", section, re.S)
    assert command and shown, "the section shows a command and its output"
    argv = shlex.split(command.group(1).replace("\\\n", " "))
    assert argv[:2] == ["judge", "decide"]
    (tmp_path / "ticket.json").write_text(json.dumps(STATE))
    monkeypatch.chdir(tmp_path)
    out = _decide(capsys, *argv[2:])
    example = json.loads(shown.group(1))
    assert list(out) == list(example)
    for qid, answer in out.items():
        assert set(answer) == set(example[qid])
        assert set(answer["probabilities"]) == set(example[qid]["probabilities"])
