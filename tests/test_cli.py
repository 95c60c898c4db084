"""`judge ask`, one prompt and batch gating, in process, with the session's real model."""

from __future__ import annotations

import io
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from calibration import CalibrationProfile, PolicyDefaults, fit_profile, make_policy, save_profile
from calibration.fit_data import LabeledScores, Provenance
from calibration.profile import etag_of
from judge import Judge
from service.cli.main import main

PROMPT = "Is this SMS spam? WINNER!! Claim your free prize now, text WIN to 80082."
CHOICES = ["spam", "ham"]
# What judge ask prints: the POST /judge response's fields (JudgeResponse: one record) that a
# judgment without request options has; audit, prompt and a score's or probe's fields are left
# out when they have their defaults.
ANSWER_KEYS = {
    "type",
    "temperature",
    "decision",
    "choice",
    "confidence",
    "probabilities",
    "raw_probabilities",
    "prediction_set",
    "reasons",
    "reason_codes",
    "threshold",
    "certified",
    "choice_mass",
    "profile",
    "model",
    "latency_ms",
    "judgment_id",
    "tokens_sha256",
    "model_sha256",
    "policy_sha256",
    "profile_etag",
}


@pytest.fixture(scope="module")
def profile(judge: Judge) -> CalibrationProfile:
    """A profile for the session model, fitted cheaply on synthetic log-probabilities."""
    rng = np.random.default_rng(0)
    n = 400
    labels = rng.integers(0, 2, n)
    p_right = rng.beta(8, 2, n)  # mostly confident, sometimes wrong
    p = np.where(labels == 0, p_right, 1 - p_right)  # P(spam)
    z = np.log(np.stack([p, 1 - p], axis=1))  # (n, 2) in CHOICES order
    return fit_profile(
        "sms",
        LabeledScores(z, np.full(n, 0.9), labels),
        CHOICES,
        Provenance(fingerprint=judge.fingerprint(), dataset="synthetic", dataset_sha256="0" * 64),
    ).profile


@pytest.fixture
def profile_file(profile: CalibrationProfile, tmp_path: Path) -> Path:
    return save_profile(profile, tmp_path / "sms.json")


def _ask(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["ask", *argv]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_ask_without_a_profile_prints_the_decision_and_the_judgment(
    loaded_once: list[dict[str, object]], capsys: pytest.CaptureFixture[str], judge: Judge
) -> None:
    out = _ask(capsys, PROMPT, "--choice", "spam", "--choice", "ham")
    assert set(out) == ANSWER_KEYS
    expected = judge.judge(PROMPT, CHOICES)
    for choice in CHOICES:
        # No profile: the "calibrated" probabilities are the engine's own.
        assert out["probabilities"][choice] == pytest.approx(
            expected.probabilities[choice], abs=1e-6
        )
        assert out["raw_probabilities"][choice] == pytest.approx(out["probabilities"][choice])
    assert out["choice"] == expected.choice
    # No profile: no certified threshold, so it escalates however confident it is.
    assert out["threshold"] is None and PolicyDefaults().uncertified_threshold is None
    assert out["profile"] is None and out["prediction_set"] is None and out["certified"] is False
    assert out["decision"] == "escalate" and out["reason_codes"] == ["uncalibrated"]
    assert out["model"] == judge.model_id
    assert loaded_once == [
        {
            "model": None,
            "dtype": "auto",
            "device": "cpu",
            "response_prefix": '{"answer": "',
            "response_suffix": '"}',
            "choice_paths": "canonical",
        }
    ]


def test_ask_reads_the_choices_on_the_paths_asked_for(
    loaded_once: list[dict[str, object]], capsys: pytest.CaptureFixture[str], judge: Judge
) -> None:
    out = _ask(capsys, PROMPT, "--choice", "spam", "--choice", "ham", "--choice-paths", "grammar")
    assert loaded_once[0]["choice_paths"] == "grammar"
    expected = judge.with_choice_paths("grammar").judge(PROMPT, CHOICES)
    for choice in CHOICES:
        assert out["raw_probabilities"][choice] == pytest.approx(
            expected.probabilities[choice], abs=1e-6
        )
    assert out["tokens_sha256"] == expected.tokens_sha256  # which names the grammar mode


def test_ask_with_a_profile_uses_its_choices_dtype_and_policy(
    loaded_once: list[dict[str, object]],
    capsys: pytest.CaptureFixture[str],
    judge: Judge,
    profile: CalibrationProfile,
    profile_file: Path,
) -> None:
    out = _ask(capsys, PROMPT, "--profile", str(profile_file))
    assert set(out) == ANSWER_KEYS | {"calibration_method"}  # the profile's map
    judgment = judge.judge(PROMPT, profile.choices)
    reference = make_policy(profile).decide(judgment)
    assert out["profile"] == "sms" and out["certified"] == reference.certified
    assert out["decision"] == reference.decision and out["choice"] == reference.choice
    assert out["reason_codes"] == reference.reason_codes
    assert out["prediction_set"] == reference.prediction_set
    assert out["threshold"] == profile.threshold.threshold
    assert list(out["probabilities"]) == profile.choices
    for choice in CHOICES:
        assert out["probabilities"][choice] == pytest.approx(
            reference.probabilities[choice], abs=1e-6
        )
        assert out["raw_probabilities"][choice] == pytest.approx(
            judgment.probabilities[choice], abs=1e-6
        )
    assert loaded_once[0]["dtype"] == profile.fingerprint.dtype == "float32"
    # The profile's paths, where the command does not name any.
    assert loaded_once[0]["choice_paths"] == profile.fingerprint.choice_paths == "canonical"


def test_ask_prints_what_pins_the_decision(
    loaded_once: list[dict[str, object]],
    capsys: pytest.CaptureFixture[str],
    judge: Judge,
    profile: CalibrationProfile,
    profile_file: Path,
) -> None:
    """The judgment's id, its tokens', weights' and policy's hashes, the profile's ETag."""
    gated = _ask(capsys, PROMPT, "--profile", str(profile_file))
    plain = _ask(capsys, PROMPT, "--choice", "spam", "--choice", "ham")
    reference = judge.judge(PROMPT, profile.choices)
    for out in (gated, plain):
        assert uuid.UUID(out["judgment_id"]).version == 7
        assert out["tokens_sha256"] == reference.tokens_sha256  # the same choices, in order
        assert out["model_sha256"] == judge.weights_sha256 == reference.model_sha256
    assert len({gated["judgment_id"], plain["judgment_id"], reference.judgment_id}) == 3
    assert gated["profile_etag"] == profile.etag == etag_of(profile_file.read_bytes())
    assert gated["policy_sha256"] == make_policy(profile).sha256
    assert plain["profile_etag"] is None
    assert plain["policy_sha256"] == make_policy(None).sha256 != gated["policy_sha256"]


@pytest.mark.parametrize(("threshold", "codes"), [("0", []), ("1", ["below_threshold"])])
def test_threshold_override(
    loaded_once: list[dict[str, object]],
    capsys: pytest.CaptureFixture[str],
    profile_file: Path,
    threshold: str,
    codes: list[str],
) -> None:
    # Without a profile the opt-in sets the threshold; with one, the override.
    for extra in (
        ["--uncertified-threshold", threshold],
        ["--threshold", threshold, "--profile", str(profile_file)],
    ):
        out = _ask(capsys, PROMPT, "--choice", "ham", "--choice", "spam", *extra)
        want = list(codes)
        if (
            out["profile"] and len(out["prediction_set"]) != 1
        ):  # a profile also gates on its conformal set
            want.append("ambiguous_set")
        assert out["reason_codes"] == want
        assert out["decision"] == ("escalate" if want else "accept")
        assert out["threshold"] == float(threshold) and out["certified"] is False
        assert len(out["reasons"]) == len(want)


def test_low_choice_mass_escalates(
    loaded_once: list[dict[str, object]], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [PROMPT, "--choice", "spam", "--choice", "ham", "--uncertified-threshold", "0"]
    out = _ask(capsys, *argv, "--min-choice-mass", "1")
    assert out["decision"] == "escalate" and out["reason_codes"] == ["low_choice_mass"]


def test_a_threshold_without_a_certificate_is_a_usage_error(
    loaded_once: list[dict[str, object]], capsys: pytest.CaptureFixture[str]
) -> None:
    # --threshold overrides a certificate; with none it would accept raw confidence quietly.
    assert main(["ask", PROMPT, "--choice", "spam", "--choice", "ham", "--threshold", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "(--threshold)" in err and "give --uncertified-threshold instead" in err


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--choice", "yes", "--choice", "no"], "choices"),
        (["--system", "You are a pirate."], "system"),
        (["--response-prefix", "Answer: "], "response_prefix"),
    ],
)
def test_profile_mismatch_is_a_usage_error_naming_the_field(
    loaded_once: list[dict[str, object]],
    capsys: pytest.CaptureFixture[str],
    profile_file: Path,
    argv: list[str],
    field: str,
) -> None:
    assert main(["ask", PROMPT, "--profile", str(profile_file), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"judge: error ({field}):" in captured.err


def test_a_missing_or_broken_profile_is_a_usage_error(
    loaded_once: list[dict[str, object]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["ask", PROMPT, "--profile", str(tmp_path / "none.json")]) == 2
    assert "no calibration profile" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text('{"name": "x"}')
    assert main(["ask", PROMPT, "--profile", str(broken)]) == 2
    assert "not a valid calibration profile" in capsys.readouterr().err
    assert loaded_once == []  # refused before any model was loaded


def test_ask_reports_bad_input(
    loaded_once: list[dict[str, object]], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["ask", "Which?", "--choice", "same", "--choice", "same"])
    assert code == 2
    assert "'same' appears more than once" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ask", "Which?"], "--choice"),
        (["ask", "--choice", "a", "--choice", "b"], "PROMPT or --input"),
        (["ask", "Which?", "--input", "x.jsonl", "--choice", "a", "--choice", "b"], "not both"),
        (["ask", "Which?", "--choice", "a", "--choice", "b", "--threshold", "1.5"], "[0, 1]"),
        (["ask", "Which?", "--choice", "a", "--choice", "b", "--output", "o"], "--input"),
        (["ask", "--input", "-", "--batch-size", "0"], "at least 1"),
    ],
)
def test_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def _batch_input(judge: Judge) -> tuple[str, list[dict[str, Any]]]:
    """Input lines with bad ones in the middle, and what each output line must say."""
    too_long = "spam " * (judge.context_window or 8192)
    lines: list[tuple[str | dict[str, Any], dict[str, Any] | None]] = [
        ({"prompt": PROMPT, "id": "first"}, {"id": "first", "prompt": PROMPT}),
        ("this is not JSON", {"id": 2, "line": 2, "type": "InputLineError", "field": None}),
        (
            {"prompt": "Is this spam? Lunch at noon?"},
            {"id": 3, "prompt": "Is this spam? Lunch at noon?"},
        ),
        (
            {"id": 7, "choices": CHOICES},
            {"id": 7, "line": 4, "type": "InputLineError", "field": "prompt"},
        ),
        ("", None),  # blank: skipped, no output
        (
            {"prompt": "Which?", "choices": ["ham", "ham"], "id": 2.5},
            {"id": 2.5, "line": 6, "type": "DuplicateChoiceError", "field": "choices"},
        ),
        (
            {"prompt": too_long, "id": "long"},
            {"id": "long", "line": 7, "type": "PromptTooLongError", "field": "prompt"},
        ),
        (
            {"prompt": "Spam?", "id": "extra", "label": "spam"},
            {"id": "extra", "line": 8, "type": "InputLineError", "field": "label"},
        ),
        (
            {"prompt": "Reply STOP to win", "choices": ["ham", "spam"], "id": True},
            {"id": True, "prompt": "Reply STOP to win"},
        ),
    ]
    text = "".join((raw if isinstance(raw, str) else json.dumps(raw)) + "\n" for raw, _ in lines)
    return text, [expected for _, expected in lines if expected is not None]


def _check_batch_output(out: str, expected: list[dict[str, Any]], judge: Judge) -> None:
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in rows] == [e["id"] for e in expected]  # order and ids kept
    for row, want in zip(rows, expected, strict=True):
        if "type" in want:
            assert set(row) == {"id", "line", "error"}
            assert row["line"] == want["line"]
            assert row["error"]["type"] == want["type"]
            assert row["error"]["field"] == want["field"]
            assert row["error"]["detail"]
        else:
            # With a profile, the response names its map's method, as POST /judge's does.
            mapped = {"calibration_method"} if row["profile"] is not None else set()
            assert set(row) == ANSWER_KEYS | {"id"} | mapped
            raw = row["raw_probabilities"]
            reference = judge.judge(want["prompt"], list(raw))
            for choice, p in reference.probabilities.items():
                assert raw[choice] == pytest.approx(p, abs=1e-4)


def test_batch_from_a_file_keeps_order_ids_and_errors_in_place(
    loaded_once: list[dict[str, object]],
    capsys: pytest.CaptureFixture[str],
    judge: Judge,
    tmp_path: Path,
) -> None:
    text, expected = _batch_input(judge)
    source, target = tmp_path / "items.jsonl", tmp_path / "out" / "decisions.jsonl"
    source.write_text(text)
    argv = ["ask", "--input", str(source), "--output", str(target), "--batch-size", "3"]
    assert main([*argv, "--choice", "spam", "--choice", "ham"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    _check_batch_output(target.read_text(), expected, judge)
    assert [p.name for p in target.parent.iterdir()] == ["decisions.jsonl"]  # no temporary left
    summary = captured.err.strip().splitlines()
    assert summary[-2].startswith("8 items: ") and summary[-2].endswith(", 5 errors")
    assert "5 lines could not be judged (lines 2, 4, 6, 7, 8)" in summary[-1]
    assert len(loaded_once) == 1


def test_batch_from_stdin_with_a_profile(
    loaded_once: list[dict[str, object]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    judge: Judge,
    profile_file: Path,
) -> None:
    text, expected = _batch_input(judge)
    mismatch = json.dumps({"prompt": "Yes?", "choices": ["yes", "no"], "id": "other"}) + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(text + mismatch))
    assert main(["ask", "--input", "-", "--profile", str(profile_file), "--threshold", "0"]) == 0
    captured = capsys.readouterr()
    expected.append({"id": "other", "line": 10, "type": "ProfileMismatchError", "field": "choices"})
    _check_batch_output(captured.out, expected, judge)
    rows = [json.loads(line) for line in captured.out.splitlines()]
    judged = [r for r in rows if "decision" in r]
    # Each line's probabilities in its own order of choices (the request's, as POST /judge
    # answers), else the profile's.
    order = {"first": CHOICES, 3: CHOICES, True: ["ham", "spam"]}
    assert all(r["profile"] == "sms" and list(r["probabilities"]) == order[r["id"]] for r in judged)
    accepted = sum(r["decision"] == "accept" for r in judged)
    ambiguous = sum("ambiguous_set" in r["reason_codes"] for r in judged)
    assert accepted + ambiguous == len(judged) == 3
    summary = captured.err.strip().splitlines()[-2]
    assert summary.startswith(f"9 items: {accepted} accepted, {3 - accepted} escalated")
    assert summary.endswith(", 6 errors")


def test_batch_of_only_bad_lines_still_answers_every_line(
    loaded_once: list[dict[str, object]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO('[1, 2]\n{"prompt": "no choices"}\n'))
    assert main(["ask", "--input", "-"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["id"], r["error"]["field"]) for r in rows] == [(1, None), (2, "choices")]


def test_batch_input_that_cannot_be_read_is_a_usage_error(
    loaded_once: list[dict[str, object]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["ask", "--input", str(tmp_path / "missing.jsonl"), "--choice", "a", "--choice", "b"]
    assert main(argv) == 2
    assert "cannot read --input" in capsys.readouterr().err


def test_serve_passes_its_settings_to_the_app_and_the_loader(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import uvicorn

    import service

    seen: dict[str, Any] = {}

    def fake_create_app(*, loader: Any, config: service.ServiceConfig) -> str:
        seen["loader"], seen["config"] = loader, config
        return "app"

    def fake_load(model: object = None, **options: Any) -> str:
        seen["load"] = {"model": model, **options}
        return "engine"

    class FakeServer:
        def __init__(self, config: uvicorn.Config) -> None:
            seen["uvicorn"] = config

        def run(self) -> None:
            seen["ran"] = True

    monkeypatch.setattr(service, "create_app", fake_create_app)
    monkeypatch.setattr(uvicorn, "Server", FakeServer)
    monkeypatch.setattr(Judge, "load", staticmethod(fake_load))
    monkeypatch.delenv("JUDGE_API_KEY", raising=False)
    argv = ["serve", "--port", "9", "--prefix-cache-mb", "12.5", "--uncertified-threshold", "0.7"]
    argv += ["--shutdown-timeout", "7", "--max-request-tokens", "1000", "--admission-wait", "0.5"]
    assert main([*argv, "--profiles-dir", str(tmp_path)]) == 0
    assert seen["ran"] and seen["uvicorn"].app == "app" and seen["uvicorn"].port == 9
    assert seen["uvicorn"].timeout_graceful_shutdown == 7
    assert seen["config"].max_request_tokens == 1000 and seen["config"].admission_wait_s == 0.5
    assert seen["config"].api_key is None
    assert seen["config"].uncertified_threshold == 0.7 and seen["config"].profiles_dir == tmp_path
    assert seen["loader"]() == "engine"  # the model loads in the server, with the cache budget
    assert seen["load"]["prefix_cache_mb"] == 12.5
    assert seen["load"]["batch_invariant"] is True  # the default; --batch-variant opts out
    assert seen["load"]["lean"] is True  # the default; --generic-pass opts out
    # The engine packs its passes to the server's budget: one number everywhere.
    assert seen["load"]["max_batch_tokens"] == seen["config"].max_batch_tokens
    assert main(["serve", "--batch-variant", "--profiles-dir", str(tmp_path)]) == 0
    seen["loader"]()
    assert seen["load"]["batch_invariant"] is False
    assert main(["serve", "--generic-pass", "--profiles-dir", str(tmp_path)]) == 0
    seen["loader"]()
    assert seen["load"]["lean"] is False
    with pytest.raises(SystemExit):
        main(["serve", "--prefix-cache-mb", "-1"])
    # The key: from a file (never the command line, where `ps` shows it), else the environment.
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    assert main(["serve", "--api-key-file", str(key_file)]) == 0
    assert seen["config"].api_key == "s3cret"
    monkeypatch.setenv("JUDGE_API_KEY", "from-env")
    assert main(["serve"]) == 0 and seen["config"].api_key == "from-env"
    key_file.write_text("")
    assert main(["serve", "--api-key-file", str(key_file)]) == 2
    assert main(["serve", "--api-key-file", str(tmp_path / "missing")]) == 2
    with pytest.raises(SystemExit):
        main(["serve", "--api-key", "s3cret"])
