"""The public APIs are what __all__ says they are, and the layers depend in one direction.

    atomicio  <-  judge, calibration  <-  tasks  <-  service  <-  cli

judge (torch) and calibration (numpy) know nothing of each other or of anything above them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import types
from pathlib import Path

import pytest

import atomicio
import calibration
import judge
import tasks

ROOT = Path(__file__).resolve().parent.parent
PROJECT = {"atomicio", "judge", "calibration", "tasks", "service", "cli"}
# What each package may import from the project, besides itself.
ALLOWED = {
    "atomicio": set(),
    "judge": {"atomicio"},
    "calibration": {"atomicio"},
    "tasks": {"atomicio", "judge", "calibration"},
    "service": {"atomicio", "judge", "calibration", "tasks"},
    "cli": {"atomicio", "judge", "calibration", "tasks", "service"},
}


@pytest.mark.parametrize("package", [judge, calibration, tasks, atomicio])
def test_all_is_honest(package: types.ModuleType) -> None:
    public = {
        name
        for name, value in vars(package).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public | {"__version__"} == set(package.__all__) | {"__version__"}
    for name in package.__all__:
        assert hasattr(package, name)


def _project_imports(package: str) -> dict[str, set[str]]:
    """Top-level project packages imported by each module of ``package``, anywhere in it.

    Imports inside functions and under ``TYPE_CHECKING`` count too: a lazy import is still a
    dependency.
    """
    found: dict[str, set[str]] = {}
    for file in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(file.relative_to(ROOT))] = (names & PROJECT) - {package}
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_layers_import_only_downwards(package: str) -> None:
    imports = _project_imports(package)
    assert imports, f"no modules found under {package}/"
    wrong = {file: names - ALLOWED[package] for file, names in imports.items()}
    assert {file: names for file, names in wrong.items() if names} == {}


def test_importing_judge_loads_no_layer_above_it() -> None:
    code = (
        "import sys, judge; "
        "loaded = {'calibration', 'service', 'tasks', 'cli'} & set(sys.modules); "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_calibration_imports_no_torch() -> None:
    code = (
        "import sys, calibration; assert 'torch' not in sys.modules and 'judge' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
