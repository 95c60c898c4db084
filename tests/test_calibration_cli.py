"""`judge calibrate` and `judge evaluate` on a small slice of a real dataset, real model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from calibration.profile import load_profile
from judge import Judge, cli

SMS = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "sms_spam"


@pytest.fixture
def session_model(monkeypatch: pytest.MonkeyPatch, judge: Judge) -> None:
    def load(model: object = None, **options: Any) -> Judge:
        return judge

    monkeypatch.setattr(Judge, "load", staticmethod(load))


@pytest.mark.skipif(not SMS.exists(), reason="the shared datasets are not beside this checkout")
def test_calibrate_then_evaluate(
    session_model: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], judge: Judge
) -> None:
    profiles = tmp_path / "profiles"
    code = cli.main(
        ["calibrate", "--task", str(SMS), "--limit", "48", "--profiles-dir", str(profiles)]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "ECE" in out
    assert sorted(p.name for p in profiles.iterdir()) == [
        "sms_spam.json",
        "sms_spam.reliability.png",
        "sms_spam.report.md",
    ]
    profile = load_profile(profiles / "sms_spam.json")
    assert profile.n_examples == 48
    assert profile.choices == ["ham", "spam"]
    assert profile.model == judge.model_id and profile.model_sha256 == judge.weights_sha256
    assert profile.dtype == judge.dtype
    assert (profiles / "sms_spam.reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    report = tmp_path / "eval.md"
    code = cli.main(
        [
            "evaluate",
            "--task",
            str(SMS),
            "--limit",
            "32",
            "--profile",
            str(profiles / "sms_spam.json"),
            "--report",
            str(report),
        ]
    )
    assert code == 0
    assert "Held-out evaluation (32 items)" in capsys.readouterr().out
    assert "Held-out evaluation" in report.read_text()


def test_evaluate_refuses_a_profile_for_other_choices(
    session_model: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not SMS.exists():
        pytest.skip("the shared datasets are not beside this checkout")
    profiles = tmp_path / "p"
    assert (
        cli.main(
            ["calibrate", "--task", str(SMS), "--limit", "16", "--profiles-dir", str(profiles)]
        )
        == 0
    )
    other = tmp_path / "other"
    other.mkdir()
    (other / "task.json").write_text(
        '{"name": "other", "choices": ["yes", "no"], "instruction": "?"}'
    )
    (other / "test.jsonl").write_text(
        "".join(f'{{"text": "item {i}", "label": "yes"}}\n' for i in range(12))
    )
    capsys.readouterr()
    code = cli.main(
        ["evaluate", "--task", str(other), "--profile", str(profiles / "sms_spam.json")]
    )
    assert code == 2
    assert "fitted for choices ['ham', 'spam']" in capsys.readouterr().err
