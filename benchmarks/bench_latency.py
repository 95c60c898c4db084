"""Latency of one judgment against the usual ways of getting the same answer out of a model.

Measures, side by side in one run on the default model, the same prompt through five
contenders:

* ``judge``: ``Judge.judge(prompt, choices)``, the whole call (rendering, tokenizing, the packed
  forward pass, the probabilities);
* ``bare``: one bare forward pass ``model(ids, logits_to_keep=1)`` over the rendered prompt,
  already tokenized; the floor every contender pays at least once;
* ``generate``: generate-then-parse: the chat prompt without the response prefix (the chat
  template's generation prompt only), greedy ``model.generate`` (``do_sample=False``) of at
  most as many tokens as ``{"answer": "<longest choice>"}`` plus ``--gen-slack``, then
  decoding and ``json.loads`` of the output; tokenizing and parsing are timed too;
* ``per_choice``: per-choice likelihood scoring as lm-evaluation-harness does it: for each
  choice, one forward pass over prompt + choice (here the JSON-escaped choice and the closing
  ``"}``, so that the whole answer is scored), the continuation split off the joint encoding
  at the length of the prompt's own encoding, summing the continuation tokens' log-probs.
  Sequential, batch size 1: one pass per choice, as the method is usually run;
* ``constrained``: constrained greedy decoding: token by token with a KV cache, the logits
  masked to the tokens the choice trie allows (the trie of the canonical tokenizations of
  rendered prompt + JSON-escaped choice + ``"}``), tokens every live path shares fed without a
  decision, stopping when a single path remains (or a path ends). The trie is built inside the
  timed call (one tokenization per choice), as ``judge`` builds its own.

Rows: 2, 4, 16 and 64 choices (distinct words of one token each after the response prefix),
times prompts of about 100, 500 and 2000 tokens: a support-inbox routing prompt whose
conversation history is padded with more earlier messages to reach the length; where the fixed
part (instruction, new message, list of choices) is already longer, nothing is added. The
prompt lists the choices and asks for JSON, so every contender sees the same text; the actual
token counts are reported. Reps per row: 15, 7 and 5 for the three lengths (--reps overrides),
so that a full run stays within 60 minutes on a 2-core CPU. Every contender runs once to warm up, then the contenders alternate
rep by rep (the order rotating each rep) so that a slow phase of the machine hits all alike.
Reported per contender: median and p95 latency (numpy's linear-interpolated percentile, so
with 5 reps it lies between the two slowest) and the median of the rep-by-rep ratios to
``bare``. ``per_choice`` is skipped in a row where k passes x (reps + 1) of the row's measured
bare pass would exceed ``--per-choice-budget-s`` (in a full run on a 2-core CPU: 64 choices x
2000 tokens); the skip is printed and recorded. Prints a table and writes
``benchmarks/results/bench_latency.json``.

    python benchmarks/bench_latency.py [--dtype auto|float32|bfloat16] [--reps N]
        [--lengths 100 500 2000] [--choices 2 4 16 64] [--gen-slack 4]
        [--per-choice-budget-s 600] [--threads N] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from benchlib import cache_keyword, cpu_model, new_cache

from judge import Judge
from judge.atomicio import write_text
from judge.engine import json_escape

RESULTS = Path(__file__).resolve().parent / "results"
CONTENDERS = ("judge", "judge_generic", "bare", "generate", "per_choice", "constrained")
LENGTHS = (100, 500, 2000)
CHOICE_COUNTS = (2, 4, 16, 64)
REPS = {100: 15, 500: 7, 2000: 5}  # per target length: a full run fits in 60 minutes

INSTRUCTION = "Route the new message in this support inbox to the category that fits it best."
HISTORY = (
    "Customer: Hello, I ordered a pair of running shoes last week and the tracking page has "
    "not changed since Tuesday.",
    "Agent: Thanks for reaching out. I can see the parcel left our warehouse on Monday; the "
    "carrier sometimes scans it only at the local depot.",
    "Customer: OK. The order number is 48213, in case you need it. I paid with my credit card.",
    "Agent: Got it. I have added a note to the order and asked the carrier for an update.",
    "Customer: Also, the confirmation email had my old address in the footer. Is that the one "
    "you are shipping to?",
    "Agent: No, the shipping label uses the address you entered at checkout, 12 Harbour Lane. "
    "The footer shows the address saved on your profile.",
    "Customer: Can I change the saved address myself, or do you have to do it?",
    "Agent: You can change it under Account, then Addresses. Changes apply to future orders.",
    "Customer: Done. By the way, do the shoes come with a size exchange if they do not fit?",
    "Agent: Yes, exchanges are free within 30 days as long as the shoes are unworn and in the "
    "original box.",
    "Customer: Great. My sister wants to order the same model, is there a discount for a "
    "second pair?",
    "Agent: There is no multi-buy discount right now, but the newsletter often has a code for "
    "10 percent off a first order.",
    "Customer: Thanks, I will tell her. The tracking page still says the label was created.",
    "Agent: The carrier replied that the parcel is at the regional hub and should move today.",
)
# Candidate categories, most plausible for the message first; distinct_choices keeps those that
# are one token after the response prefix.
WORDS = (  # noqa: SIM905  # a list literal would take a line per word
    "payment delivery account security refund billing password login returns exchange repair "
    "order support feedback question request cancel technical product stock inventory address "
    "contact other legal press media event travel music health science business weather food "
    "education history art movie game book news market energy water animal nature family "
    "friend school work home city country world phone email chat video audio photo image text "
    "code data file user admin owner team staff client positive negative neutral happy safe "
    "easy hard small large apple orange bread fish wine car bus train plane boat road"
).split()
MESSAGE = "I was charged twice for order 48213 this morning. Can you refund the second charge?"


def make_prompt(choices: Sequence[str], history_lines: int) -> str:
    """The routing prompt with ``history_lines`` earlier messages, asking for JSON."""
    history = "\n".join(HISTORY[i % len(HISTORY)] for i in range(history_lines))
    context = f"\n\nConversation so far:\n{history}" if history_lines else ""
    return (
        f"{INSTRUCTION}{context}\n\nNew message: {MESSAGE}\n\n"
        f'Answer as JSON {{"answer": "<choice>"}} with one of the choices: {", ".join(choices)}.'
    )


def prompt_of_length(judge: Judge, choices: Sequence[str], target: int) -> str:
    """The prompt whose rendered token count is closest to ``target`` (never shorter than the
    prompt without history)."""

    def count(lines: int) -> int:
        return len(_ids(judge, judge.render(make_prompt(choices, lines))))

    lo, hi = 0, 1
    while count(hi) < target:
        hi *= 2
    while lo < hi:  # the fewest lines that reach the target
        mid = (lo + hi) // 2
        if count(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    best = lo if lo == 0 or count(lo) - target <= target - count(lo - 1) else lo - 1
    return make_prompt(choices, best)


def distinct_choices(judge: Judge, n: int) -> list[str]:
    """The first ``n`` of ``WORDS`` that are one token each after the response prefix."""
    rendered = judge.render("Pick a word.")
    base = _ids(judge, rendered)
    tail = _ids(judge, rendered + "x" + judge.response_suffix)[len(base) + 1 :]
    words: list[str] = []
    for word in WORDS:
        ids = _ids(judge, rendered + json_escape(word) + judge.response_suffix)
        if ids[: len(base)] == base and ids[len(base) + 1 :] == tail:
            words.append(word)  # one token each, so the words' tokens all differ
            if len(words) == n:
                return words
    raise RuntimeError(f"only {len(words)} of the candidate words are one token, need {n}")


def generation_budget(judge: Judge, choices: Sequence[str], slack: int) -> int:
    """Tokens of ``{"answer": "<longest choice>"}`` (the longest in tokens) plus ``slack``."""
    return max(len(_ids(judge, f'{{"answer": "{json_escape(c)}"}}')) for c in choices) + slack


def parse_answer(text: str, choices: Sequence[str]) -> str | None:
    """The answer of a generated ``{"answer": ...}`` object, None where it does not parse."""
    try:
        obj = json.loads(text.strip())
    except ValueError:
        return None
    answer = obj.get("answer") if isinstance(obj, dict) else None
    return answer if isinstance(answer, str) and answer in choices else None


class Contenders:
    """The five ways to answer one (prompt, choices) item; each returns the chosen choice."""

    def __init__(self, judge: Judge, prompt: str, choices: list[str], slack: int) -> None:
        self.judge = judge
        self.generic = Judge(judge.model, judge.tokenizer, prefix_cache_mb=0, lean=False)
        self.model: Any = judge.model  # the transformers causal LM
        self.prompt = prompt
        self.choices = choices
        self.rendered = judge.render(prompt)
        self.chat = judge.render(prompt, response_prefix="")
        self.prompt_ids = torch.tensor([_ids(judge, self.rendered)])
        self.max_new_tokens = generation_budget(judge, choices, slack)
        tok = judge.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_id = int(pad)
        self.cache_kw = cache_keyword(self.model)
        self.generated_tokens: list[int] = []
        self.last_output = ""

    def run_judge(self) -> str | None:
        return self.judge.judge(self.prompt, self.choices).choice

    def run_judge_generic(self) -> str | None:
        """The same judgment on the model's own decoder (the generic pass, as before)."""
        return self.generic.judge(self.prompt, self.choices).choice

    def run_bare(self) -> str | None:
        with torch.inference_mode():
            self.model(self.prompt_ids, logits_to_keep=1)
        return None

    def run_generate(self) -> str | None:
        tok = self.judge.tokenizer
        ids = torch.tensor([_ids(self.judge, self.chat)])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
            )
        new = out[0, ids.shape[1] :]
        self.generated_tokens.append(int(new.shape[0]))
        self.last_output = str(tok.decode(new, skip_special_tokens=True))
        return parse_answer(self.last_output, self.choices)

    def run_per_choice(self) -> str | None:
        context_len = len(_ids(self.judge, self.rendered))
        scores = []
        with torch.inference_mode():
            for choice in self.choices:
                whole = _ids(self.judge, self.rendered + json_escape(choice) + '"}')
                continuation = torch.tensor(whole[context_len:])
                ids = torch.tensor([whole[:-1]])
                logits = self.model(ids, logits_to_keep=len(continuation)).logits[0]
                logprobs = torch.log_softmax(logits.float(), dim=-1)
                scores.append(float(logprobs.gather(1, continuation[:, None]).sum()))
        return self.choices[int(np.argmax(scores))]

    def run_constrained(self) -> str | None:
        paths = [_ids(self.judge, self.rendered + json_escape(c) + '"}') for c in self.choices]
        live = list(range(len(paths)))
        cache = new_cache(self.model)
        fed = 0
        with torch.inference_mode():
            while len(live) > 1:
                depth = _shared_length([paths[i] for i in live])
                if any(len(paths[i]) == depth for i in live):
                    break  # a path ends here: it is complete
                step = torch.tensor([paths[live[0]][fed:depth]])
                logits = self.model(
                    input_ids=step, use_cache=True, logits_to_keep=1, **{self.cache_kw: cache}
                ).logits[0, -1]
                allowed = sorted({paths[i][depth] for i in live})
                masked = torch.full_like(logits, float("-inf"))
                masked[allowed] = logits[allowed]
                token = int(torch.argmax(masked))
                live = [i for i in live if paths[i][depth] == token]
                fed = depth
        return self.choices[live[0]]

    def functions(self) -> dict[str, Callable[[], str | None]]:
        return {
            "judge": self.run_judge,
            "judge_generic": self.run_judge_generic,
            "bare": self.run_bare,
            "generate": self.run_generate,
            "per_choice": self.run_per_choice,
            "constrained": self.run_constrained,
        }


def bench_row(
    judge: Judge, choices: list[str], target: int, reps: int, slack: int, budget_s: float
) -> dict[str, Any]:
    prompt = prompt_of_length(judge, choices, target)
    c = Contenders(judge, prompt, choices, slack)
    functions = c.functions()
    # Warm-up: every contender once; the bare pass twice so its second time can size the row.
    c.run_bare()
    bare_s = _timed(c.run_bare)
    estimate_s = len(choices) * bare_s * (reps + 1)
    skipped: dict[str, str] = {}
    if estimate_s > budget_s:
        skipped["per_choice"] = (
            f"skipped: {len(choices)} passes x {reps + 1} runs of a {bare_s * 1000:.0f} ms "
            f"pass is about {estimate_s:.0f} s, over the {budget_s:.0f} s budget"
        )
        del functions["per_choice"]
    picks = {name: fn() for name, fn in functions.items() if name != "bare"}
    first_output = c.last_output
    c.generated_tokens.clear()

    names = list(functions)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            samples[name].append(_timed(functions[name]))

    contenders: dict[str, Any] = {}
    for name in CONTENDERS:
        if name in skipped:
            contenders[name] = {"skipped": skipped[name]}
            continue
        ms = [s * 1000 for s in samples[name]]
        contenders[name] = {
            "median_ms": statistics.median(ms),
            "p95_ms": float(np.percentile(ms, 95)),
            "ratio_to_bare": statistics.median(
                s / b for s, b in zip(samples[name], samples["bare"], strict=True)
            ),
        }
    return {
        "choices": len(choices),
        "target_tokens": target,
        "prompt_tokens": int(c.prompt_ids.shape[1]),
        "generation_prompt_tokens": len(_ids(judge, c.chat)),
        "reps": reps,
        "max_new_tokens": c.max_new_tokens,
        "generated_tokens_mean": statistics.mean(c.generated_tokens),
        "generated_output": first_output,
        "generated_parses": picks["generate"] is not None,
        "agrees_with_judge": {
            name: pick == picks["judge"] for name, pick in picks.items() if name != "judge"
        },
        "contenders": contenders,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--reps", type=int, help="reps in every row (default: 15/7/5 by length)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--choices", type=int, nargs="+", default=list(CHOICE_COUNTS))
    parser.add_argument(
        "--gen-slack", type=int, default=4, help="generate: tokens beyond the longest answer"
    )
    parser.add_argument(
        "--per-choice-budget-s",
        type=float,
        default=600.0,
        help="skip per_choice in a row whose estimated time exceeds this",
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: torch's own, one per core)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a small run: 2 and 4 choices, 100 tokens, 2 reps"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_latency.json")
    args = parser.parse_args()
    lengths, counts = args.lengths, args.choices
    if args.quick:
        lengths, counts = [100], [2, 4]
    reps_of = {n: 2 if args.quick else args.reps or REPS.get(n, 5) for n in lengths}

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    judge = Judge.load(dtype=args.dtype, prefix_cache_mb=0)  # each method pays for its prompt
    machine = _machine(judge)
    print(f"# {machine}")
    print(
        "# per_choice: sequential, one pass per choice, batch size 1; generate: greedy, "
        f"max_new_tokens = longest JSON answer + {args.gen_slack}"
    )
    words = distinct_choices(judge, max(counts))
    rows = []
    for target in lengths:
        for n in counts:
            row = bench_row(
                judge, words[:n], target, reps_of[target], args.gen_slack, args.per_choice_budget_s
            )
            rows.append(row)
            print(_format_row(row), flush=True)
    elapsed = time.perf_counter() - start
    skipped = [
        {"choices": r["choices"], "prompt_tokens": r["prompt_tokens"], "contender": name, **info}
        for r in rows
        for name, info in r["contenders"].items()
        if "skipped" in info
    ]
    print(f"# {len(skipped)} contender(s) skipped; total {elapsed:.0f} s")
    result = {
        "machine": machine,
        "quick": args.quick,
        "config": {
            "lengths": lengths,
            "choice_counts": counts,
            "reps": {str(k): v for k, v in reps_of.items()},
            "gen_slack": args.gen_slack,
            "per_choice_mode": "sequential",
            "per_choice_budget_s": args.per_choice_budget_s,
            "choices": words,
        },
        "rows": rows,
        "skipped": skipped,
        "elapsed_s": elapsed,
    }
    write_text(args.out, json.dumps(result, indent=2))


def _format_row(row: dict[str, Any]) -> str:
    lines = [
        f"{row['choices']} choices, prompt {row['prompt_tokens']} tokens "
        f"(target {row['target_tokens']}, generation prompt {row['generation_prompt_tokens']}), "
        f"{row['reps']} reps; generate: {row['generated_tokens_mean']:.1f} of "
        f"{row['max_new_tokens']} tokens, parses: {row['generated_parses']}, "
        f"output {row['generated_output']!r}",
        f"  {'contender':12} {'median ms':>10} {'p95 ms':>10} {'x bare':>8}",
    ]
    for name, c in row["contenders"].items():
        if "skipped" in c:
            lines.append(f"  {name:12} {c['skipped']}")
        else:
            lines.append(
                f"  {name:12} {c['median_ms']:10.1f} {c['p95_ms']:10.1f} {c['ratio_to_bare']:8.2f}"
            )
    return "\n".join(lines)


def _ids(judge: Judge, text: str) -> list[int]:
    return list(judge.tokenizer(text, add_special_tokens=False).input_ids)


def _shared_length(paths: Sequence[Sequence[int]]) -> int:
    n = min(len(p) for p in paths)
    for i in range(n):
        if any(p[i] != paths[0][i] for p in paths[1:]):
            return i
    return n


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _machine(judge: Judge) -> dict[str, Any]:
    import transformers

    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "dtype": judge.dtype,
        "model": judge.model_id,
    }


if __name__ == "__main__":
    main()
