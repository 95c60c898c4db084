"""The precision alarm checked after every label (issue 58): false alarms when nothing changes,
and how many labels it takes to catch a drop, the sequential bet against the per-check
Clopper-Pearson test it replaced.

Each stream is the audited accepted items' outcomes, one label at a time, under a profile
certified at precision 0.9 (alpha 0.05). Scenarios:

    hold        the precision stays at 0.9 for 2,000 labels: every alarm is false
    drop        0.85 from the first label
    drop later  0.9 for 500 labels, then 0.85: the delay counts from the change

Both alarms are checked after every label (the Clopper-Pearson one from the 20th on, as a
monitor that waits for a few labels would). For the drops, the labels to the first alarm:
median, 90th percentile, and the share of streams with none within 4,000 labels.

    python benchmarks/bench_sequential.py [--streams 1000]

It times nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from calibration.monitoring.sequential import betting_capital

RESULTS = Path(__file__).resolve().parent / "results" / "bench_sequential.json"
TARGET, ALPHA, FIRST_CP = 0.9, 0.05, 20


def first_alarms(x: np.ndarray) -> tuple[float, float]:
    """The 1-based label at which each alarm first fires (inf: never): the bet, Clopper-Pearson."""
    bet = np.flatnonzero(betting_capital(x, TARGET)[:, 0] >= 1 / ALPHA)
    hits = np.cumsum(x)
    trials = np.arange(1, x.shape[0] + 1)
    upper = np.where(
        hits == trials,
        1.0,
        stats.beta.ppf(1 - ALPHA, hits + 1, np.maximum(trials - hits, 1e-12)),
    )
    cp = np.flatnonzero((upper < TARGET) & (trials >= FIRST_CP))
    return (
        float(bet[0] + 1) if bet.size else np.inf,
        float(cp[0] + 1) if cp.size else np.inf,
    )


def scenario(name: str, streams: int, rng: np.random.Generator) -> dict[str, dict[str, float]]:
    n = 2000 if name == "hold" else 4000
    change = 500 if name == "drop later" else 0
    found: dict[str, list[float]] = {"bet": [], "clopper-pearson": []}
    for _ in range(streams):
        p = np.full(n, TARGET if name == "hold" else 0.85)
        p[:change] = TARGET
        x = (rng.random(n) < p).astype(np.float64)
        bet, cp = first_alarms(x)
        found["bet"].append(bet - change)
        found["clopper-pearson"].append(cp - change)
    out = {}
    for test, delays in found.items():
        d = np.asarray(delays)
        if name == "hold":
            out[test] = {"false alarm rate": float(np.isfinite(d).mean())}
        else:
            caught = d[np.isfinite(d)]
            out[test] = {
                "early (before the change)": float((d <= 0).mean()),
                "median delay": float(np.median(caught[caught > 0])) if caught.size else np.inf,
                "p90 delay": float(np.percentile(d, 90)),
                "missed": float(np.isinf(d).mean()),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = {name: scenario(name, args.streams, rng) for name in ("hold", "drop", "drop later")}
    print(f"{args.streams} streams each; target {TARGET}, alpha {ALPHA}; checked after every label")
    for name, row in rows.items():
        for test, numbers in row.items():
            shown = ", ".join(f"{k} {v:.3g}" for k, v in numbers.items())
            print(f"| {name} | {test} | {shown} |")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"streams": args.streams, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
