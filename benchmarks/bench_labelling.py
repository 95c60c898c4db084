"""Which labels open the gate sooner: taught-by-choice plus uniform-to-certify, or uniform alone
(issue 57).

For each task, the pool is its calibration split and the first half of its test split (items a
person could be asked to label); the second half of the test split is never labelled and says
whether each certificate held. Every item is judged once (log-probabilities and the probe's
candidate layers, at the decision point and averaged over the item); then, for each seed and
each budget of labels (100, 150, ..., 600), two ways of spending it, with the same counts in
each role:

* **uniform**: every label from the audit stream (``calibration.monitoring.labelling.audit_order``, a
  uniform sample); the labels split 5:1:4 as a probe profile's are (``split_examples``): the
  map is fitted on half, the sequence's start chosen on a tenth, the threshold certified on
  the rest;
* **taught**: half the labels from the audit stream (drawn first; the teach stream never
  picks its items), which alone chooses the start (a fifth of it) and certifies (the rest);
  half from the teach stream (``teach_order``: the smallest
  margins under the map fitted so far, spread over the item means of the middle candidate
  layer), which alone fits the map. The teach stream picks 25 at a time, refitting between;
  its first 50 are picked under the pass's own probabilities.

The map is ``judge calibrate``'s auto choice among temperature, bias and temperature, and the
probe (``fit_calibrator``); the certificate is the profile's (``sequence_start`` on the start
items, ``select_threshold`` on the certify items, precision 0.9 at delta 0.1). Reported per
budget: how often a threshold was certified, the certified coverage, and on the unlabelled
half of the test split the coverage and precision at that threshold; and per seed the labels
each way needed to certify coverage >= 0.5 at precision 0.9.

    python benchmarks/bench_labelling.py [--tasks sst2 ag_news] [--seeds 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import cpu_flags, cpu_model

from calibration.certificates.certify import select_threshold, sequence_start
from calibration.fitting import split_examples
from calibration.maps.probe import candidate_layers, map_features
from calibration.maps.scaling import ProbeInputs, fit_calibrator
from calibration.monitoring.labelling import audit_order, teach_order
from calibration.tasks import LabeledScores, judge_task_items, load_split, load_task
from judge import Judge
from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
TARGET, DELTA = 0.9, 0.1
COVERAGE = 0.5  # the coverage a certificate must reach to count as "the gate open"
ROUND = 25  # teach picks between refits
METHODS = ("temperature", "bias_temperature", "probe")


class Pool:
    """One task's judged items: the pool to label and the held-out evaluation half."""

    def __init__(self, scores: LabeledScores, n_pool: int, num_layers: int) -> None:
        self.scores = scores
        self.pool = np.arange(n_pool)
        self.evaluation = np.arange(n_pool, len(scores))
        self.num_layers = num_layers
        layers = scores.feature_layers
        assert scores.span_features is not None
        # What spreads the teach picks: the item means of the middle candidate layer.
        self.spread = scores.span_features[:, len(layers) // 2, :]

    def fit(self, index: np.ndarray, seed: int) -> Any:
        s = self.scores
        assert s.features is not None and s.span_features is not None
        return fit_calibrator(
            s.log_probabilities[index],
            s.labels[index],
            methods=METHODS,
            random_state=seed,
            probe=ProbeInputs(
                s.features, s.feature_layers, self.num_layers, s.span_features, "item"
            ).rows(index),
        )

    def probabilities(self, fitted: Any, index: np.ndarray) -> np.ndarray:
        s = self.scores
        assert s.features is not None and s.span_features is not None
        x = map_features(fitted.map, s.features[index], s.feature_layers, s.span_features[index])
        return np.asarray(fitted.map.apply(s.log_probabilities[index], x))

    def certify(
        self, fitted: Any, start_idx: np.ndarray, certify_idx: np.ndarray
    ) -> dict[str, Any]:
        """The certificate on ``certify_idx`` (started on ``start_idx``) and what it does on
        the evaluation half."""
        y = self.scores.labels

        def answers(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            p = self.probabilities(fitted, index)
            return p.max(axis=1), p.argmax(axis=1) == y[index]

        c_start, r_start = answers(start_idx)
        c_cert, r_cert = answers(certify_idx)
        start = sequence_start(
            c_start, certify_idx.shape[0], target_precision=TARGET, delta=DELTA, correct=r_start
        )
        t = select_threshold(c_cert, r_cert, target_precision=TARGET, delta=DELTA, start=start)
        out: dict[str, Any] = {
            "method": fitted.method,
            "certified": t.threshold is not None,
            "threshold": t.threshold,
            "certified_coverage": t.coverage if t.threshold is not None else 0.0,
        }
        c_eval, r_eval = answers(self.evaluation)
        accepted = c_eval >= (t.threshold if t.threshold is not None else np.inf)
        out["eval_accuracy"] = float(r_eval.mean())
        out["eval_coverage"] = float(accepted.mean())
        out["eval_precision"] = float(r_eval[accepted].mean()) if accepted.any() else None
        return out


def uniform_run(pool: Pool, budgets: list[int], seed: int) -> list[dict[str, Any]]:
    audit = pool.pool[audit_order(pool.pool.shape[0], seed)]
    rows = []
    for b in budgets:
        labelled = audit[:b]
        fit_i, conformal_i, certify_i = split_examples(pool.scores.labels[labelled], seed, True)
        fitted = pool.fit(labelled[fit_i], seed)
        rows.append(
            {"budget": b, **pool.certify(fitted, labelled[conformal_i], labelled[certify_i])}
        )
    return rows


def taught_run(pool: Pool, budgets: list[int], seed: int) -> list[dict[str, Any]]:
    audit = pool.pool[audit_order(pool.pool.shape[0], seed)]
    y = pool.scores.labels
    taught: list[int] = []
    fitted = None
    rows = []
    # The audit stream is drawn first and kept apart: the teach stream never picks an item it
    # holds (else the audit sample, without the hard items taught, would not be uniform).
    reserved = audit[: budgets[-1] // 2]
    teachable = np.setdiff1d(pool.pool, reserved)
    for b in budgets:
        # The audit stream's half: the first b/2 of its order, a fifth choosing the start,
        # the rest certifying.
        audited = audit[: b // 2]
        while len(taught) < b - b // 2:
            unlabelled = np.setdiff1d(teachable, np.asarray(taught, dtype=int))
            if fitted is None:  # nothing fitted yet: the pass's own probabilities
                z = pool.scores.log_probabilities[unlabelled]
                p = np.exp(z - z.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
            else:
                p = pool.probabilities(fitted, unlabelled)
            take = min(ROUND, b - b // 2 - len(taught))
            picks = teach_order(p, take, features=pool.spread[unlabelled])
            taught.extend(unlabelled[picks].tolist())
            if len(set(y[taught])) > 1 and len(taught) >= 20:
                fitted = pool.fit(np.asarray(taught), seed)
        fit_index = np.asarray(taught)
        fitted = pool.fit(fit_index, seed)
        # The audit half splits 1:4 (start : certify) as the probe split's last two parts do.
        order = np.random.default_rng(seed).permutation(audited.shape[0])
        n_start = audited.shape[0] // 5
        start_i, certify_i = audited[order[:n_start]], audited[order[n_start:]]
        rows.append({"budget": b, **pool.certify(fitted, start_i, certify_i)})
    return rows


def needed(rows: list[dict[str, Any]]) -> int | None:
    """The smallest budget whose certificate covers at least ``COVERAGE``."""
    return next(
        (r["budget"] for r in rows if r["certified"] and r["certified_coverage"] >= COVERAGE),
        None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["sst2", "ag_news"])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--max-labels", type=int, default=600)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 seed, small pool")
    parser.add_argument("--out", type=Path, help="where the JSON goes (default: results/)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    judge = Judge.load()
    num_layers = judge.num_layers or 0
    layers = candidate_layers(num_layers)
    budgets = list(range(100, args.max_labels + 1, 50))
    cal_limit, test_limit = 500, 1000
    if args.quick:
        args.seeds, budgets, cal_limit, test_limit = 1, [100, 150], 120, 120
    out_path = args.out or RESULTS / (
        "bench_labelling_quick.json" if args.quick else "bench_labelling.json"
    )
    report: dict[str, Any] = {
        "cpu": cpu_model(),
        "flags_avx512f": "avx512f" in cpu_flags(),
        "target_precision": TARGET,
        "delta": DELTA,
        "coverage": COVERAGE,
        "tasks": {},
    }
    for name in args.tasks:
        task = load_task(DATA / name)
        calibration, _ = load_split(task, "calibration", cal_limit)
        test, _ = load_split(task, "test", test_limit)
        half = len(test) // 2
        items = calibration + test
        start = time.perf_counter()
        scores = judge_task_items(judge, task, items, feature_layers=layers, span_layers=layers)
        judged = time.perf_counter() - start
        pool = Pool(scores, len(calibration) + half, num_layers)
        runs: dict[str, Any] = {"pool": int(pool.pool.shape[0]), "evaluation": len(test) - half}
        runs["judge_seconds"] = judged
        for seed in range(args.seeds):
            for strategy, run in (("uniform", uniform_run), ("taught", taught_run)):
                rows = run(pool, budgets, seed)
                runs.setdefault(strategy, []).append({"seed": seed, "rows": rows})
                print(name, seed, strategy, needed(rows), flush=True)
        report["tasks"][name] = runs
        write_text(out_path, json.dumps(report, indent=2))
    print(f"\n{cpu_model()}; avx512f: {'avx512f' in cpu_flags()}")
    print(
        f"Labels needed to certify coverage >= {COVERAGE} at precision {TARGET} (delta "
        f"{DELTA}), per seed; '-' none within {budgets[-1]}; and whether every certificate "
        "held on the unlabelled half of the test split"
    )
    print("| task | uniform | taught + uniform | certificates held (uniform, taught) |")
    print("|---|---|---|---|")
    for name, runs in report["tasks"].items():
        cells, held = [], []
        for strategy in ("uniform", "taught"):
            got = [needed(r["rows"]) for r in runs[strategy]]
            cells.append(", ".join("-" if g is None else str(g) for g in got))
            rows = [row for r in runs[strategy] for row in r["rows"] if row["certified"]]
            ok = sum(
                row["eval_precision"] is None or row["eval_precision"] >= TARGET for row in rows
            )
            held.append(f"{ok}/{len(rows)}")
        print(f"| {name} | {cells[0]} | {cells[1]} | {held[0]}, {held[1]} |")


if __name__ == "__main__":
    main()
