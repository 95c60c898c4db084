"""The command line, in process, with the session's model."""

from __future__ import annotations

import json
from typing import Any

import pytest

from judge import Judge, cli


@pytest.fixture
def loaded_once(monkeypatch: pytest.MonkeyPatch, judge: Judge) -> list[dict[str, object]]:
    calls: list[dict[str, object]] = []

    def fake_load(model: object = None, **options: Any) -> Judge:
        calls.append({"model": model, **options})
        return Judge(
            judge.model,
            judge.tokenizer,
            model_id=judge.model_id,
            response_prefix=options["response_prefix"],
            response_suffix=options["response_suffix"],
        )

    monkeypatch.setattr(Judge, "load", staticmethod(fake_load))
    return calls


def test_ask_prints_a_judgment(
    loaded_once: list[dict[str, object]], capsys: pytest.CaptureFixture[str], judge: Judge
) -> None:
    code = cli.main(
        ["ask", "Is this spam? WIN a free prize!", "--choice", "spam", "--choice", "ham"]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["probabilities"]) == {"spam", "ham"}
    expected = judge.judge("Is this spam? WIN a free prize!", ["spam", "ham"])
    assert out["probabilities"]["spam"] == pytest.approx(expected.probabilities["spam"], abs=1e-6)
    assert loaded_once == [
        {
            "model": None,
            "dtype": "auto",
            "device": "cpu",
            "response_prefix": '{"answer": "',
            "response_suffix": '"}',
        }
    ]


def test_ask_reports_bad_input(
    loaded_once: list[dict[str, object]], capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["ask", "Which?", "--choice", "same", "--choice", "same"])
    assert code == 2
    assert "'same' appears more than once" in capsys.readouterr().err


def test_ask_requires_a_choice(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["ask", "Which?"])
    assert "--choice" in capsys.readouterr().err
