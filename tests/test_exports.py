"""The public APIs are what __all__ says they are, and the layers depend in one direction.

Three packages are installed (judge, calibration, service); inside them the layers are

    judge.atomicio  <-  judge  <-  calibration.tasks  <-  service  <-  service.cli
    judge.atomicio  <-  calibration  <-  calibration.tasks
    judge.errors  <-  judge.scores  <-  calibration
    judge.fingerprint  <-  calibration

judge (torch) and calibration's core (numpy) know nothing of each other or of anything above
them, except the engine's torch-free leaves: calibration applies the values rules of
judge.scores and stores judge.fingerprint's value. calibration.tasks joins them (it judges
labeled sets and fits profiles on the results).

Inside ``service``, rings (below): the core that decides, and three fronts (HTTP, MCP, the
command line) that import neither each other nor let the core import them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import types
from pathlib import Path

import pytest

import calibration
import judge
from calibration import tasks
from judge import atomicio

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("judge", "calibration", "service")
# Each layer, and what it may import from the project besides itself. A module belongs to the
# longest layer name that prefixes its own.
_LEAVES = {
    "judge.atomicio",
    "judge.errors",
    "judge.scores",
    "judge.fingerprint",
    "judge.identity",
    "judge.lazy",
    "judge.adapters",
}
ALLOWED = {
    "judge.atomicio": set(),
    "judge.errors": set(),
    "judge.scores": {"judge.errors"},
    "judge.fingerprint": set(),
    "judge.identity": set(),
    "judge.lazy": set(),
    "judge.adapters": set(),  # plain data a profile carries: no torch
    "judge": _LEAVES,
    "calibration": {
        "judge.atomicio",
        "judge.scores",
        "judge.fingerprint",
        "judge.lazy",
        "judge.adapters",
    },
    "calibration.tasks": _LEAVES | {"judge", "calibration"},
    "service": _LEAVES | {"judge", "calibration", "calibration.tasks"},
    "service.cli": _LEAVES | {"judge", "calibration", "calibration.tasks", "service"},
}


def _layer(module: str) -> str:
    return max(
        (layer for layer in ALLOWED if module == layer or module.startswith(layer + ".")),
        key=len,
    )


def _module_name(file: Path) -> str:
    parts = file.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    _module_name(file): file
    for package in PACKAGES
    for file in sorted((ROOT / package).rglob("*.py"))
}


@pytest.mark.parametrize("package", [judge, calibration, tasks, atomicio])
def test_all_is_honest(package: types.ModuleType) -> None:
    # dir() rather than vars(): judge's names load on first use (PEP 562)
    public = {
        name
        for name in dir(package)
        if not name.startswith("_")
        and not isinstance(getattr(package, name), types.ModuleType)
        and name not in {"annotations", "TYPE_CHECKING", "exports"}
        # a plain module (not a package): only what it defines, not what it imports
        and (hasattr(package, "__path__") or _defined_in(package, name))
    }
    assert public | {"__version__"} == set(package.__all__) | {"__version__"}
    for name in package.__all__:
        assert hasattr(package, name)


def _defined_in(module: types.ModuleType, name: str) -> bool:
    return getattr(getattr(module, name), "__module__", None) == module.__name__


def _project_imports(module: str) -> set[str]:
    """Project modules imported by ``module``, anywhere in it.

    Imports inside functions and under ``TYPE_CHECKING`` count too: a lazy import is still a
    dependency. ``from judge import atomicio`` names the module ``judge.atomicio``.
    """
    names: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text(), str(MODULES[module]))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                names.add(child if child in MODULES else node.module)
    return {name for name in names if name.split(".")[0] in PACKAGES}


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layers_import_only_downwards(layer: str) -> None:
    members = [module for module in MODULES if _layer(module) == layer]
    assert members, f"no modules in layer {layer}"
    wrong = {
        module: {
            name
            for name in _project_imports(module)
            if _layer(name) not in ALLOWED[layer] | {layer}
        }
        for module in members
    }
    assert {module: names for module, names in wrong.items() if names} == {}


def test_only_the_three_packages_are_installed() -> None:
    found = {path.parent.name for path in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks"}
    assert found == set(PACKAGES)


def test_importing_judge_loads_no_layer_above_it() -> None:
    code = (
        "import sys, judge, judge.engine; "
        "loaded = {'calibration', 'service'} & set(sys.modules); "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_calibration_imports_no_torch() -> None:
    code = (
        "import sys, calibration; "
        "assert 'torch' not in sys.modules and 'judge.engine' not in sys.modules, sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# service/'s rings. The core decides (the top-level modules, and the cascade and the decision
# log, which every front shares); the three fronts only translate requests in and answers out:
# HTTP (service.web), MCP (service.mcp) and the command line (service.cli). Fronts never import
# each other, and nothing of the core imports a front. Two modules stand above the rings: the
# package's facade (``service``, whose ``create_app`` is the HTTP front's) and the ``judge``
# program (``service.cli.main``), which names every front's commands.
SERVICE_FRONTS = ("service.web", "service.mcp", "service.cli")
SERVICE_CORE_FOLDERS = ("service.cascade", "service.log")
SERVICE_ENTRY = {"service", "service.cli.main", "service.cli.__main__"}


def _front(module: str) -> str | None:
    return next((f for f in SERVICE_FRONTS if module == f or module.startswith(f + ".")), None)


def test_every_folder_of_service_is_a_front_or_the_core() -> None:
    folders = {
        _module_name(path.parent / "__init__.py")
        for path in (ROOT / "service").rglob("__init__.py")
        if path.parent != ROOT / "service"
    }
    assert folders == set(SERVICE_FRONTS) | set(SERVICE_CORE_FOLDERS)


@pytest.mark.parametrize("front", SERVICE_FRONTS)
def test_a_front_imports_no_other_front(front: str) -> None:
    wrong = {
        module: sorted(
            name for name in _project_imports(module) if _front(name) not in (None, front)
        )
        for module in MODULES
        if _front(module) == front and module not in SERVICE_ENTRY
    }
    assert {module: names for module, names in wrong.items() if names} == {}


def test_the_core_imports_no_front() -> None:
    core = [
        module for module in MODULES if module.split(".")[0] == "service" and _front(module) is None
    ]
    assert "service.gate_context" in core and "service.log.decision_log" in core
    wrong = {
        module: sorted(name for name in _project_imports(module) if _front(name) is not None)
        for module in core
        if module not in SERVICE_ENTRY
    }
    assert {module: names for module, names in wrong.items() if names} == {}


def test_the_judge_program_lists_only_the_fronts_commands() -> None:
    from service.cli.main import COMMAND_MODULES

    assert COMMAND_MODULES and all(_front(module) for module in COMMAND_MODULES)
    assert {_front(module) for module in COMMAND_MODULES} == set(SERVICE_FRONTS)
