"""Answer quality on every shared dataset: judge in both path modes against a careful prompt-forced pipeline and real constrained generation.

For each task under ../shared/data (or --data), on the default model, the same test items:

* ``judge canonical`` and ``judge grammar``: per-choice log-probabilities from
  ``tasks.judge_task_items`` on the calibration and test splits, read on each choice's canonical
  token path (``choice_paths="canonical"``) and on every token path a grammar engine's mask
  allows (``"grammar"``, what masked decoding emits). A calibration map
  (``calibration.maps.scaling.fit_calibrator``) is fitted on the calibration split only and applied
  to the test split. Reported raw (softmax of the log-probabilities) and calibrated: accuracy
  with its 95% Clopper-Pearson interval, NLL and ECE (15 equal-width bins).
* ``careful``: a prompt-forced pipeline as a careful user builds one. The task's prompt with its
  last line replaced by the answer's schema given as every valid reply (``careful_prompt``: one
  JSON object ``{"answer": "<choice>"}`` per choice, listed; a JSON Schema object there was
  copied back by this model), rendered with the chat template's generation prompt and no
  response prefix; greedy ``model.generate`` of up to
  --max-new-tokens (default 256), stopped at end of sequence. The output is *recovered*
  (``recover``): code fences stripped, the first JSON object decoded from the first ``{``
  (text around it ignored), validated (an object with a string ``"answer"`` that, stripped of
  surrounding whitespace, is one of the choices). A failure is retried up to 3 times in the
  same conversation: the model's reply, then a user turn that quotes the validation error and
  asks for the JSON object alone. Reported: first-attempt success (strict: the whole output
  is the JSON object, ``classify_output``; recovered: ``recover`` succeeds), success with
  retries, attempts per item, accuracy (a final failure counts as wrong) with its interval,
  and per first-attempt failure its type (``classify_output``) and the violation underneath it
  once recovered (``recover``'s: no_json_object, missing_field, enum_violation, or none: the
  recovery fixed it). It states no probability, so it has no NLL or ECE.
* ``constrained``: real constrained generation through a grammar engine, llguidance (from
  PyPI), with its default settings: the grammar is one literal per choice, the whole JSON
  object ``{"answer": "<choice>"}``; greedy decoding on the judge's own prompt (``task_prompt``,
  which names the choices) rendered with the generation prompt, with a KV cache, the engine's mask applied to the logits at every step and
  the bytes it forces fed as its tokens without a model step (``compute_ff_tokens``), one item
  at a time. Its confidence is the probability of the path it took under the mask (the
  product of its masked steps), so it has an ECE; accuracy with its interval.

Time per item: each contender's wall time over the test items divided by their number (the
judge and the careful pipeline in batches of --batch-size / --gen-batch-size, constrained
generation one item at a time, as a grammar engine decodes a request).

An output is a *strict* success when, after stripping surrounding whitespace, the whole of it
is one valid JSON object (``json.loads``) whose ``"answer"`` is a string exactly equal to one of
the choices (case and whitespace included); other keys are allowed. Every other output is
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

Each split is subsampled to at most --max-items items (default 300), drawn at random with
--seed and kept in file order; the run prints and records which splits were subsampled. Prints
a table per dataset and writes ``benchmarks/results/bench_quality.json`` and
``benchmarks/results/quality_failures_sample.jsonl`` (up to 5 raw failed first attempts per
failure type per dataset, with task, id, failure type, the violation underneath, gold label and
whether the output hit the token limit).

    python benchmarks/bench_quality.py [--tasks sms_spam trec] [--max-items 300] [--seed 0]
        [--gen-batch-size 8] [--max-new-tokens 256] [--threads N] [--quick] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
from benchlib import cache_keyword, judge_machine, new_cache

from calibration.certificates.certify import clopper_pearson_interval
from calibration.tasks import (
    LabeledItem,
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


MAX_ATTEMPTS = 4  # the first, then up to 3 retries with the validation error
VIOLATIONS = ("no_json_object", "missing_field", "enum_violation")


def careful_prompt(task: Task, text: str) -> str:
    """``task_prompt`` with its last line ("Answer with one of: ...") replaced by the answer's
    schema, given as every valid reply (one JSON object per choice), and the instruction to
    reply with one of them alone. A JSON Schema object in its place was tried first: this model
    copied the schema back (0 of 72 replies parsed on 24 items each of sst2, sms_spam and trec,
    against 12 of 72 so)."""
    prompt = task_prompt(task, text)
    head, _, last = prompt.rpartition("\n\n")
    if head and last.startswith("Answer with one of"):
        prompt = head
    replies = "\n".join(json.dumps({"answer": c}, ensure_ascii=False) for c in task.choices)
    return f"{prompt}\n\nReply with exactly one of these JSON objects, and nothing else:\n{replies}"


def recover(text: str, choices: Sequence[str]) -> tuple[str | None, str | None, str]:
    """What a careful pipeline reads from an output: (the answer, None, "") where it recovers
    one, else (None, the violation, the validation error to send back). Code fences are
    stripped, the first JSON object is decoded from the first ``{`` (text around it ignored),
    and its ``"answer"``, stripped of surrounding whitespace, must be one of ``choices``."""
    s = text.strip()
    if "```" in s:  # the fenced block's body, whatever the fence's language tag
        inside = s.split("```")[1]
        s = inside.split("\n", 1)[1] if "\n" in inside else inside
    obj: Any = None
    for at in (k for k, ch in enumerate(s) if ch == "{"):
        try:
            obj, _ = json.JSONDecoder().raw_decode(s, at)
        except ValueError:
            continue
        if isinstance(obj, dict):
            break
    if not isinstance(obj, dict):
        return None, "no_json_object", "the reply holds no JSON object"
    if "answer" not in obj:
        return None, "missing_field", 'the JSON object has no "answer" field'
    answer = obj["answer"]
    if isinstance(answer, str) and answer.strip() in choices:
        return answer.strip(), None, ""
    allowed = json.dumps(list(choices), ensure_ascii=False)
    return (
        None,
        "enum_violation",
        f'"answer" must be one of {allowed}, got {json.dumps(answer, ensure_ascii=False)}',
    )


def render_conversation(judge: Judge, messages: list[dict[str, str]]) -> str:
    """A conversation rendered with the chat template's generation prompt (no response prefix),
    as ``Judge.render`` renders a single user turn."""
    if len(messages) == 1:
        return judge.render(messages[0]["content"], response_prefix="")
    return str(
        judge.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )


def generate_outputs(
    judge: Judge, rendered: Sequence[str], max_new_tokens: int, batch_size: int
) -> list[tuple[str, bool, int]]:
    """Greedy outputs for ``rendered`` texts: (text, whether it hit ``max_new_tokens`` before
    the end of sequence, tokens generated). Batches of prompts of similar length, left-padded."""
    import torch

    tok = judge.tokenizer
    model: Any = judge.model
    eos = model.generation_config.eos_token_id
    eos_ids = {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
    eos_ids.add(int(tok.eos_token_id))
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    encoded = [list(tok(r, add_special_tokens=False).input_ids) for r in rendered]
    order = sorted(range(len(rendered)), key=lambda i: len(encoded[i]))
    outputs: list[tuple[str, bool, int]] = [("", False, 0)] * len(rendered)
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


def careful_pipeline(
    judge: Judge, task: Task, items: list[LabeledItem], args: argparse.Namespace
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The prompt-forced pipeline on ``items``: generate, recover, validate, retry with the
    error; its summary and a sample of failed first attempts."""
    choices = list(task.choices)
    conversations = [[{"role": "user", "content": careful_prompt(task, i.text)}] for i in items]
    answers: list[str | None] = [None] * len(items)
    attempts = [0] * len(items)
    first: list[tuple[str, bool]] = [("", False)] * len(items)
    pending = list(range(len(items)))
    start = time.perf_counter()
    for attempt in range(MAX_ATTEMPTS):
        if not pending:
            break
        rendered = [render_conversation(judge, conversations[i]) for i in pending]
        outputs = generate_outputs(judge, rendered, args.max_new_tokens, args.gen_batch_size)
        still = []
        for i, (text, hit_limit, _) in zip(pending, outputs, strict=True):
            attempts[i] += 1
            if attempt == 0:
                first[i] = (text, hit_limit)
            answer, _, error = recover(text, choices)
            if answer is not None:
                answers[i] = answer
                continue
            still.append(i)
            conversations[i] += [
                {"role": "assistant", "content": text},
                {
                    "role": "user",
                    "content": f"That reply is not valid: {error}. Reply again with only the "
                    "JSON object.",
                },
            ]
        pending = still
    seconds = time.perf_counter() - start

    failures: Counter[str] = Counter()
    underneath: Counter[str] = Counter()
    truncated: Counter[str] = Counter()
    samples: list[dict[str, Any]] = []
    strict = recovered_first = 0
    for item, (text, hit_limit) in zip(items, first, strict=True):
        _, failure = classify_output(text, choices)
        _, violation, _ = recover(text, choices)
        recovered_first += violation is None
        if failure is None:
            strict += 1
            continue
        failures[failure] += 1
        underneath[f"{failure}/{violation or 'none'}"] += 1
        truncated[failure] += hit_limit
        if failures[failure] <= SAMPLES_PER_TYPE:
            samples.append(
                {
                    "task": task.name,
                    "id": item.id,
                    "failure": failure,
                    "violation": violation,
                    "label": item.label,
                    "truncated": hit_limit,
                    "output": text,
                }
            )
    n = len(items)
    correct = sum(a == item.label for a, item in zip(answers, items, strict=True))
    succeeded = sum(a is not None for a in answers)
    summary = {
        "accuracy": correct / n,
        "accuracy_interval": clopper_pearson_interval(correct, n),
        "strict_first": strict / n,
        "recovered_first": recovered_first / n,
        "recovered_first_interval": clopper_pearson_interval(recovered_first, n),
        "with_retries": succeeded / n,
        "with_retries_interval": clopper_pearson_interval(succeeded, n),
        "attempts_per_item": float(np.mean(attempts)),
        "failures": {t: failures[t] for t in FAILURE_TYPES},
        "failure_violations": dict(sorted(underneath.items())),
        "truncated": {t: truncated[t] for t in FAILURE_TYPES},
        "max_new_tokens": args.max_new_tokens,
        "ms_per_item": 1000 * seconds / n,
    }
    return summary, samples


def constrained_grammar(choices: Sequence[str]) -> str:
    """The llguidance (Lark) grammar "one of the JSON objects ``{"answer": "<choice>"}``"."""
    objects = ['{"answer": "' + json_escape(c) + '"}' for c in choices]
    return "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in objects)


def constrained_generation(judge: Judge, task: Task, items: list[LabeledItem]) -> dict[str, Any]:
    """Greedy decoding under llguidance's mask, one item at a time; accuracy, the ECE of the
    taken path's masked probability, and time per item."""
    import llguidance
    import llguidance.hf
    import torch

    choices = list(task.choices)
    tokenizer = llguidance.hf.from_tokenizer(cast(Any, judge.tokenizer))
    grammar = constrained_grammar(choices)
    objects = ['{"answer": "' + json_escape(c) + '"}' for c in choices]
    model: Any = judge.model
    keyword = cache_keyword(model)
    picked, confidence = [], []
    start = time.perf_counter()
    for item in items:
        # The judge's own prompt (it names the choices), so that only the method differs.
        rendered = judge.render(task_prompt(task, item.text), response_prefix="")
        feed = list(judge.tokenizer(rendered, add_special_tokens=False).input_ids)
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        cache, out, logp = new_cache(model), [], 0.0
        with torch.inference_mode():
            while not matcher.is_accepting():
                forced = matcher.compute_ff_tokens()
                if forced:  # bytes the grammar forces: its tokens, without a model step
                    assert matcher.consume_tokens(forced), matcher.get_error()
                    feed += forced
                    out += forced
                    continue
                step = model(torch.tensor([feed]), use_cache=True, **{keyword: cache})
                feed = []
                bias = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)
                allowed = torch.from_numpy(np.flatnonzero(bias))
                lp = torch.log_softmax(step.logits[0, -1, allowed].double(), dim=-1)
                k = int(torch.argmax(lp))
                token = int(allowed[k])
                logp += float(lp[k])
                assert matcher.consume_token(token)
                feed, out = [token], [*out, token]
        picked.append(objects.index(str(judge.tokenizer.decode(out))))
        confidence.append(math.exp(logp))
    seconds = time.perf_counter() - start
    labels = np.array([choices.index(i.label) for i in items])
    hits = np.array(picked) == labels
    return {
        "accuracy": float(hits.mean()),
        "accuracy_interval": clopper_pearson_interval(int(hits.sum()), len(items)),
        "ece": binned_ece(np.array(confidence), hits),
        "mean_confidence": float(np.mean(confidence)),
        "ms_per_item": 1000 * seconds / len(items),
    }


def binned_ece(confidence: np.ndarray, hits: np.ndarray, n_bins: int = 15) -> float:
    """The ECE of answers stated at ``confidence`` (what ``calibration.metrics.ece`` computes
    from a distribution's top label, here from the answer and its confidence alone): 15
    equal-width bins, each weighted by its share of the items."""
    bins = np.minimum((confidence * n_bins).astype(int), n_bins - 1)
    total = 0.0
    for b in np.unique(bins):
        inside = bins == b
        total += inside.mean() * abs(hits[inside].mean() - confidence[inside].mean())
    return float(total)


def bench_task(
    judges: dict[str, Judge], task: Task, args: argparse.Namespace
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from calibration.maps.scaling import fit_calibrator, softmax
    from calibration.metrics import accuracy, ece, nll

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
    n_test = len(items["test"])
    labels = np.array([task.choices.index(i.label) for i in items["test"]])

    def metrics(probs: np.ndarray) -> dict[str, Any]:
        hits = int((probs.argmax(axis=1) == labels).sum())
        return {
            "accuracy": accuracy(probs, labels),
            "accuracy_interval": clopper_pearson_interval(hits, n_test),
            "nll": nll(probs, labels),
            "ece": ece(probs, labels),
        }

    row: dict[str, Any] = {"task": task.name, "choices": task.choices, "splits": splits}
    for mode, judge in judges.items():
        if judge.prefix_cache is not None:  # the modes share one: each starts cold
            judge.prefix_cache.clear()
        cal = judge_task_items(judge, task, items["calibration"], batch_size=args.batch_size)
        start = time.perf_counter()
        test = judge_task_items(judge, task, items["test"], batch_size=args.batch_size)
        test_s = time.perf_counter() - start
        fit = fit_calibrator(cal.log_probabilities, cal.labels)
        row[f"judge_{mode}"] = {
            "raw": metrics(softmax(test.log_probabilities)),
            "calibrated": {
                **metrics(fit.map.apply(test.log_probabilities)),
                "method": fit.map.method,
            },
            "ms_per_item": 1000 * test_s / n_test,
        }
        _log(f"{task.name}: judged ({mode})")
    canonical = judges["canonical"]
    row["careful"], samples = careful_pipeline(canonical, task, items["test"], args)
    _log(f"{task.name}: careful pipeline done")
    row["constrained"] = constrained_generation(canonical, task, items["test"])
    _log(f"{task.name}: constrained generation done")
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
        "--max-new-tokens", type=int, default=256, help="the careful pipeline's budget per reply"
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: torch's own, one per core)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small run: sms_spam and trec, 10 items per split, 32 new tokens a reply",
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()

    names = args.tasks or sorted(p.name for p in args.data.iterdir() if (p / "task.json").exists())
    if args.quick:
        if not args.tasks:
            preferred = [n for n in QUICK_TASKS if n in names]
            names = preferred if len(preferred) == 2 else names
        names, args.max_items, args.max_new_tokens = names[:2], 10, 32

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    canonical = Judge.load(dtype=args.dtype)
    judges = {
        "canonical": canonical,
        "grammar": canonical.with_choice_paths("grammar"),
    }
    machine = judge_machine(canonical)
    print(f"# {machine}")
    print(
        f"# at most {args.max_items} items per split (seeded subsample, seed {args.seed}); "
        f"careful: greedy, batches of {args.gen_batch_size}, up to {args.max_new_tokens} new "
        f"tokens, {MAX_ATTEMPTS - 1} retries; constrained: llguidance, greedy, one at a time",
        flush=True,
    )
    rows, samples = [], []
    for name in names:
        row, task_samples = bench_task(judges, load_task(args.data / name), args)
        rows.append(row)
        samples += task_samples
        print(format_task(row), flush=True)
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
            "max_new_tokens": args.max_new_tokens,
            "max_attempts": MAX_ATTEMPTS,
            "ece_bins": 15,
        },
        "success": SUCCESS,
        "failure_types": list(FAILURE_TYPES),
        "violations": list(VIOLATIONS),
        "tasks": rows,
        "elapsed_s": elapsed,
    }
    write_text(args.out_dir / "bench_quality.json", json.dumps(result, indent=2))
    write_text(
        args.out_dir / "quality_failures_sample.jsonl",
        "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples),
    )
    print(markdown(result))


def _acc(r: dict[str, Any]) -> str:
    low, high = r["accuracy_interval"]
    return f"{r['accuracy']:.3f} [{low:.2f}, {high:.2f}]"


def format_task(row: dict[str, Any]) -> str:
    sp = row["splits"]
    c, g = row["careful"], row["constrained"]
    lines = [
        f"{row['task']}: {len(row['choices'])} choices; calibration "
        f"{sp['calibration']['n']} of {sp['calibration']['of']}, test {sp['test']['n']} of "
        f"{sp['test']['of']}",
    ]
    for mode in ("canonical", "grammar"):
        j = row[f"judge_{mode}"]
        for kind in ("raw", "calibrated"):
            r = j[kind]
            lines.append(
                f"  judge {mode} {kind}: accuracy {_acc(r)}, NLL {r['nll']:.3f}, "
                f"ECE {r['ece']:.3f}, {j['ms_per_item']:.0f} ms/item"
            )
    lines.append(
        f"  careful: accuracy {_acc(c)}, first attempt {c['strict_first']:.1%} strict / "
        f"{c['recovered_first']:.1%} recovered, with retries {c['with_retries']:.1%}, "
        f"{c['attempts_per_item']:.2f} attempts/item, {c['ms_per_item']:.0f} ms/item"
    )
    if c["failure_violations"]:
        lines.append(
            "    first-attempt failures (type/violation underneath): "
            + ", ".join(f"{k} {v}" for k, v in c["failure_violations"].items())
        )
    lines.append(
        f"  constrained: accuracy {_acc(g)}, ECE {g['ece']:.3f}, {g['ms_per_item']:.0f} ms/item"
    )
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    """Two tables: accuracy, calibration and time side by side, and the careful pipeline's
    attempts and failures."""
    lines = [
        "| task | judge canonical raw / cal acc | ECE raw / cal | judge grammar raw / cal acc "
        "| ECE raw / cal | careful acc | constrained acc | constrained ECE "
        "| ms/item judge c / g / careful / constrained |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["tasks"]:
        jc, jg = row["judge_canonical"], row["judge_grammar"]
        c, g = row["careful"], row["constrained"]
        lines.append(
            f"| {row['task']} | {jc['raw']['accuracy']:.3f} / {_acc(jc['calibrated'])} "
            f"| {jc['raw']['ece']:.3f} / {jc['calibrated']['ece']:.3f} "
            f"| {jg['raw']['accuracy']:.3f} / {_acc(jg['calibrated'])} "
            f"| {jg['raw']['ece']:.3f} / {jg['calibrated']['ece']:.3f} "
            f"| {_acc(c)} | {_acc(g)} | {g['ece']:.3f} "
            f"| {jc['ms_per_item']:.0f} / {jg['ms_per_item']:.0f} / {c['ms_per_item']:.0f} "
            f"/ {g['ms_per_item']:.0f} |"
        )
    lines += [
        "",
        "| task | first attempt strict | first attempt recovered [95% CI] | with retries [95% CI] "
        "| attempts/item | first-attempt failures: type/violation underneath |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["tasks"]:
        c = row["careful"]
        rl, rh = c["recovered_first_interval"]
        wl, wh = c["with_retries_interval"]
        fails = ", ".join(f"{k} {v}" for k, v in c["failure_violations"].items()) or "-"
        lines.append(
            f"| {row['task']} | {c['strict_first']:.3f} | {c['recovered_first']:.3f} "
            f"[{rl:.2f}, {rh:.2f}] | {c['with_retries']:.3f} [{wl:.2f}, {wh:.2f}] "
            f"| {c['attempts_per_item']:.2f} | {fails} |"
        )
    return "\n".join(lines) + "\n"


def _log(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
