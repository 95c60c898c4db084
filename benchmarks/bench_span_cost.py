"""What the item's mean costs a judgment: the same pass, with and without the hidden states.

A probe may read the decision point's hidden state (``Query.feature_layers``), the mean over
the item's own tokens (``Query.span_layers`` over ``Query.item_span``), or both. The mean
needs no second pass, but it reads the hidden states of every token of the item, so the
prefix cache may serve only the tokens before the item. This script times, side by side and
one item at a time (what a request sees), the plain judgment against each way of reading the
hidden states, with the prefix cache off and on (on: the task's instruction is cached, as
under traffic of new items), on shared tasks' test items: round by round, each round new
items, the same for every contender. "prompt mean" averages over
the whole prompt (no item marked): the cache can then serve none of the user's message.

    python benchmarks/bench_span_cost.py [--tasks sst2 ag_news] [--items 16] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from benchlib import cpu_flags, cpu_model

from calibration.maps.probe import candidate_layers
from calibration.tasks import load_split, load_task, task_item_span, task_prompt
from judge import Judge, Query
from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_calibration import DATA  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def contenders(layers: tuple[int, ...], probe_layer: int) -> dict[str, dict[str, Any]]:
    """What each judgment asks for besides the probabilities."""
    return {
        "plain": {},
        "point, 1 layer (a probe)": {"feature_layers": (probe_layer,)},
        "item mean, 1 layer (a probe)": {"span_layers": (probe_layer,)},
        "prompt mean, 1 layer (a probe)": {"span_layers": (probe_layer,), "item_span": None},
        "point + item mean, 1 layer": {
            "feature_layers": (probe_layer,),
            "span_layers": (probe_layer,),
        },
        f"point + item mean, {len(layers)} layers (calibrate)": {
            "feature_layers": layers,
            "span_layers": layers,
        },
    }


def run_task(judge: Judge, name: str, n: int, reps: int) -> list[dict[str, object]]:
    """Per prefix cache setting and contender, the median time per item over ``reps`` rounds.

    Each round judges ``n`` new test items, the same for every contender, one at a time; with
    the cache on, each contender has a cache of its own, so what it serves is what traffic of
    new items would find there: the instruction, never the item (a repeated item would be
    served whole to a plain judgment, and only up to its item to one that reads the mean)."""
    task = load_task(DATA / name)
    items, _ = load_split(task, "test", n * (reps + 1))
    layers = candidate_layers(judge.num_layers or 0)
    asked = contenders(layers, layers[len(layers) // 2])
    rows: list[dict[str, object]] = []
    for cache in ("off", "on"):
        engines = {
            label: Judge(
                judge.model,
                judge.tokenizer,
                model_id=judge.model_id,
                prefix_cache_mb=256 if cache == "on" else 0,
            )
            for label in asked
        }
        times: dict[str, list[float]] = {label: [] for label in asked}
        for rep in range(reps + 1):  # the first round warms up (and fills each cache)
            batch = items[rep * n : (rep + 1) * n]
            for label, asks in asked.items():
                queries = [
                    Query(
                        prompt=task_prompt(task, item.text),
                        choices=task.choices,
                        **{"item_span": task_item_span(task, item.text), **asks},
                    )
                    for item in batch
                ]
                start = time.perf_counter()
                for q in queries:
                    engines[label].judge_batch([q])
                if rep:
                    times[label].append((time.perf_counter() - start) * 1000 / len(batch))
        plain = statistics.median(times["plain"])
        for label, ms in times.items():
            median = statistics.median(ms)
            rows.append(
                {
                    "task": name,
                    "cache": cache,
                    "reads": label,
                    "ms_per_item": median,
                    "ratio": median / plain,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="*", default=["sst2", "ag_news"])
    parser.add_argument("--items", type=int, default=12)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_span_cost.json")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="sst2, 2 items, 1 rep")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.items, args.reps = ["sst2"], 2, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    judge = Judge.load(dtype=args.dtype, prefix_cache_mb=0)
    rows = [r for name in args.tasks for r in run_task(judge, name, args.items, args.reps)]
    print(f"{cpu_model()}, {judge.dtype}; flags: {' '.join(cpu_flags())}")
    print("| task | prefix cache | reads | ms per item | x plain |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['task']} | {r['cache']} | {r['reads']} | {r['ms_per_item']:.1f} "
            f"| {r['ratio']:.3f} |"
        )
    out = {"cpu": cpu_model(), "flags": cpu_flags(), "dtype": judge.dtype, "rows": rows}
    write_text(args.out, json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
