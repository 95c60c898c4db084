"""Engine latency against the bare forward pass it is built on.

Measures, side by side in one run on the default model:

* the median latency of ``Judge.judge`` against one bare forward pass of the same rendered
  prompt (``model(ids, logits_to_keep=1)``), for 2, 4, 16, 64 and 255 choices, with choices
  whose first tokens all differ and with choices that share leading tokens; beside it the same
  judgment on the model's own decoder (``Judge(lean=False)``, the generic pass);
* where choices share leading tokens, exactness needs the trie's inner tokens too, so the
  floor is one bare forward pass over the prompt plus those tokens: the ratio to that floor
  is reported as well;
* the throughput of ``judge_batch`` against the same items judged one call at a time;
* the cost of hidden-state features (issue 17): the same ``judge_batch`` judged without
  features, with one layer (20) and with the five layers a probe is chosen among
  (``calibration.maps.probe.candidate_layers``); the target is at most 1.05x "without".

Each row alternates the contenders rep by rep and reports the median of the rep-by-rep
ratios, so that a slow phase of the machine hits both sides of each ratio alike. Prints
the tables and writes ``benchmarks/results/bench_engine.json``. ``--features-only`` runs just
the features' cost and writes ``bench_engine_features_<dtype>.json`` instead; the features'
cost is left out of ``--quick`` unless it is asked for that way.

    python benchmarks/bench_engine.py [--dtype auto|float32|bfloat16] [--reps 21] [--quick] [--batch-variant]
                                      [--features-only] [--feature-items 32] [--feature-reps 11]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import torch
from benchlib import judge_machine

from calibration.maps.probe import candidate_layers
from judge import Judge, Query
from judge.atomicio import write_text
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


def bench_row(judge: Judge, generic: Judge, choices: list[str], reps: int) -> dict[str, Any]:
    prepared = judge.prepare(Query(prompt=PROMPT, choices=choices))
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
        "generic": lambda: generic.judge(PROMPT, choices),
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

    def paired(base: str, name: str = "judge") -> float:
        # The median of rep-by-rep ratios: a slow phase of the machine hits both sides of a pair.
        return statistics.median(j / b for j, b in zip(samples[name], samples[base], strict=True))

    return {
        "choices": len(choices),
        "prompt_tokens": int(prompt_ids.shape[1]),
        "inner_tokens": len(trie.tree_tokens),
        "judge_ms": judge_ms,
        "bare_ms": bare_ms,
        "floor_ms": floor_ms,
        "ratio_to_bare": paired("bare"),
        "ratio_to_floor": paired("floor"),
        # The same judgment on the model's own decoder (the generic pass, as before the lean
        # one), side by side.
        "generic_ms": median_ms(samples["generic"]),
        "generic_ratio_to_floor": paired("floor", "generic"),
        "ratio_to_generic": paired("generic"),
    }


def batch_queries(items: int) -> list[Query]:
    """``items`` two-choice SMS questions of slightly different lengths."""
    return [
        Query(prompt=f"{PROMPT}\nReference number {i}: {'x' * (i % 7)}", choices=["spam", "ham"])
        for i in range(items)
    ]


def bench_batch(judge: Judge, generic: Judge, items: int, reps: int) -> dict[str, Any]:
    queries = batch_queries(items)
    sequential = lambda: [judge.judge(q.prompt, q.choices) for q in queries]  # noqa: E731
    batched = lambda: judge.judge_batch(queries)  # noqa: E731
    generic_batched = lambda: generic.judge_batch(queries)  # noqa: E731
    batched()
    generic_batched()
    samples: dict[str, list[float]] = {"sequential": [], "batched": [], "generic": []}
    for _ in range(reps):
        samples["sequential"].append(timed(sequential))
        samples["batched"].append(timed(batched))
        samples["generic"].append(timed(generic_batched))
    seq_s, bat_s, gen_s = (
        statistics.median(samples[k]) for k in ("sequential", "batched", "generic")
    )
    return {
        "items": items,
        "sequential_items_per_s": items / seq_s,
        "batched_items_per_s": items / bat_s,
        "generic_batched_items_per_s": items / gen_s,
        "speedup": seq_s / bat_s,
        "max_batch_size": judge.max_batch_size,
    }


FEATURES_TARGET = 1.05  # issue 17: features from the same pass cost at most 5%


def bench_features(judge: Judge, items: int, reps: int) -> dict[str, Any]:
    """``judge_batch`` on the same items without features, with layer 20 and with the five
    candidate layers; the order of the three rotates rep by rep."""
    num_layers = judge.num_layers or 1
    layer_sets: dict[str, tuple[int, ...]] = {
        "none": (),
        "one": (min(20, num_layers),),
        "five": candidate_layers(num_layers),
    }
    batches = {
        name: [msgspec.structs.replace(q, feature_layers=layers) for q in batch_queries(items)]
        for name, layers in layer_sets.items()
    }
    names = list(batches)
    for name in names:  # warm-up
        judge.judge_batch(batches[name])
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % 3 :] + names[: rep % 3]:
            start = time.perf_counter()
            judge.judge_batch(batches[name])
            samples[name].append(time.perf_counter() - start)
    prompt_tokens = [r.prompt_tokens for r in judge.judge_batch(batches["none"])]
    rows = []
    for name, layers in layer_sets.items():
        # Rep by rep: a slow phase of the machine hits both sides of a pair.
        ratios = [s / n for s, n in zip(samples[name], samples["none"], strict=True)]
        rows.append(
            {
                "features": name,
                "layers": list(layers),
                "batch_ms": median_ms(samples[name]),
                "ms_per_item": median_ms(samples[name]) / items,
                "ratio_to_none": statistics.median(ratios),
                "ratios": ratios,
                # The fastest reps, least disturbed by other work on the machine.
                "min_ms": min(samples[name]) * 1000,
                "ratio_of_min": min(samples[name]) / min(samples["none"]),
            }
        )
    return {
        "items": items,
        "prompt_tokens_min": min(prompt_tokens),
        "prompt_tokens_max": max(prompt_tokens),
        "max_batch_size": judge.max_batch_size,
        "target_ratio": FEATURES_TARGET,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument(
        "--quick", action="store_true", help="a small run: 2 and 16 choices, 3 reps"
    )
    parser.add_argument(
        "--features-only",
        action="store_true",
        help="only the features' cost; writes bench_engine_features_<dtype>.json",
    )
    parser.add_argument("--feature-items", type=int, default=32, help="the features' batch")
    parser.add_argument("--feature-reps", type=int, default=11)
    parser.add_argument(
        "--batch-variant",
        action="store_true",
        help="the faster arithmetic without batch invariance (bench_invariance.py compares both)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    counts = [2, 16] if args.quick else [2, 4, 16, 64, 255]
    reps = 3 if args.quick else args.reps

    # The cache off: these rows measure one pass against a bare pass over the same tokens
    # (bench_prefix_cache.py measures what the cache saves).
    judge = Judge.load(dtype=args.dtype, prefix_cache_mb=0, batch_invariant=not args.batch_variant)
    generic = Judge(
        judge.model,
        judge.tokenizer,
        prefix_cache_mb=0,
        batch_invariant=judge.batch_invariant,
        lean=False,
    )
    machine = {
        **judge_machine(judge),
        "kernels": str(torch.backends.cpu.get_cpu_capability()),
        "batch_invariant": judge.batch_invariant,
        "lean": judge.decoder_pass == "lean",
    }
    print(f"# {machine}")
    feature_items, feature_reps = (8, 2) if args.quick else (args.feature_items, args.feature_reps)
    if args.features_only:
        features = bench_features(judge, feature_items, feature_reps)
        _print_features(features)
        out = args.out or RESULTS / f"bench_engine_features_{judge.dtype}.json"
        result = {"machine": machine, "quick": args.quick, "reps": feature_reps}
        write_text(out, json.dumps({**result, "features": features}, indent=2))
        return
    rows = []
    for kind, make in (
        ("distinct", lambda n: distinct_choices(judge, n)),
        ("shared", shared_choices),
    ):
        for n in counts:
            row = {"kind": kind, **bench_row(judge, generic, make(n), reps)}
            rows.append(row)
            print(_format_row(row), flush=True)
    batch = bench_batch(judge, generic, 8 if args.quick else 32, 1 if args.quick else 3)
    print(
        f"judge_batch {batch['items']} items: {batch['batched_items_per_s']:.1f} items/s batched, "
        f"{batch['sequential_items_per_s']:.1f} items/s sequential, x{batch['speedup']:.2f}; "
        f"generic pass batched {batch['generic_batched_items_per_s']:.1f} items/s"
    )
    result = {"machine": machine, "quick": args.quick, "reps": reps, "rows": rows, "batch": batch}
    if not args.quick:
        result["features"] = features = bench_features(judge, feature_items, feature_reps)
        _print_features(features)
    write_text(args.out or RESULTS / "bench_engine.json", json.dumps(result, indent=2))


def _format_row(row: Mapping[str, Any]) -> str:
    return (
        "{kind:9} {choices:4} choices  prompt {prompt_tokens:4} tok  inner {inner_tokens:3} tok  "
        "judge {judge_ms:7.1f} ms  bare {bare_ms:7.1f} ms  floor {floor_ms:7.1f} ms  "
        "x bare {ratio_to_bare:5.2f}  x floor {ratio_to_floor:5.2f}  "
        "generic {generic_ms:7.1f} ms (x floor {generic_ratio_to_floor:5.2f})  "
        "x generic {ratio_to_generic:5.2f}"
    ).format(**row)


def _print_features(features: Mapping[str, Any]) -> None:
    print(
        f"features: judge_batch of {features['items']} items, "
        f"{features['prompt_tokens_min']}-{features['prompt_tokens_max']} prompt tokens"
    )
    print(
        f"{'features':9} {'layers':16} {'batch ms':>9} {'ms/item':>8} {'x none':>7} "
        f"{'reps':>11}  {'min ms':>8} {'x none':>7}"
    )
    for row in features["rows"]:
        layers = ",".join(map(str, row["layers"])) or "-"
        print(
            f"{row['features']:9} {layers:16} {row['batch_ms']:9.1f} {row['ms_per_item']:8.2f} "
            f"{row['ratio_to_none']:7.3f} {min(row['ratios']):5.3f}-{max(row['ratios']):5.3f}  "
            f"{row['min_ms']:8.1f} {row['ratio_of_min']:7.3f}"
        )
    worst = max(r["ratio_to_none"] for r in features["rows"])
    verdict = "within" if worst <= features["target_ratio"] else "OVER"
    print(f"worst x{worst:.3f}: {verdict} the target of x{features['target_ratio']:.2f}")


if __name__ == "__main__":
    main()
