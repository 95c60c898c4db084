"""The README's two set-up commands stay true."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def quickstart_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart.*?```sh\n(.*?)```", readme, re.S)
    assert block, "README has a Quickstart with a sh block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_quickstart_has_a_run_and_a_test_command() -> None:
    assert quickstart_commands() == ["make run", "make test"]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert quickstart_commands()[1] in ci.splitlines()


def test_test_command_runs_lint_types_and_tests() -> None:
    plan = subprocess.run(
        ["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    for tool in ("ruff check", "ruff format --check", "mypy", "pytest"):
        assert tool in plan


def test_run_command_judges_the_example() -> None:
    done = subprocess.run(
        quickstart_commands()[0].split(), cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout[done.stdout.index("{") :])
    assert set(result["probabilities"]) == {"spam", "ham"}
    assert abs(sum(result["probabilities"].values()) - 1) < 1e-9
