"""What an adapter buys over the frozen probe, and what it costs (issue 56).

For each shared task, on the first N items of its calibration split (the profile's labels) and
the first M of its test split (never seen by any fit):

* ``judge calibrate --method adapter``'s fit (``calibration.tasks.fit_adapter_profile``): a
  probe on the probe split's fit items, LoRA trained under its head on those items alone, the
  head certified on the conformal and certify splits; its wall time;
* on the test split, the served policy of three profiles fitted on the very same split of the
  very same labels: the scalar map (the probe profile's baseline), the frozen probe, and the
  adapter: accuracy, ECE, the coverage accepted under the certified threshold and the
  precision reached there (``calibration.evaluate_policy``, every gate);
* the ms per item served, one item at a time, with and without the adapter, reading the same
  layer, alternated item by item (same warm caches, same machine state);
* whether the adapter's certificate holds in resamples (``resampled_guarantee``): conformal
  and certify sets redrawn from every item the adapter never trained on, the threshold
  certified again on each, failures counted against that population's precision.

Run it alone: two CPU-heavy processes on two cores time each other.

    python benchmarks/bench_adapter.py [--tasks sst2 ag_news trec] [--limit 500] [--quick]
        [--model gemma3-270m]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from benchlib import cpu_flags, cpu_model

from calibration import CalibrationProfile, evaluate_policy
from calibration.certificates.certify import select_threshold, sequence_start
from calibration.fitting import held_out_examples
from calibration.maps.probe import map_features
from calibration.tasks import (
    AdapterProfile,
    LabeledItems,
    LabeledScores,
    Task,
    fit_adapter_profile,
    judge_task_items,
    load_split,
    load_task,
    task_item_span,
    task_prompt,
)
from calibration.tasks.adapter.training import AdapterSettings
from judge import Judge, Query
from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"


def policy(
    profile: CalibrationProfile, judge: Judge, task: Task, test: list[Any]
) -> tuple[dict[str, Any], LabeledScores]:
    """The served policy of ``profile`` on ``test`` items, judged as the profile reads them,
    and their scores."""
    engine = judge if profile.adapter is None else judge.adapted(profile.adapter)
    layers = sorted(set(profile.feature_layers) | set(profile.span_layers))
    scores = judge_task_items(engine, task, test, feature_layers=layers, span_layers=layers)
    ev = evaluate_policy(
        profile,
        scores.log_probabilities,
        scores.labels,
        scores.choice_mass,
        features=scores.features_of(profile.feature_layers),
        span_features=scores.span_features_of(profile.span_layers),
        n_bootstrap=200,
    )
    return {
        "accuracy": ev.after.accuracy.value,
        "ece": ev.after.ece.value,
        "threshold": ev.threshold,
        "certified_coverage": ev.coverage if ev.certified else 0.0,
        "precision_accepted": ev.precision,
        "baseline": None
        if ev.baseline is None
        else {"accuracy": ev.baseline.after.accuracy.value, "ece": ev.baseline.after.ece.value},
    }, scores


def answered(profile: CalibrationProfile, scores: LabeledScores) -> tuple[np.ndarray, np.ndarray]:
    """Each item's confidence under ``profile``'s map and whether its answer is right (the
    mass check left out: on these task prompts it escalates nothing)."""
    fitted = profile.calibration_map
    x = map_features(fitted, scores.features, scores.feature_layers, scores.span_features)
    p = fitted.apply(scores.log_probabilities, x)
    return p.max(axis=1), p.argmax(axis=1) == scores.labels


def resampled_guarantee(
    profile: CalibrationProfile,
    confidence: np.ndarray,
    correct: np.ndarray,
    *,
    resamples: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """Does the certificate hold in resamples? The served map's answers on items neither it
    nor its adapter was fitted on (the held-out calibration items and the test items) are the
    population; each resample draws conformal and certify sets of the profile's sizes from it
    (with replacement), starts the fixed sequence on the first, certifies on the second at the
    profile's target and delta, and fails where the population's precision at the certified
    threshold is below the target. At most delta of resamples may fail."""
    t = profile.threshold
    target, delta = t.target_precision, t.delta
    n_conformal, n_certify = profile.split.conformal, profile.split.certify
    rng = np.random.default_rng(seed)
    certified, failed, coverage = 0, 0, []
    for _ in range(resamples):
        a = rng.integers(0, confidence.shape[0], n_conformal)
        b = rng.integers(0, confidence.shape[0], n_certify)
        start = sequence_start(
            confidence[a], n_certify, target_precision=target, delta=delta, correct=correct[a]
        )
        got = select_threshold(
            confidence[b], correct[b], target_precision=target, delta=delta, start=start
        )
        if got.threshold is None:
            coverage.append(0.0)
            continue
        certified += 1
        accepted = confidence >= got.threshold
        coverage.append(float(accepted.mean()))
        failed += int(correct[accepted].mean() < target)
    return {
        "population": int(confidence.shape[0]),
        "resamples": resamples,
        "certified": certified / resamples,
        "failure_rate": failed / resamples,
        "delta": delta,
        "mean_coverage": float(np.mean(coverage)),
    }


def serving_ms(
    judge: Judge, fitted: AdapterProfile, task: Task, items: list[Any]
) -> dict[str, float]:
    """Median ms per lone item, with and without the adapter, reading the same layer."""
    profile = fitted.profile
    assert profile.adapter is not None
    layers = tuple(profile.span_layers)
    times: dict[str, list[float]] = {"probe": [], "adapter": []}
    for it in items:
        prompt = task_prompt(task, it.text)
        base = Query(
            prompt=prompt,
            choices=list(task.choices),
            span_layers=layers,
            feature_layers=tuple(profile.feature_layers),
            item_span=task_item_span(task, it.text),
        )
        for arm, query in (
            ("probe", base),
            ("adapter", msgspec.structs.replace(base, adapter=profile.adapter)),
        ):
            start = time.perf_counter()
            judge.judge_batch([query])
            times[arm].append((time.perf_counter() - start) * 1000)
    return {arm: float(np.median(ms[1:])) for arm, ms in times.items()}


def run_task(
    judge: Judge, name: str, limit: int, test_limit: int, settings: AdapterSettings
) -> dict[str, Any]:
    task = load_task(DATA / name)
    items, digest = load_split(task, "calibration", limit)
    test, _ = load_split(task, "test", test_limit)
    start = time.perf_counter()
    fitted = fit_adapter_profile(
        judge,
        task,
        LabeledItems(items, f"{name}/calibration", digest),
        name,
        adapter_settings=settings,
        keep_adapter=True,  # measured either way; ``winner`` says which a user would get
    )
    fit_seconds = time.perf_counter() - start
    probe, _ = policy(fitted.probe, judge, task, test)
    adapter, test_scores = policy(fitted.profile, judge, task, test)
    # The adapter's answers on every item it never trained on, for the resample study.
    held = held_out_examples(fitted.scores.labels, fitted.profile.split)
    conf_cal, right_cal = answered(fitted.profile, fitted.scores)
    conf_test, right_test = answered(fitted.profile, test_scores)
    guarantee = resampled_guarantee(
        fitted.profile,
        np.concatenate([conf_cal[held], conf_test]),
        np.concatenate([right_cal[held], right_test]),
    )
    row = {
        "task": name,
        "labels": len(items),
        "test_items": len(test),
        "fit_seconds": fit_seconds,
        "adapter_training_seconds": fitted.fit.seconds,
        "adapter": adapter,
        "probe": probe,
        "scalar": probe["baseline"],
        "guarantee_in_resamples": guarantee,
        "note": fitted.fit.note,
        "winner": fitted.winner,
        "validation_nll": fitted.validation_nll,
        "history": fitted.fit.history,
        "adapter_bytes": len(fitted.profile.adapter.weights) if fitted.profile.adapter else 0,
        "ms_per_item": serving_ms(judge, fitted, task, test[:21]),
    }
    print(
        json.dumps({k: row[k] for k in ("task", "fit_seconds", "adapter", "probe", "ms_per_item")}),
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["sst2", "ag_news", "trec"])
    parser.add_argument("--limit", type=int, default=500, help="calibration items (trec has 200)")
    parser.add_argument("--test-limit", type=int, default=500)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 100 items, 1 epoch")
    parser.add_argument("--out", type=Path, help="where the JSON goes (default: results/)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument(
        "--model", help="a model Judge.load takes, e.g. gemma3-270m (default: the default model)"
    )
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.quick:
        args.limit, args.test_limit, args.epochs = 100, 40, 1
    settings = AdapterSettings(epochs=args.epochs, blocks=2 if args.quick else 10)
    judge = Judge.load(args.model) if args.model else Judge.load()
    name = "bench_adapter_quick.json" if args.quick else "bench_adapter.json"
    out_path = args.out or RESULTS / name
    rows = []
    for task in args.tasks:  # written after each task: a long run keeps what it measured
        rows.append(run_task(judge, task, args.limit, args.test_limit, settings))
        head = {"cpu": cpu_model(), "flags_avx512f": "avx512f" in cpu_flags()}
        head |= {"model": judge.model_id, "dtype": judge.dtype}
        write_text(out_path, json.dumps({**head, "rows": rows}, indent=2))
    print(f"\n{cpu_model()}, {judge.model_id}, {judge.dtype}; avx512f: {'avx512f' in cpu_flags()}")
    print(
        "| task | labels | scalar acc | probe acc / ECE / cert. coverage | adapter acc / ECE / "
        "cert. coverage | validation winner | fit s | ms/item probe, adapter | adapter's "
        "certificate in resamples: certified, failed (delta) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, p, s = r["adapter"], r["probe"], r["scalar"] or {"accuracy": float("nan")}
        g = r["guarantee_in_resamples"]
        print(
            f"| {r['task']} | {r['labels']} | {s['accuracy']:.3f} | {p['accuracy']:.3f} / "
            f"{p['ece']:.3f} / {p['certified_coverage']:.3f} | {a['accuracy']:.3f} / {a['ece']:.3f}"
            f" / {a['certified_coverage']:.3f} | {r['winner']} | {r['fit_seconds']:.0f} | "
            f"{r['ms_per_item']['probe']:.1f}, {r['ms_per_item']['adapter']:.1f} | "
            f"{g['certified']:.3f}, {g['failure_rate']:.3f} ({g['delta']}) |"
        )


if __name__ == "__main__":
    main()
