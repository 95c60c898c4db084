"""Calibration on every shared dataset: fitted on the calibration split, measured on test.

For each task under ../shared/data (or --data), runs the default model over the calibration
and test splits, fits a profile on the calibration split only (``tasks.fit_labeled``; target precision 0.9
at delta 0.1 unless told otherwise) and evaluates the served policy, every gate included, on
the test split (``calibration.evaluate_policy``): coverage and precision of what it accepts,
and what it escalates, by reason. Writes, under
``benchmarks/results/calibration/``: each task's profile, markdown report, reliability
diagram and evaluation JSON, and ``summary.md`` / ``summary.json`` with one row per task.

Judging every split takes a while on a CPU, so the per-choice log-probabilities, choice
masses and labels are cached (keyed by task, split, limit, dtype, model hash and the split
file's hash) in --cache; --judge-only fills the cache and stops.

    python benchmarks/bench_calibration.py [--tasks sms_spam rte] [--limit N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from atomicio import replacing, write_text
from calibration.probe import candidate_layers
from judge import Judge
from tasks import (
    LabeledScores,
    Task,
    judge_task_items,
    load_split,
    load_task,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "calibration"
DATA = ROOT.parent / "shared" / "data"


def cached_scores(
    judge: Judge,
    task: Task,
    split: str,
    limit: int | None,
    cache: Path,
    feature_layers: tuple[int, ...] = (),
) -> tuple[LabeledScores, str]:
    """The engine's scores on a split (columns in ``task.choices`` order) and its sha256.

    Cached as ``<key>.npz`` with arrays ``log_probabilities`` (n, k), ``choice_mass`` (n,),
    ``labels`` (n,) and, with ``feature_layers``, ``features`` (n, m, H); the key names
    everything the scores depend on.
    """
    items, digest = load_split(task, split, limit)
    weights = (judge.weights_sha256 or judge.model_id)[:16]
    layers = "-L" + "_".join(map(str, feature_layers)) if feature_layers else ""
    key = f"{task.name}-{split}-{limit or 'all'}-{judge.dtype}-{weights}-{digest[:16]}{layers}"
    file = cache / f"{key}.npz"
    if file.exists():
        with np.load(file) as saved:
            scores = LabeledScores(
                log_probabilities=saved["log_probabilities"],
                choice_mass=saved["choice_mass"],
                labels=saved["labels"],
                features=saved["features"] if feature_layers else None,
                feature_layers=feature_layers,
            )
        return scores, digest
    start = time.perf_counter()
    scores = judge_task_items(judge, task, items, batch_size=8, feature_layers=feature_layers)
    elapsed = time.perf_counter() - start
    print(f"  judged {task.name}/{split}: {len(items)} items in {elapsed:.0f} s", file=sys.stderr)
    arrays: dict[str, Any] = {
        "log_probabilities": scores.log_probabilities,
        "choice_mass": scores.choice_mass,
        "labels": scores.labels,
    }
    if scores.features is not None:
        arrays["features"] = scores.features
    with replacing(file) as temp:  # temp keeps the .npz name, so savez adds no suffix
        np.savez(temp, **arrays)
    return scores, digest


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
    layers = candidate_layers(judge.num_layers or 0)
    rows = []
    for name in names:
        task = load_task(args.data / name)
        fitted_on, digest = cached_scores(judge, task, "calibration", limit, args.cache, layers)
        held_out, _ = cached_scores(judge, task, "test", limit, args.cache, layers)
        if args.judge_only:
            continue
        rows.append(report_task(judge, task, args, fitted_on, digest, held_out))
    if args.judge_only:
        return
    summary = {
        "model": judge.model_id,
        "dtype": judge.dtype,
        "limit": limit,
        "target_precision": args.target_precision,
        "delta": args.delta,
        "tasks": rows,
    }
    write_text(args.out / "summary.json", json.dumps(summary, indent=2))
    write_text(args.out / "summary.md", summary_markdown(summary))
    print(summary_markdown(summary))


def report_task(
    judge: Judge,
    task: Task,
    args: argparse.Namespace,
    fitted_on: LabeledScores,
    digest: str,
    test: LabeledScores,
) -> dict[str, object]:
    """Fit on the calibration split, evaluate the served policy on test, write the artifacts."""
    import msgspec

    from calibration import evaluate_policy, save_profile
    from calibration.reliability import reliability_diagram
    from calibration.report import profile_markdown
    from calibration.scaling import softmax
    from tasks import fit_labeled

    profile = fit_labeled(
        task.name,
        fitted_on,
        task.choices,
        judge.configuration(),
        dataset=f"{task.name}/calibration",
        dataset_sha256=digest,
        target_precision=args.target_precision,
        delta=args.delta,
    )
    evaluation = evaluate_policy(
        profile, test.log_probabilities, test.labels, test.choice_mass
    )  # columns are in task.choices order, which is profile.choices
    out = args.out
    save_profile(profile, out / f"{task.name}.json")
    write_text(out / f"{task.name}.report.md", profile_markdown(profile, evaluation))
    write_text(
        out / f"{task.name}.test.json",
        msgspec.json.format(msgspec.json.encode(evaluation)).decode(),
    )
    z = test.log_probabilities
    reliability_diagram(
        (softmax(z), test.labels),
        (profile.calibration_map.apply(z), test.labels),
        out / f"{task.name}.reliability.png",
        title=f"{task.name} (test split)",
    )
    t = profile.threshold
    return {
        "task": task.name,
        "n_calibration": profile.n_examples,
        "n_test": evaluation.n,
        "method": profile.calibration_map.method,
        "temperature": profile.calibration_map.temperature,
        "accuracy": evaluation.after.accuracy.value,
        "nll_before": evaluation.before.nll.value,
        "nll_after": evaluation.after.nll.value,
        "ece_before": evaluation.before.ece.value,
        "ece_after": evaluation.after.ece.value,
        "ece_noise_floor": evaluation.after.ece_noise_floor,
        "feasible": t.threshold is not None,
        "threshold": t.threshold,
        "infeasible_reason": None if t.threshold is not None else t.reason,
        "min_choice_mass": evaluation.min_choice_mass,
        "test_coverage": evaluation.coverage,
        "test_precision": evaluation.precision,
        "test_precision_interval": evaluation.precision_interval,
        "escalations": evaluation.escalations,
        "conformal_coverage": evaluation.conformal_coverage,
        "mean_set_size": evaluation.mean_set_size,
    }


def summary_markdown(summary: dict[str, object]) -> str:
    lines = [
        f"# Calibration on the shared datasets ({summary['model']}, {summary['dtype']})",
        "",
        f"Fitted on each calibration split; the served policy (threshold, choice mass, "
        f"single-choice conformal set) measured on the test split. Threshold: target "
        f"precision {summary['target_precision']} at delta {summary['delta']}."
        + (f" First {summary['limit']} items per split only." if summary["limit"] else ""),
        "",
        "| task | n cal/test | method | T | accuracy | NLL before → after | ECE before → after (floor) | threshold | test coverage | test precision | escalated by reason | conformal cov / size |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["tasks"]:  # type: ignore[attr-defined]
        threshold = f"{r['threshold']:.2f}" if r["feasible"] else "none certified"
        precision = "-" if r["test_precision"] is None else f"{r['test_precision']:.3f}"
        escalated = ", ".join(f"{k} {v}" for k, v in r["escalations"].items()) or "-"
        lines.append(
            f"| {r['task']} | {r['n_calibration']}/{r['n_test']} | {r['method']} | {r['temperature']:.2f} "
            f"| {r['accuracy']:.3f} | {r['nll_before']:.3f} → {r['nll_after']:.3f} "
            f"| {r['ece_before']:.3f} → {r['ece_after']:.3f} ({r['ece_noise_floor']:.3f}) "
            f"| {threshold} | {r['test_coverage']:.3f} | {precision} | {escalated} "
            f"| {r['conformal_coverage']:.3f} / {r['mean_set_size']:.2f} |"
        )
    infeasible = [r for r in summary["tasks"] if not r["feasible"]]  # type: ignore[attr-defined]
    if infeasible:
        lines += ["", "No certified threshold (every test item escalates):"]
        lines += [f"- {r['task']}: {r['infeasible_reason']}" for r in infeasible]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
