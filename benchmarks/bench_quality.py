"""Answer quality on every shared dataset: the judge, raw and calibrated, against generate-then-parse.

For each task under ../shared/data (or --data), on the default model:

* ``judge``: per-choice log-probabilities from ``tasks.judge_task_items`` on the calibration and
  test splits; a calibration map (``calibration.scaling.fit_calibrator``) is fitted on the
  calibration split only and applied (``fit.map.apply``) to the test split. Reported on the
  test split, raw (softmax of the log-probabilities) and calibrated: accuracy, NLL and ECE
  (``calibration.metrics``, 15 equal-width bins).
* ``generate``: generate-then-parse on the test split: the task's prompt with its last line
  replaced by ``Answer as JSON {"answer": "<choice>"} with one of the choices: <choices>.``,
  rendered with the chat template's generation prompt and no response prefix, greedy ``model.generate`` (``do_sample=False``)
  of at most as many tokens as ``{"answer": "<longest choice>"}`` plus ``--gen-slack``,
  stopped at end of sequence, then ``classify_output``. Items are generated in batches of
  ``--gen-batch-size``, left-padded and grouped by length (1: one at a time). Reported:
  accuracy (a failure counts as wrong), accuracy among the parsed outputs, agreement with the
  judge's raw choice, and the failure rate by failure type, with how many of each hit the
  token limit (and how many parse errors hold no ``{`` at all). The budget cannot turn a
  success into a failure: a successful output is at most the canonical tokens of the longest
  answer unless it spends more than the slack on extra whitespace; a larger slack only moves
  failures between types (prose cut off before any ``{`` is a parse error). In bfloat16 the
  batch composition nudges the logits, so a near-tie can go either way, as in ``judge_batch``.

An output is a success when, after stripping surrounding whitespace, the whole of it is one
valid JSON object (``json.loads``) whose ``"answer"`` is a string exactly equal to one of the
choices (case and whitespace included); other keys are allowed. Every other output fails and is
classified exactly once, by the first of these that holds (``s`` is the stripped output):

1. ``markdown_wrap``: ``s`` starts with a code fence (three backticks);
2. ``prose_preamble``: ``s`` contains ``{`` and 20 or more characters (after stripping) of
   text come before the first one;
3. ``schema_mirroring``: ``s`` has a JSON Schema keyword as a quoted key (``"$schema"``,
   ``"$defs"``, ``"$ref"``, ``"type"``, ``"properties"``, ``"enum"``, ``"required"``,
   ``"additionalProperties"``, ``"anyOf"``, ``"oneOf"``, ``"allOf"`` followed by a colon);
4. ``multiple_objects``: more than one ``{`` opens at the top level (outside strings, arrays
   and other objects), complete or not;
5. ``trailing_text``: a JSON object parses from the first ``{`` and non-whitespace text
   follows it;
6. ``parse_error``: ``s`` is not valid JSON, or is valid JSON but not an object (an output
   with no ``{`` at all, prose included, lands here);
7. ``enum_violation``: ``s`` is a JSON object with an ``"answer"`` that is not one of the
   choices (not a string, another case, extra whitespace, another word);
8. ``missing_field``: ``s`` is a JSON object without ``"answer"``.

Each split is subsampled to at most --max-items items (default 300, so that a full run on a
2-core CPU fits in 60 minutes), drawn at random with --seed and kept in file order; the run
prints and records which splits were subsampled. Prints a table per dataset and writes
``benchmarks/results/bench_quality.json`` and ``benchmarks/results/quality_failures_sample.jsonl``
(up to 5 raw failed outputs per failure type per dataset, with task, id, failure type, gold
label and whether the output hit the token limit).

    python benchmarks/bench_quality.py [--tasks sms_spam trec] [--max-items 300] [--seed 0]
        [--gen-batch-size 8] [--gen-slack 4] [--threads N] [--quick] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import judge_machine

from calibration.tasks import (
    LabeledItem,
    LabeledScores,
    Task,
    judge_task_items,
    load_split,
    load_task,
    task_prompt,
)
from judge import Judge
from judge.atomicio import write_text
from judge.engine import json_escape

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT.parent / "shared" / "data"
QUICK_TASKS = ("sms_spam", "trec")
SAMPLES_PER_TYPE = 5

FAILURE_TYPES = (
    "markdown_wrap",
    "prose_preamble",
    "schema_mirroring",
    "multiple_objects",
    "trailing_text",
    "parse_error",
    "enum_violation",
    "missing_field",
)
SUCCESS = (
    "after stripping surrounding whitespace, the whole output is one valid JSON object whose "
    '"answer" is a string exactly equal to one of the choices; other keys are allowed'
)
_SCHEMA_KEY = re.compile(
    r'"(?:\$schema|\$defs|\$ref|type|properties|enum|required|additionalProperties|anyOf|'
    r'oneOf|allOf)"\s*:'
)
_PREAMBLE_CHARS = 20
_INVALID = object()


def classify_output(text: str, choices: list[str]) -> tuple[str | None, str | None]:
    """(the parsed answer, None) for a success, else (None, the failure type); see the module
    docstring for the definitions and their precedence."""
    s = text.strip()
    try:
        obj: Any = json.loads(s)
    except ValueError:
        obj = _INVALID
    if isinstance(obj, dict):
        answer = obj.get("answer")
        if isinstance(answer, str) and answer in choices:
            return answer, None
    if s.startswith("```"):
        return None, "markdown_wrap"
    brace = s.find("{")
    if brace >= 0 and len(s[:brace].strip()) >= _PREAMBLE_CHARS:
        return None, "prose_preamble"
    if _SCHEMA_KEY.search(s):
        return None, "schema_mirroring"
    if _top_level_objects(s) > 1:
        return None, "multiple_objects"
    if brace >= 0:
        try:
            _, end = json.JSONDecoder().raw_decode(s, brace)
        except ValueError:
            pass
        else:
            if s[end:].strip():
                return None, "trailing_text"
    if not isinstance(obj, dict):
        return None, "parse_error"
    return None, "enum_violation" if "answer" in obj else "missing_field"


def _top_level_objects(s: str) -> int:
    """How many ``{`` open at nesting depth 0, outside JSON strings."""
    depth = count = 0
    in_string = escaped = False
    for ch in s:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            count += ch == "{" and depth == 0
            depth += 1
        elif ch in "}]":
            depth = max(depth - 1, 0)
    return count


def subsample(
    items: list[LabeledItem], limit: int, seed: int, key: str
) -> tuple[list[LabeledItem], bool]:
    """At most ``limit`` items drawn at random (seeded by ``seed`` and ``key``), in file order."""
    if len(items) <= limit:
        return items, False
    picked = sorted(random.Random(f"{seed}:{key}").sample(range(len(items)), limit))
    return [items[i] for i in picked], True


def generation_prompt(task: Task, text: str) -> str:
    """``task_prompt`` with its last line ("Answer with one of: ...") asking for JSON instead."""
    prompt = task_prompt(task, text)
    head, _, last = prompt.rpartition("\n\n")
    if head and last.startswith("Answer with one of"):
        prompt = head
    choices = ", ".join(task.choices)
    return (
        f'{prompt}\n\nAnswer as JSON {{"answer": "<choice>"}} with one of the choices: {choices}.'
    )


def generation_budget(judge: Judge, choices: Sequence[str], slack: int) -> int:
    """Tokens of ``{"answer": "<longest choice>"}`` (the longest in tokens) plus ``slack``."""
    tok = judge.tokenizer
    return slack + max(
        len(tok(f'{{"answer": "{json_escape(c)}"}}', add_special_tokens=False).input_ids)
        for c in choices
    )


def generate_outputs(
    judge: Judge, prompts: Sequence[str], max_new_tokens: int, batch_size: int
) -> list[tuple[str, bool, int]]:
    """Greedy outputs for ``prompts`` (chat-rendered, no response prefix): (text, whether it
    hit ``max_new_tokens`` before the end of sequence, tokens generated)."""
    import torch

    tok = judge.tokenizer
    model: Any = judge.model
    eos = model.generation_config.eos_token_id
    eos_ids = {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
    eos_ids.add(int(tok.eos_token_id))
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    encoded = [
        list(tok(judge.render(p, response_prefix=""), add_special_tokens=False).input_ids)
        for p in prompts
    ]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    outputs: list[tuple[str, bool, int]] = [("", False, 0)] * len(prompts)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(encoded[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):  # left padding
            ids[row, width - len(encoded[i]) :] = torch.tensor(encoded[i])
            mask[row, width - len(encoded[i]) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        for row, i in enumerate(chunk):
            new = out[row, width:].tolist()
            stop = next((k for k, t in enumerate(new) if t in eos_ids), None)
            kept = new if stop is None else new[:stop]
            text = str(tok.decode(kept, skip_special_tokens=True))
            outputs[i] = (text, stop is None and len(new) >= max_new_tokens, len(kept))
    return outputs


def _judge_items(
    judge: Judge, task: Task, items: list[LabeledItem], batch_size: int
) -> LabeledScores:
    """The judge's scores on ``items``, columns in ``task.choices`` order."""
    return judge_task_items(judge, task, items, batch_size=batch_size)


def bench_task(
    judge: Judge, task: Task, args: argparse.Namespace
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from calibration.metrics import accuracy, ece, nll
    from calibration.scaling import fit_calibrator, softmax

    splits: dict[str, Any] = {}
    items: dict[str, list[LabeledItem]] = {}
    for split in ("calibration", "test"):
        everything, _ = load_split(task, split)
        items[split], sampled = subsample(
            everything, args.max_items, args.seed, f"{task.name}:{split}"
        )
        splits[split] = {"n": len(items[split]), "of": len(everything), "subsampled": sampled}
        _log(
            f"{task.name}/{split}: {len(items[split])} of {len(everything)} items"
            + (f" (seeded subsample, seed {args.seed})" if sampled else "")
        )

    start = time.perf_counter()
    cal = _judge_items(judge, task, items["calibration"], args.batch_size)
    judge_cal_s = time.perf_counter() - start
    start = time.perf_counter()
    test = _judge_items(judge, task, items["test"], args.batch_size)
    test_labels = test.labels
    judge_test_s = time.perf_counter() - start
    _log(f"{task.name}: judged in {judge_cal_s + judge_test_s:.0f} s")

    fit = fit_calibrator(cal.log_probabilities, cal.labels)
    raw = softmax(test.log_probabilities)
    calibrated = fit.map.apply(test.log_probabilities)

    def metrics(probs: np.ndarray) -> dict[str, float]:
        return {
            "accuracy": accuracy(probs, test_labels),
            "nll": nll(probs, test_labels),
            "ece": ece(probs, test_labels),
        }

    max_new_tokens = generation_budget(judge, task.choices, args.gen_slack)
    prompts = [generation_prompt(task, item.text) for item in items["test"]]
    start = time.perf_counter()
    outputs = generate_outputs(judge, prompts, max_new_tokens, args.gen_batch_size)
    gen_s = time.perf_counter() - start
    _log(f"{task.name}: generated in {gen_s:.0f} s")

    failures: Counter[str] = Counter()
    truncated: Counter[str] = Counter()
    no_brace = 0
    samples: list[dict[str, Any]] = []
    correct = parsed = agree = 0
    judge_choice = raw.argmax(axis=1)
    for n, (item, (text, hit_limit, _)) in enumerate(zip(items["test"], outputs, strict=True)):
        answer, failure = classify_output(text, task.choices)
        if failure is None:
            parsed += 1
            correct += answer == item.label
            agree += answer == task.choices[judge_choice[n]]
            continue
        failures[failure] += 1
        truncated[failure] += hit_limit
        no_brace += failure == "parse_error" and "{" not in text
        if failures[failure] <= SAMPLES_PER_TYPE:
            samples.append(
                {
                    "task": task.name,
                    "id": item.id,
                    "failure": failure,
                    "label": item.label,
                    "truncated": hit_limit,
                    "output": text,
                }
            )
    n_test = len(items["test"])
    row = {
        "task": task.name,
        "choices": task.choices,
        "splits": splits,
        "judge": {
            "raw": metrics(raw),
            "calibrated": {
                **metrics(calibrated),
                "method": fit.map.method,
                "temperature": fit.map.temperature,
                "bias": getattr(fit.map, "bias", None),
                "note": fit.note,
            },
            "calibration_seconds": judge_cal_s,
            "test_seconds": judge_test_s,
            "test_items_per_s": n_test / judge_test_s,
        },
        "generate": {
            "accuracy": correct / n_test,
            "parsed": parsed,
            "accuracy_on_parsed": correct / parsed if parsed else None,
            "agreement_with_judge_on_parsed": agree / parsed if parsed else None,
            "parse_failure_rate": (n_test - parsed) / n_test,
            "failures": {t: failures[t] for t in FAILURE_TYPES},
            "failure_rates": {t: failures[t] / n_test for t in FAILURE_TYPES},
            "truncated": {t: truncated[t] for t in FAILURE_TYPES},
            "parse_errors_without_brace": no_brace,
            "max_new_tokens": max_new_tokens,
            "mean_new_tokens": float(np.mean([k for _, _, k in outputs])),
            "seconds": gen_s,
            "items_per_s": n_test / gen_s,
        },
    }
    return row, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--tasks", nargs="*", help="task names (default: every task in --data)")
    parser.add_argument("--max-items", type=int, default=300, help="per split, seeded subsample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--batch-size", type=int, default=8, help="judge_labeled batch size")
    parser.add_argument("--gen-batch-size", type=int, default=8)
    parser.add_argument(
        "--gen-slack", type=int, default=4, help="generate: tokens beyond the longest answer"
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: torch's own, one per core)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a small run: sms_spam and trec, 20 items per split"
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()

    names = args.tasks or sorted(p.name for p in args.data.iterdir() if (p / "task.json").exists())
    if args.quick:
        if not args.tasks:
            preferred = [n for n in QUICK_TASKS if n in names]
            names = preferred if len(preferred) == 2 else names
        names, args.max_items = names[:2], 20

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    judge = Judge.load(dtype=args.dtype)
    machine = judge_machine(judge)
    print(f"# {machine}")
    print(
        f"# at most {args.max_items} items per split (seeded subsample, seed {args.seed}); "
        f"generate: greedy, batches of {args.gen_batch_size}, "
        f"max_new_tokens = longest JSON answer + {args.gen_slack}",
        flush=True,
    )
    rows, samples = [], []
    for name in names:
        row, task_samples = bench_task(judge, load_task(args.data / name), args)
        rows.append(row)
        samples += task_samples
        print(format_task(row), flush=True)
    print(format_summary(rows))
    elapsed = time.perf_counter() - start
    print(f"# total {elapsed:.0f} s")
    result = {
        "machine": machine,
        "quick": args.quick,
        "config": {
            "data": str(args.data),
            "tasks": names,
            "max_items": args.max_items,
            "seed": args.seed,
            "judge_batch_size": args.batch_size,
            "gen_batch_size": args.gen_batch_size,
            "gen_slack": args.gen_slack,
            "ece_bins": 15,
        },
        "success": SUCCESS,
        "failure_types": list(FAILURE_TYPES),
        "tasks": rows,
        "elapsed_s": elapsed,
    }
    write_text(args.out_dir / "bench_quality.json", json.dumps(result, indent=2))
    write_text(
        args.out_dir / "quality_failures_sample.jsonl",
        "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples),
    )


def format_task(row: dict[str, Any]) -> str:
    sp = row["splits"]
    sampled = any(s["subsampled"] for s in sp.values())
    j, g = row["judge"], row["generate"]
    cal = j["calibrated"]
    lines = [
        f"{row['task']}: {len(row['choices'])} choices; calibration "
        f"{sp['calibration']['n']} of {sp['calibration']['of']}, test {sp['test']['n']} of "
        f"{sp['test']['of']}" + (" (seeded subsample)" if sampled else ""),
        f"  {'contender':22} {'accuracy':>8} {'NLL':>7} {'ECE':>7} {'failed':>7} {'items/s':>8}",
        f"  {'judge raw':22} {j['raw']['accuracy']:8.3f} {j['raw']['nll']:7.3f} "
        f"{j['raw']['ece']:7.3f} {'-':>7} {j['test_items_per_s']:8.1f}",
        f"  {'judge calibrated':22} {cal['accuracy']:8.3f} {cal['nll']:7.3f} {cal['ece']:7.3f} "
        f"{'-':>7} {'':>8}  {cal['method']}, T={cal['temperature']:.2f}",
        f"  {'generate-then-parse':22} {g['accuracy']:8.3f} {'-':>7} {'-':>7} "
        f"{g['parse_failure_rate']:7.1%} {g['items_per_s']:8.1f}",
    ]
    failed = [
        f"{t} {g['failures'][t]}"
        + (f" ({g['truncated'][t]} at the limit)" if g["truncated"][t] else "")
        for t in FAILURE_TYPES
        if g["failures"][t]
    ]
    lines.append("  failures: " + (", ".join(failed) if failed else "none"))
    if g["parse_errors_without_brace"]:
        lines.append(f"  parse errors with no '{{' at all: {g['parse_errors_without_brace']}")
    return "\n".join(lines)


def format_summary(rows: list[dict[str, Any]]) -> str:
    lines = [
        "",
        f"{'task':16} {'judge acc':>9} {'calib acc':>9} {'ECE raw':>8} {'ECE cal':>8} "
        f"{'gen acc':>8} {'gen fail':>8}",
    ]
    for r in rows:
        j, g = r["judge"], r["generate"]
        lines.append(
            f"{r['task']:16} {j['raw']['accuracy']:9.3f} {j['calibrated']['accuracy']:9.3f} "
            f"{j['raw']['ece']:8.3f} {j['calibrated']['ece']:8.3f} {g['accuracy']:8.3f} "
            f"{g['parse_failure_rate']:8.1%}"
        )
    return "\n".join(lines)


def _log(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
