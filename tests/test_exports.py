"""The public APIs are what __all__ says they are, and calibration needs no torch."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

import calibration
import judge


@pytest.mark.parametrize("package", [judge, calibration])
def test_all_is_honest(package: types.ModuleType) -> None:
    public = {
        name
        for name, value in vars(package).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public | {"__version__"} == set(package.__all__) | {"__version__"}
    for name in package.__all__:
        assert hasattr(package, name)


def test_calibration_imports_no_torch() -> None:
    code = (
        "import sys, calibration; assert 'torch' not in sys.modules and 'judge' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
