"""Would the item's own tokens lift the probe? Measured before it is built into the pass.

The probe reads one hidden state: the decision point's (the last prompt token), at one layer.
Issue 32 proposes two more features from the same pass: the mean of the hidden states over the
item's own tokens (the text, not the instruction around it), and two layers side by side. This
script measures what each would buy, on the shared tasks where the probe trails or nears
TF-IDF + logistic regression, before any of it goes into the engine:

* the decision point's states and the choices' log-probabilities are bench_calibration.py's
  cached judgments (the engine's own pass);
* the span means come from one plain transformers forward pass per item over the same rendered
  prompt (``Judge.render``), averaged over the tokens whose characters lie inside the item's
  text (found in the rendered prompt; the tokenizer's offsets say which tokens they are);
* each arm is fitted with the probe's own fitter (``calibration.probe.fit_probe``: a slot and
  C chosen by 5-fold cross-validated NLL on the calibration split, refitted on all of it) and
  measured on the test split: accuracy and NLL. "auto" picks the arm with the lowest
  cross-validated NLL, as the fitter would if it had every arm.

    python benchmarks/bench_span_features.py [--tasks sst2 ag_news trec sms_spam]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from benchlib import cpu_flags, cpu_model

from calibration.probe import candidate_layers, fit_probe
from calibration.tasks import Task, load_split, load_task, task_prompt
from judge import Judge
from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_calibration import DATA, cached_scores  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def span_means(judge: Judge, task: Task, split: str, layers: tuple[int, ...]) -> np.ndarray:
    """(n, m, H): each item's hidden states of ``layers`` averaged over its text's tokens."""
    items, _ = load_split(task, split)
    out = np.zeros((len(items), len(layers), judge.hidden_size or 0), dtype=np.float32)
    for i, item in enumerate(items):
        rendered = judge.render(task_prompt(task, item.text))
        start = rendered.index(item.text)
        end = start + len(item.text)
        encoded = judge.tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
        inside = [t for t, (a, b) in enumerate(encoded.offset_mapping) if a < end and b > start]
        ids = torch.tensor([encoded.input_ids])
        with torch.inference_mode():
            states = judge.model(ids, output_hidden_states=True).hidden_states
        for j, layer in enumerate(layers):
            out[i, j] = states[layer][0, inside].float().mean(dim=0).numpy()
    return out


def arms(point: np.ndarray, mean: np.ndarray, layers: tuple[int, ...]) -> dict[str, Any]:
    """Each arm's candidate slots (n, slots, width) and their names."""
    pairs = [(a, b) for i, a in enumerate(layers) for b in layers[i + 1 :]]
    index = {layer: j for j, layer in enumerate(layers)}
    return {
        "decision point": (point, [f"L{n}" for n in layers]),
        "span mean": (mean, [f"L{n}" for n in layers]),
        "point + mean": (
            np.concatenate([point, mean], axis=2),
            [f"L{n}" for n in layers],
        ),
        "two layers": (
            np.stack(
                [np.concatenate([point[:, index[a]], point[:, index[b]]], 1) for a, b in pairs], 1
            ),
            [f"L{a}+L{b}" for a, b in pairs],
        ),
    }


def evaluate(probe: Any, z: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    p = probe.apply(z, x)
    rows = np.arange(y.shape[0])
    return float((p.argmax(1) == y).mean()), float(-np.log(np.clip(p[rows, y], 1e-12, 1)).mean())


def run_task(judge: Judge, task: Task, cache: Path) -> dict[str, Any]:
    layers = candidate_layers(judge.num_layers or 0)
    fit, _ = cached_scores(judge, task, "calibration", None, cache, layers)
    test, _ = cached_scores(judge, task, "test", None, cache, layers)
    start = time.perf_counter()
    fit_mean = span_means(judge, task, "calibration", layers)
    test_mean = span_means(judge, task, "test", layers)
    forward_s = time.perf_counter() - start
    assert fit.features is not None and test.features is not None
    fit_arms = arms(fit.features, fit_mean, layers)
    test_arms = arms(test.features, test_mean, layers)
    from sklearn.model_selection import StratifiedKFold

    folds = list(StratifiedKFold(5, shuffle=True, random_state=0).split(fit.labels, fit.labels))
    rows: dict[str, Any] = {}
    for name, (x, slots) in fit_arms.items():
        fitted = fit_probe(
            x, list(range(len(slots))), len(slots), fit.log_probabilities, fit.labels, folds
        )
        slot = fitted.probe.layers[0]
        x_test = test_arms[name][0][:, slot, :].astype(np.float64)
        accuracy, nll = evaluate(fitted.probe, test.log_probabilities, x_test, test.labels)
        rows[name] = {
            "slot": slots[slot],
            "C": fitted.probe.l2,
            "cv_nll": float(fitted.heldout_nll.mean()),
            "test_accuracy": accuracy,
            "test_nll": nll,
        }
    auto = min(rows, key=lambda k: rows[k]["cv_nll"])
    return {"arms": rows, "auto": auto, "forward_s": forward_s, "n_fit": len(fit.labels)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--tasks", nargs="*", default=["sst2", "ag_news", "trec", "sms_spam"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "judge" / "logits")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_span_features.json")
    args = parser.parse_args()
    judge = Judge.load(dtype=args.dtype)
    tfidf = json.loads((RESULTS / "bench_labels.json").read_text())
    out: dict[str, Any] = {
        "cpu": cpu_model(),
        "flags": cpu_flags(),
        "dtype": judge.dtype,
        "tasks": {},
    }
    print("| task | arm | slot | C | CV NLL | test NLL | test accuracy |")
    print("|---|---|---|---|---|---|---|")
    for name in args.tasks:
        result = run_task(judge, load_task(args.data / name), args.cache)
        out["tasks"][name] = result
        for arm, r in result["arms"].items():
            mark = " (auto)" if arm == result["auto"] else ""
            print(
                f"| {name} | {arm}{mark} | {r['slot']} | {r['C']:g} | {r['cv_nll']:.4f} | "
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
