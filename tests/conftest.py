"""Session fixtures: the real default model is loaded once for the whole test session."""

from __future__ import annotations

from typing import Any

import pytest

from judge import Judge


@pytest.fixture(scope="session")
def judge() -> Judge:
    """The default model in float32, where the engine must match the reference within 1e-4."""
    return Judge.load(dtype="float32")


@pytest.fixture
def loaded_once(monkeypatch: pytest.MonkeyPatch, judge: Judge) -> list[dict[str, object]]:
    """Judge.load hands out the session model (with the asked-for template) and logs its calls."""
    calls: list[dict[str, object]] = []

    def fake_load(model: object = None, **options: Any) -> Judge:
        calls.append({"model": model, **options})
        return Judge(
            judge.model,
            judge.tokenizer,
            model_id=judge.model_id,
            weights_sha256=judge.weights_sha256,
            response_prefix=options["response_prefix"],
            response_suffix=options["response_suffix"],
        )

    monkeypatch.setattr(Judge, "load", staticmethod(fake_load))
    return calls
