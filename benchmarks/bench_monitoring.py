"""Monitoring a deployed profile, in simulation: false alarms when nothing changes, and how
many live items it takes to catch a label-prior shift and an input shift.

The world is tests/test_monitoring.py's ``draw``: a binary task (prior 0.7 / 0.3) and a
3-choice task (0.5 / 0.3 / 0.2), labels y ~ prior, scores margin * onehot(y) + N(0, I) with
margin 2, and a judge whose probabilities are the exact posterior: calibrated on the reference
distribution. The profile accepts items whose confidence is >= 0.9 and certifies a target
precision 0.01 below the true precision of accepted items (found on a million items), so the
certificate truly holds until traffic changes.

Each run draws a fresh reference (``reference_of`` on 600 held-out items) and a live stream:
4000 items like the reference, then N items after a change, each audited (labeled) with
probability 5%. At the end of the stream the monitor runs

    drift      ``drift_test`` on the last 1000 items, alpha 0.01 (KS on confidence and
               chi-square on top choice, Bonferroni)
    precision  ``audited_precision`` (a sequential bet since issue 58) on the audited accepted
               items of the last 4000 items
               (about 200 audits), alpha 0.05, against the target

Windows reach back before the change when N is smaller than they are. Scenarios:

    none         nothing changes: every alarm is a false alarm (rate <= alpha per test)
    label prior  the last choice's share grows (binary 0.3 -> 0.6; 3-choice 0.2 -> 0.6); the
                 judge keeps the old prior
    input        harder inputs: the margin falls from 2 to 1, the judge keeps margin 2, so it
                 is over-confident and accepted items' precision falls below the target

For each, the share of runs in which each test (and either) raised the alarm, by N, and
"caught within": the smallest N at which >= 90% of runs raised it. With no change, the rates
are also pooled over every N (the same distribution), with a one-sided 95% Clopper-Pearson
upper bound: each test's rate must be <= its alpha, either's <= their sum.

    python benchmarks/bench_monitoring.py [--runs 500] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy
from benchlib import cpu_model

from calibration.monitoring.health import audited_precision, drift_test, reference_of
from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_monitoring import draw  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

THRESHOLD = 0.9  # accept at confidence >= this
TARGET_MARGIN = 0.01  # the certified target sits this far below the true precision
N_REFERENCE = 600
N_BEFORE = 4000  # live items like the reference, before the change
DRIFT_WINDOW, DRIFT_ALPHA = 1000, 0.01
AUDIT_WINDOW, AUDIT_ALPHA, AUDIT_RATE = 4000, 0.05, 0.05  # audits are scarce: a longer window
MARGIN, HARD_MARGIN = 2.0, 1.0
CAUGHT = 0.9

TASKS: dict[str, dict[str, list[float]]] = {
    "binary": {"prior": [0.7, 0.3], "shifted": [0.4, 0.6]},
    "3-choice": {"prior": [0.5, 0.3, 0.2], "shifted": [0.2, 0.2, 0.6]},
}
SCENARIOS = ("none", "label prior", "input")


def live_world(task: str, scenario: str) -> dict[str, Any]:
    """Keyword arguments of ``draw`` for live traffic after the change."""
    prior = TASKS[task]["prior"]
    if scenario == "label prior":
        return {"prior": TASKS[task]["shifted"], "margin": MARGIN, "model_prior": prior}
    if scenario == "input":
        return {"prior": prior, "margin": HARD_MARGIN, "model_margin": MARGIN}
    return {"prior": prior, "margin": MARGIN}


def truth(rng: np.random.Generator, world: dict[str, Any], n: int = 1_000_000) -> dict[str, float]:
    """True precision and acceptance rate of accepted items, on n fresh items."""
    p, y = draw(rng, n, **world)
    accepted = p.max(axis=1) >= THRESHOLD
    return {
        "precision": float((p.argmax(axis=1) == y)[accepted].mean()),
        "acceptance": float(accepted.mean()),
    }


def one_run(
    rng: np.random.Generator, task: str, scenario: str, n_after: int, target: float
) -> tuple[bool, bool]:
    """(drift alarm, precision alarm) at the end of one simulated stream."""
    prior = TASKS[task]["prior"]
    ref = reference_of(draw(rng, N_REFERENCE, prior, MARGIN)[0], source="simulated held-out")
    p_before, y_before = draw(rng, N_BEFORE, prior, MARGIN)
    p_after, y_after = draw(rng, n_after, **live_world(task, scenario))
    p, y = np.concatenate([p_before, p_after]), np.concatenate([y_before, y_after])  # (T, k)
    conf, top = p.max(axis=1), p.argmax(axis=1)
    audited = rng.random(len(y)) < AUDIT_RATE
    drift = drift_test(ref, conf[-DRIFT_WINDOW:], top[-DRIFT_WINDOW:], alpha=DRIFT_ALPHA)
    window = slice(-AUDIT_WINDOW, None)
    seen = audited[window] & (conf[window] >= THRESHOLD)
    check = audited_precision(
        top[window][seen] == y[window][seen], target=target, alpha=AUDIT_ALPHA
    )
    return drift.drifted, check.contradicts


def pooled(rows: list[dict[str, Any]], runs: int) -> dict[str, Any]:
    """Alarm rates with no change, over every N, each with its one-sided 95% upper bound."""
    from scipy import stats

    total = runs * len(rows)
    out: dict[str, Any] = {"runs": total}
    for key in ("drift", "precision", "either"):
        alarms = round(sum(r[key] for r in rows) * runs)
        upper = 1.0 if alarms == total else stats.beta.ppf(0.95, alarms + 1, total - alarms)
        out[key] = {"rate": alarms / total, "upper95": float(upper)}
    return out


def caught_within(rows: list[dict[str, Any]], key: str) -> int | None:
    return next((r["n_after"] for r in rows if r[key] >= CAUGHT), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--sizes", type=int, nargs="*", default=[100, 200, 500, 1000, 2000, 4000])
    parser.add_argument("--quick", action="store_true", help="20 runs, N = 500 only")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_monitoring.json")
    args = parser.parse_args()
    runs, sizes = (20, [500]) if args.quick else (args.runs, args.sizes)
    begin = time.perf_counter()
    rng = np.random.default_rng(0)
    tasks = []
    for task in TASKS:
        before = truth(rng, live_world(task, "none"))
        target = round(before["precision"] - TARGET_MARGIN, 4)
        scenarios = []
        for scenario in SCENARIOS:
            rows = []
            for n_after in sizes:
                alarms = np.array(
                    [one_run(rng, task, scenario, n_after, target) for _ in range(runs)]
                )  # (runs, 2)
                rows.append(
                    {
                        "n_after": n_after,
                        "drift": float(alarms[:, 0].mean()),
                        "precision": float(alarms[:, 1].mean()),
                        "either": float(alarms.any(axis=1).mean()),
                    }
                )
            after = truth(rng, live_world(task, scenario))
            if scenario == "none":
                stationary = pooled(rows, runs)
            scenarios.append(
                {
                    "scenario": scenario,
                    "true_precision_after": after["precision"],
                    "acceptance_after": after["acceptance"],
                    "certificate_holds_after": after["precision"] >= target,
                    "rows": rows,
                    "caught_within": {
                        key: caught_within(rows, key) for key in ("drift", "precision", "either")
                    },
                }
            )
        tasks.append(
            {
                "task": task,
                "prior": TASKS[task]["prior"],
                "true_precision": before["precision"],
                "acceptance": before["acceptance"],
                "target": target,
                "false_alarms": stationary,
                "scenarios": scenarios,
            }
        )
    result = {
        "machine": {
            "cpu": cpu_model(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "scipy": scipy.__version__,
        },
        "quick": args.quick,
        "config": {
            "runs": runs,
            "sizes": sizes,
            "threshold": THRESHOLD,
            "target_margin": TARGET_MARGIN,
            "n_reference": N_REFERENCE,
            "n_before": N_BEFORE,
            "drift_window": DRIFT_WINDOW,
            "drift_alpha": DRIFT_ALPHA,
            "audit_window": AUDIT_WINDOW,
            "audit_alpha": AUDIT_ALPHA,
            "audit_rate": AUDIT_RATE,
            "margin": MARGIN,
            "hard_margin": HARD_MARGIN,
            "caught": CAUGHT,
        },
        "tasks": tasks,
        "elapsed_s": round(time.perf_counter() - begin, 1),
    }
    write_text(args.out, json.dumps(result, indent=2) + "\n")
    print(table(result))


def table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    tests = ("drift", "precision", "either")
    lines = [
        f"{cfg['runs']} runs per cell; alarm rates at the end of the stream (drift alpha "
        f"{cfg['drift_alpha']}, precision alpha {cfg['audit_alpha']}).",
        "",
        "| task | scenario | true precision after / target | N after | drift | precision "
        "| either |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in result["tasks"]:
        for s in t["scenarios"]:
            for r in s["rows"]:
                lines.append(
                    f"| {t['task']} | {s['scenario']} | {s['true_precision_after']:.3f} / "
                    f"{t['target']:.3f} | {r['n_after']} | {r['drift']:.3f} | "
                    f"{r['precision']:.3f} | {r['either']:.3f} |"
                )
    lines += [
        "",
        "False alarms with no change, pooled over every N: rate (one-sided 95% upper bound).",
        "",
        "| task | runs | drift (alpha 0.01) | precision (alpha 0.05) | either (<= 0.06) |",
        "|---|---|---|---|---|",
    ]
    for t in result["tasks"]:
        f = t["false_alarms"]
        cells = [f"{f[k]['rate']:.4f} ({f[k]['upper95']:.4f})" for k in tests]
        lines.append(f"| {t['task']} | {f['runs']} | " + " | ".join(cells) + " |")
    top = max(cfg["sizes"])
    lines += [
        "",
        f"Caught within: the fewest items after the change at which >= {cfg['caught']:.0%} of "
        f"runs raise the alarm ('> {top}': not within the sizes tried).",
        "",
        "| task | scenario | drift | precision | either |",
        "|---|---|---|---|---|",
    ]
    for t in result["tasks"]:
        for s in t["scenarios"][1:]:
            c = s["caught_within"]
            cells = [f"> {top}" if c[k] is None else str(c[k]) for k in tests]
            lines.append(f"| {t['task']} | {s['scenario']} | " + " | ".join(cells) + " |")
    lines.append(f"\n{result['elapsed_s']} s")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
