"""What the item's own tokens buy the probe: the engine's span means beside the decision point.

The probe reads one hidden state: the decision point's (the last prompt token), at one layer.
The same pass also gives the mean of the hidden states over the item's own tokens
(``Query.span_layers``, over ``Query.item_span``: the text judged, not the instruction around
it) or over the whole prompt (no span marked). This script measures what each arm buys, on the
shared tasks, with the engine's own pass (``bench_calibration.cached_scores``, span "item" and
"prompt"):

* each arm is fitted with the probe's own fitter (``calibration.maps.probe.fit_probe``: a slot and
  C chosen by 5-fold cross-validated NLL on the calibration split, refitted on all of it) and
  measured on the test split: accuracy and NLL;
* "auto" is what the fitter picks when it is given the means too (the point, the mean or both,
  per layer, by cross-validated NLL), as ``judge calibrate`` fits it.

    python benchmarks/bench_span_features.py [--tasks sst2 ag_news trec sms_spam]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import cpu_flags, cpu_model

from calibration.maps.map_types import ProbeSpan
from calibration.maps.probe import candidate_layers, fit_probe, probe_input
from calibration.tasks import LabeledScores, Task, load_task
from judge import Judge
from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_calibration import DATA, cached_scores  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def arms(item: LabeledScores, prompt: LabeledScores) -> dict[str, Any]:
    """Each arm's candidate slots (n, slots, width): one slot per layer."""
    assert item.features is not None and item.span_features is not None
    assert prompt.span_features is not None
    point = item.features
    return {
        "decision point": point,
        "item mean": item.span_features,
        "prompt mean": prompt.span_features,
        "point + item mean": np.concatenate([point, item.span_features], axis=2),
        "point + prompt mean": np.concatenate([point, prompt.span_features], axis=2),
    }


def evaluate(probe: Any, z: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    p = probe.apply(z, x)
    rows = np.arange(y.shape[0])
    return float((p.argmax(1) == y).mean()), float(-np.log(np.clip(p[rows, y], 1e-12, 1)).mean())


def run_task(judge: Judge, task: Task, cache: Path, limit: int | None) -> dict[str, Any]:
    from threadpoolctl import threadpool_limits

    layers = candidate_layers(judge.num_layers or 0)
    fit = {s: cached_scores(judge, task, "calibration", limit, cache, layers, s)[0] for s in SPANS}
    test = {s: cached_scores(judge, task, "test", limit, cache, layers, s)[0] for s in SPANS}
    # One BLAS thread for the fits, as fit_calibrator runs them: on problems this small more
    # threads only add hand-offs (a third of the time went to the kernel with two).
    with threadpool_limits(limits=1, user_api="blas"):
        return fit_arms(judge.num_layers or 0, layers, fit, test)


def fit_arms(
    num_layers: int,
    layers: tuple[int, ...],
    fit: dict[ProbeSpan, LabeledScores],
    test: dict[ProbeSpan, LabeledScores],
) -> dict[str, Any]:
    """Each arm fitted on ``fit`` and measured on ``test`` (both judged with item and prompt
    means), and what the fitter picks when it may read the means."""
    from sklearn.model_selection import StratifiedKFold

    fit_arms, test_arms = arms(fit["item"], fit["prompt"]), arms(test["item"], test["prompt"])
    y, z = fit["item"].labels, fit["item"].log_probabilities
    folds = list(StratifiedKFold(5, shuffle=True, random_state=0).split(y, y))
    rows: dict[str, Any] = {}
    for name, x in fit_arms.items():
        fitted = fit_probe(x, layers, num_layers, z, y, folds)
        slot = layers.index(fitted.probe.layers[0])
        x_test = test_arms[name][:, slot, :].astype(np.float64)
        t = test["item"]
        accuracy, nll = evaluate(fitted.probe, t.log_probabilities, x_test, t.labels)
        rows[name] = {
            "layer": fitted.probe.layers[0],
            "C": fitted.probe.l2,
            "cv_nll": float(fitted.heldout_nll.mean()),
            "test_accuracy": accuracy,
            "test_nll": nll,
        }
    for span in SPANS:  # what the fitter picks when it may read the means too
        s = fit[span]
        assert s.features is not None
        fitted = fit_probe(
            s.features,
            layers,
            num_layers,
            z,
            y,
            folds,
            span_features=s.span_features,
            span=span,
        )
        probe, t = fitted.probe, test[span]
        x_test = probe_input(probe.reads, probe.layers, t.features, t.span_features, layers)
        accuracy, nll = evaluate(probe, t.log_probabilities, x_test, t.labels)
        rows[f"auto ({span} means)"] = {
            "layer": probe.layers[0],
            "reads": probe.reads,
            "C": probe.l2,
            "cv_nll": float(fitted.heldout_nll.mean()),
            "test_accuracy": accuracy,
            "test_nll": nll,
        }
    return {"arms": rows, "n_fit": len(y)}


SPANS: tuple[ProbeSpan, ...] = ("item", "prompt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--tasks", nargs="*", default=["sst2", "ag_news", "trec", "sms_spam"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "judge" / "logits")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_span_features.json")
    parser.add_argument("--quick", action="store_true", help="40 items per split of sms_spam")
    args = parser.parse_args()
    limit = None
    if args.quick:
        args.tasks, limit = ["sms_spam"], 40
    judge = Judge.load(dtype=args.dtype)
    tfidf = json.loads((RESULTS / "bench_labels.json").read_text())
    out: dict[str, Any] = {
        "cpu": cpu_model(),
        "flags": cpu_flags(),
        "dtype": judge.dtype,
        "tasks": {},
    }
    print("| task | arm | layer | C | CV NLL | test NLL | test accuracy |")
    print("|---|---|---|---|---|---|---|")
    for name in args.tasks:
        result = run_task(judge, load_task(args.data / name), args.cache, limit)
        out["tasks"][name] = result
        for arm, r in result["arms"].items():
            reads = f" {r['reads']}" if "reads" in r else ""
            print(
                f"| {name} | {arm} | {r['layer']}{reads} | {r['C']:g} | {r['cv_nll']:.4f} | "
                f"{r['test_nll']:.4f} | {r['test_accuracy']:.3f} |"
            )
        reference = tfidf_accuracy(tfidf, name)
        if reference is not None:
            print(f"| {name} | TF-IDF + LR, all labels (bench_labels) | | | | | {reference:.3f} |")
    write_text(args.out, json.dumps(out, indent=2))


def tfidf_accuracy(results: dict[str, Any], task: str) -> float | None:
    """bench_labels' TF-IDF accuracy trained on every label of ``task``, if it measured it."""
    rows = [r for r in results["rows"] if r["task"] == task and r["arm"] == "tfidf"]
    whole = [r for r in rows if r.get("accuracy_all_labels") is not None]
    return float(max(whole, key=lambda r: r["labels"])["accuracy_all_labels"]) if whole else None


if __name__ == "__main__":
    main()
