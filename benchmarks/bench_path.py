"""The path one request takes through the project's own files, traced on the real model.

    python benchmarks/bench_path.py [--model PATH_OR_ID] [--dtype auto] [--out FILE]

Fits a small profile over HTTP (POST /profiles/{name}/fit, 40 sms_spam examples, temperature),
then traces one ``POST /judge`` with that profile from the ASGI entry to the logits and back.
Every function call that lands in a project file (judge/, calibration/, service/, and the
old top-level packages where they still exist) is recorded per thread with
``sys.setprofile`` / ``threading.setprofile`` (a coroutine resumed after an await is the same
call, not a new one). Per thread, consecutive calls in one file are one
visit; a *step* is a move from one file to another, and a *re-entry* is a visit to a file the
thread had already left. Prints the files in first-visit order with their visits, and the
totals, so that two trees can be compared with the same measure.

A structural measure, not a timing: it does not depend on the machine's speed.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "sms_spam"
PACKAGES = ("judge", "calibration", "service", "tasks", "cli", "atomicio")

_active = False
_events: list[tuple[int, str]] = []  # (thread id, project file), in call order


_SUSPENDABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR
_started: set[int] = set()  # coroutine and generator frames already entered once


def _record(frame: FrameType, event: str, arg: Any) -> None:
    if not _active or event != "call":
        return
    if frame.f_code.co_flags & _SUSPENDABLE:
        # A coroutine resumed after an await reports "call" again: the same call, not a new
        # entry into its file (async code would otherwise count every await as a re-entry).
        if id(frame) in _started:
            return
        _started.add(id(frame))
    file = frame.f_code.co_filename
    if file.startswith(str(ROOT)):
        relative = file[len(str(ROOT)) + 1 :]
        if relative.split("/", 1)[0] in PACKAGES:
            _events.append((threading.get_ident(), relative))


def _visits(events: list[tuple[int, str]]) -> dict[int, list[str]]:
    """Per thread, the files in visit order (consecutive calls in one file are one visit)."""
    visits: dict[int, list[str]] = {}
    for thread, file in events:
        path = visits.setdefault(thread, [])
        if not path or path[-1] != file:
            path.append(file)
    return visits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON")
    args = parser.parse_args(argv)

    # Set before any thread starts, so that the test client's and the model's threads report.
    threading.setprofile(_record)
    sys.setprofile(_record)

    import tempfile

    from litestar.testing import TestClient

    from judge import Judge
    from service import ServiceConfig, create_app

    task = json.loads((DATA / "task.json").read_text())
    rows = [json.loads(line) for line in (DATA / "calibration.jsonl").read_text().splitlines()]
    by_label: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_label.setdefault(row["label"], []).append(row)
    examples = [
        {"prompt": f"{task['instruction']}\n\n{row['text']}", "label": row["label"]}
        for label in sorted(by_label)
        for row in by_label[label][:20]
    ]
    global _active
    with tempfile.TemporaryDirectory() as profiles:
        engine = Judge.load(args.model, dtype=args.dtype)
        app = create_app(engine, config=ServiceConfig(profiles_dir=Path(profiles)))
        with TestClient(app, timeout=600) as client:
            while client.get("/ready").status_code != 200:  # the warm-up judgment
                time.sleep(0.1)
            fit = client.post(
                "/profiles/spam/fit",
                json={
                    "choices": task["choices"],
                    "examples": examples,
                    "method": "temperature",
                },
            )
            assert fit.status_code in (200, 201), fit.text
            body = {
                "prompt": f"{task['instruction']}\n\nWINNER!! Claim your free prize now.",
                "choices": task["choices"],
                "profile": "spam",
            }
            client.post("/judge", json=body)  # warm: the trace sees the steady state
            _events.clear()
            _active = True
            response = client.post("/judge", json=body)
            _active = False
            assert response.status_code == 200, response.text
    sys.setprofile(None)
    threading.setprofile(None)

    visits = _visits(_events)
    order: list[str] = []
    entries: Counter[str] = Counter()
    steps = reentries = 0
    for path in visits.values():
        seen: set[str] = set()
        for i, file in enumerate(path):
            entries[file] += 1
            if file not in order:
                order.append(file)
            if i:
                steps += 1
            if file in seen:
                reentries += 1
            seen.add(file)
    print(
        f"one POST /judge with a profile: {len(order)} files, {steps} steps, "
        f"{reentries} re-entries, {len(visits)} threads"
    )
    for file in order:
        print(f"  {entries[file]:3d}  {file}")
    if args.out is not None:
        from judge.atomicio import write_text

        result = {"files": order, "visits": dict(entries), "steps": steps, "reentries": reentries}
        write_text(args.out, json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
