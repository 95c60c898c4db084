"""Pairwise judging: one order against both, and the position-consistency gate.

Two position-balanced pairwise tasks are derived from shared data (``derive_pairs``): each
item is a pair question (``judge.answers.PairQuestion``) whose candidates are named "first"
and "second" in the order given, and the correct one is given first in every other item:

    sst2            "Which review is more positive?": a positive and a negative test sentence
                    (the i-th of each), state "Two sentences from movie reviews."
    commonsense_qa  "Which answer is right?": the correct option against one distractor (drawn
                    with a fixed seed), state "Question: <question>"

Each item is asked with ``order="given"`` (one order: the model reads the candidates once) and
``order="invariant"`` (both orders, one run, the probabilities averaged over them), side by
side; the contenders take turns item by item, and the prefix cache is off, so both are computed
cold and their costs compare. Reported per task and contender, on the test split:

* accuracy (the more probable candidate is the correct one) and ECE;
* position bias: the share of items where the candidate in the first place wins, per order
  read (0.5 is none; an order's is the same in both contenders' runs);
* for both orders, position consistency: the share of items whose two orders pick the same
  winner, and the accuracy on those (the classic position-consistency measure);
* coverage and accuracy of the accepted at the threshold 0.9 (``calibration.Policy.checks``),
  on the raw probabilities and after a temperature fitted on pairs derived the same way from
  the calibration split; for both orders also under the position-consistency gate at bounds
  ``--bounds`` (``max_order_spread``; ``position_inconsistent``);
* the cost: ms and tokens fed per item, and both orders' as a multiple of one order's.

    python benchmarks/bench_pairwise.py [--limit 300] [--dtype auto] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
from benchlib import decided, judge_machine

from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"

Order = Literal["given", "invariant"]
ORDERS: tuple[Order, ...] = ("given", "invariant")
NAMES = ("first", "second")
THRESHOLD = 0.9
TASKS = {
    "sst2": ("Two sentences from movie reviews.", "Which review is more positive?"),
    "commonsense_qa": (None, "Which answer is right?"),
}


def derive_pairs(task: str, rows: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` position-balanced pair items of ``task``: {state, candidates, label}.

    The correct candidate is "first" in even items and "second" in odd ones, so a judge that
    always picks one place is at 0.5.
    """
    state, _ = TASKS[task]
    pairs: list[tuple[str, str, str]] = []  # (state, correct, other)
    if task == "sst2":
        positive = [r["text"] for r in rows if r["label"] == "positive"]
        negative = [r["text"] for r in rows if r["label"] == "negative"]
        pairs = [(str(state), p, n) for p, n in zip(positive, negative, strict=False)]
    else:
        draw = random.Random(20261203)
        for r in rows:
            options = dict(r["options"])
            correct = options.pop(r["label"])
            distractors = sorted(set(options.values()) - {correct})
            if distractors:
                pairs.append((f"Question: {r['question']}", correct, draw.choice(distractors)))
    items = []
    for i, (item_state, correct, other) in enumerate(pairs[:limit]):
        texts = (correct, other) if i % 2 == 0 else (other, correct)
        items.append(
            {
                "state": item_state,
                "candidates": dict(zip(NAMES, texts, strict=True)),
                "label": i % 2,  # index of the correct candidate in NAMES
            }
        )
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--limit", type=int, default=300, help="pairs per split (default 300)")
    parser.add_argument("--bounds", default="0.1,0.2", help="spread bounds to report")
    parser.add_argument("--model", help="a model id, directory, GGUF file or packaged name")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, help="torch threads (default: one per core)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 12 pairs")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_pairwise.json")
    args = parser.parse_args()

    import torch

    from judge import Judge

    if args.threads:
        torch.set_num_threads(args.threads)
    limit = 12 if args.quick else args.limit
    bounds = [float(b) for b in args.bounds.split(",")]
    # Off: an item computed twice (once per contender) must not read the first one's state.
    judge = Judge.load(args.model, dtype=args.dtype, prefix_cache_mb=0)
    machine = judge_machine(judge)
    print(f"# {machine}", flush=True)
    begin = time.perf_counter()
    tasks = []
    for task in TASKS:
        splits = {
            split: derive_pairs(task, _rows(args.data / task / f"{split}.jsonl"), limit)
            for split in ("calibration", "test")
        }
        runs = {split: _judge_all(judge, task, items) for split, items in splits.items()}
        tasks.append(_report(task, splits, runs, bounds))
    result = {
        "machine": machine,
        "quick": args.quick,
        "config": {
            "limit": limit,
            "threshold": THRESHOLD,
            "bounds": bounds,
            "instructions": {t: v[1] for t, v in TASKS.items()},
            "prefix_cache": "off",
        },
        "tasks": tasks,
        "elapsed_s": round(time.perf_counter() - begin, 1),
    }
    write_text(args.out, json.dumps(result, indent=2) + "\n")
    print(markdown(result))


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _judge_all(judge: Any, task: str, items: list[dict[str, Any]]) -> dict[Order, dict[str, Any]]:
    """Each item under both contenders, taking turns: per contender the answers' log-probs
    (n, 2) by candidate, choice mass and spread, each order's P("A") (n, orders), the
    seconds and tokens fed per item."""
    from judge.answers import PairQuestion

    _, instructions = TASKS[task]

    def ask(item: dict[str, Any], order: Order) -> tuple[Any, list[float], float, int]:
        question = PairQuestion(
            instructions=instructions, candidates=item["candidates"], order=order
        )
        answers, judgments, seconds, fed = decided(judge, item["state"], {"pair": question})
        return answers["pair"], [j.probs[0] for j in judgments], seconds, fed

    for item in items[:2]:  # warm-up: first-call costs are not the item's
        for order in ORDERS:
            ask(item, order)
    out: dict[Order, dict[str, Any]] = {
        o: {"log_probs": [], "mass": [], "spread": [], "first_place": [], "s": [], "tokens": []}
        for o in ORDERS
    }
    for k, item in enumerate(items):
        for order in ORDERS[k % 2 :] + ORDERS[: k % 2]:
            answer, first_place, seconds, fed = ask(item, order)
            run = out[order]
            run["log_probs"].append(answer.judgment.log_probs)
            run["mass"].append(answer.judgment.choice_mass)
            run["spread"].append(answer.order_spread)
            run["first_place"].append(first_place)
            run["s"].append(seconds)
            run["tokens"].append(fed)
        if (k + 1) % 100 == 0:
            print(f"# {task}: {k + 1}/{len(items)}", file=sys.stderr, flush=True)
    return out


def _report(
    task: str,
    splits: dict[str, list[dict[str, Any]]],
    runs: dict[str, dict[Order, dict[str, Any]]],
    bounds: list[float],
) -> dict[str, Any]:
    from calibration.maps.scaling import TemperatureScaler
    from calibration.metrics import accuracy, ece
    from calibration.policy import make_policy

    y = np.array([item["label"] for item in splits["test"]])
    y_cal = np.array([item["label"] for item in splits["calibration"]])
    test, cal = runs["test"], runs["calibration"]
    rows = []
    for order in ORDERS:
        z = np.array(test[order]["log_probs"])
        scaler = TemperatureScaler().fit(np.array(cal[order]["log_probs"]), y_cal)
        calibrated = np.log(np.clip(scaler.predict_proba(z), 1e-300, None))
        spread = np.array(test[order]["spread"])
        mass = np.array(test[order]["mass"])
        first_place = np.array(test[order]["first_place"])  # (n, orders): P("A")
        consistent = accuracy_consistent = None
        if order == "invariant":
            # The candidate each order picks: "A" is the first-named in the given order, the
            # second-named in the swapped one.
            picks = np.stack([first_place[:, 0] <= 0.5, first_place[:, 1] > 0.5], axis=1)
            agree = picks[:, 0] == picks[:, 1]
            consistent = float(agree.mean())
            if agree.any():
                accuracy_consistent = float((picks[agree, 0] == y[agree]).mean())
        gates = [None] if order == "given" else [None, *bounds]
        for bound in gates:
            policy = make_policy(None, uncertified_threshold=THRESHOLD, max_order_spread=bound)
            row: dict[str, Any] = {
                "orders": "one" if order == "given" else "both",
                "bound": bound,
                "accuracy": accuracy(np.exp(z), y),
                "ece": ece(np.exp(z), y),
                "ece_calibrated": ece(np.exp(calibrated), y),
                "temperature": float(scaler.temperature_),
                # Per order read: how often the candidate in the first place won.
                "first_place_wins": [float(v) for v in (first_place > 0.5).mean(axis=0)],
                "spread_mean": float(spread.mean()),
                "consistent": consistent,
                "accuracy_consistent": accuracy_consistent,
                "ms_per_item": 1000 * float(np.mean(test[order]["s"])),
                "tokens_per_item": float(np.mean(test[order]["tokens"])),
            }
            # Without a bound of its own a pair is bounded by the default: the row without the
            # gate passes no spread at all.
            for name, scores in (("raw", z), ("calibrated", calibrated)):
                g = policy.checks(
                    list(NAMES), scores, mass, None, None if bound is None else spread, pair=True
                )
                accepted = g.accepted
                row[f"coverage_{name}"] = float(accepted.mean())
                row[f"precision_{name}"] = (
                    float((g.best[accepted] == y[accepted]).mean()) if accepted.any() else None
                )
            rows.append(row)
    one = next(r for r in rows if r["orders"] == "one")
    for r in rows:
        r["ms_ratio"] = r["ms_per_item"] / one["ms_per_item"]
        r["tokens_ratio"] = r["tokens_per_item"] / one["tokens_per_item"]
    return {"task": task, "n": len(y), "n_calibration": len(y_cal), "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"{m['model']} ({m['dtype']}), {m['cpu']} [{' '.join(m['cpu_flags'])}], "
        f"{m['torch_threads']} torch threads, prefix cache off; accepted at "
        f"{result['config']['threshold']}, raw / after a temperature fitted on calibration pairs",
        "",
        "| task | orders | spread bound | accuracy | ECE raw / cal | first place wins "
        "| consistent | accuracy if consistent | coverage raw | precision raw | coverage cal "
        "| precision cal | ms/item | x ms | x tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    for t in result["tasks"]:
        for r in t["rows"]:
            wins = " / ".join(f"{v:.2f}" for v in r["first_place_wins"])
            lines.append(
                f"| {t['task']} (n={t['n']}) | {r['orders']} "
                f"| {'none' if r['bound'] is None else r['bound']} | {r['accuracy']:.3f} "
                f"| {r['ece']:.3f} / {r['ece_calibrated']:.3f} | {wins} "
                f"| {num(r['consistent'])} | {num(r['accuracy_consistent'])} "
                f"| {num(r['coverage_raw'])} | {num(r['precision_raw'])} "
                f"| {num(r['coverage_calibrated'])} | {num(r['precision_calibrated'])} "
                f"| {r['ms_per_item']:.0f} | {r['ms_ratio']:.2f} | {r['tokens_ratio']:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
