"""Session fixtures: the real default model is loaded once for the whole test session (once
per worker under `make test`'s two), and one `judge serve` on it is shared by the modules
that only send it requests; each worker's torch runs on its share of the cores."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from cores import share_cores
from server import READY_S, Server, free_port

from judge import Judge


def pytest_configure(config: pytest.Config) -> None:
    share_cores()


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
            choice_paths=options.get("choice_paths", "canonical"),
        )

    monkeypatch.setattr(Judge, "load", staticmethod(fake_load))
    return calls


@pytest.fixture(scope="session")
def model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`judge serve` on the default model in float32, with a profile store of its own; shared
    by tests/test_client.py, test_service_e2e.py and test_systemone.py, whose tests each
    leave the store as they found it. A start loads the model (11 s on a 2-core EPYC), which
    each of those modules paid for a server of its own. Its deadline is a hang bound (how long
    a judgment takes is the machine's speed); requests sent together within 20 ms share a pass.
    """
    port = free_port()
    command = [sys.executable, "-m", "service.cli.main", "serve", "--port", str(port)]
    command += ["--dtype", "float32", "--profiles-dir", str(tmp_path_factory.mktemp("profiles"))]
    command += ["--max-wait-ms", "20", "--request-timeout", f"{READY_S:g}"]
    server = Server(command, port)
    server.wait_ready()
    yield server
    server.stop()
