"""Calibration on every shared dataset: fitted on the calibration split, measured on test.

For each task under ../shared/data (or --data), runs the default model over the calibration
and test splits, fits a profile on the calibration split only (target precision 0.9 at
delta 0.1 unless told otherwise) and evaluates it on the test split. Writes, under
``benchmarks/results/calibration/``: each task's profile, markdown report, reliability
diagram and evaluation JSON, and ``summary.md`` / ``summary.json`` with one row per task.

Judging every split takes a while on a CPU, so per-choice logits are cached (keyed by
model hash, dtype, task, split and the split file's hash) in --cache; --judge-only fills the
cache and stops.

    python benchmarks/bench_calibration.py [--tasks sms_spam rte] [--limit N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
from benchlib import write_atomic

from judge import Judge
from judge.tasks import Task, judge_items, load_split, load_task

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "calibration"
DATA = ROOT.parent / "shared" / "data"


def cached_logits(
    judge: Judge, task: Task, split: str, limit: int | None, cache: Path
) -> tuple[np.ndarray, np.ndarray, str]:
    items, digest = load_split(task, split, limit)
    key = f"{task.name}-{split}-{limit or 'all'}-{judge.dtype}-{(judge.weights_sha256 or judge.model_id)[:16]}-{digest[:16]}"
    file = cache / f"{key}.npz"
    if file.exists():
        saved = np.load(file)
        return saved["logits"], saved["labels"], digest
    start = time.perf_counter()
    logits, labels = judge_items(judge, task, items, batch_size=8)
    elapsed = time.perf_counter() - start
    print(f"  judged {task.name}/{split}: {len(items)} items in {elapsed:.0f} s", file=sys.stderr)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{key}.tmp.npz"
    np.savez(tmp, logits=logits, labels=labels)
    os.replace(tmp, file)
    return logits, labels, digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--tasks", nargs="*", help="task names (default: every task in --data)")
    parser.add_argument("--limit", type=int, help="first N items of each split")
    parser.add_argument("--quick", action="store_true", help="40 items per split of sms_spam")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--target-precision", type=float, default=0.9)
    parser.add_argument("--delta", type=float, default=0.1)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "judge" / "logits")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--judge-only", action="store_true")
    args = parser.parse_args()

    names = args.tasks or sorted(p.name for p in args.data.iterdir() if (p / "task.json").exists())
    limit = args.limit
    if args.quick:
        names, limit = ["sms_spam"], 40
    judge = Judge.load(dtype=args.dtype)
    rows = []
    for name in names:
        task = load_task(args.data / name)
        cal_logits, cal_labels, cal_digest = cached_logits(
            judge, task, "calibration", limit, args.cache
        )
        test_logits, test_labels, _ = cached_logits(judge, task, "test", limit, args.cache)
        if args.judge_only:
            continue
        rows.append(
            report_task(
                judge, task, args, (cal_logits, cal_labels, cal_digest), (test_logits, test_labels)
            )
        )
    if args.judge_only:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {
        "model": judge.model_id,
        "dtype": judge.dtype,
        "limit": limit,
        "target_precision": args.target_precision,
        "delta": args.delta,
        "tasks": rows,
    }
    write_atomic(args.out / "summary.json", json.dumps(summary, indent=2))
    write_atomic(args.out / "summary.md", summary_markdown(summary))
    print(summary_markdown(summary))


def report_task(
    judge: Judge,
    task: Task,
    args: argparse.Namespace,
    calibration: tuple[np.ndarray, np.ndarray, str],
    test: tuple[np.ndarray, np.ndarray],
) -> dict[str, object]:
    from calibration.fitting import evaluate_profile, fit_profile
    from calibration.profile import save_profile
    from calibration.reliability import reliability_diagram
    from calibration.report import profile_markdown
    from calibration.scaling import apply_calibration, softmax

    cal_logits, cal_labels, digest = calibration
    profile = fit_profile(
        task.name,
        cal_logits,
        cal_labels,
        task.choices,
        dtype=judge.dtype,
        **judge.configuration(),
        dataset=f"{task.name}/calibration",
        dataset_sha256=digest,
        target_precision=args.target_precision,
        delta=args.delta,
    )
    evaluation = evaluate_profile(profile, *test)
    out = args.out
    save_profile(profile, out / f"{task.name}.json")
    write_atomic(out / f"{task.name}.report.md", profile_markdown(profile, evaluation))
    write_atomic(
        out / f"{task.name}.test.json",
        msgspec.json.format(msgspec.json.encode(evaluation)).decode(),
    )
    test_logits, test_labels = test
    calibrated = apply_calibration(test_logits, profile.method, profile.temperature, profile.bias)
    reliability_diagram(
        (softmax(test_logits), test_labels),
        (calibrated, test_labels),
        out / f"{task.name}.reliability.png",
        title=f"{task.name} (test split)",
    )
    t = profile.threshold
    return {
        "task": task.name,
        "n_calibration": profile.n_examples,
        "n_test": evaluation.n,
        "method": profile.method,
        "temperature": profile.temperature,
        "accuracy": evaluation.after.accuracy.value,
        "nll_before": evaluation.before.nll.value,
        "nll_after": evaluation.after.nll.value,
        "ece_before": evaluation.before.ece.value,
        "ece_after": evaluation.after.ece.value,
        "ece_noise_floor": evaluation.after.ece_noise_floor,
        "feasible": t.feasible,
        "threshold": t.threshold,
        "test_coverage": evaluation.coverage,
        "test_precision": evaluation.precision,
        "infeasible_reason": None if t.feasible else t.reason,
        "conformal_coverage": evaluation.conformal_coverage,
        "mean_set_size": evaluation.mean_set_size,
    }


def summary_markdown(summary: dict[str, object]) -> str:
    lines = [
        f"# Calibration on the shared datasets ({summary['model']}, {summary['dtype']})",
        "",
        f"Fitted on each calibration split, measured on the test split. Threshold: target "
        f"precision {summary['target_precision']} at delta {summary['delta']}."
        + (f" First {summary['limit']} items per split only." if summary["limit"] else ""),
        "",
        "| task | n cal/test | method | T | accuracy | NLL before → after | ECE before → after (floor) | threshold | test coverage | test precision | conformal cov / size |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["tasks"]:  # type: ignore[attr-defined]
        threshold = f"{r['threshold']:.2f}" if r["feasible"] else "infeasible"
        precision = "-" if r["test_precision"] is None else f"{r['test_precision']:.3f}"
        lines.append(
            f"| {r['task']} | {r['n_calibration']}/{r['n_test']} | {r['method']} | {r['temperature']:.2f} "
            f"| {r['accuracy']:.3f} | {r['nll_before']:.3f} → {r['nll_after']:.3f} "
            f"| {r['ece_before']:.3f} → {r['ece_after']:.3f} ({r['ece_noise_floor']:.3f}) "
            f"| {threshold} | {r['test_coverage']:.3f} | {precision} "
            f"| {r['conformal_coverage']:.3f} / {r['mean_set_size']:.2f} |"
        )
    infeasible = [r for r in summary["tasks"] if not r["feasible"]]  # type: ignore[attr-defined]
    if infeasible:
        lines += ["", "Infeasible thresholds:"]
        lines += [f"- {r['task']}: {r['infeasible_reason']}" for r in infeasible]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
