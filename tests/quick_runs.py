"""What the benchmarks' --quick runs share (tests/test_bench_smoke.py and
tests/test_bench_smoke_service.py): where the scripts and the shared datasets are, the
watchdog, and how a script is run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
DATA = ROOT.parent / "shared" / "data"
# A watchdog, not a speed: a --quick run that has not ended in an hour is hung. The slowest
# take minutes on a 2-core AVX2 machine, several times that while other jobs share its cores
# (bench_reliability's took 218 s here under a load of 9), and none must fail for it.
HANG_S = 3600


def run_quick(script: str, *args: str) -> None:
    """Run ``benchmarks/<script> --quick`` on one torch thread; it must exit 0."""
    # One torch thread: the smoke runs stay fast even while other jobs hold the cores.
    cmd = [sys.executable, str(BENCHMARKS / script), "--quick", "--threads", "1", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-4000:]
