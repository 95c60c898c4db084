"""llama.cpp's OpenAI-compatible server (llama-cpp-python's, built from its PyPI sdist) on the
default model's own GGUF file, for the tests of ``judge.server_engine``.

Without ``llama_cpp`` the tests that need it skip, unless ``JUDGE_REQUIRE_LLAMA_CPP=1`` (CI
sets it, after building it in ``.ci/run``), when they fail.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from server import free_port

from judge.loading import default_model_path

# A watchdog, not a speed: the GGUF maps in well under a second.
READY_S = 120.0


def require_llama_cpp() -> None:
    """Skip (or, under JUDGE_REQUIRE_LLAMA_CPP=1, fail) where llama-cpp-python's server is
    not installed."""
    missing = [
        m for m in ("llama_cpp", "uvicorn", "sse_starlette") if not importlib.util.find_spec(m)
    ]
    if missing:
        reason = f"llama-cpp-python[server] is not installed ({', '.join(missing)} missing)"
        if os.environ.get("JUDGE_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(f"{reason}, and JUDGE_REQUIRE_LLAMA_CPP=1 requires it")
        pytest.skip(reason)


class LlamaServer:
    """One ``python -m llama_cpp.server`` on the default GGUF, serving it as ``smollm2``."""

    def __init__(self) -> None:
        require_llama_cpp()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.spec = f"openai+{self.base_url}"
        command = [sys.executable, "-m", "llama_cpp.server", "--model", str(default_model_path())]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--model_alias", "smollm2"]
        # logits_all: the echoed prompt log-probabilities need every position's logits.
        command += ["--logits_all", "true", "--n_ctx", "4096", "--n_threads", "1"]
        # To a file: llama.cpp writes more at start than a pipe holds unread.
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed with the object)
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited: {self.output()}")
            try:
                if httpx.get(f"{self.base_url}/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama_cpp.server did not start: {self.output()}")

    def kill(self) -> None:
        """SIGKILL: the server dies as a crashed one does, mid-request or not."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def output(self) -> str:
        self.kill()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]
