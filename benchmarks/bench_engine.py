"""Engine latency against the bare forward pass it is built on.

Measures, side by side in one run on the default model:

* the median latency of ``Judge.judge`` against one bare forward pass of the same rendered
  prompt (``model(ids, logits_to_keep=1)``), for 2, 4, 16, 64 and 255 choices, with choices
  whose first tokens all differ and with choices that share leading tokens;
* where choices share leading tokens, exactness needs the trie's inner tokens too, so the
  floor is one bare forward pass over the prompt plus those tokens: the ratio to that floor
  is reported as well;
* the throughput of ``judge_batch`` against the same items judged one call at a time.

Each row alternates the contenders rep by rep and reports the median of the rep-by-rep
ratios, so that a slow phase of the machine hits both sides of each ratio alike. Prints
the tables and writes ``benchmarks/results/bench_engine.json``.

    python benchmarks/bench_engine.py [--dtype auto|float32|bfloat16] [--reps 21] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from benchlib import cpu_model

from atomicio import write_text
from judge import Judge, Query
from judge.engine import json_escape

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = (
    "Decide whether this SMS text message is spam (unsolicited advertising or scam) or ham "
    "(a normal, legitimate message). Answer with one of the allowed labels only.\n\n"
    "Message: Congratulations! You have been selected to receive a free holiday voucher worth "
    "500 pounds. Call 09061743386 now to claim before midnight, standard rates apply."
)


def distinct_choices(judge: Judge, n: int) -> list[str]:
    """``n`` words that are each one token after the response prefix, all different."""
    rendered = judge.render(PROMPT)
    tok = judge.tokenizer
    base = len(tok(rendered, add_special_tokens=False).input_ids)
    suffix_len = (
        len(tok(rendered + "x" + judge.response_suffix, add_special_tokens=False).input_ids)
        - base
        - 1
    )
    words: list[str] = []
    for token_id in range(tok.vocab_size):
        word = str(tok.decode([token_id]))
        if not (word.isascii() and word.isalpha() and word.islower() and len(word) >= 3):
            continue
        ids = tok(
            rendered + json_escape(word) + judge.response_suffix, add_special_tokens=False
        ).input_ids
        if len(ids) == base + 1 + suffix_len and ids[base] == token_id:
            words.append(word)
            if len(words) == n:
                return words
    raise RuntimeError(f"found only {len(words)} single-token words")


def shared_choices(n: int) -> list[str]:
    """``n`` labels sharing the leading tokens ``option_`` and branching on their digits."""
    return [f"option_{i}" for i in range(n)]


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_row(judge: Judge, choices: list[str], reps: int) -> dict[str, Any]:
    prepared = judge._prepare(Query(prompt=PROMPT, choices=choices))
    trie = prepared.trie
    prompt_ids = torch.tensor(
        [judge.tokenizer(prepared.prompt, add_special_tokens=False).input_ids]
    )
    floor_ids = torch.tensor([trie.context + trie.tree_tokens])
    model = judge.model

    def bare(ids: torch.Tensor) -> Callable[[], object]:
        def run() -> object:
            with torch.inference_mode():
                return model(ids, logits_to_keep=1).logits

        return run

    contenders = {
        "judge": lambda: judge.judge(PROMPT, choices),
        "bare": bare(prompt_ids),
        "floor": bare(floor_ids),
    }
    for fn in contenders.values():  # warm-up
        fn()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(reps):
        for name, fn in contenders.items():
            samples[name].append(timed(fn))
    judge_ms, bare_ms, floor_ms = (median_ms(samples[k]) for k in ("judge", "bare", "floor"))

    def paired(base: str) -> float:
        # The median of rep-by-rep ratios: a slow phase of the machine hits both sides of a pair.
        return statistics.median(
            j / b for j, b in zip(samples["judge"], samples[base], strict=True)
        )

    return {
        "choices": len(choices),
        "prompt_tokens": int(prompt_ids.shape[1]),
        "inner_tokens": len(trie.tree_tokens),
        "judge_ms": judge_ms,
        "bare_ms": bare_ms,
        "floor_ms": floor_ms,
        "ratio_to_bare": paired("bare"),
        "ratio_to_floor": paired("floor"),
    }


def bench_batch(judge: Judge, items: int, reps: int) -> dict[str, Any]:
    queries = [
        Query(prompt=f"{PROMPT}\nReference number {i}: {'x' * (i % 7)}", choices=["spam", "ham"])
        for i in range(items)
    ]
    sequential = lambda: [judge.judge(q.prompt, q.choices) for q in queries]  # noqa: E731
    batched = lambda: judge.judge_batch(queries)  # noqa: E731
    batched()
    samples: dict[str, list[float]] = {"sequential": [], "batched": []}
    for _ in range(reps):
        samples["sequential"].append(timed(sequential))
        samples["batched"].append(timed(batched))
    seq_s, bat_s = (statistics.median(samples[k]) for k in ("sequential", "batched"))
    return {
        "items": items,
        "sequential_items_per_s": items / seq_s,
        "batched_items_per_s": items / bat_s,
        "speedup": seq_s / bat_s,
        "max_batch_size": judge.max_batch_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument(
        "--quick", action="store_true", help="a small run: 2 and 16 choices, 3 reps"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_engine.json")
    args = parser.parse_args()
    counts = [2, 16] if args.quick else [2, 4, 16, 64, 255]
    reps = 3 if args.quick else args.reps

    # The cache off: these rows measure one pass against a bare pass over the same tokens
    # (bench_prefix_cache.py measures what the cache saves).
    judge = Judge.load(dtype=args.dtype, prefix_cache_mb=0)
    machine = {
        "cpu": cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": judge.dtype,
        "model": judge.model_id,
    }
    print(f"# {machine}")
    rows = []
    for kind, make in (
        ("distinct", lambda n: distinct_choices(judge, n)),
        ("shared", shared_choices),
    ):
        for n in counts:
            row = {"kind": kind, **bench_row(judge, make(n), reps)}
            rows.append(row)
            print(_format_row(row), flush=True)
    batch = bench_batch(judge, 8 if args.quick else 32, 1 if args.quick else 3)
    print(
        f"judge_batch {batch['items']} items: {batch['batched_items_per_s']:.1f} items/s batched, "
        f"{batch['sequential_items_per_s']:.1f} items/s sequential, x{batch['speedup']:.2f}"
    )
    result = {"machine": machine, "quick": args.quick, "reps": reps, "rows": rows, "batch": batch}
    write_text(args.out, json.dumps(result, indent=2))


def _format_row(row: Mapping[str, Any]) -> str:
    return (
        "{kind:9} {choices:4} choices  prompt {prompt_tokens:4} tok  inner {inner_tokens:3} tok  "
        "judge {judge_ms:7.1f} ms  bare {bare_ms:7.1f} ms  floor {floor_ms:7.1f} ms  "
        "x bare {ratio_to_bare:5.2f}  x floor {ratio_to_floor:5.2f}"
    ).format(**row)


if __name__ == "__main__":
    main()
