"""Certified thresholds: fixed-sequence testing (LTT) against Bonferroni, in simulation.

Runs the whole fitting procedure (map, conformal quantile, threshold: ``fit_profile``)
on many calibration sets drawn from the synthetic world of tests/test_gating_simulation.py,
with each multiple-testing procedure, and measures the served policy on a large fresh sample
whose true probabilities are known. For each procedure and calibration-set size it prints how
often a threshold was certified, how often the served policy's true precision fell below the
target (must be at most delta), and the mean coverage (the fraction of items accepted, which is
what a procedure that certifies more buys). Same resamples for both procedures, side by side.

    python benchmarks/bench_gating.py [--resamples 500] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from judge import atomicio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_gating_simulation import simulate  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def run(procedure: str, n: int, resamples: int, target: float, delta: float) -> dict[str, object]:
    start = time.perf_counter()
    precision, coverage = simulate(resamples, n, target=target, delta=delta, procedure=procedure)
    certified = [p for p in precision if p == p]
    return {
        "procedure": procedure,
        "n": n,
        "resamples": resamples,
        "certified": len(certified) / resamples,
        "failure_rate": sum(p < target for p in certified) / resamples,
        "mean_coverage": float(np.mean(coverage)),
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resamples", type=int, default=500)
    parser.add_argument("--sizes", type=int, nargs="*", default=[200, 500, 1000])
    parser.add_argument("--target-precision", type=float, default=0.9)
    parser.add_argument("--delta", type=float, default=0.1)
    parser.add_argument("--quick", action="store_true", help="20 resamples of 500 items")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_gating.json")
    args = parser.parse_args()
    sizes, resamples = (args.sizes, args.resamples) if not args.quick else ([500], 20)
    rows = [
        run(procedure, n, resamples, args.target_precision, args.delta)
        for n in sizes
        for procedure in ("fixed_sequence", "bonferroni")
    ]
    lines = [
        f"Target precision {args.target_precision}, delta {args.delta}; the oracle accepts "
        "about 65% at this precision.",
        "",
        "| n | procedure | certified | precision < target | mean coverage |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['n']} | {r['procedure']} | {r['certified']:.3f} | {r['failure_rate']:.3f} "
        f"| {r['mean_coverage']:.3f} |"
        for r in rows
    ]
    print("\n".join(lines))
    atomicio.write_text(args.out, json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
