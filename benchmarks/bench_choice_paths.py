"""Canonical or grammar-exact choice paths: which to make the default, measured on the shared sets.

The engine reads each choice either on its canonical token path (``choice_paths="canonical"``,
the trie) or on every token path a grammar engine's mask allows (``"grammar"``, what
constrained decoding emits; ``judge.grammar``). For every shared set, both modes judge the same
calibration and test items (the first --limit of each split) with the same model and dtype; a
scalar profile (temperature or bias + temperature, chosen on held-out NLL) is fitted on the
calibration split for each mode and its served policy measured on the test split. Side by side
per set and mode: raw and calibrated accuracy, NLL and ECE after the map, the certified
threshold, test coverage and precision of what the gate accepts, how many of --seeds split
seeds certify and their mean coverage, and the wall time per item of judging (the splits judged
in batches of 8, the prefix cache on, as ``bench_calibration.py`` judges them).

Probe profiles read the pass's hidden state at the decision point, which the paths after it do
not change, so this compares the scalar maps only: they are where the two modes can differ.
Scores are cached with ``bench_calibration.cached_scores`` (its key names the mode).

    python benchmarks/bench_choice_paths.py [--limit N] [--tasks sms_spam trec] [--seeds 5]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_calibration import cached_scores, fit_and_evaluate, fit_arguments
from benchlib import judge_machine

from calibration.tasks import load_task
from judge import Judge
from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "choice_paths"
MODES = ("canonical", "grammar")
SCALAR = ["temperature", "bias_temperature"]


def run_task(
    judges: dict[str, Judge], name: str, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Each mode's scores on both splits, its fitted scalar profile and its test policy."""
    task = load_task(args.data / name)
    out: dict[str, dict[str, Any]] = {}
    for mode, judge in judges.items():
        start = time.perf_counter()
        fitted_on, digest = cached_scores(judge, task, "calibration", args.limit, args.cache)
        test, _ = cached_scores(judge, task, "test", args.limit, args.cache)
        seconds = time.perf_counter() - start
        profile, e = fit_and_evaluate(judge, task, args, fitted_on, digest, test, SCALAR)
        certified, coverage = 0, []
        for seed in range(args.seeds):
            _, s = fit_and_evaluate(
                judge, task, args, fitted_on, digest, test, SCALAR, seed=seed, n_bootstrap=10
            )
            certified += s.threshold is not None
            coverage.append(s.coverage)
        out[mode] = {
            "n": [len(fitted_on), len(test)],
            # None where the scores came from the cache: then no time was measured.
            "ms_per_item": 1000 * seconds / (len(fitted_on) + len(test)) if seconds > 1 else None,
            "method": profile.calibration_map.method,
            "accuracy_raw": e.before.accuracy.value,
            "accuracy": e.after.accuracy.value,
            "nll": e.after.nll.value,
            "ece": e.after.ece.value,
            "threshold": e.threshold,
            "coverage": e.coverage,
            "precision": e.precision,
            "seeds": args.seeds,
            "seeds_certified": certified,
            "mean_coverage": float(np.mean(coverage)) if coverage else None,
        }
        print(f"# {name} {mode} done", flush=True)
    return out


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"{m['model']} ({m['dtype']}), {m['cpu']}, {m['torch_threads']} torch threads; "
        + (
            f"first {result['limit']} items per split"
            if result["limit"]
            else "every item of every split"
        )
        + f"; scalar profile, target precision "
        f"{result['target_precision']} at delta {result['delta']}",
        "",
        "| set | n cal/test | paths | map | raw acc | calibrated acc | NLL | ECE | threshold "
        "| test coverage | test precision | seeds certified | mean coverage over seeds "
        "| ms/item |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, modes in result["tasks"].items():
        for mode, r in modes.items():
            threshold = "none" if r["threshold"] is None else f"{r['threshold']:.2f}"
            precision = "-" if r["precision"] is None else f"{r['precision']:.3f}"
            ms = "-" if r["ms_per_item"] is None else f"{r['ms_per_item']:.0f}"
            lines.append(
                f"| {name} | {r['n'][0]}/{r['n'][1]} | {mode} | {r['method']} "
                f"| {r['accuracy_raw']:.3f} | {r['accuracy']:.3f} | {r['nll']:.3f} "
                f"| {r['ece']:.3f} | {threshold} | {r['coverage']:.3f} | {precision} "
                f"| {r['seeds_certified']}/{r['seeds']} | {r['mean_coverage']:.3f} | {ms} |"
            )
    totals = {
        mode: (
            sum(modes[mode]["seeds_certified"] for modes in result["tasks"].values()),
            float(np.mean([modes[mode]["accuracy"] for modes in result["tasks"].values()])),
            float(np.mean([modes[mode]["nll"] for modes in result["tasks"].values()])),
        )
        for mode in MODES
    }
    lines += [""] + [
        f"- {mode}: {seeds} seed-fits certified in all; mean calibrated accuracy {acc:.3f}, "
        f"mean NLL {nll:.3f}"
        for mode, (seeds, acc, nll) in totals.items()
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    fit_arguments(parser, RESULTS)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    names = args.tasks or sorted(p.name for p in args.data.iterdir() if (p / "task.json").exists())
    if args.quick:
        names, args.limit, args.seeds = ["sms_spam"], 40, 2
    canonical = Judge.load(dtype=args.dtype)
    judges = {
        "canonical": canonical,
        "grammar": canonical.with_choice_paths("grammar"),
    }
    result = {
        "machine": judge_machine(canonical),
        "limit": args.limit,
        "target_precision": args.target_precision,
        "delta": args.delta,
        "tasks": {name: run_task(judges, name, args) for name in names},
    }
    write_text(args.out / "summary.json", json.dumps(result, indent=2) + "\n")
    write_text(args.out / "summary.md", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
