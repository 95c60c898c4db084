"""What the benchmark scripts share: the machine's CPU model, timing side by side, and typed
questions decided with their cost.

Result files are written with ``atomicio.write_text``, like every other file the project writes.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "AVX2",
    "SIMD",
    "cache_keyword",
    "cpu_flags",
    "cpu_model",
    "decided",
    "emulate_avx2",
    "judge_machine",
    "new_cache",
    "timed",
]

# The flag families that decide how fast these benchmarks run: vector width, native bfloat16
# (avx512_bf16, amx_bf16), AMX. A flag is listed when it starts with one of these.
SIMD = ("sse4_2", "fma", "f16c", "avx", "avx2", "avx512", "amx")


# On an AVX-512 or AMX machine, the kernels an AVX2-only CPU runs (approximately: the cache
# sizes and the clock are still this machine's): torch's own kernels, oneDNN's and MKL's.
AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "DNNL_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def emulate_avx2(wanted: bool) -> None:
    """With ``wanted`` (a script's --emulate-avx2), run this script again in a process whose
    kernels are limited to AVX2 (``AVX2``; they are read at start-up, so the process must be a
    new one) and exit with its status; in that process, or without ``wanted``, return."""
    if wanted and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        raise SystemExit(subprocess.call([sys.executable, *sys.argv], env={**os.environ, **AVX2}))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The CPU's vector-instruction flags (lscpu's Flags, from /proc/cpuinfo) of the families
    in ``SIMD``: what the matrix kernels can use."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return [f for f in line.split(":", 1)[-1].split() if f.startswith(SIMD)]


def timed(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """Milliseconds of each function, taking turns rep by rep after one warm-up each: side by
    side, so a machine's drift falls on every contender alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1000)
    return times


def judge_machine(judge: Any) -> dict[str, Any]:
    """Where a benchmark of ``judge`` (a ``judge.Judge``) ran: the CPU and its vector flags,
    cores, torch and its threads, Python, the model and its dtype."""
    import torch

    return {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": judge.dtype,
        "model": judge.model_id,
    }


def decided(judge: Any, state: object, questions: Mapping[str, Any]) -> tuple[Any, Any, float, int]:
    """``decide``'s steps on typed ``questions`` about ``state`` (``judge.answers``): the
    answers by id, the listings' judgments, the seconds plan, prepare, run and answers took,
    and the tokens fed to the model (the packed rows: the state once per row)."""
    from judge.answers import plan_decisions
    from judge.packing import pack_rows, row_length

    start = time.perf_counter()
    plan = plan_decisions(state, questions)
    prepared = [judge.prepare(q) for q in plan.queries]
    judgments = judge.run_shared(prepared)
    answers = plan.answers(judgments)
    seconds = time.perf_counter() - start
    tries = [p.trie for p in prepared]
    fed = sum(row_length([tries[i] for i in r]) for r in pack_rows(tries, judge.max_batch_tokens))
    return answers, judgments, seconds, fed


def cache_keyword(model: Any) -> str:
    """The forward keyword of the KV cache: ``cache`` in newer transformers."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(model: Any) -> Any:
    """An empty KV cache for ``model``'s forward (under ``cache_keyword``)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()
