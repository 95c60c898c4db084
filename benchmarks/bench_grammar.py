"""Grammar-exact against canonical paths: what judge reads and what a masked decoder emits.

For every shared labeled set (../shared/data, the first 15 test items of each by default), side
by side on the same items:

    canonical  ``Judge.judge``: each choice's probability from its canonical token path (the
               tokenizer's own encoding of prompt + choice + suffix), one packed pass
    grammar    ``Judge(choice_paths="grammar").judge``: what decoding under a grammar engine's
               mask emits (every token path that spells the choice, each step renormalised
               over the allowed tokens; llguidance with ``no_forcing`` and XGrammar mask this
               way), every position of the choices' grammar tree packed into one pass
    reference  ``judge.grammar.grammar_probabilities``: the same distribution, one plain
               forward pass per position (the check on the one-pass mode)

Reported per set: the mean and max total variation between the two distributions (half the L1
distance), the items whose argmax differs, each argmax's accuracy against the labels, the
tree's size (positions: token paths to the nodes where two or more choices remain, each a
distribution to read; tokens per choice: allowed tokens that settle on a choice, summed over
the nodes, mean and range over the choices), the tokens each mode adds to the pass after the
prompt (mean per item), the largest difference between the one-pass grammar mode and the
reference, and each method's wall time per item. The three take turns item by item (rotating
the order), after a warm-up item; the prefix cache is off, so every item is computed cold.

    python benchmarks/bench_grammar.py [--limit 15] [--dtype float32] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import judge_machine

from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"


def run_task(judge: Any, task: Any, limit: int) -> dict[str, Any]:
    """The three distributions for the first ``limit`` test items of ``task``, and their
    summary."""
    from calibration.tasks import load_split, task_prompt
    from judge import Judge
    from judge.grammar import GrammarVocabulary, choice_targets, grammar_probabilities

    items, _ = load_split(task, "test", limit)
    one_pass = Judge(
        judge.model,
        judge.tokenizer,
        model_id=judge.model_id,
        weights_sha256=judge.weights_sha256,
        prefix_cache_mb=0,
        choice_paths="grammar",
    )
    choices = list(task.choices)
    tree = GrammarVocabulary.of(judge.tokenizer).tree(
        choice_targets(choices, judge.response_suffix)
    )
    per_choice = tree.determining_tokens()

    def canonical(prompt: str) -> list[float]:
        return list(judge.judge(prompt, choices).probs)

    def grammar(prompt: str) -> list[float]:
        return list(one_pass.judge(prompt, choices).probs)

    def reference(prompt: str) -> list[float]:
        return list(grammar_probabilities(judge, prompt, choices).values())

    contenders = {"canonical": canonical, "grammar": grammar, "reference": reference}
    for fn in contenders.values():  # warm-up: first-call costs are not the item's
        fn(task_prompt(task, items[0].text))
    rows = []
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    moved = 0
    added: dict[str, list[int]] = {"canonical": [], "grammar": []}
    for k, item in enumerate(items):
        prompt = task_prompt(task, item.text)
        query = {"prompt": prompt, "choices": choices}
        prepared = judge.prepare(query)
        # The trie's root before the prompt's last token: the canonical paths and the grammar
        # would then not start from the same tokens.
        moved += len(prepared.trie.context) < prepared.prompt_tokens
        # Tokens each mode feeds after the prompt's own (the trie's, and where its root moved
        # back, the prompt tokens it feeds again).
        for name, engine in (("canonical", judge), ("grammar", one_pass)):
            trie = engine.prepare(query).trie
            added[name].append(trie.packed_length - prepared.prompt_tokens)
        probs: dict[str, list[float]] = {}
        names = list(contenders)
        order = names[k % 3 :] + names[: k % 3]  # take turns
        for name in order:
            start = time.perf_counter()
            probs[name] = contenders[name](prompt)
            seconds[name].append(time.perf_counter() - start)
        p, q = np.array(probs["canonical"]), np.array(probs["grammar"])
        r = np.array(probs["reference"])
        rows.append(
            {
                "id": item.id,
                "label": item.label,
                "canonical": p.tolist(),
                "grammar": q.tolist(),
                "reference": r.tolist(),
                "tv": float(0.5 * np.abs(p - q).sum()),
                "one_pass_error": float(np.abs(q - r).max()),
            }
        )
    tv = np.array([r["tv"] for r in rows])
    labels = np.array([choices.index(r["label"]) for r in rows])
    top_p = np.array([int(np.argmax(r["canonical"])) for r in rows])
    top_q = np.array([int(np.argmax(r["grammar"])) for r in rows])
    return {
        "task": task.name,
        "choices": choices,
        "n": len(rows),
        "positions": sum(tree.positions.values()),
        "nodes": len(tree.nodes),
        "tokens_per_choice": dict(zip(choices, per_choice, strict=True)),
        "tv_mean": float(tv.mean()),
        "tv_max": float(tv.max()),
        "argmax_differs": int((top_p != top_q).sum()),
        "one_pass_error_max": max(r["one_pass_error"] for r in rows),
        "tokens_added_canonical": float(np.mean(added["canonical"])),
        "tokens_added_grammar": float(np.mean(added["grammar"])),
        "accuracy_canonical": float((top_p == labels).mean()),
        "accuracy_grammar": float((top_q == labels).mean()),
        "ms_canonical": 1000 * float(np.mean(seconds["canonical"])),
        "ms_grammar": 1000 * float(np.mean(seconds["grammar"])),
        "ms_reference": 1000 * float(np.mean(seconds["reference"])),
        "root_moved": moved,
        "items": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--limit", type=int, default=15, help="test items per set (default 15)")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, help="torch threads (default: one per core)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 items per set")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_grammar.json")
    args = parser.parse_args()

    import torch

    from calibration.tasks import load_task
    from judge import Judge

    if args.threads:
        torch.set_num_threads(args.threads)
    limit = 3 if args.quick else args.limit
    names = sorted(p.name for p in args.data.iterdir() if (p / "task.json").is_file())
    # Off: the canonical pass must not read what an earlier item's pass left in the cache.
    judge = Judge.load(dtype=args.dtype, prefix_cache_mb=0)
    machine = judge_machine(judge)
    print(f"# {machine}")
    begin = time.perf_counter()
    tasks = []
    for name in names:
        tasks.append(run_task(judge, load_task(args.data / name), limit))
        print(f"# {name} done", flush=True)
    result = {
        "machine": machine,
        "quick": args.quick,
        "config": {"split": "test", "limit": limit, "prefix_cache": "off", "warmup_items": 1},
        "tasks": tasks,
        "elapsed_s": round(time.perf_counter() - begin, 1),
    }
    write_text(args.out, json.dumps(result, indent=2) + "\n")
    print(markdown(result))


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"first {result['config']['limit']} test items per set, {m['model']} ({m['dtype']}), "
        f"{m['cpu']}, {m['torch_threads']} torch threads, prefix cache off",
        "",
        "| set | n | positions | tokens/choice | tokens added canonical / grammar | mean TV "
        "| max TV | argmax differs | acc canonical | acc grammar | one pass vs reference "
        "| ms canonical | ms grammar | ms reference |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in result["tasks"]:
        per = list(t["tokens_per_choice"].values())
        lines.append(
            f"| {t['task']} | {t['n']} | {t['positions']} "
            f"| {np.mean(per):.1f} ({min(per)}-{max(per)}) "
            f"| {t['tokens_added_canonical']:.1f} / {t['tokens_added_grammar']:.1f} "
            f"| {t['tv_mean']:.3f} | {t['tv_max']:.3f} | {t['argmax_differs']} "
            f"| {t['accuracy_canonical']:.3f} | {t['accuracy_grammar']:.3f} "
            f"| {t['one_pass_error_max']:.1e} | {t['ms_canonical']:.0f} "
            f"| {t['ms_grammar']:.0f} | {t['ms_reference']:.0f} |"
        )
    moved = sum(t["root_moved"] for t in result["tasks"])
    lines += ["", f"items whose trie root moved before the prompt's last token: {moved}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
