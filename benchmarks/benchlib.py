"""What the benchmark scripts share: the machine's CPU model.

Result files are written with ``atomicio.write_text``, like every other file the project writes.
"""

from __future__ import annotations

import platform
from pathlib import Path

__all__ = ["cpu_flags", "cpu_model"]

# The flags that decide how fast these benchmarks run: vector width, native bfloat16, AMX.
_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """Which of the flags that matter here (AVX2, AVX-512, bfloat16, AMX) the CPU reports."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    present = set(line.split(":", 1)[-1].split())
    return [f for f in _FLAGS if f in present]
