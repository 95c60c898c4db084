"""The public API is what __all__ says it is."""

from __future__ import annotations

import types

import judge


def test_all_is_honest() -> None:
    public = {
        name
        for name, value in vars(judge).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public | {"__version__"} == set(judge.__all__)
    for name in judge.__all__:
        assert hasattr(judge, name)
