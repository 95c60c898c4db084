"""The prefix cache on a rubric workload: a long fixed head, a short item, one call per item.

The head is a system prompt of about 1000 tokens (a grading rubric and worked examples); the
items are SMS messages from ../shared/data/sms_spam (20-100 tokens each), judged one
``Judge.judge`` call at a time as a pipeline makes them, with 2 choices (pass/fail) and with 5
(grades A-E). Side by side, item by item, in one run on the default model:

* ``off``: the cache off, today's engine: the whole prompt every call;
* ``cold``: the cache on but emptied before each call (a miss: what the cache costs);
* ``warm``: the cache on and holding the head (a hit);
* ``floor``: one bare decoder pass over only the tokens the warm call computed, attending to
  the same cached prefix given as the model's past: what a hit cannot beat.

Reports per-item medians, the median of item-by-item ratios, tokens computed per item and the
bytes the cache holds. Then over HTTP: ``judge serve`` with the cache off and on, the same
distinct items (the rubric as the request's system prompt, 2 choices) at concurrency 1 and 16,
throughput and median latency. Writes ``benchmarks/results/bench_prefix_cache.json``.

``--model gemma3-270m`` runs it on the second model, whose sliding-window layers read the
cached head like any (the floor's past keeps every key, as the engine's cache does).

    python benchmarks/bench_prefix_cache.py [--items 100] [--http-requests 48] [--quick]
        [--model MODEL]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch
from benchlib import cpu_flags, cpu_model
from transformers import DynamicCache

from calibration.tasks import load_split, load_task
from judge import Judge, Judgment
from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT.parent / "shared" / "data"

RUBRIC = """You are a strict grader for a telecom company's message-screening team. Every
message below was received by a customer. Grade how likely it is that the message is
unsolicited advertising or a scam, using the rubric.

Rubric.
- A prize, award, cash, voucher or free gift that the customer did not ask for is a strong
  sign of a scam, above all when a premium-rate number, a short code or a link must be used
  to claim it.
- Urgency ("now", "today only", "expires", "final notice") and capital letters add weight.
- A request to reply STOP, to text a keyword, or to call a number starting with 09 counts
  as advertising even when no prize is offered.
- Messages between people who know each other (plans, jokes, questions about the day,
  greetings, apologies, lifts, meals) are legitimate however informal their spelling.
- A message from a company the customer uses (a delivery slot, a bill, a password code) is
  legitimate when it asks for nothing in return.
- When in doubt, weigh who benefits: the sender's profit points to advertising; the
  customer's convenience points to a legitimate message.

Worked examples.
1. "WINNER!! As a valued network customer you have been selected to receive a 900 pound
   prize reward! To claim call 09061701461. Claim code KL341. Valid 12 hours only." This
   offers an unrequested prize, asks for a premium-rate call and adds urgency: spam.
2. "Ok lar... Joking wif u oni..." Two friends joking: legitimate.
3. "Had your mobile 11 months or more? U R entitled to Update to the latest colour mobiles
   with camera for Free! Call The Mobile Update Co FREE on 08002986030" Unrequested offer
   with a number to call: advertising.
4. "I'm gonna be home soon and i don't want to talk about this stuff anymore tonight, k?
   I've cried enough today." A personal message: legitimate.
5. "SIX chances to win CASH! From 100 to 20,000 pounds txt> CSH11 and send to 87575. Cost
   150p/day, 6days, 16+ TsandCs apply Reply HL 4 info" Cash prize, short code, daily cost:
   spam.
6. "Your parcel is booked for delivery tomorrow between 10:00 and 12:00. No action needed."
   A company the customer uses, asking for nothing: legitimate.
7. "URGENT! Your Mobile No. was awarded 2000 Bonus Caller Prize on 5/9/03 This is our final
   try to contact U! Call from Landline 09064019788 BOX42WR29C, 150PPM" Prize, urgency and a
   premium-rate number: spam.
8. "Sorry, I'll call later in the meeting." Legitimate.
9. "Free entry in 2 a wkly comp to win FA Cup final tkts 21st May 2005. Text FA to 87121 to
   receive entry question(std txt rate)T&C's apply 08452810075over18's" A competition
   entered by texting a short code: spam.
10. "Did you catch the bus? Are you frying an egg? Did you make a tea? Are you eating your
    mum's left over dinner? Do you feel my Love?" Legitimate.
11. "Thanks for your subscription to Ringtone UK your mobile will be charged 5 pounds per
    week. Reply STOP to unsubscribe." An unrequested charge with a STOP keyword: spam.
12. "Ahhh. Work. I vaguely remember that! What does it feel like? Lol" Legitimate.

Answer with the grade only."""

CHOICE_SETS = {
    2: ("pass", "fail"),
    5: ("A", "B", "C", "D", "E"),
}


def items(judge: Judge, n: int) -> list[str]:
    """``n`` SMS texts of 20-100 tokens from the sms_spam test split, in file order."""
    task = load_task(DATA / "sms_spam")
    rows, _ = load_split(task, "test")
    out = []
    for row in rows:
        length = len(judge.tokenizer(row.text, add_special_tokens=False).input_ids)
        if 20 <= length <= 100:
            out.append(row.text)
        if len(out) == n:
            break
    return out


def timed(fn: Callable[[], Judgment]) -> tuple[float, Judgment]:
    start = time.perf_counter()
    result = fn()
    return (time.perf_counter() - start) * 1000, result


@torch.inference_mode()
def floor_ms(judge: Judge, prompt_ids: list[int], cached: int, head_kv: list) -> float:
    """One bare pass over ``prompt_ids[cached:]`` with the first ``cached`` keys and values
    as the past; the root's logits only."""
    past = DynamicCache()
    for i, (k, v) in enumerate(head_kv):
        past.update(k[:, :, :cached], v[:, :, :cached], i)
    ids = torch.tensor([prompt_ids[cached:]])
    positions = torch.arange(cached, len(prompt_ids))[None]
    decoder = judge.model.get_decoder()
    name = (
        "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    )
    start = time.perf_counter()
    judge.model(input_ids=ids, position_ids=positions, logits_to_keep=1, **{name: past})
    return (time.perf_counter() - start) * 1000


@torch.inference_mode()
def head_keys_values(judge: Judge, prompt_ids: list[int]) -> list:
    # A cache of our own: the model's would keep only a sliding layer's window (Gemma 3).
    out = judge.model.get_decoder()(
        input_ids=torch.tensor([prompt_ids]), use_cache=True, past_key_values=DynamicCache()
    )
    cache = getattr(out, "cache", None) or out.past_key_values
    return [(layer.keys, layer.values) for layer in cache.layers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100, help="items per choice set")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--http-requests", type=int, default=48, help="per concurrency level")
    parser.add_argument("--quick", action="store_true", help="4 items per choice set, no HTTP")
    parser.add_argument(
        "--generic",
        action="store_true",
        help="the model's own decoder instead of the lean pass (the engine before it)",
    )
    parser.add_argument("--model", default=None, help="model id, directory or .gguf")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    name = f"_{args.model.replace('/', '_')}" if args.model else ""
    out_path = args.out or RESULTS / f"bench_prefix_cache{name}.json"
    n_items = 4 if args.quick else args.items

    lean = not args.generic
    off = Judge.load(args.model, dtype=args.dtype, prefix_cache_mb=0, system=RUBRIC, lean=lean)

    def cached_engine() -> Judge:
        return Judge(off.model, off.tokenizer, model_id=off.model_id, system=RUBRIC, lean=lean)

    cold, warm = cached_engine(), cached_engine()
    assert cold.prefix_cache is not None and warm.prefix_cache is not None
    texts = items(off, n_items)
    head_ids = off.tokenizer(off.render(""), add_special_tokens=False).input_ids
    head_kv = head_keys_values(off, head_ids)
    rows: list[dict[str, Any]] = []
    for k, choices in CHOICE_SETS.items():
        # Each choice set starts with only the head cached, not the items of the last one.
        warm.prefix_cache.clear()
        warm.judge("A message that is not among the items.", list(choices))
        per_item = []
        for text in texts:
            t_off, r_off = timed(lambda: off.judge(text, list(choices)))  # noqa: B023
            cold.prefix_cache.clear()
            t_cold, r_cold = timed(lambda: cold.judge(text, list(choices)))  # noqa: B023
            # Distinct items, one call each: the warm cache holds the head, not this item.
            t_warm, r_warm = timed(lambda: warm.judge(text, list(choices)))  # noqa: B023
            prompt_ids = off.tokenizer(r_warm.prompt, add_special_tokens=False).input_ids
            reused = r_warm.cached_tokens
            kv = head_kv if prompt_ids[:reused] == head_ids[:reused] else None
            t_floor = floor_ms(
                off, prompt_ids, reused, kv or head_keys_values(off, prompt_ids[:reused])
            )
            per_item.append(
                {
                    "off": t_off,
                    "cold": t_cold,
                    "warm": t_warm,
                    "floor": t_floor,
                    "prompt_tokens": r_warm.prompt_tokens,
                    "computed_off": r_off.computed_tokens,
                    "computed_cold": r_cold.computed_tokens,
                    "computed_warm": r_warm.computed_tokens,
                    # bfloat16 rounds differently for different sequence shapes (as batching
                    # does); in float32 the cache agrees within 1e-5 (tests/test_prefix_cache.py).
                    "max_abs_diff": max(
                        abs(r_warm.probabilities[c] - r_off.probabilities[c]) for c in choices
                    ),
                }
            )
        median = {key: statistics.median(p[key] for p in per_item) for key in per_item[0]}
        worst = max(p["max_abs_diff"] for p in per_item)
        ratio = {
            "off_over_warm": statistics.median(p["off"] / p["warm"] for p in per_item),
            "warm_over_floor": statistics.median(p["warm"] / p["floor"] for p in per_item),
            "cold_over_off": statistics.median(p["cold"] / p["off"] for p in per_item),
        }
        rows.append(
            {
                "choices": k,
                "items": len(per_item),
                "median": median,
                "ratio": ratio,
                "bytes": warm.prefix_cache.stats().bytes,
                "max_abs_diff": worst,
            }
        )
    head_tokens = len(head_ids)
    result = {
        "machine": {
            "cpu": cpu_model(),
            "flags": cpu_flags(),
            "torch_threads": torch.get_num_threads(),
            "dtype": off.dtype,
            "lean": lean,
            "model": off.model_id,
            "decoder_pass": off.decoder_pass,
        },
        "head_tokens": head_tokens,
        "rows": rows,
        "http": []
        if args.quick
        else http_rows(items(off, 2 * args.http_requests), args.dtype, lean, args.model),
        "quick": args.quick,
    }
    lines = [
        f"{off.model_id} ({off.decoder_pass} pass). "
        f"Head: {head_tokens} tokens; {n_items} items per choice set; {off.dtype}, "
        f"{torch.get_num_threads()} threads.",
        "",
        "| choices | off ms | cold ms | warm ms | floor ms | off/warm | warm/floor | cold/off | tokens computed off / warm | cache MB | max abs diff warm vs off |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, q = r["median"], r["ratio"]
        lines.append(
            f"| {r['choices']} | {m['off']:.0f} | {m['cold']:.0f} | {m['warm']:.0f} | {m['floor']:.0f} "
            f"| {q['off_over_warm']:.2f} | {q['warm_over_floor']:.2f} | {q['cold_over_off']:.2f} "
            f"| {m['computed_off']:.0f} / {m['computed_warm']:.0f} | {r['bytes'] / 2**20:.1f} "
            f"| {r['max_abs_diff']:.1e} |"
        )
    if result["http"]:
        lines += [
            "",
            "| HTTP | concurrency | requests/s | p50 ms |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| cache {h['cache']} | {h['concurrency']} | {h['throughput_rps']:.2f} | {h['p50_ms']:.0f} |"
            for h in result["http"]
        ]
    print("\n".join(lines))
    write_text(out_path, json.dumps(result, indent=2))


def http_rows(
    texts: list[str], dtype: str, lean: bool = True, model: str | None = None
) -> list[dict[str, Any]]:
    """Half the texts at concurrency 1, the other half at 16, so that no level finds another's
    items cached."""
    from bench_service import free_port, load, start_server, stop_server

    half = len(texts) // 2
    out = []
    for mb in (0, 256):
        port = free_port()
        flags = ["--prefix-cache-mb", str(mb)] + ([] if lean else ["--generic-pass"])
        flags += ["--model", model] if model else []
        server = start_server(port, 16, dtype, flags)
        try:
            url = f"http://127.0.0.1:{port}"
            prime = {"prompt": "Not an item.", "choices": ["pass", "fail"], "system": RUBRIC}
            httpx.post(f"{url}/judge", json=prime, timeout=300).raise_for_status()
            for level, batch in ((1, texts[:half]), (16, texts[half:])):

                def body(i: int, batch: list[str] = batch) -> dict[str, Any]:
                    return {"prompt": batch[i], "choices": ["pass", "fail"], "system": RUBRIC}

                row = asyncio.run(load(url, level, len(batch), body))
                assert not row["errors"], row["errors"]
                out.append({"cache": "on" if mb else "off", **row})
        finally:
            stop_server(server)
    return out


if __name__ == "__main__":
    main()
