"""The fixed cost of a pass: one-token passes and ~105-token judgments against their arithmetic.

A judgment is one forward pass, so what a pass costs beyond its arithmetic is paid by every
judgment. Measured in one process, side by side, the four ways of running a pass taking turns
rep by rep: the lean pass (``judge.decoder``) or the model's own decoder (the generic pass, as
before), each in the batch-invariant arithmetic (the default) and the ordinary one.

- **Peak**: ``F.linear`` and the lean pass's packed product on the model's own MLP shapes
  (hidden -> intermediate and back) at 64 to 512 rows, in the engine's dtype; the best GFLOP/s,
  measured before and after the passes, is the in-process matmul peak.
- **Weight floor**: a pass reads every decoder weight once; their bytes over the bandwidth of
  reading a 1 GiB tensor in this process is what a one-token pass cannot beat.
- **One-token pass**: the decoder over one token, as the last step of a warm call is.
  Beside it, the default pass's products alone over one row (*products alone*): the share
  of a one-token pass that is its kernels' own, and the bandwidth they read the weights at.
- **Judgment**: ``Judge.judge`` of a two-choice SMS prompt of about 105 tokens, the prefix
  cache off, and the bare ``model(ids, logits_to_keep=1)`` over the same tokens.
- **Start-up** (``--startup``): ``Judge.load()`` and a first judgment in a fresh process, with
  an empty cache directory (a first start: the GGUF is de-quantized) and again (a later start).

**The roofline.** A pass's *floor* is the larger of its arithmetic at the peak (its linear
layers', attention's and the roots' LM head FLOPs) and reading every weight it uses once at the
bandwidth (the decoder's linear weights; a judgment's LM head too); "x floor" is a pass's time
over its floor, and says which bound it is ("arith" or "memory"). The goals (issue 31): a
1-token pass at most 2x its floor, and a ~105-token judgment at 50% of the peak or more
("share of peak": its arithmetic at the peak over its time), on every CPU class. Prints the
tables and the goals met or not, and writes ``benchmarks/results/bench_pass_<dtype>.json``.

``--emulate-avx2`` runs it with the kernels of an AVX2-only CPU (``benchlib.AVX2``) on an
AVX-512 or AMX machine; the peak and the bandwidth are measured under the same limit.

    python benchmarks/bench_pass.py [--dtype auto|float32|bfloat16] [--reps 15] [--startup]
        [--quick] [--emulate-avx2]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from benchlib import cpu_flags, cpu_model, emulate_avx2, timed
from torch.nn import functional as F

from judge import Judge
from judge.atomicio import write_text
from judge.attention import Lanes
from judge.batch_invariant import invariant_ops
from judge.decoder import packed_linear, packing_library

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = (
    "Is this SMS spam? WINNER!! As a valued network customer you have been selected to receive "
    "a 900 prize reward! To claim call 09061701461. Claim code KL341. Valid 12 hours only. "
    "Reply STOP to end, or text HELP for more. Standard rates apply, 18+ only."
)
CHOICES = ["spam", "ham"]
ARMS = [("lean", True), ("generic", True), ("lean", False), ("generic", False)]
# The default pass's products alone over one row, timed in the same rotation as the passes.
PRODUCTS = "products alone"
# The goals of issue 31, on every CPU class: a 1-token pass within this multiple of its floor,
# and a judgment at this share of the matmul peak or more.
ONE_TOKEN_GOAL = 2.0
SHARE_GOAL = 0.5


def arm_name(path: str, invariant: bool) -> str:
    return f"{path}, {'invariant' if invariant else 'variant'}"


def matmul_peak(model: Any, reps: int) -> dict[str, Any]:
    """The best GFLOP/s of a product on the model's MLP shapes, in its dtype: ``F.linear``
    or the packed weight the lean pass computes on (``packing_library``: on an AMD CPU MKL,
    and so ``F.linear``, is far from this machine's best)."""
    mlp: Any = model.get_decoder().layers[0].mlp
    best: dict[str, Any] = {"gflops": 0.0}
    for weight in (mlp.up_proj.weight, mlp.down_proj.weight):
        w = weight.detach().clone()
        for rows in (64, 128, 256, 512):
            x = torch.randn(rows, w.shape[1], dtype=w.dtype)
            ways: dict[str, Callable[[], object]] = {"F.linear": functools.partial(F.linear, x, w)}
            packed = packed_linear(w, None, rows)
            if packed is not None:
                ways[f"packed ({packing_library(w.dtype)})"] = functools.partial(packed, x)
            for way, times in timed(ways, reps).items():
                gflops = 2 * rows * w.shape[0] * w.shape[1] / min(times) / 1e6
                if gflops > best["gflops"]:
                    best = {"gflops": gflops, "rows": rows, "shape": list(w.shape), "by": way}
    return best


def read_bandwidth() -> float:
    """GB/s of summing a 1 GiB float32 tensor (far larger than the caches)."""
    x = torch.ones(2**28)
    ms = min(timed({"sum": lambda: x.sum()}, 5)["sum"])
    return x.nbytes / ms / 1e6


def head_bytes(model: Any) -> int:
    """Bytes of the LM head's weight: read once by a pass that scores a root."""
    weight = model.get_output_embeddings().weight
    return int(weight.numel() * weight.element_size())


def floor_ms(flops: float, nbytes: float, peak_gflops: float, gb_s: float) -> tuple[float, str]:
    """The roofline floor of a pass, in ms, and its bound: its arithmetic at the peak or its
    weights read once at the bandwidth, whichever is slower."""
    arithmetic, memory = flops / peak_gflops / 1e6, nbytes / gb_s / 1e6
    return (arithmetic, "arith") if arithmetic >= memory else (memory, "memory")


def linear_params(model: Any) -> tuple[int, int]:
    """(elements, bytes) of the decoder blocks' linear weights."""
    elements = nbytes = 0
    for module in model.get_decoder().layers.modules():
        if isinstance(module, torch.nn.Linear):
            elements += module.weight.numel()
            nbytes += module.weight.numel() * module.weight.element_size()
    return elements, nbytes


def pass_flops(model: Any, tokens: int, params: int, roots: int = 0) -> float:
    """Linear layers, causal attention (scores and weighted values) and the roots' LM head."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    attention = 4 * config.num_attention_heads * head_dim * tokens * (tokens + 1) / 2
    head = 2 * roots * config.vocab_size * config.hidden_size
    return 2 * tokens * params + config.num_hidden_layers * attention + head


def one_token(judge: Judge, invariant: bool) -> Callable[[], object]:
    ids = torch.tensor([judge.tokenizer("Hello").input_ids[-1]])
    if judge._lean is not None:
        lean = judge._lean
        lanes = Lanes.build(
            [([0], [0], torch.ones(1, 1, dtype=torch.bool))], 1, pad_key=1, blocking=lean.blocking
        )
        at = torch.tensor([0])
        return lambda: lean.run(ids, torch.tensor([0]), lanes, None, at, at)
    decoder = judge.model.get_decoder()

    def generic() -> object:
        with torch.inference_mode(), invariant_ops() if invariant else _nothing():
            return decoder(input_ids=ids[None], use_cache=False)

    return generic


def products_alone(judge: Judge) -> Callable[[], object]:
    """The lean pass's products over one row, layer after layer, as a one-token pass runs
    them (each on its packed weight, in this arithmetic), and nothing else: how much of a
    one-token pass is the products' own kernels."""
    lean = judge._lean
    assert lean is not None
    dtype = judge.model.dtype
    products = [p for layer in lean.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    inputs = [torch.zeros(1, p.weight.shape[1], dtype=dtype) for p in products]

    def run() -> None:
        with torch.inference_mode():
            for product, x in zip(products, inputs, strict=True):
                product(x)

    return run


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def bench_passes(base: Judge, reps: int) -> dict[str, Any]:
    model, tokenizer = base.model, base.tokenizer
    judges = {
        arm_name(path, inv): Judge(
            model, tokenizer, prefix_cache_mb=0, lean=path == "lean", batch_invariant=inv
        )
        for path, inv in ARMS
    }
    prepared = base.prepare({"prompt": PROMPT, "choices": CHOICES})
    ids = torch.tensor([prepared.trie.context])

    def bare() -> object:
        with torch.inference_mode():
            return model(ids, logits_to_keep=1)

    one_fns = {name: one_token(j, name.endswith("invariant")) for name, j in judges.items()}
    one_fns[PRODUCTS] = products_alone(judges[arm_name("lean", True)])
    one = timed(one_fns, reps)
    products = one.pop(PRODUCTS)
    fns: dict[str, Callable[[], object]] = {
        name: functools.partial(j.judge, PROMPT, CHOICES) for name, j in judges.items()
    }
    fns["bare pass"] = bare
    judged = timed(fns, reps)
    return {
        "prompt_tokens": prepared.prompt_tokens,
        "computed_tokens": prepared.tokens,
        "one_token_ms": one,
        "one_token_products_ms": products,
        "judgment_ms": judged,
    }


def startup(dtype: str, reps: int) -> dict[str, Any]:
    """Seconds from a fresh process to its first judgment, with an empty cache directory and
    again with the one it left, for the lean and the generic pass."""
    code = (
        "import sys, time; t = time.perf_counter(); from judge import Judge; "
        f"j = Judge.load(dtype={dtype!r}, lean=sys.argv[1] == 'lean'); "
        "j.judge('Is this spam? Win a prize now!', ['spam', 'ham']); "
        "print(time.perf_counter() - t)"
    )
    out: dict[str, Any] = {}
    for path in ("lean", "generic"):
        for _ in range(reps):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "JUDGE_CACHE_DIR": cache}
                for start in ("first", "later"):
                    run = subprocess.run(
                        [sys.executable, "-c", code, path],
                        env=env,
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    seconds = float(run.stdout.strip().splitlines()[-1])
                    out.setdefault(f"{path}, {start} start", []).append(seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--startup", action="store_true", help="also time fresh processes")
    parser.add_argument("--quick", action="store_true", help="3 reps, no start-up")
    parser.add_argument("--threads", type=int, help="torch threads (default: one per core)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--emulate-avx2", action="store_true")
    args = parser.parse_args()
    emulate_avx2(args.emulate_avx2)
    reps = 3 if args.quick else args.reps
    if args.threads:
        torch.set_num_threads(args.threads)

    base = Judge.load(dtype=args.dtype, prefix_cache_mb=0)
    dtype = base.dtype
    elements, nbytes = linear_params(base.model)
    peak = matmul_peak(base.model, reps)
    bandwidth = read_bandwidth()
    passes = bench_passes(base, reps)
    # The peak again, after the passes, and the better of the two: on a machine shared with
    # other jobs, a peak measured while they ran would be too low, and a pass measured once
    # they had stopped would seem to beat its own arithmetic.
    peak = max(peak, matmul_peak(base.model, reps), key=lambda p: float(p["gflops"]))

    one_flops = pass_flops(base.model, 1, elements)
    tokens = passes["computed_tokens"]
    judgment_flops = pass_flops(base.model, tokens, elements, roots=1)
    judgment_bytes = nbytes + head_bytes(base.model)
    one_floor, one_bound = floor_ms(one_flops, nbytes, peak["gflops"], bandwidth)
    judgment_floor, judgment_bound = floor_ms(
        judgment_flops, judgment_bytes, peak["gflops"], bandwidth
    )
    capability = torch.backends.cpu.get_cpu_capability()
    emulated = " (AVX2 emulated)" if args.emulate_avx2 else ""

    print(f"{cpu_model()} ({', '.join(cpu_flags())}); kernels {capability}{emulated}; ", end="")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {dtype}; {reps} reps")
    print(
        f"matmul peak {peak['gflops']:.0f} GFLOP/s "
        f"({peak['by']} {peak['shape']}, {peak['rows']} rows)"
    )
    print(f"decoder linear weights {nbytes / 2**20:.0f} MiB, read at {bandwidth:.1f} GB/s")
    print()
    print(f"1-token pass: floor {one_floor:.2f} ms ({one_bound} bound)")
    print("| pass | ms (min) | x floor |")
    print("|---|---|---|")
    rows = []
    for name, times in passes["one_token_ms"].items():
        med = statistics.median(times)
        row = {"arm": name, "one_token_ms": med, "one_token_min_ms": min(times)}
        row |= {"one_token_x_floor": med / one_floor}
        rows.append(row)
        print(f"| {name} | {med:.2f} ({min(times):.2f}) | {med / one_floor:.2f} |")
    products_ms = statistics.median(passes["one_token_products_ms"])
    products = {
        "ms": products_ms,
        "x_floor": products_ms / one_floor,
        "read_gb_s": nbytes / products_ms / 1e6,
    }
    print(
        f"| {PRODUCTS} ({arm_name('lean', True)}: one row each) | {products_ms:.2f} "
        f"({min(passes['one_token_products_ms']):.2f}) | {products['x_floor']:.2f} |"
    )
    print(f"(the products read the weights at {products['read_gb_s']:.1f} GB/s)")
    print()
    print(
        f"Judgment: {passes['prompt_tokens']} prompt tokens, {tokens} computed; floor "
        f"{judgment_floor:.1f} ms ({judgment_bound} bound)"
    )
    print("| pass | ms (min) | x floor | share of peak | x bare pass | x generic, invariant |")
    print("|---|---|---|---|---|---|")
    judged = passes["judgment_ms"]
    bare = judged["bare pass"]
    before = judged[arm_name("generic", True)]
    peak_ms = judgment_flops / peak["gflops"] / 1e6
    for name, times in judged.items():
        med = statistics.median(times)
        share = peak_ms / med
        x_bare = statistics.median(t / b for t, b in zip(times, bare, strict=True))
        x_before = statistics.median(t / b for t, b in zip(times, before, strict=True))
        x_floor = med / judgment_floor
        print(
            f"| {name} | {med:.1f} ({min(times):.1f}) | {x_floor:.2f} | {share:.0%} "
            f"| {x_bare:.2f} | {x_before:.2f} |"
        )
        match = next((r for r in rows if r["arm"] == name), None)
        values = {"judgment_ms": med, "judgment_min_ms": min(times), "share_of_peak": share}
        values |= {"judgment_x_floor": x_floor, "x_bare": x_bare, "x_generic_invariant": x_before}
        if match is None:
            rows.append({"arm": name, **values})
        else:
            match.update(values)
    default = next(r for r in rows if r["arm"] == arm_name("lean", True))
    goals = {
        "one_token_x_floor": default["one_token_x_floor"] <= ONE_TOKEN_GOAL,
        "judgment_share_of_peak": default["share_of_peak"] >= SHARE_GOAL,
    }
    print()
    print(
        f"goals, the default pass ({arm_name('lean', True)}): 1-token within "
        f"{ONE_TOKEN_GOAL:g}x its floor: {'met' if goals['one_token_x_floor'] else 'NOT met'} "
        f"({default['one_token_x_floor']:.2f}x); judgment at {SHARE_GOAL:.0%} of peak or more: "
        f"{'met' if goals['judgment_share_of_peak'] else 'NOT met'} "
        f"({default['share_of_peak']:.0%})"
    )

    result: dict[str, Any] = {
        "machine": {
            "cpu": cpu_model(),
            "flags": cpu_flags(),
            "kernels": capability + emulated,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "dtype": dtype,
        "reps": reps,
        "peak": peak,
        "read_gb_s": bandwidth,
        "linear_weights_bytes": nbytes,
        "head_bytes": judgment_bytes - nbytes,
        "one_token_flops": one_flops,
        "one_token_floor_ms": one_floor,
        "one_token_bound": one_bound,
        "one_token_products": products,
        "judgment_flops": judgment_flops,
        "judgment_floor_ms": judgment_floor,
        "judgment_bound": judgment_bound,
        "goals": goals,
        "prompt_tokens": passes["prompt_tokens"],
        "computed_tokens": tokens,
        "rows": rows,
        "raw": passes,
    }
    if args.startup and not args.quick:
        seconds = startup(args.dtype, 2)
        result["startup_s"] = seconds
        print()
        print("| start | seconds to the first judgment (each run) |")
        print("|---|---|")
        for name, values in seconds.items():
            print(f"| {name} | {', '.join(f'{v:.1f}' for v in values)} |")
    suffix = "_avx2" if args.emulate_avx2 else ""
    out = args.out or RESULTS / f"bench_pass_{dtype}{suffix}.json"
    write_text(out, json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
