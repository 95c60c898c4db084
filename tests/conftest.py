"""Session fixtures: the real default model is loaded once for the whole test session."""

from __future__ import annotations

import pytest

from judge import Judge


@pytest.fixture(scope="session")
def judge() -> Judge:
    """The default model in float32, where the engine must match the reference within 1e-4."""
    return Judge.load(dtype="float32")
