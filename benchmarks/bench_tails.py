"""A lane's last block of queries in fewer queries (``Blocking.tails``) against a whole block.

The batch-invariant attention computes queries in blocks of ``Blocking.queries`` (32); a lane's
last, partial block used to be padded to a whole one. Where a smaller count is measured to give
each query a whole block's bits, the engine now runs that block in it. Side by side in one
process, the two blockings taking turns call by call, on the default model:

- **warm call**: ``bench_prefix_cache``'s rubric head (~950 tokens) in the prefix cache and a
  short SMS-like item, two choices: a call computes ~36 tokens over the cached head; each
  blocking judges its own items, so neither finds the other's item cached;
- **one-token pass**: the lean decoder over one token, as the last step of a warm call is;
- **same bits**: the same items judged both ways from the same cache state.

Prints a table and writes ``benchmarks/results/bench_tails.json``.

    python benchmarks/bench_tails.py [--dtype auto|float32|bfloat16] [--calls 40] [--threads N]
        [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from bench_prefix_cache import RUBRIC
from benchlib import judge_machine

from judge import Judge
from judge.atomicio import write_text
from judge.attention import Lanes

RESULTS = Path(__file__).resolve().parent / "results"
CHOICES = ["pass", "fail"]


def item(i: int) -> str:
    return f"Message {i}: are you coming to dinner tonight at {i % 12 + 1} pm? Let me know soon."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--calls", type=int, default=40, help="warm calls per blocking")
    parser.add_argument("--threads", type=int, help="torch threads (default: one per core)")
    parser.add_argument("--quick", action="store_true", help="4 calls per blocking")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_tails.json")
    args = parser.parse_args()
    calls = 4 if args.quick else args.calls
    if args.threads:
        torch.set_num_threads(args.threads)

    judge = Judge.load(dtype=args.dtype, system=RUBRIC)
    lean = judge._lean
    assert lean is not None and lean.blocking is not None and judge.prefix_cache is not None
    blockings = {
        "tails": lean.blocking,
        "whole blocks": dataclasses.replace(lean.blocking, tails=()),
    }
    judge.judge("A message that is not among the items.", CHOICES)  # the head, cached
    ids, at = torch.tensor([5]), torch.tensor([0])
    one_lane = [([0], [0], torch.ones(1, 1, dtype=torch.bool))]
    warm: dict[str, list[float]] = {name: [] for name in blockings}
    one: dict[str, list[float]] = {name: [] for name in blockings}
    computed = 0
    for i in range(calls):
        names = list(blockings) if i % 2 else list(blockings)[::-1]
        for k, name in enumerate(names):
            lean.blocking = blockings[name]
            start = time.perf_counter()
            computed = judge.judge(item(2 * i + k), CHOICES).computed_tokens
            warm[name].append((time.perf_counter() - start) * 1000)
            lanes = Lanes.build(one_lane, 1, pad_key=1, blocking=blockings[name])
            start = time.perf_counter()
            lean.run(ids, at, lanes, None, at, at)
            one[name].append((time.perf_counter() - start) * 1000)
    same = True
    for i in range(min(calls, 10)):
        probs = []
        for blocking in blockings.values():
            lean.blocking = blocking
            judge.prefix_cache.clear()
            judge.judge("A message that is not among the items.", CHOICES)
            probs.append(judge.judge(item(1000 + i), CHOICES).probs)
        same &= probs[0] == probs[1]
    lean.blocking = blockings["tails"]

    median = {n: (statistics.median(warm[n]), statistics.median(one[n])) for n in blockings}
    result = {
        "machine": {
            **judge_machine(judge),
            "capability": str(torch.backends.cpu.get_cpu_capability()),
        },
        "tails": list(blockings["tails"].tails),
        "warm_computed_tokens": computed,
        "calls": calls,
        "median_ms": {n: {"warm_call": w, "one_token": o} for n, (w, o) in median.items()},
        "same_bits": same,
        "quick": args.quick,
    }
    (w_t, o_t), (w_w, o_w) = median["tails"], median["whole blocks"]
    print(
        f"{result['machine']['cpu']}; kernels {result['machine']['capability']}; {judge.dtype}; "
        f"tails {blockings['tails'].describe()}; {calls} calls each\n\n"
        "| blocking | warm call ms | one-token pass ms |\n|---|---|---|\n"
        f"| whole blocks | {w_w:.1f} | {o_w:.2f} |\n| tails | {w_t:.1f} | {o_t:.2f} |\n"
        f"| tails / whole | {w_t / w_w:.2f} | {o_t / o_w:.2f} |\n\n"
        f"warm calls computed {computed} tokens; same bits both ways: {same}"
    )
    write_text(args.out, json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
