"""A cascade of two local models on the shared sets, against each model alone.

The first stage is the default model (SmolLM2-135M-Instruct), the second ``--second``
(default: Gemma 3 270M, ``Judge.load("gemma3-270m")`` from its PyPI chunk packages). Both
judge each task's calibration and test splits (scores cached like bench_calibration's, by
model, dtype and split file). Then, at ``--target-precision`` and ``--delta``, with the scalar
calibration maps (temperature, bias + temperature):

    alone     each model's own profile, fitted on the calibration split at delta: the share
              of test items it accepts and their precision
    cascade   ``calibration.tasks.fit_cascade`` on the calibration split (every stage fitted
              on every item, the pair of thresholds certified together at delta, the cheaper
              rule among those of equal coverage by each model's measured ms per item): the
              share of test items each stage decides and a person gets, the precision of what
              it accepts, and its expected ms per item
    guarantee the calibration and test items pooled and cut in random halves
              ``--resamples`` times; the cascade fitted on one half, measured on the other:
              how often its precision falls below the target (the claim: at most delta of the
              time), and its mean coverage
    cost      milliseconds per item of each model, side by side on the same test items (the
              models take turns, batch by batch, so a slow phase of the machine hits both),
              and the cascade's expected cost on test: each stage on the share that reaches
              it, none past the rule's last stage that may accept

    python benchmarks/bench_cascade.py [--tasks sms_spam sst2] [--limit N] [--maps auto|scalar]
        [--resamples 100] [--quick]

Writes benchmarks/results/bench_cascade.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from bench_calibration import cached_scores, evaluate_on
from benchlib import cpu_flags, cpu_model

from calibration import FitError, FitSettings, Provenance, candidate_layers
from calibration.maps.map_types import ProbeSpan
from calibration.tasks import (
    CascadeStageData,
    LabeledScores,
    cascade_rule_on,
    fit_cascade,
    fit_labeled,
    load_split,
    load_task,
    task_prompt,
)
from judge import Judge
from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
SCALAR = ["temperature", "bias_temperature"]


def _joined(a: LabeledScores, b: LabeledScores) -> LabeledScores:
    def both(x: np.ndarray | None, y: np.ndarray | None) -> np.ndarray | None:
        return None if x is None or y is None else np.concatenate([x, y])

    return LabeledScores(
        log_probabilities=np.concatenate([a.log_probabilities, b.log_probabilities]),
        choice_mass=np.concatenate([a.choice_mass, b.choice_mass]),
        labels=np.concatenate([a.labels, b.labels]),
        features=both(a.features, b.features),
        feature_layers=a.feature_layers,
        span_features=both(a.span_features, b.span_features),
        span=a.span,
    )


def alone(
    judge: Judge, task: Any, fit: LabeledScores, test: LabeledScores, settings: FitSettings
) -> dict[str, Any]:
    """One model's profile on the calibration split, measured on test."""
    provenance = Provenance(fingerprint=judge.fingerprint(), dataset=task.name, dataset_sha256="-")
    profile = fit_labeled(task.name, fit, task.choices, provenance, settings).profile
    ev = evaluate_on(profile, test, n_bootstrap=50)
    return {
        "threshold": profile.threshold.threshold,
        "map": profile.calibration_map.method,
        "coverage": ev.coverage,
        "precision": ev.precision,
        "accuracy": float(np.mean(test.log_probabilities.argmax(axis=1) == test.labels)),
        "choice_mass": float(test.choice_mass.mean()),
    }


def cascade(
    judges: list[Judge],
    names: list[str],
    task: Any,
    fits: list[LabeledScores],
    tests: list[LabeledScores],
    settings: FitSettings,
    costs: list[float] | None = None,
) -> dict[str, Any]:
    """The cascade fitted on ``fits``, measured on ``tests``; an error where it could not be
    fitted, with the reason."""
    stages = [
        CascadeStageData(n, s, j.fingerprint()) for n, s, j in zip(names, fits, judges, strict=True)
    ]
    try:
        fitted = fit_cascade(
            task.name, stages, task.choices, dataset=task.name, dataset_sha256="-",
            settings=settings, costs=costs,
        )  # fmt: skip
    except FitError as exc:
        return {"error": str(exc)}
    on_test = cascade_rule_on(fitted.profiles, tests, costs)
    certificate = fitted.certificate
    return {
        "thresholds": on_test.thresholds,
        "maps": [p.calibration_map.method for p in fitted.profiles],
        "shares": dict(zip(names, on_test.stage_coverage, strict=True))
        | {"person": 1.0 - on_test.coverage},
        "coverage": on_test.coverage,
        "precision": on_test.precision,
        "ms_per_item": on_test.cost_per_item,
        "certified": {
            "n": certificate.rule.n if certificate.rule else None,
            "coverage": certificate.rule.coverage if certificate.rule else None,
            "lower_bound": certificate.precision_lower_bound,
            "candidates": certificate.candidates,
            "sequence": certificate.sequence,
            "tested": certificate.tested,
            "rules_certified": certificate.certified,
            "reason": certificate.reason,
        },
    }


def guarantee(
    judges: list[Judge],
    names: list[str],
    task: Any,
    pools: list[LabeledScores],
    settings: FitSettings,
    resamples: int,
) -> dict[str, Any]:
    """Random halves of the pooled items: fit on one, measure on the other."""
    n = len(pools[0])
    failures = unfitted = 0
    coverage: list[float] = []
    why: str | None = None  # the first resample's reason for not fitting, where one had one
    for r in range(resamples):
        order = np.random.default_rng(1000 + r).permutation(n)
        fit, test = order[: n // 2], order[n // 2 :]
        result = cascade(
            judges,
            names,
            task,
            [p.rows(fit) for p in pools],
            [p.rows(test) for p in pools],
            _with_seed(settings, r),
        )
        if "error" in result:
            unfitted += 1
            why = why or result["error"]
            continue
        coverage.append(result["coverage"])
        if result["precision"] is not None:
            failures += result["precision"] < settings.target_precision
    return {
        "resamples": resamples,
        "fitted": resamples - unfitted,
        "failures": failures,
        "failure_rate": failures / max(1, resamples - unfitted),
        "mean_coverage": float(np.mean(coverage)) if coverage else None,
        "not_fitted_because": why,
    }


def _with_seed(settings: FitSettings, seed: int) -> FitSettings:
    return msgspec.structs.replace(settings, seed=seed)


def cost(judges: list[Judge], task: Any, items: int, reps: int = 3) -> list[dict[str, float]]:
    """Milliseconds and prompt tokens per item of each model on the same test items, the
    models taking turns batch by batch; the median over ``reps`` rounds."""
    test, _ = load_split(task, "test", items)
    prompts = [task_prompt(task, item.text) for item in test]
    times: list[list[float]] = [[] for _ in judges]
    tokens = [0.0 for _ in judges]
    for j in judges:  # warm: the first pass of a model pays for its kernels' set-up
        j.judge(prompts[0], task.choices)
    for _ in range(reps):
        spent = [0.0 for _ in judges]
        for start in range(0, len(prompts), 8):
            batch = [{"prompt": p, "choices": task.choices} for p in prompts[start : start + 8]]
            for i, j in enumerate(judges):
                began = time.perf_counter()
                done = j.judge_batch(batch)
                spent[i] += time.perf_counter() - began
                tokens[i] = float(np.mean([d.prompt_tokens for d in done]))
        for i in range(len(judges)):
            times[i].append(spent[i] / len(prompts) * 1000)
    return [
        {"ms_per_item": float(np.median(t)), "prompt_tokens": tokens[i]}
        for i, t in enumerate(times)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--tasks", nargs="*", default=["sms_spam", "sst2"])
    parser.add_argument("--limit", type=int, help="first N items of each split (default: all)")
    parser.add_argument("--second", default="gemma3-270m", help="the second stage's model")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--target-precision", type=float, default=0.9)
    parser.add_argument("--delta", type=float, default=0.1)
    parser.add_argument(
        "--maps",
        default="auto",
        choices=["auto", "scalar"],
        help="calibration maps: auto (a probe on each model's hidden states where it wins by "
        "cross-validated NLL, the item's mean included) or the scalar maps only",
    )
    parser.add_argument("--resamples", type=int, default=100)
    parser.add_argument("--cost-items", type=int, default=32)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "judge" / "logits")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_cascade.json")
    parser.add_argument("--quick", action="store_true", help="sms_spam, 40 items, 5 resamples")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.tasks, args.limit, args.resamples, args.cost_items = ["sms_spam"], 40, 5, 8

    judges = [Judge.load(dtype=args.dtype), Judge.load(args.second, dtype=args.dtype)]
    names = ["smollm2", args.second]
    methods = SCALAR if args.maps == "scalar" else "auto"
    settings = FitSettings(
        target_precision=args.target_precision, delta=args.delta, methods=methods, n_bootstrap=50
    )
    # The layers a probe may read, per model (none for the scalar maps).
    layers = [candidate_layers(j.num_layers or 0) if args.maps == "auto" else () for j in judges]
    span: ProbeSpan | None = "item" if args.maps == "auto" else None
    rows = []
    for name in args.tasks:
        task = load_task(args.data / name)
        fits, tests = (
            [
                cached_scores(j, task, split, args.limit, args.cache, tuple(ls), span)[0]
                for j, ls in zip(judges, layers, strict=True)
            ]
            for split in ("calibration", "test")
        )
        costs = cost(judges, task, args.cost_items)
        ms = [c["ms_per_item"] for c in costs]
        row = {
            "task": name,
            "n_calibration": len(fits[0]),
            "n_test": len(tests[0]),
            "alone": {
                n: {**alone(j, task, f, t, settings), **c}
                for n, j, f, t, c in zip(names, judges, fits, tests, costs, strict=True)
            },
            "cascade": cascade(judges, names, task, fits, tests, settings, ms),
            "guarantee": guarantee(
                judges,
                names,
                task,
                [_joined(f, t) for f, t in zip(fits, tests, strict=True)],
                settings,
                args.resamples,
            ),
        }
        rows.append(row)
        print(f"  {name} done", file=sys.stderr)
    summary = {
        "models": [j.model_id for j in judges],
        "dtype": judges[0].dtype,
        "decoder_pass": [j.decoder_pass for j in judges],
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "python": platform.python_version(),
        "target_precision": args.target_precision,
        "delta": args.delta,
        "maps": args.maps,
        "limit": args.limit,
        "tasks": rows,
    }
    write_text(args.out, json.dumps(summary, indent=2) + "\n")
    print(markdown(summary))


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(summary: dict[str, Any]) -> str:
    target = summary["target_precision"]
    lines = [
        f"# Cascade: {' -> '.join(summary['models'])} ({summary['dtype']}; {summary['cpu']})",
        "",
        f"Target precision {target}, delta {summary['delta']} (the cascade's pair of thresholds "
        f"certified together at delta); maps: {summary['maps']}; items of each split: "
        f"{summary['limit'] or 'all'}.",
        "",
        "| task | judge | accuracy | mass | coverage | precision | decided by stage 1 / 2 / "
        "person | ms per item |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for row in summary["tasks"]:
        for name, a in row["alone"].items():
            lines.append(
                f"| {row['task']} | {name} alone | {_f(a['accuracy'])} | "
                f"{_f(a['choice_mass'])} | {_f(a['coverage'])} | {_f(a['precision'])} | - | "
                f"{a['ms_per_item']:.0f} |"
            )
        c = row["cascade"]
        if "error" in c:
            lines.append(f"| {row['task']} | cascade | not fitted: {c['error']} |||||| ")
            continue
        shares = " / ".join(f"{v:.2f}" for v in c["shares"].values())
        at = ", ".join("never" if t is None else f"{t:.2f}" for t in c["thresholds"])
        lines.append(
            f"| {row['task']} | cascade (at {at}) | - | - | {_f(c['coverage'])} "
            f"| {_f(c['precision'])} | {shares} | {c['ms_per_item']:.0f} |"
        )
    lines += ["", "| task | resamples fitted | precision below target | rate | mean coverage |"]
    lines.append("|---|---:|---:|---:|---:|")
    for row in summary["tasks"]:
        g = row["guarantee"]
        lines.append(
            f"| {row['task']} | {g['fitted']} of {g['resamples']} | {g['failures']} | "
            f"{g['failure_rate']:.3f} (delta {summary['delta']}) | {_f(g['mean_coverage'])} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
