"""The README's two set-up commands stay true."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from server import Server, free_port

ROOT = Path(__file__).resolve().parent.parent


def quickstart_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Set up: two commands.*?```sh\n(.*?)```", readme, re.S)
    assert block, "README has a set-up section with a sh block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_quickstart_has_a_serve_and_a_test_command() -> None:
    assert quickstart_commands() == ["make serve", "make test"]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert quickstart_commands()[1] in ci.splitlines()


def test_ci_also_runs_the_benchmark_smoke_runs() -> None:
    """``make test`` leaves out the benchmarks' --quick runs (marked ``bench``); CI runs them."""
    assert "make bench-smoke" in (ROOT / ".ci" / "run").read_text().splitlines()
    plan = subprocess.run(
        ["make", "-n", "bench-smoke"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "pytest -m bench" in plan
    # On two workers (the quick scripts run on one thread each), each file whole on one of
    # them, so that a module fixture (a model loaded, an adapter trained) starts once.
    assert "-n $(TEST_WORKERS) --dist loadfile" in (ROOT / "Makefile").read_text()
    files = re.findall(r"tests/\S+\.py", plan)
    assert {"tests/test_bench_smoke.py", "tests/test_bench_smoke_service.py"} <= set(files)
    # `make test` leaves out every test marked bench: each must be in a file this runs.
    marked = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").glob("test_*.py")
        if re.search(r"(?<![\"'])pytest\.mark\.bench\b", path.read_text())
    }
    assert marked and sorted(marked - set(files)) == [], "bench tests that no run of CI runs"


def test_test_command_runs_lint_types_and_tests() -> None:
    plan = subprocess.run(
        ["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    for tool in ("ruff check", "ruff format --check", "mypy", "pytest"):
        assert tool in plan


def test_serve_command_answers_the_curl_example() -> None:
    readme = (ROOT / "README.md").read_text()
    curl = re.search(r"With `make serve` running.*?```sh\n(.*?)```", readme, re.S)
    example = re.search(r"```json\n(.*?)```", readme[curl.end() :] if curl else "", re.S)
    assert curl and example, "the quickstart shows a curl command and its answer"
    port = free_port()
    server = Server([*quickstart_commands()[0].split(), f"PORT={port}"], port, cwd=str(ROOT))
    try:
        server.wait_ready()
        command = curl.group(1).replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    shown = json.loads(example.group(1))
    assert set(answer) == set(shown)
    assert set(answer["probabilities"]) == {"spam", "ham"}
    # No profile: the honest default escalates the sure answer, as the README shows.
    assert answer["decision"] == shown["decision"] == "escalate"
    assert answer["reason_codes"] == shown["reason_codes"] == ["uncalibrated"]


def test_run_command_judges_the_example() -> None:
    done = subprocess.run(["make", "run"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    # make itself may print around the JSON (a nested make says which directory it leaves).
    result, _ = json.JSONDecoder().raw_decode(done.stdout, done.stdout.index("{"))
    assert set(result["probabilities"]) == {"spam", "ham"}
    assert abs(sum(result["probabilities"].values()) - 1) < 1e-9


def test_the_layout_names_every_module() -> None:
    """The layout page names each module of the three packages by its path from the repo
    root, in backticks (``judge/scores.py`` and ``calibration/scores.py`` both exist), and
    every ``.py`` path it names exists: a new module without a row fails, and so does a stale
    row."""
    section = re.search(r"^# Layout\n(.*)", (ROOT / "docs" / "layout.md").read_text(), re.S | re.M)
    assert section, "docs/layout.md is the Layout page"
    modules = {
        path.relative_to(ROOT).as_posix()
        for package in ("judge", "calibration", "service")
        for path in (ROOT / package).rglob("*.py")
        if path.name != "__init__.py" and "static" not in path.relative_to(ROOT).parts
    }
    assert len(modules) > 50  # the walk found the project
    named = set(re.findall(r"`([^`\s]+\.py)`", section.group(1)))
    assert sorted(modules - named) == [], "modules the Layout section does not name"
    assert sorted(p for p in named if not (ROOT / p).is_file()) == [], "stale paths"
    in_packages = {p for p in named if p.split("/")[0] in {"judge", "calibration", "service"}}
    assert in_packages == modules  # nor an __init__.py or a file under static/
