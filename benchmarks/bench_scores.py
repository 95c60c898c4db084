"""Graded judgments: does the expected value track human ratings better than the top grade?

On sts_images (sentence pairs rated 0-5 by annotators; ``score`` is their mean), the default
model judges each test pair between the choices "0".."5". For each item it compares, against
``score``, the expected value sum_j p_j * j and the most likely value argmax_j p_j: Pearson
and Spearman correlation, each with a paired bootstrap 95% interval (1000 resamples of the
items; the same resamples for every row), and the interval of the difference expected minus
most likely. Rows: the raw probabilities; a labeled profile fitted on the calibration split
(``calibration.fit_profile`` with the task's values; labels are the rounded ratings); and
label-free batch calibration fitted on the calibration split's texts; and the same labeled fit
with a probe on the pass's hidden state competing ("auto"). The judgments are the
cached per-choice log-probabilities of bench_calibration.py (judged once if missing).

    python benchmarks/bench_scores.py [--resamples 1000]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
from benchlib import cpu_model
from scipy import stats

from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_calibration import cached_scores  # noqa: E402


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    return float(stats.spearmanr(x, y).statistic)


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.corrcoef(x, y)[0, 1])


def correlations(
    predictions: dict[str, np.ndarray], target: np.ndarray, resamples: int, seed: int
) -> dict[str, dict[str, list[float] | None]]:
    """Point value and bootstrap 95% interval of each correlation, and of EV - ML differences.

    A constant prediction (a judge that gives every item the same grade) has no correlation:
    its entries are None, not NaN.
    """
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, target.shape[0], size=(resamples, target.shape[0]))
    out: dict[str, dict[str, list[float] | None]] = {}
    for name, fn in (("pearson", _pearson), ("spearman", _spearman)):
        draws = {}
        for key, pred in predictions.items():
            if np.ptp(pred) == 0:
                out.setdefault(key, {})[name] = None
                continue
            point = fn(pred, target)
            samples = np.array([fn(pred[i], target[i]) for i in idx])
            draws[key] = samples
            low, high = np.nanpercentile(samples, [2.5, 97.5])
            out.setdefault(key, {})[name] = [point, float(low), float(high)]
        if len(draws) < 2:
            out.setdefault("difference", {})[name] = None
            continue
        diff = draws["expected"] - draws["most_likely"]
        point = fn(predictions["expected"], target) - fn(predictions["most_likely"], target)
        low, high = np.nanpercentile(diff, [2.5, 97.5])
        out.setdefault("difference", {})[name] = [point, float(low), float(high)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "judge" / "logits")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_scores.json")
    args = parser.parse_args()

    from calibration import FitSettings, Provenance, estimate_prior, fit_profile, prior_correction
    from calibration.maps.probe import candidate_layers, map_features
    from calibration.maps.scaling import softmax
    from calibration.tasks import load_split, load_task
    from judge import Judge

    task = load_task(args.data / "sts_images")
    assert task.values is not None, "sts_images/task.json has values"
    judge = Judge.load(dtype=args.dtype)
    start = time.perf_counter()
    layers = candidate_layers(judge.num_layers or 0)
    cal, digest = cached_scores(judge, task, "calibration", None, args.cache, layers)
    test, _ = cached_scores(judge, task, "test", None, args.cache, layers)
    items, _ = load_split(task, "test")
    rows = [json.loads(line) for line in (Path(task.path) / "test.jsonl").read_text().splitlines()]
    by_id = {str(r["id"]): float(r["score"]) for r in rows}
    target = np.array([by_id[item.id] for item in items])  # (n,) annotators' mean rating
    values = np.array([task.values[c] for c in task.choices])  # (k,)

    provenance = Provenance(
        fingerprint=judge.fingerprint(), dataset="sts_images/calibration", dataset_sha256=digest
    )
    settings = FitSettings(values=task.values)
    # The scalar maps: "auto" without features.
    scalar = dataclasses.replace(cal, features=None, feature_layers=())
    profile = fit_profile("sts_images", scalar, task.choices, provenance, settings).profile
    # The same fit with a probe on the pass's hidden state competing.
    probed = fit_profile("sts_images", cal, task.choices, provenance, settings).profile
    batch = prior_correction(estimate_prior(cal.log_probabilities))
    z = test.log_probabilities
    probe_map = probed.calibration_map
    probe_name = f"auto ({probe_map.method}" + (
        f", layer {', '.join(map(str, probed.feature_layers))})" if probed.feature_layers else ")"
    )
    variants = {
        "raw": softmax(z),
        f"calibrated ({profile.calibration_map.method}, T={profile.calibration_map.temperature:.3g})": profile.calibration_map.apply(
            z
        ),
        probe_name: probe_map.apply(z, map_features(probe_map, test.features, test.feature_layers)),
        "batch (label-free)": batch.apply(z),
    }
    results = []
    for name, probs in variants.items():
        predictions = {"expected": probs @ values, "most_likely": values[probs.argmax(axis=1)]}
        corr = correlations(predictions, target, args.resamples, seed=0)
        results.append(
            {
                "probabilities": name,
                "accuracy_vs_label": float((probs.argmax(1) == test.labels).mean()),
                "mean_std": float(
                    np.sqrt(
                        (probs * (values[None, :] - predictions["expected"][:, None]) ** 2).sum(1)
                    ).mean()
                ),
                **corr,
            }
        )
    summary = {
        "task": "sts_images",
        "split": "test",
        "n": int(target.shape[0]),
        "model": judge.model_id,
        "dtype": judge.dtype,
        "cpu": cpu_model(),
        "resamples": args.resamples,
        "profile_note": profile.note,
        "signal": None if profile.signal is None else profile.signal.verdict,
        "auto_note": probed.note,
        "auto_signal": None if probed.signal is None else probed.signal.verdict,
        "rows": results,
        "seconds": round(time.perf_counter() - start, 1),
    }
    write_text(args.out, json.dumps(summary, indent=2) + "\n")
    print(markdown(summary))


def _cell(x: list[float] | None) -> str:
    return "undefined (constant)" if x is None else f"{x[0]:.3f} [{x[1]:.3f}, {x[2]:.3f}]"


def markdown(summary: dict[str, object]) -> str:
    lines = [
        f"sts_images test, n={summary['n']}, {summary['model']} ({summary['dtype']}); "
        f"bootstrap 95% intervals over {summary['resamples']} paired resamples",
        "",
        "| probabilities | Pearson: expected | Pearson: most likely | difference | "
        "Spearman: expected | Spearman: most likely | difference | mean std |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:  # type: ignore[attr-defined]
        lines.append(
            f"| {r['probabilities']} | {_cell(r['expected']['pearson'])} "
            f"| {_cell(r['most_likely']['pearson'])} | {_cell(r['difference']['pearson'])} "
            f"| {_cell(r['expected']['spearman'])} | {_cell(r['most_likely']['spearman'])} "
            f"| {_cell(r['difference']['spearman'])} | {r['mean_std']:.3f} |"
        )
    lines += [
        "",
        f"Calibrated profile: {summary['profile_note']}",
        "",
        f"Signal: {summary['signal']}",
        "",
        f"Auto profile (probe competing): {summary['auto_note']}",
        "",
        f"Signal: {summary['auto_signal']}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
