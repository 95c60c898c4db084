"""Throughput of Ray Serve replicas against one process, on the default model.

Runs ``judge serve`` (one process) and then ``judge serve --ray --replicas N`` (a local Ray
cluster, one CPU per replica), one after the other on the same machine; for each, waits for
``/ready``, warms up, then sends ``--requests`` distinct ``POST /judge`` requests at
``--concurrency`` (16) and reports throughput, p50/p95 latency, errors and how many requests
each replica answered (the ``X-Judge-Replica`` header). Writes
``benchmarks/results/bench_ray.json``. On a 2-core machine little gain is expected: one
process already uses both cores for its forward passes.

    python benchmarks/bench_ray.py [--replicas 2] [--requests 192] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from bench_service import load, sms_body
from benchlib import cpu_model

from judge.atomicio import write_text

RESULTS = Path(__file__).resolve().parent / "results"
JUDGE = str(Path(sys.executable).parent / "judge")


def measure(command: list[str], port: int, args: argparse.Namespace) -> dict[str, Any]:
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        while time.monotonic() - started < 600:  # bounded: the model loads in well under this
            if process.poll() is not None:
                raise SystemExit(f"{command} exited with {process.returncode}")
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        ready_s = time.monotonic() - started
        asyncio.run(load(url, args.concurrency, 2 * args.concurrency))  # warm-up
        # Other prompts than the warm-up's, so that the prefix cache does not answer them.
        result = asyncio.run(
            load(url, args.concurrency, args.requests, lambda i: sms_body(10_000 + i))
        )
        return {"ready_s": ready_s, **result}
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_ray.json")
    args = parser.parse_args()
    common = ["--port", str(args.port), "--log-level", "warning"]
    rows = {
        "1 process": measure([JUDGE, "serve", *common], args.port, args),
        f"{args.replicas} Ray replicas": measure(
            [JUDGE, "serve", *common, "--ray", "--replicas", str(args.replicas)], args.port, args
        ),
    }
    print(f"concurrency {args.concurrency}, {args.requests} requests, {os.cpu_count()} CPUs")
    print("| setup | ready (s) | req/s | p50 ms | p95 ms | errors | per replica |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['ready_s']:.1f} | {r['throughput_rps']:.1f} | {r['p50_ms']:.0f} | "
            f"{r['p95_ms']:.0f} | {sum(r['errors'].values())} | {sorted(r['per_replica'].values())} |"
        )
    machine = {"cpu": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version()}
    result = {"machine": machine, "config": vars(args) | {"out": str(args.out)}, "rows": rows}
    write_text(args.out, json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
