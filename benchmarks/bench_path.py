"""The path one request takes through the project's own files and layers, traced on the real model.

    python benchmarks/bench_path.py [--model PATH_OR_ID] [--dtype auto] [--out FILE]

Fits a small profile over HTTP (POST /profiles/{name}/fit, 40 sms_spam examples, temperature),
then traces one ``POST /judge`` with that profile from the ASGI entry to the logits and back.
Every call into, and every return to, a project file (judge/, calibration/, service/, and the
old top-level packages where they still exist) is recorded per thread with ``sys.setprofile`` /
``threading.setprofile``. Code outside the project in between (litestar, anyio, torch) is
transparent: a return lands in the nearest project frame below the returning one. An await
that suspends a coroutine is no move: the coroutine resumes where it was, so async code does
not count every await as a return and a new call. A plain generator's yield is a return to its
consumer, and its resumption a call.

Per thread, the files control is in, in order, make a *path*; consecutive moments in one file
are one *visit*; a *step* is a move from one visit to the next, and a *re-entry* is a visit to
a file the thread had already left. Three measures are printed, so that two trees can be
compared with the same one:

- **per file, calls** (the measure before issue 30): calls only, no returns. Cheap and
  comparable with the earlier rows, but it under-counts moves (a return is not seen, so
  ``A`` calling ``B`` and then ``C`` reads ``A -> B -> C``) and it counts the model's inner
  loop: each of the decoder's layers calls into ``judge/attention.py`` and back, so a
  30-layer model adds some 60 steps that say nothing about the project's structure. (A
  resumed coroutine is told by its RESUME instruction; the script before issue 30 told it by
  the frame's id, which a new frame may reuse, so it missed a few fresh coroutines.)
- **per file, calls and returns, the pass once**: calls and returns, with the model's inner
  loop counted once. A run of consecutive visits inside the pass's own files
  (``judge/forward.py``, ``judge/decoder.py``, ``judge/attention.py``,
  ``judge/batch_invariant.py``) is one visit to *the pass*, however many layers it loops over;
  leaving it (to ``judge/prefix_cache.py``, say) and coming back is a step each way, as for
  any file. The same collapse on calls only is printed beside it, to show what the loop alone
  accounted for. Collapsing the loop, rather than not counting below the engine's call of the
  pass (``judge.forward.score_rows``), keeps what the pass asks of the rest of the engine
  (the prefix cache's lookup, assembly and store), which is the project's structure.
- **by layer**: the same path with each file replaced by its package (``judge``,
  ``calibration``, ``calibration.tasks``, ``service``, ``service.cli``), consecutive visits
  to one package merged. A *crossing* is a move from a file of one package to a file of
  another, each way: ``service -> calibration`` and back is two. Printed per thread in order,
  each layer visit with the function it was entered by (or returned to) and its files.

A structural measure, not a timing: it does not depend on the machine's speed.
"""

from __future__ import annotations

import argparse
import dis
import functools
import inspect
import itertools
import json
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "sms_spam"
PACKAGES = ("judge", "calibration", "service", "tasks", "cli", "atomicio")
# The model's inner loop: the pass and what it calls once per layer.
PASS_FILES = (
    "judge/forward.py",
    "judge/decoder.py",
    "judge/attention.py",
    "judge/batch_invariant.py",
)
PASS = "the pass"

CALL, RESUME, RETURN = "call", "resume", "return"
_AWAITABLE = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_SUSPENDABLE = _AWAITABLE | inspect.CO_GENERATOR
_RESUME = dis.opmap["RESUME"]
_YIELD = dis.opmap["YIELD_VALUE"]

_active = False
_events: list[tuple[int, str, str, str]] = []  # (thread id, kind, project file, function)
_threads: dict[int, str] = {}  # thread id: its name, in order of first event


@functools.cache
def _project_file(filename: str) -> str | None:
    """``filename`` relative to the repository root if it is one of the project's, else None."""
    if not filename.startswith(str(ROOT)):
        return None
    relative = filename[len(str(ROOT)) + 1 :]
    return relative if relative.split("/", 1)[0] in PACKAGES else None


def _resumed(frame: FrameType) -> bool:
    """A generator or coroutine frame resumed after a yield or an await (its RESUME's oparg is
    0 at the start of the function only)."""
    code = frame.f_code.co_code
    return code[frame.f_lasti] == _RESUME and code[frame.f_lasti + 1] & 3 != 0


def _suspended(frame: FrameType) -> bool:
    """A generator or coroutine frame leaving at a yield or an await, to be resumed."""
    return frame.f_lasti >= 0 and frame.f_code.co_code[frame.f_lasti] == _YIELD


def _record(frame: FrameType, event: str, arg: Any) -> None:
    if not _active or event not in (CALL, RETURN):
        return
    code = frame.f_code
    file = _project_file(code.co_filename)
    if file is None:
        return
    thread = threading.get_ident()
    if thread not in _threads:
        _threads[thread] = threading.current_thread().name
    suspendable = code.co_flags & _SUSPENDABLE
    if event == CALL:
        if suspendable and _resumed(frame):
            if not code.co_flags & _AWAITABLE:  # a generator resumed by its consumer: a call
                _events.append((thread, RESUME, file, code.co_qualname))
            return  # a coroutine resumed after an await: the same call, no move
        _events.append((thread, CALL, file, code.co_qualname))
        return
    if code.co_flags & _AWAITABLE and _suspended(frame):
        return  # an await that suspends: the coroutine resumes here, no move
    back = frame.f_back
    while back is not None:
        caller = _project_file(back.f_code.co_filename)
        if caller is not None:
            _events.append((thread, RETURN, caller, back.f_code.co_qualname))
            return
        back = back.f_back


@dataclass
class Visit:
    """Consecutive moments of one thread in one unit: a file, or the pass (``PASS_FILES``)."""

    unit: str
    entry: str  # the function it was entered by, or returned to
    files: list[str] = field(default_factory=list)  # in first-visit order


def _visits(
    events: Sequence[tuple[int, str, str, str]], *, returns: bool, pass_once: bool
) -> dict[int, list[Visit]]:
    """Per thread, its visits in order: from calls only (as before issue 30: neither returns
    nor a generator's resumptions), or from every move; the pass's files one unit, or each
    its own."""
    visits: dict[int, list[Visit]] = {}
    for thread, kind, file, function in events:
        if kind != CALL and not returns:
            continue
        unit = PASS if pass_once and file in PASS_FILES else file
        path = visits.setdefault(thread, [])
        if not path or path[-1].unit != unit:
            path.append(Visit(unit, function))
        if file not in path[-1].files:
            path[-1].files.append(file)
    return visits


def _layer(file: str) -> str:
    """A file's package (``service/cli/main.py``: ``service.cli``); a top-level module's name."""
    parent = Path(file).parent
    return str(parent).replace("/", ".") if parent != Path(".") else Path(file).stem


def _by_layer(visits: dict[int, list[Visit]]) -> dict[int, list[Visit]]:
    """Per thread, the visits merged by package: each a visit to a layer, with its files."""
    layers: dict[int, list[Visit]] = {}
    for thread, path in visits.items():
        merged = layers.setdefault(thread, [])
        for visit in path:
            layer = _layer(visit.files[0])
            if not merged or merged[-1].unit != layer:
                merged.append(Visit(layer, f"{Path(visit.files[0]).stem}.{visit.entry}"))
            merged[-1].files += [f for f in visit.files if f not in merged[-1].files]
    return layers


@dataclass
class Measure:
    """Files in first-visit order, each file's visits, steps and re-entries over all threads."""

    order: list[str]
    visits: Counter[str]
    steps: int
    reentries: int


def _measure(visits: dict[int, list[Visit]]) -> Measure:
    order: list[str] = []
    entries: Counter[str] = Counter()
    steps = reentries = 0
    for path in visits.values():
        seen: set[str] = set()
        for i, visit in enumerate(path):
            for file in visit.files:
                entries[file] += 1
                if file not in order:
                    order.append(file)
            steps += i > 0
            reentries += visit.unit in seen
            seen.add(visit.unit)
    return Measure(order, entries, steps, reentries)


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
            for _ in range(2):  # warm: the trace sees the steady state
                client.post("/judge", json=body)
            _events.clear()
            _active = True
            response = client.post("/judge", json=body)
            _active = False
            assert response.status_code == 200, response.text
    sys.setprofile(None)
    threading.setprofile(None)

    calls = _measure(_visits(_events, returns=False, pass_once=False))
    calls_once = _measure(_visits(_events, returns=False, pass_once=True))
    path = _visits(_events, returns=True, pass_once=True)
    moves = _measure(path)
    layers = _by_layer(path)
    by_layer = _measure(layers)
    crossings = by_layer.steps
    pairs: Counter[str] = Counter()
    for merged in layers.values():
        for a, b in itertools.pairwise(merged):
            pairs[f"{a.unit} -> {b.unit}"] += 1
    # a thread's name without the address some carry (asyncio-portal-7f29...)
    names = {t: re.sub(r"-[0-9a-f]{8,}$", "", _threads.get(t, str(t))) for t in path}
    judged = response.json()

    print(
        f"one POST /judge with a profile (its map: {judged.get('calibration_method')}, temperature "
        f"{judged.get('temperature')}): {len(moves.order)} files, {len(path)} threads"
    )
    print(f"  {'measure':<46} {'steps':>6} {'re-entries':>11}")
    for label, m in (
        ("per file, calls (before issue 30)", calls),
        ("per file, calls, the pass once", calls_once),
        ("per file, calls and returns, the pass once", moves),
    ):
        print(f"  {label:<46} {m.steps:6d} {m.reentries:11d}")
    print(
        f"  {'by layer, calls and returns (crossings)':<46} {crossings:6d} {by_layer.reentries:11d}"
    )
    print(f"\n  {'calls':>5} {'visits':>6}  {'layer':<12} file (first-visit order)")
    for file in moves.order:
        print(f"  {calls.visits[file]:5d} {moves.visits[file]:6d}  {_layer(file):<12} {file}")
    print("\n  crossings by direction: " + ", ".join(f"{p} {n}" for p, n in sorted(pairs.items())))
    for thread, merged in layers.items():
        print(f"\n  by layer, thread {names[thread]!r}: {len(merged) - 1} crossings")
        for visit in merged:
            files = ", ".join(Path(f).stem for f in visit.files)
            print(f"    {visit.unit:<12} {visit.entry:<44} {files}")
    if args.out is not None:
        from judge.atomicio import write_text

        def measure(m: Measure) -> dict[str, Any]:
            return {"visits": dict(m.visits), "steps": m.steps, "reentries": m.reentries}

        result = {
            "calibration_method": judged.get("calibration_method"),
            "files": moves.order,
            "calls": measure(calls),
            "calls_pass_once": measure(calls_once),
            "moves_pass_once": measure(moves),
            "layers": {
                "crossings": crossings,
                "reentries": by_layer.reentries,
                "by_direction": dict(sorted(pairs.items())),
                "paths": {
                    names[thread]: [
                        {"layer": v.unit, "entry": v.entry, "files": v.files} for v in merged
                    ]
                    for thread, merged in layers.items()
                },
            },
            "steps": calls.steps,  # the measure before issue 30, under its old keys
            "reentries": calls.reentries,
        }
        write_text(args.out, json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
