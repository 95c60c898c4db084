"""What N labels buy: a profile fitted on N labeled items, its served policy measured on test.

For each task, N labeled items are drawn from the calibration split (several draws per N,
stratified by label), a profile is fitted on them with ``methods="auto"`` (the probe on the
pass's hidden state competing with the scalar maps, as ``judge calibrate`` does by default),
and the served policy, every gate included, is measured on the whole test split at each target
precision: how often a threshold was certified, how often the test precision then met the
target, and the mean test accuracy and coverage. The judgments are bench_calibration.py's
cache (judged once if missing).

    python benchmarks/bench_labels.py [--tasks sst2 sms_spam ag_news] [--draws 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from benchlib import cpu_model

from calibration import FitSettings
from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_calibration import cached_scores  # noqa: E402


def draw(labels: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of n items, each label's share as in ``labels`` (at least one of each)."""
    classes, counts = np.unique(labels, return_counts=True)
    want = np.maximum(1, np.round(counts / counts.sum() * n).astype(int))
    picked = [
        rng.choice(np.flatnonzero(labels == c), size=min(w, k), replace=False)
        for c, w, k in zip(classes, want, counts, strict=True)
    ]
    return np.sort(np.concatenate(picked))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--tasks", nargs="*", default=["sst2", "sms_spam", "ag_news", "trec"])
    parser.add_argument("--sizes", nargs="*", type=int, default=[100, 200, 300, 500])
    parser.add_argument("--targets", nargs="*", type=float, default=[0.9, 0.8])
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "judge" / "logits")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_labels.json")
    args = parser.parse_args()

    from calibration import candidate_layers, evaluate_policy
    from calibration.tasks import LabeledScores, fit_labeled, load_task
    from judge import Judge

    judge = Judge.load(dtype=args.dtype)
    layers = candidate_layers(judge.num_layers or 0)
    start = time.perf_counter()
    rows = []
    for name in args.tasks:
        task = load_task(args.data / name)
        cal, digest = cached_scores(judge, task, "calibration", None, args.cache, layers)
        test, _ = cached_scores(judge, task, "test", None, args.cache, layers)
        assert cal.features is not None and test.features is not None
        for n in [s for s in args.sizes if s <= len(cal)]:
            for target in args.targets:
                outcomes = []
                for d in range(args.draws if n < len(cal) else 1):
                    idx = draw(cal.labels, n, np.random.default_rng(d))
                    subset = LabeledScores(
                        log_probabilities=cal.log_probabilities[idx],
                        choice_mass=cal.choice_mass[idx],
                        labels=cal.labels[idx],
                        features=cal.features[idx],
                        feature_layers=cal.feature_layers,
                    )
                    profile = fit_labeled(
                        name,
                        subset,
                        task.choices,
                        judge.fingerprint(),
                        dataset=f"{name}/calibration[{n}]",
                        dataset_sha256=digest,
                        settings=FitSettings(target_precision=target),
                    )
                    e = evaluate_policy(
                        profile,
                        test.log_probabilities,
                        test.labels,
                        test.choice_mass,
                        features=test.features_of(profile.feature_layers),
                        n_bootstrap=10,
                    )
                    outcomes.append((profile.calibration_map.method, e))
                rows.append(
                    {
                        "task": name,
                        "labels": len(idx),
                        "target": target,
                        "draws": len(outcomes),
                        "probe_chosen": sum(m == "probe" for m, _ in outcomes),
                        "accuracy": float(np.mean([e.after.accuracy.value for _, e in outcomes])),
                        "certified": sum(e.threshold is not None for _, e in outcomes),
                        "precision_met": sum(
                            e.precision is not None and e.precision >= target for _, e in outcomes
                        ),
                        "coverage": float(np.mean([e.coverage for _, e in outcomes])),
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr)
    summary = {
        "model": judge.model_id,
        "dtype": judge.dtype,
        "cpu": cpu_model(),
        "rows": rows,
        "seconds": round(time.perf_counter() - start, 1),
    }
    write_text(args.out, json.dumps(summary, indent=2) + "\n")
    print(markdown(summary))


def markdown(summary: dict[str, object]) -> str:
    lines = [
        f"{summary['model']} ({summary['dtype']}); auto profiles fitted on N labels drawn from "
        "each calibration split, served policy measured on the whole test split",
        "",
        "| task | labels | target | draws | probe chosen | test accuracy | certified | "
        "test precision >= target | mean test coverage |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:  # type: ignore[attr-defined]
        lines.append(
            f"| {r['task']} | {r['labels']} | {r['target']} | {r['draws']} | {r['probe_chosen']} "
            f"| {r['accuracy']:.3f} | {r['certified']} | {r['precision_met']} "
            f"| {r['coverage']:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
