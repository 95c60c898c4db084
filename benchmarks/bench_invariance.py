"""Same item, same probabilities: what batch-invariant arithmetic buys and what it costs.

On the default model, for each dtype, with the batch-invariant arithmetic (the default) and
without it (``batch_invariant=False``, ``judge serve --batch-variant``), side by side in one
run on the same items (../shared/data: sst2, commonsense_qa and rte test items):

* reproducibility: each item judged alone (cache off) is the reference; it is judged again in
  batches of 2, 4 and 16 beside other items at a random slot, on a cold and on a warm prefix
  cache, and as one of four questions sharing a context (``judge_shared``, against that
  question judged alone). Reports the largest probability difference, how many judgments are
  bitwise identical, and the accept/escalate flips at thresholds 0.5 to 0.95 (the top
  probability on either side of the threshold).
* cost: milliseconds per item judged alone, and per item in batches of 16, alternating the
  two arithmetics rep by rep; the ratio invariant / variant is the median of rep-by-rep
  ratios. ``--service`` adds ``judge serve`` throughput at concurrency 16, both ways.

Prints the tables and writes ``benchmarks/results/bench_invariance.json``.

    python benchmarks/bench_invariance.py [--items 24] [--reps 5] [--dtypes float32,bfloat16]
                                          [--service] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from benchlib import cpu_model

from calibration.tasks import load_split, load_task, task_prompt
from judge import Judge, Judgment, Query
from judge.atomicio import write_text
from judge.engine import shared_query

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT.parent / "shared" / "data"
THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
BATCHES = (2, 4, 16)
CONTEXT = "Read the item below carefully, then answer the question about it."


def items(count: int) -> list[Query]:
    """Half sst2 (short, 2 choices), a quarter commonsense_qa (5), a quarter rte (long)."""
    shares = {"sst2": count - 2 * (count // 4), "commonsense_qa": count // 4, "rte": count // 4}
    queries = []
    for name, n in shares.items():
        task = load_task(DATA / name)
        for item in load_split(task, "test", limit=n)[0]:
            queries.append(Query(prompt=task_prompt(task, item.text), choices=list(task.choices)))
    return queries


def gap(a: Judgment, b: Judgment) -> float:
    return max(abs(x - y) for x, y in zip(a.probs, b.probs, strict=True))


def flips(a: Judgment, b: Judgment) -> int:
    """Thresholds at which one would accept and the other escalate."""
    return sum((a.confidence >= t) != (b.confidence >= t) for t in THRESHOLDS)


def reproducibility(
    plain: Judge, cached: Judge, queries: list[Query], batches: tuple[int, ...] = BATCHES
) -> dict[str, Any]:
    rng = random.Random(0)
    lone = [plain.judge_batch([q])[0] for q in queries]
    pairs: dict[str, list[tuple[Judgment, Judgment]]] = {}
    for size in batches:
        for i, q in enumerate(queries):
            # Other items (with repeats when there are fewer than the batch needs).
            others = rng.choices([p for k, p in enumerate(queries) if k != i], k=size - 1)
            slot = rng.randrange(size)
            got = plain.judge_batch([*others[:slot], q, *others[slot:]])[slot]
            pairs.setdefault(f"batch of {size}", []).append((got, lone[i]))
    assert cached.prefix_cache is not None
    for i, q in enumerate(queries):
        cached.prefix_cache.clear()
        pairs.setdefault("cold cache", []).append((cached.judge_batch([q])[0], lone[i]))
        warm = cached.judge_batch([q])[0]
        assert warm.cached_tokens > 0
        pairs.setdefault("warm cache", []).append((warm, lone[i]))
    for start in range(0, len(queries), 4):
        group = queries[start : start + 4]
        shared = plain.judge_shared(CONTEXT, group)
        for q, j in zip(group, shared, strict=True):
            alone = plain.judge_batch([shared_query(CONTEXT, q)])[0]
            pairs.setdefault("shared context", []).append((j, alone))
    return {
        how: {
            "judgments": len(ps),
            "max_diff": max(gap(a, b) for a, b in ps),
            "bitwise": sum(a.probs == b.probs for a, b in ps),
            "flips": sum(flips(a, b) for a, b in ps),
        }
        for how, ps in pairs.items()
    }


def cost(
    judges: dict[str, Judge], queries: list[Query], reps: int, size: int = 16
) -> dict[str, Any]:
    """Median ms per item, alone and in a batch of ``size``, each rep timing both
    arithmetics."""
    batch = [queries[i % len(queries)] for i in range(size)]
    alone = queries[:8]
    work: dict[str, Callable[[Judge], object]] = {
        "alone": lambda j: [j.judge_batch([q]) for q in alone],
        f"batch of {size}": lambda j: j.judge_batch(batch),
    }
    per_item = {"alone": len(alone), f"batch of {size}": size}
    out: dict[str, Any] = {}
    for name, run in work.items():
        for j in judges.values():
            run(j)  # warm-up
        ms: dict[str, list[float]] = {mode: [] for mode in judges}
        for rep in range(reps):
            order = list(judges) if rep % 2 == 0 else list(reversed(judges))
            for mode in order:
                start = time.perf_counter()
                run(judges[mode])
                ms[mode].append((time.perf_counter() - start) * 1000 / per_item[name])
        ratios = [a / b for a, b in zip(ms["invariant"], ms["variant"], strict=True)]
        out[name] = {
            "invariant_ms": statistics.median(ms["invariant"]),
            "variant_ms": statistics.median(ms["variant"]),
            "ratio": statistics.median(ratios),
        }
    return out


def service_throughput(dtype: str, requests: int) -> dict[str, float]:
    from bench_service import free_port, load, start_server, stop_server

    out = {}
    for mode, extra in (("invariant", []), ("variant", ["--batch-variant"])):
        port = free_port()
        server = start_server(port, 16, dtype, extra)
        try:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(load(url, 2, 4))  # warm-up
            out[mode] = asyncio.run(load(url, 16, requests))["throughput_rps"]
        finally:
            stop_server(server)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=24)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--service", action="store_true", help="also judge serve's throughput")
    parser.add_argument("--requests", type=int, default=96, help="requests for --service")
    parser.add_argument(
        "--quick", action="store_true", help="4 items, batches of 2 and 4, 1 rep, float32 only"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_invariance.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    count, reps = (4, 1) if args.quick else (args.items, args.reps)
    batches, cost_batch = ((2, 4), 4) if args.quick else (BATCHES, 16)
    dtypes = ["float32"] if args.quick else args.dtypes.split(",")
    queries = items(count)
    base = Judge.load(dtype="float32", prefix_cache_mb=0)
    result: dict[str, Any] = {
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "items": len(queries),
        "quick": args.quick,
        "dtypes": {},
    }
    for dtype in dtypes:
        model = base.model if dtype == "float32" else base.model.to(getattr(torch, dtype))
        judges = {
            "invariant": Judge(model, base.tokenizer, prefix_cache_mb=0),
            "variant": Judge(model, base.tokenizer, prefix_cache_mb=0, batch_invariant=False),
        }
        entry: dict[str, Any] = {"reproducibility": {}}
        for mode, plain in judges.items():
            cached = Judge(
                model, base.tokenizer, prefix_cache_mb=64, batch_invariant=plain.batch_invariant
            )
            table = reproducibility(plain, cached, queries, batches)
            entry["reproducibility"][mode] = table
            print(f"\n{dtype}, {mode} arithmetic: against the item judged alone")
            print(f"{'how':16} {'judgments':>9} {'max |dp|':>10} {'bitwise':>8} {'flips':>6}")
            for how, row in table.items():
                print(
                    f"{how:16} {row['judgments']:9d} {row['max_diff']:10.2e} "
                    f"{row['bitwise']:8d} {row['flips']:6d}"
                )
        entry["cost"] = cost(judges, queries, reps, cost_batch)
        print(f"\n{dtype}, cost (ms per item): invariant / variant")
        for name, row in entry["cost"].items():
            print(
                f"{name:12} {row['invariant_ms']:8.1f} {row['variant_ms']:8.1f}  "
                f"x{row['ratio']:.2f}"
            )
        if args.service and not args.quick:
            entry["service_rps"] = service_throughput(dtype, args.requests)
            rps = entry["service_rps"]
            print(
                f"judge serve, concurrency 16: {rps['invariant']:.2f} req/s invariant, "
                f"{rps['variant']:.2f} variant, x{rps['invariant'] / rps['variant']:.2f}"
            )
        result["dtypes"][dtype] = entry
    write_text(args.out, json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
