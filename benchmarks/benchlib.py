"""What the benchmark scripts share: the machine's CPU model.

Result files are written with ``atomicio.write_text``, like every other file the project writes.
"""

from __future__ import annotations

import platform
from pathlib import Path

__all__ = ["SIMD", "cpu_flags", "cpu_model"]

# The flag families that decide how fast these benchmarks run: vector width, native bfloat16
# (avx512_bf16, amx_bf16), AMX. A flag is listed when it starts with one of these.
SIMD = ("sse4_2", "fma", "f16c", "avx", "avx2", "avx512", "amx")


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
