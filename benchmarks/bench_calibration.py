"""Calibration on every shared dataset: fitted on the calibration split, measured on test.

For each task under ../shared/data (or --data), runs the default model over the calibration
and test splits, fits a profile on the calibration split only (``tasks.fit_labeled``; target precision 0.9
at delta 0.1 unless told otherwise) and evaluates the served policy, every gate included, on
the test split (``calibration.evaluate_policy``): coverage and precision of what it accepts,
and what it escalates, by reason. Writes, under
``benchmarks/results/calibration/``: each task's profile, markdown report, reliability
diagram and evaluation JSON, and ``summary.md`` / ``summary.json`` with one row per task.

Judging every split takes a while on a CPU, so the per-choice log-probabilities, choice
masses and labels are cached (keyed by task, split, limit, dtype, choice paths where not
canonical, model hash and the split file's hash) in --cache; --judge-only fills the cache and stops.

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

from calibration import CalibrationProfile, FitSettings, PolicyEvaluation, Provenance
from calibration.maps.map_types import Probe, ProbeSpan
from calibration.maps.probe import candidate_layers
from calibration.tasks import (
    LabeledScores,
    Task,
    judge_task_items,
    load_split,
    load_task,
)
from judge import Judge
from judge.atomicio import replacing, write_text

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
    span: ProbeSpan | None = None,
) -> tuple[LabeledScores, str]:
    """The engine's scores on a split (columns in ``task.choices`` order) and its sha256.

    Cached as ``<key>.npz`` with arrays ``log_probabilities`` (n, k), ``choice_mass`` (n,),
    ``labels`` (n,), with ``feature_layers`` ``features`` (n, m, H) and with a ``span`` too
    ``span_features`` (n, m, H), the same layers' means over each item's own text ("item")
    or over its whole prompt ("prompt"); the key names everything the scores depend on.
    """
    items, digest = load_split(task, split, limit)
    weights = (judge.weights_sha256 or judge.model_id)[:16]
    layers = "-L" + "_".join(map(str, feature_layers)) if feature_layers else ""
    spans = f"-S{span}" if span and feature_layers else ""
    paths = "" if judge.choice_paths == "canonical" else f"-{judge.choice_paths}"
    key = f"{task.name}-{split}-{limit or 'all'}-{judge.dtype}{paths}-{weights}-{digest[:16]}"
    file = cache / f"{key}{layers}{spans}.npz"
    if file.exists():
        with np.load(file) as saved:
            scores = LabeledScores(
                log_probabilities=saved["log_probabilities"],
                choice_mass=saved["choice_mass"],
                labels=saved["labels"],
                features=saved["features"] if feature_layers else None,
                feature_layers=feature_layers,
                span_features=saved["span_features"] if spans else None,
                span=span if spans else None,
            )
        return scores, digest
    start = time.perf_counter()
    scores = judge_task_items(
        judge,
        task,
        items,
        batch_size=8,
        feature_layers=feature_layers,
        span_layers=feature_layers if span else (),
        span=span or "item",
    )
    elapsed = time.perf_counter() - start
    print(f"  judged {task.name}/{split}: {len(items)} items in {elapsed:.0f} s", file=sys.stderr)
    arrays: dict[str, Any] = {
        "log_probabilities": scores.log_probabilities,
        "choice_mass": scores.choice_mass,
        "labels": scores.labels,
    }
    if scores.features is not None:
        arrays["features"] = scores.features
    if scores.span_features is not None:
        arrays["span_features"] = scores.span_features
    with replacing(file) as temp:  # temp keeps the .npz name, so savez adds no suffix
        np.savez(temp, **arrays)
    return scores, digest


def fit_arguments(parser: argparse.ArgumentParser, out: Path) -> None:
    """What a benchmark that judges the shared splits and fits profiles on them takes: the
    data, the tasks, how many items, the dtype, the certificate's target, the score cache and
    where the results go (this script's and ``bench_choice_paths.py``'s)."""
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--tasks", nargs="*", help="task names (default: every task in --data)")
    parser.add_argument("--limit", type=int, help="first N items of each split (default: all)")
    parser.add_argument("--quick", action="store_true", help="40 items per split of sms_spam")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--target-precision", type=float, default=0.9)
    parser.add_argument("--delta", type=float, default=0.1)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "judge" / "logits")
    parser.add_argument("--out", type=Path, default=out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    fit_arguments(parser, RESULTS)
    parser.add_argument("--judge-only", action="store_true")
    parser.add_argument(
        "--span",
        default="item",
        choices=["item", "prompt", "none"],
        help="what the probe may average the hidden states over besides reading the decision "
        "point: each item's own text (default), its whole prompt, or nothing",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="also refit each task's profiles with this many split seeds and report how often "
        "each certifies (the split is random: with 100-500 labels it decides a lot)",
    )
    args = parser.parse_args()

    names = args.tasks or sorted(p.name for p in args.data.iterdir() if (p / "task.json").exists())
    limit = args.limit
    if args.quick:
        names, limit = ["sms_spam"], 40
    judge = Judge.load(dtype=args.dtype)
    layers = candidate_layers(judge.num_layers or 0)
    span = None if args.span == "none" else args.span
    rows = []
    for name in names:
        task = load_task(args.data / name)
        fitted_on, digest = cached_scores(
            judge, task, "calibration", limit, args.cache, layers, span
        )
        held_out, _ = cached_scores(judge, task, "test", limit, args.cache, layers, span)
        if args.judge_only:
            continue
        rows.append(report_task(judge, task, args, fitted_on, digest, held_out))
        if args.seeds > 1:
            rows[-1]["seeds"] = seed_sweep(judge, task, args, fitted_on, digest, held_out)
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


# The two profiles fitted per task: the scalar maps alone (the default before learned heads)
# and "auto", where a probe on the pass's hidden state competes (the default now).
VARIANTS: dict[str, list[str] | str] = {
    "scalar": ["temperature", "bias_temperature"],
    "auto": "auto",
}


def report_task(
    judge: Judge,
    task: Task,
    args: argparse.Namespace,
    fitted_on: LabeledScores,
    digest: str,
    test: LabeledScores,
) -> dict[str, object]:
    """Fit both variants on the calibration split, evaluate each served policy on test, and
    write the artifacts (the auto profile's under the task's name, the scalar one's with
    ``.scalar``)."""
    row: dict[str, object] = {
        "task": task.name,
        "graded": task.values is not None,  # a score (sts_images), not a classification
        "n_calibration": len(fitted_on),
        "n_test": len(test),
    }
    for variant, methods in VARIANTS.items():
        row[variant] = report_variant(judge, task, args, fitted_on, digest, test, variant, methods)
    return row


def report_variant(
    judge: Judge,
    task: Task,
    args: argparse.Namespace,
    fitted_on: LabeledScores,
    digest: str,
    test: LabeledScores,
    variant: str,
    methods: list[str] | str,
) -> dict[str, object]:
    import msgspec

    from calibration import save_profile
    from calibration.maps.probe import map_features
    from calibration.maps.scaling import softmax
    from calibration.reliability import reliability_diagram
    from calibration.report import profile_markdown

    start = time.perf_counter()
    profile, evaluation = fit_and_evaluate(judge, task, args, fitted_on, digest, test, methods)
    fit_s = time.perf_counter() - start  # the evaluation's share is small: one pass of arrays
    x = map_features(
        profile.calibration_map, test.features, test.feature_layers, test.span_features
    )
    m = profile.calibration_map
    layers = m.layers if isinstance(m, Probe) else []
    out = args.out
    stem = task.name if variant == "auto" else f"{task.name}.{variant}"
    save_profile(profile, out / f"{stem}.json")
    write_text(out / f"{stem}.report.md", profile_markdown(profile, evaluation))
    write_text(
        out / f"{stem}.test.json",
        msgspec.json.format(msgspec.json.encode(evaluation)).decode(),
    )
    z = test.log_probabilities
    reliability_diagram(
        (softmax(z), test.labels),
        (profile.calibration_map.apply(z, x), test.labels),
        out / f"{stem}.reliability.png",
        title=f"{task.name} (test split, {profile.calibration_map.method})",
    )
    t = profile.threshold
    return {
        "method": m.method,
        "layers": list(layers),
        "reads": m.reads if isinstance(m, Probe) else None,
        "temperature": m.temperature,
        "fit_seconds": fit_s,
        "profile_bytes": len(msgspec.json.encode(profile)),
        "accuracy": evaluation.after.accuracy.value,
        "nll_before": evaluation.before.nll.value,
        "nll_after": evaluation.after.nll.value,
        "ece_before": evaluation.before.ece.value,
        "ece_after": evaluation.after.ece.value,
        "ece_noise_floor": evaluation.after.ece_noise_floor,
        "beats_prior": evaluation.signal.beats_prior,
        "feasible": t.threshold is not None,
        "threshold": t.threshold,
        "infeasible_reason": None if t.threshold is not None else t.reason,
        "split": [profile.split.fit, profile.split.conformal, profile.split.certify],
        "min_choice_mass": evaluation.min_choice_mass,
        "test_coverage": evaluation.coverage,
        "test_precision": evaluation.precision,
        "test_precision_interval": evaluation.precision_interval,
        "escalations": evaluation.escalations,
        "labels_needed": None if t.threshold is not None else labels_needed(profile, fitted_on),
        "conformal_coverage": evaluation.conformal_coverage,
        "mean_set_size": evaluation.mean_set_size,
        "baseline": None
        if evaluation.baseline is None
        else {
            "accuracy": evaluation.baseline.after.accuracy.value,
            "threshold": evaluation.baseline.threshold,
            "test_coverage": evaluation.baseline.coverage,
            "test_precision": evaluation.baseline.precision,
        },
    }


def fit_and_evaluate(
    judge: Judge,
    task: Task,
    args: argparse.Namespace,
    fitted_on: LabeledScores,
    digest: str,
    test: LabeledScores,
    methods: list[str] | str,
    *,
    seed: int = 0,
    n_bootstrap: int = 1000,
) -> tuple[CalibrationProfile, PolicyEvaluation]:
    """A profile fitted on the calibration split, and its served policy on the test split
    (columns in task.choices order, which is the profile's)."""
    from calibration.tasks import fit_labeled

    provenance = Provenance(
        fingerprint=judge.fingerprint(), dataset=f"{task.name}/calibration", dataset_sha256=digest
    )
    settings = FitSettings(
        target_precision=args.target_precision, delta=args.delta, methods=methods, seed=seed
    )
    profile = fit_labeled(task.name, fitted_on, task.choices, provenance, settings).profile
    return profile, evaluate_on(profile, test, n_bootstrap)


def evaluate_on(
    profile: CalibrationProfile, test: LabeledScores, n_bootstrap: int = 1000
) -> PolicyEvaluation:
    """The profile's served policy on the test split's scores, the probe's layers read."""
    from calibration import evaluate_policy

    return evaluate_policy(
        profile,
        test.log_probabilities,
        test.labels,
        test.choice_mass,
        features=test.features_of(profile.feature_layers),
        span_features=test.span_features_of(profile.span_layers),
        n_bootstrap=n_bootstrap,
    )


def labels_needed(profile: CalibrationProfile, fitted_on: LabeledScores) -> dict[str, Any]:
    """About how many labels would certify ``profile``'s target, where it certified nothing
    (``calibration.fitting.labels_for_next_look``, on the calibration items the map was not
    fitted on, at 80% power; at the delta of a first look from a log, 6/pi^2 of the profile's,
    so a little more than a plain refit would need)."""
    import msgspec

    from calibration.fitting import labels_for_next_look

    m = profile.calibration_map
    layers = m.layers if isinstance(m, Probe) else []  # both arrays cut to the probe's layers
    needed = labels_for_next_look(
        profile,
        fitted_on.log_probabilities,
        fitted_on.labels,
        fitted_on.choice_mass,
        features=fitted_on.features_of(layers),
        feature_layers=layers,
        span_features=fitted_on.span_features_of(layers if profile.span_layers else []),
    )
    return dict(msgspec.to_builtins(needed))


def seed_sweep(
    judge: Judge,
    task: Task,
    args: argparse.Namespace,
    fitted_on: LabeledScores,
    digest: str,
    test: LabeledScores,
) -> dict[str, object]:
    """Per variant, over split seeds 0..seeds-1: how often a threshold was certified, how often
    the test precision reached the target, the mean test coverage (0 for a seed that certified
    nothing) and over the certified seeds alone, and for the seeds that certified nothing the
    labels each would likely need (``labels_needed``)."""
    out: dict[str, object] = {}
    for variant, methods in VARIANTS.items():
        certified = met = 0
        coverage, opened, needed = [], [], []
        for seed in range(args.seeds):
            profile, e = fit_and_evaluate(
                judge, task, args, fitted_on, digest, test, methods, seed=seed, n_bootstrap=10
            )
            certified += e.threshold is not None
            met += e.precision is not None and e.precision >= args.target_precision
            coverage.append(e.coverage)
            if e.threshold is not None:
                opened.append(e.coverage)
            elif variant == "auto":
                needed.append(labels_needed(profile, fitted_on)["labels"])
        out[variant] = {
            "seeds": args.seeds,
            "certified": certified,
            "precision_met": met,
            "mean_coverage": float(np.mean(coverage)),
            "mean_coverage_certified": float(np.mean(opened)) if opened else None,
            "labels_needed": needed,
        }
    return out


def summary_markdown(summary: dict[str, object]) -> str:
    target = summary["target_precision"]
    lines = [
        f"# Calibration on the shared datasets ({summary['model']}, {summary['dtype']})",
        "",
        f"Fitted on each calibration split; the served policy (threshold, choice mass, "
        f"single-choice conformal set) measured on the test split. Threshold: target "
        f"precision {target} at delta {summary['delta']}. Two profiles per task: the scalar "
        "maps (temperature or bias + temperature, 3:2:5 split) and auto (a probe on the pass's "
        "hidden state competes; 5:1:4 split when it does)."
        + (f" First {summary['limit']} items per split only." if summary["limit"] else ""),
        "",
        "| task | n cal/test | profile | map | accuracy | NLL after | ECE after (floor) | threshold | test coverage | test precision | escalated by reason |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    tasks: list[dict[str, object]] = summary["tasks"]  # type: ignore[assignment]
    for row in tasks:
        for variant in VARIANTS:
            r: dict[str, object] = row[variant]  # type: ignore[assignment]
            threshold = f"{r['threshold']:.2f}" if r["feasible"] else "none certified"
            precision = "-" if r["test_precision"] is None else f"{r['test_precision']:.3f}"
            escalated = ", ".join(f"{k} {v}" for k, v in r["escalations"].items()) or "-"  # type: ignore[attr-defined]
            method = str(r["method"])
            if r["layers"]:
                read = "" if r.get("reads") in (None, "point") else f" {r['reads']}"
                method += f" (layer {', '.join(map(str, r['layers']))}{read})"  # type: ignore[call-overload]
            lines.append(
                f"| {row['task']} | {row['n_calibration']}/{row['n_test']} | {variant} | {method} "
                f"| {r['accuracy']:.3f} | {r['nll_after']:.3f} "
                f"| {r['ece_after']:.3f} ({r['ece_noise_floor']:.3f}) "
                f"| {threshold} | {r['test_coverage']:.3f} | {precision} | {escalated} |"
            )
    classification = [row for row in tasks if not row.get("graded")]
    opened = [
        row["task"]
        for row in classification
        if row["auto"]["feasible"]  # type: ignore[index]
        and (row["auto"]["test_precision"] or 0) >= target  # type: ignore[index, operator]
    ]
    lines += [
        "",
        f"Certified with test precision >= {target} (auto): {len(opened)} of "
        f"{len(classification)} classification tasks ({', '.join(map(str, opened)) or 'none'}).",
    ]
    shut: list[tuple[object, dict[str, Any]]] = []
    for row in tasks:
        auto: dict[str, Any] = row["auto"]  # type: ignore[assignment]
        if auto.get("labels_needed"):
            shut.append((row["task"], auto["labels_needed"]))
    if shut:
        lines += ["", "Where auto certified nothing, the labels it would likely need:", ""]
        for task, needed in shut:
            labels = needed["labels"]
            count = f"about {labels:,} labels" if labels is not None else "no number of labels"
            lines.append(f"- {task}: {count} (here {needed['given']}): {needed['reason']}")
    swept = [row for row in tasks if "seeds" in row]
    if swept:
        lines += [
            "",
            "Over split seeds (each a different random 3:2:5 or 5:1:4 split of the same labels):",
            "",
            "| task | profile | seeds | certified | test precision >= target | mean test coverage "
            "| over the certified | labels needed where shut |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in swept:
            for variant in VARIANTS:
                sweep: dict[str, Any] = row["seeds"][variant]  # type: ignore[index]
                when_open = sweep.get("mean_coverage_certified")
                shut_labels = ", ".join(
                    "never" if n is None else f"{n:,}" for n in sweep.get("labels_needed", [])
                )
                lines.append(
                    f"| {row['task']} | {variant} | {sweep['seeds']} | {sweep['certified']} "
                    f"| {sweep['precision_met']} | {sweep['mean_coverage']:.3f} "
                    f"| {'-' if when_open is None else f'{when_open:.3f}'} | {shut_labels or '-'} |"
                )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
