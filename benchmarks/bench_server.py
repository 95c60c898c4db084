"""judge over llama.cpp's server against the local engine, on the same model (issue 48).

Starts llama-cpp-python's OpenAI-compatible server on the default model's own GGUF file (its
4-bit weights, llama.cpp's arithmetic) and judges through it (``judge.server_engine``) in both
read modes, side by side with the local engine (the same GGUF de-quantized, torch):

1. **Speed**: sst2 test items (2 choices), one call at a time (concurrency 1) and 16 at once
   (the local engine: ``judge_batch`` of 16, as ``judge serve`` batches them; the server: 16
   threads), median latency and throughput. The echo reads each choice's whole path back
   (llama-cpp-python then sorts the vocabulary in Python for every token: seconds per item);
   the top read asks one next-token request per scored node.
2. **Agreement and quality** on every shared set: the first ``--items`` calibration and test
   items through the server (read=top, top ``--top``) and the local engine in float32 (the
   GGUF's weights de-quantized, nothing rounded further); the largest and
   mean probability gap, how often the two pick the same choice, how many server judgments
   were read only in part (a set with any is not fitted: calibrate refuses them); then a
   profile fitted on each engine's calibration items and evaluated on its test items:
   calibrated accuracy, ECE, and the coverage and precision of the certified rule.

Writes ``benchmarks/results/bench_server.json`` (``--out``). Needs ``llama-cpp-python[server]`` (CI builds
it; ``.ci/run`` says how).

    python benchmarks/bench_server.py [--items 100] [--speed-items 32] [--top 1000] [--quick]
        [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from benchlib import cpu_flags, cpu_model

from calibration import Provenance, evaluate_policy
from calibration.tasks import fit_labeled, load_split, load_task, task_prompt
from calibration.tasks.labeled import scores_from_judgments
from judge import Judge, Judgment
from judge.atomicio import write_text
from judge.engines import open_engine
from judge.loading import default_model_path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT.parent / "shared" / "data"


def start_server(port: int, threads: int) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(default_model_path())]
    command += ["--host", "127.0.0.1", "--port", str(port), "--model_alias", "smollm2"]
    command += ["--logits_all", "true", "--n_ctx", "4096", "--n_threads", str(threads)]
    log = tempfile.TemporaryFile()  # noqa: SIM115 (the process writes it until killed)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("llama_cpp.server did not start")


def speed(engine: Any, queries: list[dict[str, Any]], concurrency: int) -> dict[str, float]:
    """Median latency (ms) of a call and items per second, ``concurrency`` at once."""
    latencies: list[float] = []
    start = time.perf_counter()
    if concurrency == 1:
        for q in queries:
            t = time.perf_counter()
            engine.judge_batch([q])
            latencies.append((time.perf_counter() - t) * 1000)
    elif isinstance(engine, Judge):  # the local engine batches, as judge serve does
        for i in range(0, len(queries), concurrency):
            t = time.perf_counter()
            engine.judge_batch(queries[i : i + concurrency])
            latencies += [(time.perf_counter() - t) * 1000] * len(queries[i : i + concurrency])
    else:

        def one(q: dict[str, Any]) -> float:
            t = time.perf_counter()
            engine.judge_batch([q])
            return (time.perf_counter() - t) * 1000

        with ThreadPoolExecutor(concurrency) as pool:
            latencies = list(pool.map(one, queries))
    elapsed = time.perf_counter() - start
    return {"median_ms": statistics.median(latencies), "items_per_s": len(queries) / elapsed}


def quality(engines: dict[str, Any], name: str, items: int) -> dict[str, Any]:
    task = load_task(DATA / name)
    splits = {s: load_split(task, s, items) for s in ("calibration", "test")}
    judged: dict[str, dict[str, list[Judgment]]] = {e: {} for e in engines}
    for split, (rows, _) in splits.items():
        queries = [{"prompt": task_prompt(task, r.text), "choices": task.choices} for r in rows]
        for label, engine in engines.items():
            judged[label][split] = [
                j for i in range(0, len(queries), 8) for j in engine.judge_batch(queries[i : i + 8])
            ]
    served, local = judged["server"], judged["local"]
    pairs = [(a, b) for s in splits for a, b in zip(served[s], local[s], strict=True)]
    gaps = [max(abs(x - y) for x, y in zip(a.probs, b.probs, strict=True)) for a, b in pairs]
    out: dict[str, Any] = {
        "n": len(pairs),
        "max_gap": max(gaps),
        "mean_gap": statistics.fmean(gaps),
        "same_choice": statistics.fmean(a.choice == b.choice for a, b in pairs),
        "read_in_part": sum(a.unknown_mass > 0 for a, _ in pairs),
    }
    for label, engine in engines.items():
        if label == "server" and out["read_in_part"]:
            continue  # calibrate refuses judgments read in part: no profile to fit
        labels = {s: [r.label for r in splits[s][0]] for s in splits}
        cal = scores_from_judgments(
            judged[label]["calibration"], labels["calibration"], task.choices
        )
        test = scores_from_judgments(judged[label]["test"], labels["test"], task.choices)
        provenance = Provenance(
            fingerprint=engine.fingerprint(),
            dataset=f"{name}/calibration",
            dataset_sha256=splits["calibration"][1],
        )
        profile = fit_labeled(name, cal, task.choices, provenance).profile
        ev = evaluate_policy(profile, test.log_probabilities, test.labels, test.choice_mass)
        out[label] = {
            "accuracy": ev.after.accuracy.value,
            "ece": ev.after.ece.value,
            "coverage": ev.coverage,
            "precision": ev.precision,
            "threshold": ev.threshold,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=100, help="per split and set")
    parser.add_argument("--speed-items", type=int, default=32)
    parser.add_argument("--top", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2, help="the server's")
    parser.add_argument("--quick", action="store_true", help="a few items, two sets")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_server.json")
    args = parser.parse_args()
    items, speed_items = (20, 8) if args.quick else (args.items, args.speed_items)
    port = 8000 + int(time.time()) % 1000
    server = start_server(port, args.threads)
    try:
        spec = f"openai+http://127.0.0.1:{port}/v1"
        local = Judge.load()  # as a user gets it: bfloat16 where the CPU computes it
        # The agreement is with the GGUF's weights as they are, de-quantized to float32.
        exact = local if local.dtype == "float32" else Judge.load(dtype="float32")
        # llama-cpp-python's server answers one request at a time: at 16 in flight the last
        # waits for the 15 before it (an echo read takes seconds on 2 cores), far past the
        # engine's 60 s default, which is meant for one call.
        echo = open_engine(spec, timeout_s=900.0)
        top = open_engine(f"{spec}?read=top&top={args.top}", timeout_s=900.0)
        sst2 = load_task(DATA / "sst2")
        rows, _ = load_split(sst2, "test", speed_items)
        queries = [{"prompt": task_prompt(sst2, r.text), "choices": sst2.choices} for r in rows]
        timings: dict[str, Any] = {}
        # The echo read is slow on llama-cpp-python: it sorts the whole vocabulary in Python
        # for every echoed token (about 15 s a request on 2 AVX2 cores), so it is timed on a
        # quarter of the items (two with --quick, not warmed first: a smoke run, not a timing).
        echo_items = 2 if args.quick else max(4, speed_items // 4)
        for label, engine in (("local", local), ("server top", top), ("server echo", echo)):
            some = queries if label != "server echo" else queries[:echo_items]
            if label != "server echo" or not args.quick:
                engine.judge_batch(some[:1])  # warm: the server's alignment check, packing
            timings[label] = {str(c): speed(engine, some, c) for c in (1, 16)}
        print(f"# judge over llama.cpp's server, {cpu_model()} ({' '.join(cpu_flags())})")
        print(f"local engine: {local.dtype}, {local.arithmetic}\n")
        print("| engine | c=1 median ms | c=1 items/s | c=16 median ms | c=16 items/s |")
        print("|---|---|---|---|---|")
        for label, t in timings.items():
            one, many = t["1"], t["16"]
            print(
                f"| {label} | {one['median_ms']:.0f} | {one['items_per_s']:.2f} | "
                f"{many['median_ms']:.0f} | {many['items_per_s']:.2f} |"
            )
        sets = (
            ["sst2", "sms_spam"]
            if args.quick
            else sorted(p.name for p in DATA.iterdir() if (p / "task.json").is_file())
        )
        quality_rows = {}
        print(
            f"\n{items} calibration + {items} test items per set, server read=top top={args.top}\n"
        )
        print(
            "| set | max gap | mean gap | same choice | read in part | "
            "acc local / server | ECE local / server | coverage local / server |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name in sets:
            q = quality({"server": top, "local": exact}, name, items)
            quality_rows[name] = q
            loc, srv = q.get("local", {}), q.get("server", {})

            def both(key: str, q_loc: dict[str, Any] = loc, q_srv: dict[str, Any] = srv) -> str:
                return " / ".join("-" if key not in x else f"{x[key]:.3f}" for x in (q_loc, q_srv))

            print(
                f"| {name} | {q['max_gap']:.3f} | {q['mean_gap']:.4f} | {q['same_choice']:.3f} | "
                f"{q['read_in_part']} | {both('accuracy')} | {both('ece')} | {both('coverage')} |"
            )
        result = {
            "cpu": cpu_model(),
            "flags": cpu_flags(),
            "local_dtype": local.dtype,  # of the speed table; the quality rows: float32
            "top": args.top,
            "items": items,
            "speed": timings,
            "quality": quality_rows,
            "quick": args.quick,
        }
        write_text(args.out, json.dumps(result, indent=2) + "\n")
    finally:
        server.kill()
        server.wait(30)


if __name__ == "__main__":
    main()
