"""Order invariance: what averaging over listings of the options buys, and what it costs.

On commonsense_qa (a question and five options A-E), each test item is one System One choice
question (``judge.answers``) about the state ``Question: <question>``, asked with the options
in the given order and with ``order="invariant"`` (the five cyclic shifts of the listing, judged
in one run and averaged). The options are named two ways:

    letters  criteria {"A": "get wet", ...}: the model answers a letter; each letter stays bound
             to its text while the listing rotates, so a shift moves "A: get wet" to another
             place in the list (the bias left is one for letters, not for places)
    texts    criteria {"get wet": None, ...}: the model answers the option's text itself, so
             there is no letter to prefer, only a place in the list

For each naming and order, side by side on the same items: accuracy and ECE of the answer's
probabilities (``calibration.metrics``), the mean and 90th percentile of ``order_spread`` (the
largest difference across listings in one option's probability; 0 by construction for a single
listing), and the cost per item: wall time of plan, prepare, run and answers (what ``decide``
does), and tokens fed to the model (the packed rows' lengths: the state once per row, then each
listing's question and choice trie). The prefix cache is off, so every item is computed cold
and the costs are comparable; the contenders take turns item by item, so a slow phase of the
machine hits all alike. Items whose option texts repeat (10 of 721) cannot name options by
their text and are left out of every row.

    python benchmarks/bench_order.py [--limit 300] [--dtype auto] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import json
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

INSTRUCTIONS = "Which option answers the question best?"
NAMINGS = ("letters", "texts")
Order = Literal["given", "invariant"]
ORDERS: tuple[Order, ...] = ("given", "invariant")


def load_items(path: Path, limit: int) -> tuple[list[dict[str, Any]], int]:
    """The first ``limit`` test rows whose five option texts are distinct, and how many
    rows before the last one taken were left out for repeating a text."""
    items, dropped = [], 0
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if len(set(row["options"].values())) < len(row["options"]):
            dropped += 1
            continue
        items.append(row)
        if len(items) == limit:
            break
    return items, dropped


def question(row: dict[str, Any], naming: str, order: Order) -> Any:
    from judge.answers import ChoiceQuestion

    options: dict[str, str] = row["options"]
    if naming == "letters":
        criteria: dict[str, Any] = dict(options)
    else:
        criteria = dict.fromkeys(options.values())
    return ChoiceQuestion(instructions=INSTRUCTIONS, criteria=criteria, order=order)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--limit", type=int, default=300, help="test items (default 300)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, help="torch threads (default: one per core)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 10 items")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_order.json")
    args = parser.parse_args()

    import torch

    from calibration.metrics import accuracy, ece
    from judge import Judge

    if args.threads:
        torch.set_num_threads(args.threads)
    limit = 10 if args.quick else args.limit
    items, dropped = load_items(args.data / "commonsense_qa" / "test.jsonl", limit)
    # Off: a question computed twice (once per contender) must not read the first one's state.
    judge = Judge.load(dtype=args.dtype, prefix_cache_mb=0)
    machine = judge_machine(judge)
    print(f"# {machine}")
    contenders: list[tuple[str, Order]] = [(n, o) for n in NAMINGS for o in ORDERS]

    def ask(row: dict[str, Any], naming: str, order: Order) -> tuple[Any, float, int]:
        """The item's answer, the seconds ``decide``'s steps took, the tokens fed."""
        state = f"Question: {row['question']}"
        answers, _, seconds, fed = decided(judge, state, {"answer": question(row, naming, order)})
        return answers["answer"], seconds, fed

    for row in items[:2]:  # warm-up: first-call costs (allocations, kernels) are not the item's
        for naming, order in contenders:
            ask(row, naming, order)

    begin = time.perf_counter()
    probs: dict[tuple[str, Order], list[list[float]]] = {c: [] for c in contenders}
    spreads: dict[tuple[str, Order], list[float]] = {c: [] for c in contenders}
    seconds: dict[tuple[str, Order], list[float]] = {c: [] for c in contenders}
    tokens: dict[tuple[str, Order], list[int]] = {c: [] for c in contenders}
    orderings: dict[tuple[str, Order], int] = {}
    labels = []
    for k, row in enumerate(items):
        letters = list(row["options"])
        labels.append(letters.index(row["label"]))
        # Take turns, starting one later each item.
        for naming, order in contenders[k % 4 :] + contenders[: k % 4]:
            answer, s, fed = ask(row, naming, order)
            # The probabilities in A-E order: the texts are named in that order too.
            probs[naming, order].append(list(answer.probabilities.values()))
            spreads[naming, order].append(answer.order_spread)
            seconds[naming, order].append(s)
            tokens[naming, order].append(fed)
            orderings[naming, order] = answer.orderings
        if (k + 1) % 50 == 0:
            print(f"# {k + 1}/{len(items)} items", file=sys.stderr, flush=True)
    y = np.array(labels)
    rows_out = []
    for naming, order in contenders:
        c = (naming, order)
        p = np.array(probs[c])  # (n, 5)
        spread = np.array(spreads[c])
        base: tuple[str, Order] = (naming, "given")
        rows_out.append(
            {
                "naming": naming,
                "order": order,
                "orderings": orderings[c],
                "accuracy": accuracy(p, y),
                "ece": ece(p, y),
                "spread_mean": float(spread.mean()),
                "spread_p90": float(np.percentile(spread, 90)),
                "ms_per_item": 1000 * float(np.mean(seconds[c])),
                "tokens_per_item": float(np.mean(tokens[c])),
                "ms_ratio": float(np.mean(seconds[c]) / np.mean(seconds[base])),
                "tokens_ratio": float(np.mean(tokens[c]) / np.mean(tokens[base])),
            }
        )
    result = {
        "machine": machine,
        "quick": args.quick,
        "config": {
            "task": "commonsense_qa",
            "split": "test",
            "n": len(items),
            "limit": limit,
            "dropped_repeated_texts": dropped,
            "state": "Question: <question>",
            "instructions": INSTRUCTIONS,
            "max_orderings": 5,
            "prefix_cache": "off",
            "warmup_items": 2,
        },
        "rows": rows_out,
        "elapsed_s": round(time.perf_counter() - begin, 1),
    }
    write_text(args.out, json.dumps(result, indent=2) + "\n")
    print(markdown(result))


def markdown(result: dict[str, Any]) -> str:
    m, cfg = result["machine"], result["config"]
    lines = [
        f"commonsense_qa test, n={cfg['n']} ({cfg['dropped_repeated_texts']} items with a "
        f"repeated option text left out), {m['model']} ({m['dtype']}), {m['cpu']} "
        f"[{' '.join(m['cpu_flags'])}], {m['torch_threads']} torch threads, prefix cache off",
        "",
        "| naming | order | listings | accuracy | ECE | spread mean | spread p90 "
        "| ms/item | tokens/item | x ms | x tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['naming']} | {r['order']} | {r['orderings']} | {r['accuracy']:.3f} "
            f"| {r['ece']:.3f} | {r['spread_mean']:.3f} | {r['spread_p90']:.3f} "
            f"| {r['ms_per_item']:.0f} | {r['tokens_per_item']:.0f} | {r['ms_ratio']:.2f} "
            f"| {r['tokens_ratio']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
