"""Where a judgment's time goes: the default judgment against the bare pass, op by op.

    python benchmarks/bench_breakdown.py [--dtype float32] [--reps 10] [--emulate-avx2] [--quick]
        [--threads N] [--lengths 50,100,...,2000] [--out FILE]

One process, side by side, taking turns rep by rep: ``Judge.judge`` of a two-choice SMS prompt
of about 105 tokens in the default arithmetic (the lean pass where the model has one, batch-
invariant, the prefix cache off) and the bare ``model(ids, logits_to_keep=1)`` over the same
prompt tokens. Each is timed on the wall clock, then profiled (``torch.profiler``, CPU) over the
same reps; the ops' self time is grouped into families (matrix products, attention, element-wise
work, copies and layout, the rest) and the time no op accounts for is Python and dispatch. Prints
one table per arm and their ratio, and writes ``benchmarks/results/bench_breakdown.json``.

``--lengths`` then judges prompts of about those many tokens (the same SMS text, repeated and
cut) beside the bare pass over the same tokens, 3 reps each, and prints each ratio and their
geometric mean below 1,000 tokens: how the cost of the arithmetic moves with the length.

``--emulate-avx2`` re-runs the script with ``ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2``: on an AVX-512 or AMX machine, the kernels an AVX2-only CPU runs
(approximately: the cache sizes and the clock are still this machine's). Name the CPU with any
figure (the table's header does).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_pass import CHOICES, PROMPT  # the ~105-token judgment bench_pass measures
from benchlib import cpu_flags, cpu_model, emulate_avx2, timed
from torch.profiler import ProfilerActivity, profile

from judge import Judge
from judge.atomicio import write_text

RESULTS = Path(__file__).resolve().parent / "results"
# An op's family, by the first of these words its name holds (lower case); else "other".
FAMILIES = (
    ("matrix products", ("mm", "linear", "matmul", "gemm", "mkl", "onednn", "mkldnn", "bmm")),
    ("attention", ("attention", "sdpa", "flash")),
    ("copies and layout", ("copy", "cat", "pad", "index", "gather", "stack", "clone", "to")),
    (
        "element-wise",
        ("mul", "add", "sub", "div", "silu", "neg", "rsqrt", "pow", "mean", "exp", "softmax"),
    ),
)


def family(name: str) -> str:
    low = name.lower().removeprefix("aten::")
    for label, words in FAMILIES:
        if any(w in low for w in words):
            return label
    return "other"


def breakdown(fn: Callable[[], object], reps: int) -> dict[str, Any]:
    """Self CPU time per op family per call (ms), the top ops, and the time no op took."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        total = (time.perf_counter() - start) * 1000 / reps
    by_family: dict[str, float] = defaultdict(float)
    ops = []
    for event in prof.key_averages():
        self_ms = event.self_cpu_time_total / 1000 / reps
        by_family[family(event.key)] += self_ms
        ops.append((self_ms, event.key, event.count // reps))
    ops.sort(reverse=True)
    accounted = sum(by_family.values())
    return {
        "profiled_ms": total,
        "families_ms": dict(sorted(by_family.items(), key=lambda kv: -kv[1])),
        "unaccounted_ms": max(total - accounted, 0.0),
        "top_ops": [{"op": k, "self_ms": ms, "calls": c} for ms, k, c in ops[:12]],
    }


def long_prompt(judge: Judge, tokens: int) -> str:
    """The benchmark's SMS text repeated and cut to about ``tokens`` tokens of chat prompt."""
    ids = judge.tokenizer((PROMPT + " ") * (tokens // 40 + 2)).input_ids
    overhead = judge.prepare({"prompt": "", "choices": CHOICES}).prompt_tokens
    return str(judge.tokenizer.decode(ids[: max(1, tokens - overhead)]))


def by_length(judge: Judge, lengths: list[int], reps: int) -> list[dict[str, Any]]:
    """The judgment against the bare pass at each prompt length, side by side; printed."""
    rows = []
    for tokens in lengths:
        prompt = long_prompt(judge, tokens)
        ids = torch.tensor([judge.prepare({"prompt": prompt, "choices": CHOICES}).trie.context])

        def bare(ids: torch.Tensor = ids) -> object:
            with torch.inference_mode():
                return judge.model(ids, logits_to_keep=1)

        times = timed(
            {"judgment": functools.partial(judge.judge, prompt, CHOICES), "bare": bare}, reps
        )
        judged, plain = (statistics.median(times[k]) for k in ("judgment", "bare"))
        rows.append(
            {"tokens": ids.shape[1], "judgment_ms": judged, "bare_ms": plain, "x": judged / plain}
        )
    if rows:
        print("| prompt tokens | judgment ms | bare ms | x |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['tokens']} | {r['judgment_ms']:.1f} | {r['bare_ms']:.1f} | {r['x']:.2f} |")
        short = [r["x"] for r in rows if r["tokens"] < 1000]
        if short:
            print(f"geometric mean below 1,000 tokens: {statistics.geometric_mean(short):.3f}x")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--emulate-avx2", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2 reps: the script runs")
    parser.add_argument("--threads", type=int, help="torch threads (default: one per core)")
    parser.add_argument(
        "--lengths",
        type=lambda s: [int(n) for n in s.split(",")],
        default=[],
        help="comma-separated prompt lengths in tokens to judge beside the bare pass",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_breakdown.json")
    args = parser.parse_args()
    emulate_avx2(args.emulate_avx2)
    reps = 2 if args.quick else args.reps
    if args.threads:
        torch.set_num_threads(args.threads)
    judge = Judge.load(dtype=args.dtype, prefix_cache_mb=0)
    prepared = judge.prepare({"prompt": PROMPT, "choices": CHOICES})
    ids = torch.tensor([prepared.trie.context])
    model = judge.model

    def bare() -> object:
        with torch.inference_mode():
            return model(ids, logits_to_keep=1)

    arms: dict[str, Callable[[], object]] = {
        f"judgment ({judge.decoder_pass}, invariant)": functools.partial(
            judge.judge, PROMPT, CHOICES
        ),
        "bare pass": bare,
    }
    times = timed(arms, reps)
    medians = {name: statistics.median(ms) for name, ms in times.items()}
    parts = {name: breakdown(fn, reps) for name, fn in arms.items()}
    capability = torch.backends.cpu.get_cpu_capability()
    print(
        f"{cpu_model()} ({' '.join(cpu_flags())}); torch {torch.__version__}, kernels "
        f"{capability}{' (AVX2 emulated)' if args.emulate_avx2 else ''}, "
        f"{torch.get_num_threads()} threads, {judge.dtype}"
    )
    print(
        f"{prepared.prompt_tokens} prompt tokens, {prepared.tokens} computed by the judgment; "
        f"median of {reps} reps, side by side\n"
    )
    names = list(arms)
    judged, bare_name = names
    print(f"| | {' | '.join(names)} |\n|---|---|---|")
    print(f"| wall ms (median) | {medians[judged]:.1f} | {medians[bare_name]:.1f} |")
    families = sorted({f for p in parts.values() for f in p["families_ms"]})
    for label in [*families, "unaccounted (Python, dispatch)"]:
        cells = []
        for name in names:
            p = parts[name]
            ms = (
                p["unaccounted_ms"]
                if label.startswith("unaccounted")
                else p["families_ms"].get(label, 0.0)
            )
            cells.append(f"{ms:.1f}")
        print(f"| {label} ms | {' | '.join(cells)} |")
    print(f"\njudgment / bare pass: {medians[judged] / medians[bare_name]:.2f}x (wall, median)\n")
    for name in names:
        print(f"top ops, {name}:")
        for op in parts[name]["top_ops"]:
            print(f"  {op['self_ms']:8.2f} ms  {op['calls']:5d} calls  {op['op']}")
    sweep = by_length(judge, args.lengths, 2 if args.quick else 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text(
        args.out,
        json.dumps(
            {
                "cpu": cpu_model(),
                "flags": cpu_flags(),
                "kernels": capability,
                "emulated_avx2": args.emulate_avx2,
                "dtype": judge.dtype,
                "threads": torch.get_num_threads(),
                "prompt_tokens": prepared.prompt_tokens,
                "computed_tokens": prepared.tokens,
                "wall_ms": times,
                "breakdown": parts,
                "lengths": sweep,
            },
            indent=2,
        ),
    )


if __name__ == "__main__":
    main()
