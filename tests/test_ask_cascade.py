"""``judge ask --cascade``: what the command's model escalates goes to the later stages, each
deciding through its own gate, as ``judge serve --cascade`` decides (one function,
``service.cascade.escalation.escalated``); the flags are checked before any model loads."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from calibration import Gate, LabeledScores, Provenance, fit_profile, make_policy, save_profile
from judge import Judge
from service.cli.main import main

CHOICES = ["spam", "ham"]
ITEMS = [
    "WINNER! You have won a free cruise, text CLAIM to 80082 now",
    "See you at the station at 6",
    "URGENT: your account is locked, call 0906 555 0199",
    "Can you pick up some bread on your way home?",
    "Free entry in a weekly draw to win concert tickets, text WIN to 80808",
    "Sorry, I'll call you later, I'm in a meeting",
]


def prompt(text: str) -> str:
    return f"Is this SMS spam or ham?\n\nSMS: {text}"


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object, **__: object) -> Judge:
        pytest.fail("a model was loaded before the flags were checked")

    monkeypatch.setattr(Judge, "load", staticmethod(fail))


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--stage-profile", "big=p.json"], "--stage-profile"),
        (["--cascade", "local=other.gguf"], "--cascade"),
        (["--cascade", "big=x.gguf", "--cascade", "big=y.gguf"], "--cascade"),
        (["--cascade", "big=x.gguf", "--stage-profile", "small=p.json"], "--stage-profile"),
    ],
)
def test_a_bad_cascade_is_refused_before_any_model_loads(
    no_model: None, capsys: pytest.CaptureFixture[str], argv: list[str], field: str
) -> None:
    assert main(["ask", "Is it?", "--choice", "a", "--choice", "b", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"judge: error ({field})"), err


@pytest.mark.slow
def test_what_the_first_stage_escalates_the_second_decides(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    judge: Judge,
    tmp_path: Path,
) -> None:
    # The second stage: the same model under a profile that sharpens every judgment (its
    # labels always follow the scores), so it accepts what the raw gate escalates.
    loads: list[Any] = []

    def load(model: object = None, **options: Any) -> Judge:
        loads.append(model)
        return judge

    monkeypatch.setattr(Judge, "load", staticmethod(load))
    rng = np.random.default_rng(0)
    gap = rng.uniform(0.2, 1.0, 300) * rng.choice([-1, 1], 300)
    z = np.stack([gap, -gap], axis=1)
    z -= np.logaddexp(z[:, 0], z[:, 1])[:, None]
    profile = fit_profile(
        "sharp",
        LabeledScores(z, np.full(300, 0.9), (gap < 0).astype(int)),
        CHOICES,
        Provenance(fingerprint=judge.fingerprint(), dataset="synthetic", dataset_sha256="0" * 64),
    ).profile
    save_profile(profile, tmp_path / "sharp.json")
    lines = "".join(
        json.dumps({"prompt": prompt(t), "choices": CHOICES, "id": i}) + "\n"
        for i, t in enumerate(ITEMS)
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    argv = ["ask", "--input", "-", "--cascade", "big=other-model.gguf"]
    assert main([*argv, "--stage-profile", f"big={tmp_path / 'sharp.json'}"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert loads == [None, "other-model.gguf"]  # the command's model, then the stage's
    assert [r["id"] for r in rows] == list(range(len(ITEMS)))
    first, second = Gate(None), make_policy(profile)
    decided = []
    for text, row in zip(ITEMS, rows, strict=True):
        judgment = judge.judge(prompt(text), CHOICES)
        mine, theirs = first.decide(judgment), second.decide(judgment)
        stages = [part["stage"] for part in row["cascade"]]
        if mine.accepted:
            assert row["decided_by"] == "local" and stages == ["local"]
            assert row["profile"] is None
        else:
            assert stages == ["local", "big"]
            assert row["cascade"][0]["answer"]["decision"] == "escalate"
            assert row["decided_by"] == ("big" if theirs.accepted else None)
            # The row is the second stage's own: its profile and its calibrated probabilities.
            assert row["profile"] == "sharp"
            assert row["probabilities"] == pytest.approx(theirs.probabilities, abs=1e-4)
        decided.append(row["decided_by"])
    assert "big" in decided, decided  # the sharpened gate took at least one
    assert "decided by:" in captured.err and "big" in captured.err
