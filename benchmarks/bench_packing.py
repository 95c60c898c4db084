"""Which library should compute the lean pass's float32 products on this CPU: MKL or oneDNN?

``judge.decoder.packing_library`` picks MKL on an Intel CPU and oneDNN elsewhere. The AMD half
of that was measured (MKL 1.4-2.7x oneDNN's time there); the Intel half was MKL measured alone.
This runs both on the machine it is on, in one process, side by side (rep by rep):

- **Layer**: one decoder layer's four products (fused q/k/v, o, fused gate/up, down) over 117
  rows in the pass's chunks, each library on its own packed copy of the weights, and F.linear.
- **Judgment**: ``Judge.judge`` of a ~105-token two-choice prompt (prefix cache off) with the
  lean pass's products packed by each library, beside the bare ``model(ids, logits_to_keep=1)``
  over the same tokens; and whether the two libraries' judgments are bitwise the same.

Float32 only (bfloat16 is oneDNN's alone). ``--emulate-avx2`` limits the kernels to AVX2
(``benchlib.AVX2``). Prints the tables and writes ``benchmarks/results/bench_packing.json``
(``bench_packing_avx2.json`` emulated).

    python benchmarks/bench_packing.py [--reps 15] [--emulate-avx2] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from bench_pass import CHOICES, PROMPT
from benchlib import cpu_flags, cpu_model, emulate_avx2, timed
from torch.nn import functional as F

import judge.decoder
from judge import Judge
from judge.atomicio import write_text

RESULTS = Path(__file__).resolve().parent / "results"
# The libraries this build of torch has (an x86 build has both).
LIBRARIES = tuple(
    library
    for library, backend in (("MKL", torch.backends.mkl), ("oneDNN", torch.backends.mkldnn))
    if backend.is_available()
)
ROWS = 117


def layer_products(model: Any, library: str, rows: int) -> Callable[[], object]:
    """One layer's four products over ROWS rows in chunks of ``rows``, on ``library``'s packed
    weights (or F.linear)."""
    layer: Any = model.get_decoder().layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    weights = [
        torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
        attn.o_proj.weight,
        torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        mlp.down_proj.weight,
    ]
    ops: list[Callable[[torch.Tensor], torch.Tensor]] = []
    for w in (w.detach().float().contiguous() for w in weights):
        with packed_by(library):
            packed = judge.decoder.packed_linear(w, None, rows) if library in LIBRARIES else None
        ops.append(packed or functools.partial(F.linear, weight=w))
    inputs = [torch.randn(ROWS, w.shape[1]) for w in weights]
    pad = -ROWS % rows

    def run() -> None:
        for op, x in zip(ops, inputs, strict=True):
            torch.cat([op(c) for c in F.pad(x, (0, 0, 0, pad)).split(rows)])

    return run


@contextlib.contextmanager
def packed_by(library: str) -> Iterator[None]:
    """``judge.decoder.packing_library`` answering ``library`` for float32, while inside."""
    chosen = judge.decoder.packing_library
    judge.decoder.packing_library = lambda dtype: library if dtype == torch.float32 else None
    try:
        yield
    finally:
        judge.decoder.packing_library = chosen


def judge_on(base: Judge, library: str) -> Judge:
    """A judge of ``base``'s model whose lean pass is packed by ``library``."""
    # One lean pass per model is kept (judge.decoder._DECODERS): drop it, so this one packs anew.
    judge.decoder._DECODERS.pop(base.model, None)
    with packed_by(library):
        made = Judge(base.model, base.tokenizer, prefix_cache_mb=0)
        made.judge(PROMPT, CHOICES)  # the products are packed and measured on first use
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--emulate-avx2", action="store_true")
    parser.add_argument("--quick", action="store_true", help="3 reps")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    emulate_avx2(args.emulate_avx2)
    reps = 3 if args.quick else args.reps
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = Judge.load(dtype="float32", prefix_cache_mb=0)
    judges = {library: judge_on(base, library) for library in LIBRARIES}
    lean = base._lean
    rows = lean.product_rows()[0] if lean is not None else 32
    ways = (*LIBRARIES, "F.linear")
    layer = timed({way: layer_products(base.model, way, rows) for way in ways}, reps)
    ids = torch.tensor([base.prepare({"prompt": PROMPT, "choices": CHOICES}).trie.context])

    def bare() -> None:
        with torch.inference_mode():
            base.model(ids, logits_to_keep=1)

    arms: dict[str, Callable[[], object]] = {"bare pass": bare}
    for lib, made in judges.items():
        arms[f"judge ({lib})"] = functools.partial(made.judge, PROMPT, CHOICES)
    judgment = timed(arms, reps)
    results = {lib: j.judge(PROMPT, CHOICES) for lib, j in judges.items()}
    same = len({tuple(r.probabilities.items()) for r in results.values()}) == 1

    report: dict[str, Any] = {
        "cpu": cpu_model(),
        "flags": cpu_flags(),
        "emulated_avx2": os.environ.get("ATEN_CPU_CAPABILITY") == "avx2",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "chunk_rows": rows,
        "layer_ms": {k: statistics.median(v) for k, v in layer.items()},
        "judgment_ms": {k: statistics.median(v) for k, v in judgment.items()},
        "bitwise_same_judgment": same,
        "arithmetic": {lib: made.arithmetic for lib, made in judges.items()},
    }
    bare_ms = report["judgment_ms"]["bare pass"]
    print(f"{report['cpu']}; {' '.join(report['flags'])}")
    print(f"emulated AVX2: {report['emulated_avx2']}; chunks of {rows} rows; float32")
    print(f"\none layer's four products over {ROWS} rows (median of {reps})")
    for way, ms in report["layer_ms"].items():
        print(f"  {way:10s} {ms:7.2f} ms  {ms / report['layer_ms']['F.linear']:.2f}x F.linear")
    print(f"\na {ids.shape[-1]}-token judgment (median of {reps})")
    for arm, ms in report["judgment_ms"].items():
        print(f"  {arm:16s} {ms:7.1f} ms  {ms / bare_ms:.2f}x the bare pass")
    print(f"the two libraries' judgments bitwise the same: {same}")
    for lib, words in report["arithmetic"].items():
        print(f"  {lib}: {words}")
    name = "bench_packing_avx2.json" if report["emulated_avx2"] else "bench_packing.json"
    write_text(args.out or RESULTS / name, json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
