"""POST /v1/systemone against POST /judge: one request of 3 questions, or 3 requests.

Starts ``judge serve`` on a free loopback port, waits for ``/ready``, and for a few states
(support tickets of a few hundred tokens) measures side by side:

    systemone   one POST /v1/systemone with 3 questions (noul, choice, score) about the state
    judge x3    three POST /judge, one after another, with the same rendered prompts (the
                state and the question: ``judge.answers.plan_decisions``) and choices

Each state is new to the server for each arm (a fresh suffix), so neither finds the state in
the prefix cache that the other filled; one warm-up of each first. Reports the wall time per
request and per question (median over repetitions), and the largest difference between the two
arms' probabilities. Prints the table and writes ``benchmarks/results/bench_systemone.json``.

    python benchmarks/bench_systemone.py [--reps 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from benchlib import cpu_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from judge.answers import plan_decisions  # noqa: E402

TICKET = (
    "Hello, I have been a customer for three years. This month my card was charged twice for "
    "the premium plan, once on the 3rd and again on the 5th, and the second charge also "
    "triggered an overdraft fee from my bank. I tried the in-app chat but it kept "
    "disconnecting, and the help page said to email billing, which bounced. Please refund the "
    "duplicate charge and tell me whether you can cover the overdraft fee. I also noticed the "
    "app logs me out every time I switch networks, which started after the last update. "
)
QUESTIONS: dict[str, dict[str, Any]] = {
    "billing": {"type": "noul", "instructions": "Is this about billing?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should handle it?",
        "criteria": {
            "billing": "payments, refunds and invoices",
            "technical": "bugs, outages and errors",
            "sales": "plans, upgrades and quotes",
        },
    },
    "urgency": {
        "type": "score",
        "instructions": "How urgent is it?",
        "criteria": ["not urgent", "within a week", "today", "right now"],
    },
}


SERVE = [sys.executable, "-m", "service.cli.main", "serve"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def systemone(http: httpx.Client, state: dict[str, str]) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    r = http.post("/v1/systemone", json={"state": state, "questions": QUESTIONS})
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    body = r.json()
    return elapsed, {q: a["raw_probabilities"] for q, a in body["answers"].items()}


def judge_each(http: httpx.Client, state: dict[str, str]) -> tuple[float, dict[str, Any]]:
    plan = plan_decisions(state, QUESTIONS)
    out: dict[str, Any] = {}
    start = time.perf_counter()
    for asked in plan.asked:
        query = plan.queries[asked.start]  # order "given": one listing
        r = http.post("/judge", json={"prompt": query.prompt, "choices": query.choices})
        r.raise_for_status()
        out[asked.id] = r.json()["raw_probabilities"]
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quick", action="store_true", help="2 repetitions")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/bench_systemone.json"
    )
    args = parser.parse_args()
    reps = 2 if args.quick else args.reps
    port = free_port()
    server = subprocess.Popen(
        [*SERVE, "--port", str(port), "--dtype", args.dtype, "--log-level", "warning"],
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                try:
                    if http.get("/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            systemone(http, {"ticket": TICKET, "id": "warm-up-1"})
            judge_each(http, {"ticket": TICKET, "id": "warm-up-2"})
            one, each, diff = [], [], 0.0
            for i in range(reps):
                t1, _ = systemone(http, {"ticket": TICKET, "id": f"s-{i}"})
                t3, _ = judge_each(http, {"ticket": TICKET, "id": f"j-{i}"})
                # Same prompts, to compare the numbers: a state that neither arm has seen.
                _, ref = judge_each(http, {"ticket": TICKET, "id": f"s-{i}x"})
                _, got = systemone(http, {"ticket": TICKET, "id": f"s-{i}x"})
                diff = max(diff, *(abs(got[q][c] - ref[q][c]) for q in ref for c in ref[q]))
                one.append(t1)
                each.append(t3)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    n = len(QUESTIONS)
    rows = [
        {
            "arm": "systemone (1 request)",
            "request_ms": 1000 * statistics.median(one),
            "per_question_ms": 1000 * statistics.median(one) / n,
        },
        {
            "arm": f"judge x{n} (sequential)",
            "request_ms": 1000 * statistics.median(each),
            "per_question_ms": 1000 * statistics.median(each) / n,
        },
    ]
    result = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "quick": args.quick,
        "reps": reps,
        "dtype": args.dtype,
        "rows": rows,
        "speedup": statistics.median(each) / statistics.median(one),
        "max_abs_probability_difference": diff,
        "raw_s": {"systemone": one, "judge_each": each},
    }
    print(f"{'arm':<26} {'request ms':>11} {'per question ms':>16}")
    for row in rows:
        print(f"{row['arm']:<26} {row['request_ms']:>11.1f} {row['per_question_ms']:>16.1f}")
    print(f"speedup {result['speedup']:.2f}x; max |dp| {diff:.2e}; CPU {cpu_model()}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
