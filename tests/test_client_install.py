"""The client installs and imports without the server's dependencies (``pip install calibrated-judge``).

Each check runs in a fresh interpreter whose imports of the server's packages fail, as they
would where only the base dependencies are installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVER_ONLY = (
    "torch",
    "transformers",
    "litestar",
    "scipy",
    "sklearn",
    "uvicorn",
    "prometheus_client",
)
BLOCKER = f"""
import sys

SERVER_ONLY = {SERVER_ONLY!r}

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in SERVER_ONLY:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None

sys.meta_path.insert(0, Blocker())
"""


def run_blocked(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_client_imports_and_works_without_the_server_s_packages() -> None:
    result = run_blocked(
        """
        import sys

        import httpx
        import msgspec

        from service.client import AsyncJudgeClient, JudgeClient, JudgeRequest

        answer = {
            "type": "judgment", "choice": "a", "confidence": 0.9,
            "probabilities": {"a": 0.9, "b": 0.1}, "raw_probabilities": {"a": 0.9, "b": 0.1},
            "decision": "accept", "reasons": [], "reason_codes": [], "threshold": 0.5,
            "certified": False, "temperature": None, "choice_mass": 1.0,
            "prediction_set": None, "profile": None, "model": "m", "latency_ms": 1.0,
            "judgment_id": "0190a0b4-6c2e-7b3a-9f1e-2d4c6b8a0e1f", "tokens_sha256": "0" * 64,
            "model_sha256": "1" * 64, "policy_sha256": "2" * 64, "profile_etag": None,
        }

        def handler(request):
            msgspec.json.decode(request.content, type=JudgeRequest)
            return httpx.Response(200, json=answer)

        with JudgeClient("http://judge.test", transport=httpx.MockTransport(handler)) as c:
            assert c.judge("p", ["a", "b"]).choice == "a"
        AsyncJudgeClient("http://judge.test")
        loaded = {m for m in sys.modules if m.split(".")[0] in SERVER_ONLY or m == "judge.engine"}
        assert not loaded, loaded
        """
    )
    assert result.returncode == 0, result.stderr


def test_the_commands_say_how_to_install_the_server() -> None:
    result = run_blocked(
        """
        from service.cli.main import main

        raise SystemExit(main(["serve", "--port", "8000"]))
        """
    )
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("judge: error: `judge serve` needs the server's dependencies")
    assert line.endswith(
        "pip install 'calibrated-judge[server]' (from a checkout: pip install '.[server]')"
    )


def test_the_base_dependencies_are_the_client_s() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower() for r in requirements}

    assert names(project["dependencies"]) == {"msgspec", "httpx", "numpy"}
    server = names(project["optional-dependencies"]["server"])
    assert server >= {
        "torch", "transformers", "gguf", "accelerate", "scipy", "scikit-learn", "threadpoolctl",
        "matplotlib", "tqdm", "litestar", "uvicorn", "prometheus-client",
    }  # fmt: skip


def test_every_install_line_names_the_project_s_distribution() -> None:
    """``judge`` on the package index is an unrelated project: the distribution is named
    otherwise, and no page, message or test tells anyone to install ``judge`` from it."""
    from service.install import DISTRIBUTION, install_hint

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION != "judge"
    assert install_hint("server").startswith(f"pip install '{DISTRIBUTION}[server]'")
    wrong = re.compile(r"pip install (-e )?['\"]?judge\b")
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    code = [
        p
        for d in ("judge", "calibration", "service", "tests", "benchmarks")
        for p in (ROOT / d).rglob("*.py")
    ]
    found = [
        f"{path.relative_to(ROOT)}: {line.strip()}"
        for path in pages + code
        for line in path.read_text().splitlines()
        if wrong.search(line) and "unrelated" not in line  # the warning against it
    ]
    assert found == []
