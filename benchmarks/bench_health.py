"""The decision log's loop on the real model: serve, label the audit sample, check, replay.

On a shared dataset (default sst2) with the default model, as a new user would run it:

1. ``judge calibrate --task`` fits a profile on the calibration split (auto: the probe
   competes), unless one is already in ``--profiles-dir``;
2. ``judge serve --decision-log --audit-rate 0.2 --log-requests`` in its own process judges the
   test split (batches of 16), the audited decisions get their true labels (``POST /labels``),
   and ``GET /profiles/{name}/health`` and ``judge check`` say whether the profile holds;
3. the same with a fresh log fed only the test items of the first choice (a label-prior
   shift): the drift test must fire and ``judge check`` exit 1;
4. ``judge replay`` re-runs one logged decision of the first log: with batch-invariant
   arithmetic nothing may change.

Prints a table and writes ``benchmarks/results/bench_health.json``. No timing target: the
seconds are recorded for the reader. ``--quick`` judges 200 test items.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from benchlib import cpu_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from server import Server, free_port  # noqa: E402

from calibration.tasks import Task, load_task, task_prompt  # noqa: E402
from judge.atomicio import write_text  # noqa: E402

JUDGE = str(Path(sys.executable).parent / "judge")
RESULTS = ROOT / "benchmarks" / "results"


def serve_and_check(
    task: Task, name: str, rows: list[dict[str, Any]], work: Path, profiles: Path
) -> dict[str, Any]:
    """Judge ``rows`` through a server with a fresh log; label the audit sample; check."""
    log = work / f"{name}.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{log}{suffix}").unlink(missing_ok=True)
    port = free_port()
    command = [
        JUDGE,
        "serve",
        "--port",
        str(port),
        "--profiles-dir",
        str(profiles),
        "--decision-log",
        str(log),
        "--audit-rate",
        "0.2",
        "--log-requests",
    ]
    server = Server(command, port)
    started = time.perf_counter()
    try:
        server.wait_ready()
        responses: list[dict[str, Any]] = []
        with httpx.Client(base_url=server.url, timeout=600) as client:
            for i in range(0, len(rows), 16):
                items = [
                    {
                        "prompt": task_prompt(task, r["text"]),
                        "choices": task.choices,
                        "profile": task.name,
                    }
                    for r in rows[i : i + 16]
                ]
                answer = client.post("/judge/batch", json={"items": items})
                answer.raise_for_status()
                responses += answer.json()["results"]
            audited = [
                {"judgment_id": r["judgment_id"], "label": row["label"]}
                for r, row in zip(responses, rows, strict=True)
                if r.get("audit")
            ]
            labeled = client.post("/labels", json={"labels": audited}).json()["results"]
            health = client.get(f"/profiles/{task.name}/health").json()
    finally:
        server.stop()
    seconds = time.perf_counter() - started
    check = subprocess.run(
        [
            JUDGE,
            "check",
            "--profile",
            task.name,
            "--profiles-dir",
            str(profiles),
            "--log",
            str(log),
        ],
        capture_output=True,
        text=True,
    )
    return {
        "stream": name,
        "n": len(rows),
        "accepted": sum(r["decision"] == "accept" for r in responses),
        "audited": len(audited),
        "label_statuses": sorted({x["status"] for x in labeled}),
        "alarms": health["alarms"],
        "precision": health["precision"],
        "drift": health["drift"],
        "shares": health["shares"],
        "check_exit": check.returncode,
        "check_says": check.stderr.strip().splitlines()[-1] if check.stderr else "",
        "seconds": round(seconds, 1),
        "log": str(log),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", type=Path, default=ROOT.parent / "shared" / "data" / "sst2")
    parser.add_argument("--work", type=Path, default=Path("/tmp/judge-bench-health"))
    parser.add_argument("--quick", action="store_true", help="200 test items")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_health.json")
    args = parser.parse_args()
    task = load_task(args.task)
    profiles = args.work / "profiles"
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if not (profiles / f"{task.name}.json").exists():
        subprocess.run(
            [JUDGE, "calibrate", "--task", str(args.task), "--profiles-dir", str(profiles)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    fit_s = time.perf_counter() - started
    test = [json.loads(line) for line in (args.task / "test.jsonl").read_text().splitlines()]
    if args.quick:
        test = test[:200]
    first = task.choices[0]
    streams = [
        serve_and_check(task, "stationary", test, args.work, profiles),
        serve_and_check(
            task, f"only {first}", [r for r in test if r["label"] == first], args.work, profiles
        ),
    ]
    with sqlite3.connect(streams[0]["log"]) as db:
        (judgment_id,) = db.execute("SELECT judgment_id FROM decisions LIMIT 1").fetchone()
    replay = subprocess.run(
        [
            JUDGE,
            "replay",
            judgment_id,
            "--log",
            streams[0]["log"],
            "--profiles-dir",
            str(profiles),
        ],
        capture_output=True,
        text=True,
    )
    changed = json.loads(replay.stdout)["changed"] if replay.returncode == 0 else None
    print(f"\n{task.name}, {cpu_model()}; profile fitted or found in {fit_s:.0f} s")
    print(
        "| stream | n | accepted | audited | audited precision [95% CI] | drift p (KS, chi2) "
        "| alarms | judge check |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for s in streams:
        p, d = s["precision"], s["drift"]
        shown = (
            f"{p['correct']}/{p['n']} = {p['precision']:.3f} [{p['lower']:.3f}, {p['upper']:.3f}]"
            if p and p["n"]
            else "-"
        )
        drift = f"{d['confidence_p']:.2g}, {d['choice_p']:.2g}" if d and d["confidence_p"] else "-"
        print(
            f"| {s['stream']} | {s['n']} | {s['accepted']} | {s['audited']} | {shown} | {drift} "
            f"| {', '.join(s['alarms']) or 'none'} | exit {s['check_exit']} |"
        )
    print(f"replay of {judgment_id}: exit {replay.returncode}, changed {changed}")
    result = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "quick": args.quick,
        "task": task.name,
        "fit_s": round(fit_s, 1),
        "streams": streams,
        "replay": {"judgment_id": judgment_id, "exit": replay.returncode, "changed": changed},
    }
    write_text(args.out, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
