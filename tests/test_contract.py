"""The OpenAPI document is the contract: schemathesis runs every check on every operation,
stateful phase included, against a live server, and any finding fails the test. Settings:
schemathesis.toml; a fixed seed.

Two runs, each with every check:

- against the service around a fake engine (tests/fake_server.py), in a process of its own,
  with the fuzzing budget (``FAKE_EXAMPLES`` per operation), every phase: the HTTP machinery,
  bodies, statuses, headers, auth, profile links, at no model cost;
- against `judge serve` on the real default model, with a small budget (``REAL_EXAMPLES``
  per operation): what only the model can show, the documented examples accepted, generated
  prompts and choices through its tokenizer (refusals as 4xx), real judgments and profiles
  fitted on them in the response schemas. Its phases are the examples, fuzzing and stateful
  ones, and the coverage phase (boundary values of every field) for the judging operations
  only: elsewhere that phase re-sends the documented fit and System 1 bodies with boundary
  values of their settings, tens of seconds of model work each on a busy machine, which the
  fake's run checks as well.

One run of every phase at 8 examples on the real model took 437 s of a 15-minute suite on a
2-core AVX2 machine; most of the model's work went to fits and System 1 questions, most of
those sent by the coverage phase (measured here: 5.0 of the 8.6 s the server computed).
`make fuzz` (``JUDGE_FUZZ_EXAMPLES`` set) runs every phase on both, with its larger budget.

Every check but one: response time is not part of the contract. `--checks all` would also
switch on schemathesis' max_response_time (10 s unless told otherwise), which a correct fit
fails on a busy machine (22 s seen); timing is measured in benchmarks/, not asserted here.
For the same reason the servers' deadlines and schemathesis' request timeout are hang bounds,
the client's longer than the server's, so that a slow answer is a 503 the contract allows,
never a client-side timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from server import Server, free_port

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
KEY = "contract-test-key"
REAL_EXAMPLES = 2
FAKE_EXAMPLES = 8
# Hang bounds, not speeds: a server answers 503 after SERVER_DEADLINE_S (fits included), and
# schemathesis waits a minute longer, so only a hung server fails on time.
SERVER_DEADLINE_S = 600
CLIENT_TIMEOUT_S = SERVER_DEADLINE_S + 60
RUN_TIMEOUT_S = 3600  # the whole schemathesis run


def examples(default: int) -> int:
    """Examples per operation: ``default``, or $JUDGE_FUZZ_EXAMPLES (`make fuzz`)."""
    return int(os.environ.get("JUDGE_FUZZ_EXAMPLES", str(default)))


def schemathesis_command() -> str:
    found = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[dev]')")
    return found


def contract_checks() -> list[str]:
    """Every check that ``--checks all`` turns on, less max_response_time.

    schemathesis cannot exclude that one by name (``--exclude-checks`` does not accept it, and
    schemathesis.toml can only set its limit), so the test names every other check instead,
    from the registry the CLI itself offers for ``--checks``.
    """
    pytest.importorskip("schemathesis", reason="schemathesis is not installed")
    from schemathesis.checks import CHECKS, load_all_checks

    load_all_checks()
    return [name for name in CHECKS.get_all_names() if name != "max_response_time"]


def test_every_check_but_response_time_is_on() -> None:
    names = contract_checks()
    from schemathesis.config import ChecksConfig

    # The checks the contract is about are among them.
    assert {
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "response_headers_conformance",
        "positive_data_acceptance",
        "negative_data_rejection",
        "use_after_free",
        "ensure_resource_availability",
        "ignored_auth",
    } <= set(names)
    # As the CLI applies --checks: `all` brings in the timing check, the named list does not.
    everything = ChecksConfig()
    everything.update(included_check_names=["all"])
    assert everything.max_response_time.enabled
    chosen = ChecksConfig()
    chosen.update(included_check_names=names)
    assert not chosen.max_response_time.enabled
    assert all(chosen.get_by_name(name=n).enabled for n in names)


def real_server(tmp_path: Path, port: int) -> list[str]:
    """`judge serve` on the default model."""
    command = [sys.executable, "-m", "service.cli.main", "serve", "--port", str(port)]
    command += ["--profiles-dir", str(tmp_path / "profiles"), "--log-level", "warning"]
    # Generated prompts run to the request budget; batch-invariant attention is float64 and
    # quadratic in the prompt (a 4000-token judgment takes half a minute), so the budget is
    # kept small: longer prompts get the 413 the contract promises, at no model cost.
    command += ["--max-request-tokens", "1024"]
    deadline = str(SERVER_DEADLINE_S)
    return [*command, "--request-timeout", deadline, "--fit-timeout", deadline]


def fake_server(tmp_path: Path, port: int) -> list[str]:
    """The same service around tests/fake_server.py's engine; its deadlines are the defaults
    (60 s; 1800 s for a fit), which a fake's judgments never come near."""
    command = [sys.executable, str(TESTS / "fake_server.py"), "--port", str(port)]
    command += ["--profiles-dir", str(tmp_path / "profiles")]
    return [*command, "--max-request-tokens", "1024"]


def run_contract(
    tmp_path: Path,
    server_command: Callable[[Path, int], list[str]],
    max_examples: int,
    runs: Sequence[Sequence[str]] = ((),),
) -> None:
    """schemathesis against one server, once per entry of ``runs`` (its extra arguments)."""
    st = schemathesis_command()
    port = free_port()
    os.environ["JUDGE_API_KEY"] = KEY
    try:
        server = Server(server_command(tmp_path, port), port)
    finally:
        del os.environ["JUDGE_API_KEY"]
    try:
        server.wait_ready({"Authorization": f"Bearer {KEY}"})
        for extra in runs:
            schemathesis(st, server.url, max_examples, extra)
    finally:
        server.stop()


def schemathesis(st: str, url: str, max_examples: int, extra: Sequence[str]) -> None:
    result = subprocess.run(
        [
            st,
            "run",
            f"{url}/schema/openapi.json",
            "--checks",
            ",".join(contract_checks()),
            "--seed",
            "20261130",
            "--max-examples",
            str(max_examples),
            "--header",
            f"Authorization: Bearer {KEY}",
            "--request-timeout",
            str(CLIENT_TIMEOUT_S),
            "--workers",
            "1",
            *extra,
        ],
        cwd=ROOT,  # schemathesis.toml
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_the_service_keeps_its_openapi_contract_under_fuzzing(tmp_path: Path) -> None:
    run_contract(tmp_path, fake_server, examples(FAKE_EXAMPLES))


@pytest.mark.slow
def test_the_service_keeps_its_openapi_contract_on_the_model(tmp_path: Path) -> None:
    if "JUDGE_FUZZ_EXAMPLES" in os.environ:  # `make fuzz`: every phase, every operation
        runs: list[list[str]] = [[]]
    else:
        runs = [
            ["--phases", "examples,fuzzing,stateful"],
            ["--phases", "coverage", "--include-path-regex", "^/judge(/batch)?$"],
        ]
    run_contract(tmp_path, real_server, examples(REAL_EXAMPLES), runs)
