"""Label shift on shared sets, default model (issue 58): a planted change of the class mix is
detected by the sequential mix test, the probabilities corrected to the estimated live prior
are better calibrated, and after detection nothing is accepted under the stale certificate.

For each task: a profile fitted as ``judge calibrate`` fits it (auto: temperature, bias or
probe; precision 0.9, delta 0.1) on the calibration split, judged by the default model; the
test split judged once. Each stream is drawn from the test split: ``BEFORE`` decisions at the
test split's own mix, then ``AFTER`` at a planted one (items drawn with replacement, per
class). Two plantings per task:

    prior    the first choice's share raised (sst2, ag_news) or spam's (sms_spam): the test
             split resampled, as the issue asks
    second   the other way: the last choice's share raised to 0.7 (sst2, ag_news), or ham
             and spam trade shares (sms_spam: spam 88%)

and one stream with no change (the false-alarm check). Per stream: the live decision at which
``mix_shift`` (alpha 0.01, checked after every decision by construction) first fires, the
live prior EM estimates from the ``AFTER`` decisions up to detection (at least 200), the ECE
of the post-change probabilities uncorrected and corrected to that estimate, and what the
certified threshold would have accepted after detection without the hold (its count and
precision: the stale certificate's promise under the new mix) against the held gate's 0.
``SEEDS`` streams per planting.

    python benchmarks/bench_label_shift.py [--tasks sst2 ag_news sms_spam] [--seeds 20]

Judging takes minutes on 2 cores (run it alone); the rest is arithmetic.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import cpu_flags, cpu_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from calibration import FitSettings, Provenance
from calibration.gate import Gate
from calibration.maps.probe import candidate_layers, map_features
from calibration.metrics import ece
from calibration.monitoring.label_shift import correct, mix_shift, prior_estimate, source_prior
from calibration.policy import Hold
from calibration.tasks import LabeledScores, fit_labeled, judge_task_items, load_split, load_task
from judge import Judge

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results" / "bench_label_shift.json"
BEFORE, AFTER, ALPHA = 300, 1500, 0.01


def planted(task: str, base: np.ndarray, how: str) -> np.ndarray:
    """The planted mix after the change, from the test split's ``base`` mix."""
    k = base.shape[0]
    if how == "none":
        return base
    if how == "second" and task == "sms_spam":
        return base[::-1].copy()
    if how == "second":
        target, j = 0.7, k - 1
    else:
        target = {"sst2": 0.85, "sms_spam": 0.5}.get(task, 0.55)
        j = 1 if task == "sms_spam" else 0  # sms_spam: spam (the minority) grows
    rest = np.delete(base, j)
    moved = np.insert(rest / rest.sum() * (1 - target), j, target)
    assert moved.shape == (k,)
    return moved


def stream(
    rng: np.random.Generator, y: np.ndarray, before: np.ndarray, after: np.ndarray
) -> np.ndarray:
    """Item indices: BEFORE drawn at mix ``before``, then AFTER at ``after``, per class."""
    by_class = [np.flatnonzero(y == c) for c in range(before.shape[0])]

    def draw(mix: np.ndarray, n: int) -> np.ndarray:
        classes = rng.choice(mix.shape[0], size=n, p=mix)
        return np.array([rng.choice(by_class[c]) for c in classes])

    return np.concatenate([draw(before, BEFORE), draw(after, AFTER)])


def run_task(judge: Judge, name: str, seeds: int) -> dict[str, Any]:
    task = load_task(DATA / name)
    calibration, digest = load_split(task, "calibration")
    test, _ = load_split(task, "test")
    layers = candidate_layers(judge.fingerprint().num_layers or 1)
    fit = judge_task_items(judge, task, calibration, feature_layers=layers, span_layers=layers)
    provenance = Provenance(
        fingerprint=judge.fingerprint(), dataset=f"{name}/calibration", dataset_sha256=digest
    )
    settings = FitSettings(target_precision=0.9, delta=0.1)
    profile = fit_labeled(name, fit, task.choices, provenance, settings).profile
    scores: LabeledScores = judge_task_items(
        judge, task, test, feature_layers=layers, span_layers=layers
    )
    x = map_features(
        profile.calibration_map, scores.features, scores.feature_layers, scores.span_features
    )
    p = np.asarray(profile.calibration_map.apply(scores.log_probabilities, x))
    y = scores.labels
    assert profile.reference is not None
    source = source_prior(profile.reference)
    assert source is not None
    gate = Gate(profile)
    accepted = gate.policy.checks(
        task.choices, scores.log_probabilities, scores.choice_mass, x
    ).accepted
    held = (
        Gate(profile, hold=Hold(reason="shifted"))
        .policy.checks(task.choices, scores.log_probabilities, scores.choice_mass, x)
        .accepted
    )
    base = np.bincount(y, minlength=len(task.choices)) / y.shape[0]
    out: dict[str, Any] = {
        "method": profile.calibration_map.method,
        "threshold": profile.threshold.threshold,
        "source_prior": [float(v) for v in source],
        "test_mix": [float(v) for v in base],
        "plantings": {},
    }
    for how in ("none", "prior", "second"):
        mix = planted(name, base, how)
        rows = []
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            idx = stream(rng, y, base, mix)
            found = mix_shift(profile.reference, p[idx].argmax(axis=1), alpha=ALPHA)
            row: dict[str, Any] = {"detected_at": found.detected_at}
            if how != "none" and found.detected_at is not None:
                seen = idx[BEFORE : max(found.detected_at, BEFORE + 200)]
                estimate = prior_estimate(
                    task.choices, p[seen], source, source_n=profile.reference.n, alpha=0.05
                )
                later = idx[max(found.detected_at, BEFORE) :]
                moved = correct(p[later], source, estimate.estimate)
                row.update(
                    estimate=estimate.estimate,
                    ece_uncorrected=ece(p[later], y[later]),
                    ece_corrected=ece(moved, y[later]),
                    accepted_unheld=int(accepted[later].sum()),
                    precision_unheld=float(
                        (p[later].argmax(axis=1) == y[later])[accepted[later]].mean()
                    )
                    if accepted[later].any()
                    else None,
                    accepted_held=int(held[later].sum()),
                )
            rows.append(row)
        out["plantings"][how] = {"mix": [float(v) for v in mix], "streams": rows}
    return out


def summary(name: str, result: dict[str, Any]) -> list[str]:
    lines = []
    for how, planting in result["plantings"].items():
        rows = planting["streams"]
        found = [r["detected_at"] for r in rows if r["detected_at"] is not None]
        if how == "none":
            lines.append(f"| {name} | none | false alarms {len(found)}/{len(rows)} | | | |")
            continue
        delays = [d - BEFORE for d in found]
        eces = [(r["ece_uncorrected"], r["ece_corrected"]) for r in rows if "ece_corrected" in r]
        unheld = [r["precision_unheld"] for r in rows if r.get("precision_unheld") is not None]
        lines.append(
            f"| {name} | {how} {np.round(planting['mix'], 2).tolist()} | detected {len(found)}/"
            f"{len(rows)}, median delay {np.median(delays) if delays else float('nan'):.0f} | "
            f"ECE {np.mean([e[0] for e in eces]):.3f} -> {np.mean([e[1] for e in eces]):.3f} | "
            f"unheld precision {np.mean(unheld) if unheld else float('nan'):.3f} on "
            f"{np.mean([r['accepted_unheld'] for r in rows if 'accepted_unheld' in r]):.0f} accepted | "
            f"held accepted {sum(r.get('accepted_held', 0) for r in rows)} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["sst2", "ag_news", "sms_spam"])
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    judge = Judge.load()
    results = {name: run_task(judge, name, args.seeds) for name in args.tasks}
    print(
        f"{cpu_model()}; {judge.dtype}; {BEFORE} decisions at the test mix, then {AFTER} at the planted one"
    )
    print("| task | planting | detection | ECE after the change | without the hold | with it |")
    print("|---|---|---|---|---|---|")
    for name, result in results.items():
        for line in summary(name, result):
            print(line)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps({"cpu": cpu_model(), "flags": cpu_flags(), "results": results}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
