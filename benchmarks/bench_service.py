"""HTTP load against a running server on loopback, with micro-batching on and off.

Starts ``judge serve`` on a free loopback port (with ``--max-batch-size 16`` and the default
``--max-wait-ms 5``, which waits only after a pass of several; with ``--max-wait-ms 0``, never
waiting; and with ``--max-batch-size 1``), waits for
``/ready``, then at concurrency 1, 4, 16 and 64 sends a fixed number of ``POST /judge``
requests (distinct SMS-style prompts, two choices) and reports throughput, p50/p95/p99
latency and, per request, what HTTP adds to the engine: the client's latency less the
``latency_ms`` the engine measured for the same judgment. Zero errors are expected; any are
counted and reported. Prints the table and writes ``benchmarks/results/bench_service.json``.

    python benchmarks/bench_service.py [--requests 128] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import httpx
import numpy as np
from benchlib import cpu_model

from judge.atomicio import write_text

RESULTS = Path(__file__).resolve().parent / "results"
# Watchdogs, not speed limits: a server that has not answered /ready (or not exited after
# SIGTERM) in this long is hung. Loading the model takes seconds to a minute, more on a slow
# machine shared with other jobs; no bound here is a speed the machine must reach.
START_S = 900.0
STOP_S = 300.0
MESSAGES = [
    "WINNER!! As a valued customer you have been selected to receive a 900 prize reward",
    "Hey, are we still on for lunch tomorrow at the usual place?",
    "URGENT! Your mobile number has won a 2000 bonus caller prize, call 09058094565 now",
    "I'll be late tonight, don't wait up for me",
    "Free ringtone! Reply REAL to 87131 to get yours, 1.50 per week",
    "Can you send me the photos from the weekend when you get a chance",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    port: int,
    batch_size: int,
    dtype: str,
    extra: Sequence[str] = (),
    *,
    ready_path: str = "/ready",
    log: IO[bytes] | None = None,
) -> subprocess.Popen[bytes]:
    """``judge serve`` in its own process group, once ``ready_path`` answers 200.

    ``extra`` flags come last, so they override the defaults here (argparse keeps the last).
    ``ready_path="/health"`` returns before the model has loaded; ``log`` takes the server's
    stderr (default: this process's).
    """
    command = [
        sys.executable, "-m", "service.cli.main", "serve", "--port", str(port), "--dtype", dtype,
        "--max-batch-size", str(batch_size), "--max-queue", "1024", "--log-level", "warning",
        *extra,
    ]  # fmt: skip
    process = subprocess.Popen(
        command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=log
    )
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_server(process)
    raise RuntimeError("server never became ready")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_S)
    except subprocess.TimeoutExpired:  # hung: a failure, but leave no server behind
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(STOP_S)
        raise


def sms_body(i: int) -> dict[str, Any]:
    return {
        "prompt": f"Is this SMS spam? {MESSAGES[i % len(MESSAGES)]} (#{i})",
        "choices": ["spam", "ham"],
    }


async def load(
    url: str,
    concurrency: int,
    requests: int,
    body: Callable[[int], dict[str, Any]] = sms_body,
) -> dict[str, Any]:
    """Send ``requests`` requests (the i-th is ``body(i)``) with at most ``concurrency`` in
    flight."""
    latencies: list[float] = []
    over_engine: list[float] = []  # ms the request took beyond its engine's own latency_ms
    errors: dict[str, int] = {}
    replicas: dict[str, int] = {}  # which replica answered (X-Judge-Replica), for bench_ray
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            start = time.perf_counter()
            try:
                r = await client.post(f"{url}/judge", json=body(i))
                replica = r.headers.get("x-judge-replica", "?")
                replicas[replica] = replicas.get(replica, 0) + 1
                took = time.perf_counter() - start
                if r.status_code != 200:
                    errors[str(r.status_code)] = errors.get(str(r.status_code), 0) + 1
                elif isinstance(engine_ms := r.json().get("latency_ms"), int | float):
                    over_engine.append(took * 1000 - engine_ms)
            except httpx.HTTPError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                took = time.perf_counter() - start
            latencies.append(took)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    ms = np.array(latencies) * 1000
    return {
        "concurrency": concurrency,
        "requests": requests,
        "seconds": elapsed,
        "throughput_rps": requests / elapsed,
        "p50_ms": float(np.percentile(ms, 50)),
        "p95_ms": float(np.percentile(ms, 95)),
        "p99_ms": float(np.percentile(ms, 99)),
        "over_engine_p50_ms": float(np.median(over_engine)) if over_engine else None,
        "errors": errors,
        "per_replica": replicas,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128, help="requests per concurrency level")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 4, 12 requests")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_service.json")
    args = parser.parse_args()
    levels = [1, 4] if args.quick else [1, 4, 16, 64]
    requests = 12 if args.quick else args.requests

    rows = []
    # The default waits up to 5 ms for company after a shared pass; "no wait" never waits.
    configs = (("on", 16, "5"), ("on, no wait", 16, "0"), ("off", 1, "0"))
    for batching, batch_size, wait in configs:
        port = free_port()
        server = start_server(port, batch_size, args.dtype, ["--max-wait-ms", wait])
        try:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(load(url, 2, 4))  # warm-up
            for concurrency in levels:
                row = {"batching": batching, **asyncio.run(load(url, concurrency, requests))}
                rows.append(row)
                print(
                    f"batching {batching:3}  concurrency {concurrency:3}  {row['throughput_rps']:6.2f} req/s  "
                    f"p50 {row['p50_ms']:7.1f} ms  p95 {row['p95_ms']:7.1f} ms  p99 {row['p99_ms']:7.1f} ms  "
                    f"over engine p50 {row['over_engine_p50_ms'] or 0:5.2f} ms  errors {row['errors'] or 0}",
                    flush=True,
                )
        finally:
            stop_server(server)

    def rps(batching: str, c: int) -> float:
        return next(
            r["throughput_rps"] for r in rows if r["batching"] == batching and r["concurrency"] == c
        )

    speedups = {c: rps("on", c) / rps("off", c) for c in levels}
    waiting = {c: rps("on", c) / rps("on, no wait", c) for c in levels}
    print(
        "throughput, batching on / off: "
        + ", ".join(f"c={c}: x{s:.2f}" for c, s in speedups.items())
    )
    print(
        "throughput, waiting after a shared pass / never: "
        + ", ".join(f"c={c}: x{s:.2f}" for c, s in waiting.items())
    )
    machine = {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()}
    result = {
        "machine": machine,
        "quick": args.quick,
        "dtype": args.dtype,
        "rows": rows,
        "speedup": speedups,
        "waiting_over_never": waiting,
    }
    write_text(args.out, json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
