"""Label-free prior correction against labeled calibration, on every shared classification task.

For each classification task under ../shared/data it measures accuracy, NLL and ECE (15
bins) on the test split of the default model's probabilities after each of, side by side:

* raw: the model's own probabilities;
* contextual (label-free): the prior of three content-free inputs ("N/A", "", "[MASK]" in the
  task's prompt; Zhao et al. 2021) divided out; three forward passes per task;
* batch (label-free): the mean probability vector of the calibration split's texts, labels
  ignored (Zhou et al. 2023), divided out;
* temperature, bias+temperature (labeled): fitted on the calibration split's labels;
* batch+temperature (labeled): batch correction, then a temperature fitted on the labels;
* prior: the calibration split's label frequencies for every item (the predictor a judge
  must beat);

and, from a profile fitted on the calibration split (``fit_profile``) and evaluated on the test
split (``evaluate_policy``), whether the calibrated judge beats the label prior there.
The test and calibration judgments are the cached log-probabilities of bench_calibration.py
(judged once if missing).

    python benchmarks/bench_label_free.py [--tasks trec rte]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from benchlib import cpu_model

from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_calibration import cached_scores  # noqa: E402

VARIANTS = (
    "raw",
    "contextual",
    "batch",
    "temperature",
    "bias+temperature",
    "batch+temperature",
    "prior",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument(
        "--tasks", nargs="*", help="task names (default: every classification task)"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "judge" / "logits")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_label_free.json")
    args = parser.parse_args()

    from calibration.tasks import load_task
    from judge import Judge

    names = args.tasks or sorted(
        p.name
        for p in args.data.iterdir()
        if (p / "task.json").exists() and load_task(p).kind == "classification"
    )
    judge = Judge.load(dtype=args.dtype)
    start = time.perf_counter()
    rows = [run_task(judge, load_task(args.data / name), args.cache) for name in names]
    summary = {
        "model": judge.model_id,
        "dtype": judge.dtype,
        "cpu": cpu_model(),
        "tasks": rows,
        "seconds": round(time.perf_counter() - start, 1),
    }
    write_text(args.out, json.dumps(summary, indent=2) + "\n")
    print(markdown(summary))


def run_task(judge: object, task: object, cache: Path) -> dict[str, object]:
    from calibration import (
        BatchTemperatureScaler,
        BiasTemperatureScaler,
        Provenance,
        TemperatureScaler,
        estimate_prior,
        evaluate_policy,
        fit_profile,
        prior_correction,
    )
    from calibration.certificates.signal import label_prior
    from calibration.maps.scaling import softmax
    from calibration.metrics import accuracy, ece, nll
    from calibration.tasks import Task, content_free_prompts, judge_unlabeled
    from judge import Judge

    assert isinstance(judge, Judge) and isinstance(task, Task)
    cal, digest = cached_scores(judge, task, "calibration", None, cache)
    test, _ = cached_scores(judge, task, "test", None, cache)
    zc, yc, z, y = cal.log_probabilities, cal.labels, test.log_probabilities, test.labels
    k = z.shape[1]
    content_free = judge_unlabeled(judge, content_free_prompts(task), task.choices)  # (3, k)
    contextual_prior = estimate_prior(content_free)
    batch_prior = estimate_prior(zc)
    prior = label_prior(yc, k)
    probs = {
        "raw": softmax(z),
        "contextual": prior_correction(contextual_prior).apply(z),
        "batch": prior_correction(batch_prior).apply(z),
        "temperature": TemperatureScaler().fit(zc, yc).predict_proba(z),
        "bias+temperature": BiasTemperatureScaler().fit(zc, yc).predict_proba(z),
        "batch+temperature": BatchTemperatureScaler().fit(zc, yc).predict_proba(z),
        "prior": np.tile(prior, (z.shape[0], 1)),
    }
    metrics = {
        name: {"accuracy": accuracy(p, y), "nll": nll(p, y), "ece": ece(p, y)}
        for name, p in probs.items()
    }
    provenance = Provenance(
        fingerprint=judge.fingerprint(), dataset=f"{task.name}/calibration", dataset_sha256=digest
    )
    profile = fit_profile(task.name, cal, task.choices, provenance).profile
    evaluation = evaluate_policy(profile, z, y, test.choice_mass)
    s = evaluation.signal
    return {
        "task": task.name,
        "n_calibration": int(zc.shape[0]),
        "n_test": int(z.shape[0]),
        "contextual_prior": dict(zip(task.choices, contextual_prior, strict=True)),
        "batch_prior": dict(zip(task.choices, batch_prior, strict=True)),
        "metrics": metrics,
        "profile_method": profile.calibration_map.method,
        "profile_temperature": profile.calibration_map.temperature,
        "beats_prior_on_test": s.beats_prior,
        "temperature_at_bound": s.temperature_at_bound,
        "accuracy_gain_on_test": [s.accuracy_gain.value, s.accuracy_gain.low, s.accuracy_gain.high],
        "nll_gain_on_test": [s.nll_gain.value, s.nll_gain.low, s.nll_gain.high],
        "auroc_on_test": s.auroc,
        "verdict": s.verdict,
    }


def markdown(summary: dict[str, object]) -> str:
    head = " | ".join(VARIANTS)
    lines = [
        f"Test split of each task; {summary['model']} ({summary['dtype']}). Label-free "
        "columns use no label; labeled ones are fitted on the calibration split's labels.",
        "",
    ]
    for metric, fmt in (("accuracy", ".3f"), ("nll", ".3f"), ("ece", ".3f")):
        lines += [f"**{metric}**", "", f"| task | {head} |", "|---" * (len(VARIANTS) + 1) + "|"]
        for r in summary["tasks"]:  # type: ignore[attr-defined]
            cells = " | ".join(format(r["metrics"][v][metric], fmt) for v in VARIANTS)
            lines.append(f"| {r['task']} | {cells} |")
        lines.append("")
    lines += [
        "**Does the calibrated profile beat the label prior on test?**",
        "",
        "| task | profile map | T | beats prior | accuracy gain [95% CI] | NLL gain [95% CI] | "
        "AUROC | T at bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["tasks"]:  # type: ignore[attr-defined]
        a, g = r["accuracy_gain_on_test"], r["nll_gain_on_test"]
        auroc = "n/a" if r["auroc_on_test"] is None else f"{r['auroc_on_test']:.3f}"
        lines.append(
            f"| {r['task']} | {r['profile_method']} | {r['profile_temperature']:.3g} "
            f"| {'yes' if r['beats_prior_on_test'] else '**no**'} "
            f"| {a[0]:+.3f} [{a[1]:+.3f}, {a[2]:+.3f}] | {g[0]:+.3f} [{g[1]:+.3f}, {g[2]:+.3f}] "
            f"| {auroc} | {'yes' if r['temperature_at_bound'] else 'no'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
