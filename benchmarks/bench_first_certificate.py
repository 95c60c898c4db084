"""Labels to the first certificate on the path users take: the labelling queue through the real
command line, a simulated person typing each item's true label (issue 66).

For each task, the pool is its calibration split and the first half of its test split, written
as a file of unlabelled items; the second half of the test split is never labelled and checks
every certificate. The pool is judged once (``judge_pool``, as the queue judges it; every run
reads the kept scores). Then, for each seed, three ways to the first certificate, each fitted
every ``--every`` labels as the queue fits (``calibration.tasks.advise``): a fit is a look only
where the fitted map's own confidence in its answers (out of fold, no label read) says the
labels are likely enough, and the looks of a split spend one delta
(``calibration.certificates.recertify``):

* **default**: ``judge label --queue --items POOL --task DIR --seed S`` in a subprocess, both
  streams in turn, the teach stream ordered by the map fitted so far. The labeller reads each
  card's id off the screen and types its true label; when a fit begins it waits for its
  result before the next key (a person slower than the fit). A look that certifies writes the
  profile; the labeller copies it.
* **uniform**: the audit stream alone, in the same queue in process: uniform labels only.
* **before**: both streams in turn, the teach stream in the model's own order (never the
  fitted map's), and the uniform labels split by the pattern beside the taught ones
  (``allotment="pattern"``), as fits split before this issue.

A run stops at the first certificate whose certified coverage (on its certify split) is at
least 0.5 at precision 0.9, delta 0.1 over the split's looks, or when the labels run out (the
cap). Reported: per task and way, the labels to that certificate per seed and their median,
and how many looks it took; every certificate written (each run's first, and its first of half
coverage) checked on the unlabelled half: its precision there against 0.9, counted; and the
queue's estimate of the audit labels a certificate needs (at its first fit with at least 50
audit labels) against the audit labels its first certificate took.

    python benchmarks/bench_first_certificate.py [--tasks ...] [--seeds 5] [--first-seed 0]
        [--every 10] [--quick]
    python benchmarks/bench_first_certificate.py --tables A.json B.json  # runs merged, per task
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import queue as queues
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import cpu_flags, cpu_model

from calibration import FitSettings, load_profile
from calibration.maps.probe import candidate_layers
from calibration.tasks import (
    ItemQueue,
    Looks,
    advise,
    checks_on_scores,
    judge_pool,
    load_pool,
    load_split,
    load_task,
    looks_path,
)
from judge import Judge
from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
JUDGE = Path(sys.executable).parent / "judge"
TARGET, DELTA, COVERAGE = 0.9, 0.1, 0.5
EVERY = 10  # labels between fits, the queue's default (--every)
WAYS = ("default", "uniform", "before")
FEW = 50  # the queue's estimate is read at its first fit with this many audit labels


class Pool:
    """One task's pool (a file of its unlabelled items, in a working task folder that keeps
    their scores) and its evaluation half, judged."""

    def __init__(self, name: str, work: Path, engine: Judge, quick: bool) -> None:
        source = load_task(DATA / name)
        calibration, _ = load_split(source, "calibration", 60 if quick else None)
        test, _ = load_split(source, "test", 120 if quick else None)
        half = len(test) // 2
        self.folder = work / name
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "task.json").write_text((DATA / name / "task.json").read_text())
        self.task = load_task(self.folder)
        items = calibration + test[:half]
        self.truth = {f"p{i}": item.label for i, item in enumerate(items)}
        self.items = work / f"{name}.items.jsonl"
        write_text(
            self.items,
            "".join(
                json.dumps({"id": key, "text": item.text}) + "\n"
                for key, item in zip(self.truth, items, strict=True)
            ),
        )
        self.pool, digest = load_pool(self.items)
        layers = candidate_layers(engine.num_layers or 0)
        start = time.perf_counter()
        self.scores = judge_pool(
            engine, self.task, [t for _, t in self.pool], digest, layers=layers
        )
        self.judge_seconds = time.perf_counter() - start
        # The evaluation half, judged as the pool is (and kept beside it), its labels set.
        held = test[half:]
        texts = "".join(json.dumps({"text": item.text}) + "\n" for item in held)
        scores = judge_pool(
            engine,
            self.task,
            [item.text for item in held],
            hashlib.sha256(texts.encode()).hexdigest(),
            layers=layers,
        )
        self.evaluation = dataclasses.replace(
            scores,
            labels=np.array([self.task.choices.index(item.label) for item in held]),
        )
        self.fingerprint = engine.fingerprint()

    def check(self, profile_path: Path) -> dict[str, Any]:
        """A certificate on the unlabelled half: its precision and coverage there."""
        profile = load_profile(profile_path)
        e = self.evaluation
        gates = checks_on_scores(profile, e)
        accepted = gates.accepted
        right = gates.best == e.labels
        t = profile.threshold
        return {
            "labels": profile.n_examples,
            "audit": profile.n_examples - profile.split.taught,
            "method": profile.calibration_map.method,
            "threshold": t.threshold,
            "certified_coverage": t.coverage,
            "test_coverage": float(accepted.mean()),
            "test_precision": float(right[accepted].mean()) if accepted.any() else None,
            "test_accepted": int(accepted.sum()),
        }


class Screen:
    """What the queue's subprocess has printed, read line by line as it comes: the card shown,
    the fits begun and finished, and the certificates written (copied as they come)."""

    def __init__(self, process: subprocess.Popen[str], pool: Pool, split: str, out: Path):
        self.pool, self.split, self.out = pool, split, out
        self.profiles = out / f"{pool.task.name}-{split}-profiles"
        self.lines: queues.Queue[str | None] = queues.Queue()
        self.card: str | None = None  # the id of the item on screen, once its keys are shown
        self.pending: int | None = None  # a fit begun on this many labels, not finished yet
        self.fits: list[dict[str, Any]] = []
        self.certificates: list[dict[str, Any]] = []
        self.ended = False
        self._shown: str | None = None

        def read() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                self.lines.put(line.rstrip("\n"))
            self.lines.put(None)

        threading.Thread(target=read, daemon=True).start()

    def next_card(self) -> str | None:
        """The id of the next item to label, once no fit the queue began is still running;
        None when the queue has ended."""
        self.card = None
        while self.card is None or self.pending is not None:
            line = self.lines.get(timeout=900)
            if line is None:
                self.ended = True
                return None
            self._read(line)
        return self.card

    def _read(self, line: str) -> None:
        if m := re.match(r"^\[(?:audit|teach): \d+ left\] (\S+)", line):
            self._shown = m.group(1)
        elif "q quit" in line:
            self.card = self._shown
        elif m := re.search(r"fitting a profile on the (\d+) labels", line):
            self.pending = int(m.group(1))
        elif m := re.match(r"^\[fit on (\d+) labels: (\d+) audit", line):
            n = int(m.group(1))
            fit: dict[str, Any] = {"labels": n, "audit": int(m.group(2))}
            fit["certified"] = "the gate opens" in line
            fit["look"] = fit["certified"] or "certified nothing" in line
            if fit["certified"]:
                kept = self.out / f"{self.pool.task.name}-{self.split}-{n}.json"
                shutil.copy(self.profiles / f"{self.pool.task.name}.json", kept)
                self.certificates.append({"file": kept.name, **self.pool.check(kept)})
                fit["coverage"] = self.certificates[-1]["certified_coverage"]
            self.fits.append(fit)
            if self.pending == n:
                self.pending = None
        elif m := re.search(r"about (\d+) more audit labels \((\d+) in all\)", line):
            self.fits[-1]["estimate"] = int(m.group(2))
        elif "more labels will not" in line and self.fits:
            self.fits[-1]["estimate"] = None


def run_cli(pool: Pool, seed: int, cap: int, out: Path, every: int) -> dict[str, Any]:
    """The default way, through ``judge label --queue``: what each fit said, and the
    certificates it wrote (copied to ``out``)."""
    split = f"default-{seed}"
    (pool.folder / f"{split}.jsonl").unlink(missing_ok=True)
    looks_path(pool.task, split).unlink(missing_ok=True)  # a new lineage for a new run
    profiles = out / f"{pool.task.name}-{split}-profiles"
    shutil.rmtree(profiles, ignore_errors=True)
    argv = [str(JUDGE), "label", "--queue", "--items", str(pool.items), "--task"]
    argv += [str(pool.folder), "--split", split, "--seed", str(seed), "--profiles-dir"]
    argv += [str(profiles), "--dtype", pool.fingerprint.dtype, "--refit-every", str(every)]
    process = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        bufsize=1,
    )
    assert process.stdin is not None
    screen = Screen(process, pool, split, out)
    labelled = 0
    while (card := screen.next_card()) is not None:
        done = any(c["certified_coverage"] >= COVERAGE for c in screen.certificates)
        if done or labelled >= cap:
            process.stdin.write("q\n")
            process.stdin.flush()
            break
        process.stdin.write(f"{pool.task.choices.index(pool.truth[card]) + 1}\n")
        process.stdin.flush()
        labelled += 1
    while not screen.ended:  # the queue's last fit, on every label, as it quits
        line = screen.lines.get(timeout=900)
        if line is None:
            break
        screen._read(line)
    process.stdin.close()
    process.wait(timeout=900)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {process.returncode}")
    # A fit on the labels left after the last scheduled one, at the queue's end, is not a
    # fit the labeller waited for: the run's certificates are those it stopped on or before.
    return {"fits": screen.fits, "certificates": screen.certificates, "labels": labelled}


def run_in_process(
    pool: Pool, seed: int, cap: int, out: Path, way: str, every: int
) -> dict[str, Any]:
    """The uniform or the before way: the queue in process, fitted every ``every`` labels as
    the command line's queue fits (``advise``, a look where the labels are likely enough)."""
    split = f"{way}-{seed}"
    (pool.folder / f"{split}.jsonl").unlink(missing_ok=True)
    streams = ["audit"] if way == "uniform" else ["audit", "teach"]
    queue = ItemQueue(pool.task, pool.pool, pool.scores, split, seed=seed, streams=streams)
    settings = FitSettings(target_precision=TARGET, delta=DELTA)
    if way == "before":
        settings = FitSettings(target_precision=TARGET, delta=DELTA, allotment="pattern")
    looks = Looks(delta=DELTA)
    fits: list[dict[str, Any]] = []
    certificates: list[dict[str, Any]] = []
    labelled = 0
    while labelled < cap and (item := queue.next()) is not None:
        queue.label(item, pool.truth[item.id])
        labelled += 1
        if labelled % every or not queue.ready():
            continue
        advice = advise(
            pool.task,
            split,
            queue.snapshot(),
            pool.fingerprint,
            name=pool.task.name,
            looks=looks,
            settings=settings,
            alternating=len(streams) > 1,
        )
        needed = advice.needed
        fit: dict[str, Any] = {
            "labels": advice.labels,
            "audit": advice.audit,
            "look": advice.looked,
            "certified": advice.certified,
            "estimate": None if needed is None else needed.labels,
        }
        fits.append(fit)
        if advice.looked:
            looks = Looks(delta=DELTA, looks=looks.looks + 1)
        if advice.certified:
            kept = out / f"{pool.task.name}-{split}-{labelled}.json"
            write_text(kept, _encoded(advice.profile))
            certificates.append({"file": kept.name, **pool.check(kept)})
            fit["coverage"] = certificates[-1]["certified_coverage"]
            if fit["coverage"] >= COVERAGE:
                break
    return {"fits": fits, "certificates": certificates, "labels": labelled}


def _encoded(profile: Any) -> str:
    from calibration.profile import profile_bytes

    return profile_bytes(profile).decode()


def first(run: dict[str, Any], coverage: float) -> dict[str, Any] | None:
    """The run's first certificate of at least ``coverage``."""
    return next((c for c in run["certificates"] if c["certified_coverage"] >= coverage), None)


def estimate(run: dict[str, Any]) -> int | None:
    """The queue's estimate of the audit labels in all, at its first fit with ``FEW``."""
    return next(
        (f.get("estimate") for f in run["fits"] if f["audit"] >= FEW and "estimate" in f),
        None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["sst2", "ag_news", "sms_spam", "trec"])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds run from this one")
    parser.add_argument("--ways", nargs="+", default=list(WAYS))
    parser.add_argument("--cap", type=int, default=500, help="labels a run may take at most")
    parser.add_argument("--every", type=int, default=EVERY, help="labels between fits")
    parser.add_argument("--quick", action="store_true", help="one task, one seed, a small pool")
    parser.add_argument("--work", type=Path, help="working folder (default: results/...)")
    parser.add_argument("--out", type=Path, help="where the JSON goes (default: results/)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument(
        "--tables", nargs="+", type=Path, help="print the tables of these reports, merged"
    )
    args = parser.parse_args()
    if args.tables:
        merged = merge([json.loads(path.read_text()) for path in args.tables])
        print_tables(merged, args.ways)
        return
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.quick:
        args.tasks, args.seeds, args.cap = args.tasks[:1], 1, 100
    # Scratch: the pools, their kept scores, the labels and every profile written (ignored).
    work = args.work or ROOT / "benchmarks" / ".work" / (
        "first_certificate_quick" if args.quick else "first_certificate"
    )
    out_path = args.out or RESULTS / (
        "bench_first_certificate_quick.json" if args.quick else "bench_first_certificate.json"
    )
    engine = Judge.load()
    report: dict[str, Any] = {
        "cpu": cpu_model(),
        "flags": [f for f in cpu_flags() if f.startswith(("avx", "amx"))],
        "dtype": engine.dtype,
        "target_precision": TARGET,
        "delta": DELTA,
        "coverage": COVERAGE,
        "every": args.every,
        "tasks": {},
    }
    for name in args.tasks:
        pool = Pool(name, work, engine, args.quick)
        cap = min(args.cap, len(pool.pool))
        runs: dict[str, Any] = {"pool": len(pool.pool), "cap": cap}
        runs["evaluation"] = len(pool.evaluation)
        runs["judge_seconds"] = pool.judge_seconds
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for way in args.ways:
                start = time.perf_counter()
                if way == "default":
                    run = run_cli(pool, seed, cap, work, args.every)
                else:
                    run = run_in_process(pool, seed, cap, work, way, args.every)
                run["seconds"] = time.perf_counter() - start
                runs.setdefault(way, []).append({"seed": seed, **run})
                got = first(run, COVERAGE)
                print(name, seed, way, None if got is None else got["labels"], flush=True)
        report["tasks"][name] = runs
        write_text(out_path, json.dumps(report, indent=2))
    print_tables(report, args.ways)


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report of several runs' (of the same settings): each task's runs of each way, by
    seed, in the order given."""
    merged = {**reports[0], "tasks": {}}
    for report in reports:
        for name, runs in report["tasks"].items():
            into = merged["tasks"].setdefault(name, {**runs, **{w: [] for w in WAYS}})
            for way in WAYS:
                into[way].extend(runs.get(way, []))
                into[way].sort(key=lambda run: run["seed"])
    return merged


def print_tables(report: dict[str, Any], ways: list[str]) -> None:
    print(f"\n{report['cpu']} ({', '.join(report['flags'])}); {report['dtype']}")
    print(
        f"Labels to the first certificate of coverage >= {COVERAGE} at precision {TARGET}, "
        f"delta {DELTA}, per seed ('-': none within the cap), and their median"
    )
    print("| task | " + " | ".join(ways) + " |")
    print("|---|" + "---|" * len(ways))
    for name, runs in report["tasks"].items():
        cells = []
        for way in ways:
            got = [first(r, COVERAGE) for r in runs[way]]
            labels = [None if g is None else g["labels"] for g in got]
            finite = [x if x is not None else 10**9 for x in labels]
            median = statistics.median_high(finite)  # a run with none counts as the most
            shown = "-" if median >= 10**9 else f"{median:g}"
            looks = [sum(bool(f.get("look")) for f in r["fits"]) for r in runs[way]]
            cells.append(
                ", ".join("-" if x is None else str(x) for x in labels)
                + f" (median {shown}; looks {', '.join(map(str, looks))})"
            )
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nEvery first certificate (of any coverage, and of half) on the unlabelled half:")
    print("| way | certificates | precision < 0.9 there | lowest precision |")
    print("|---|---|---|---|")
    for way in ways:
        checked = []
        for runs in report["tasks"].values():
            for r in runs[way]:
                seen = set()
                for c in (first(r, 0.0), first(r, COVERAGE)):
                    if c is not None and c["file"] not in seen:
                        seen.add(c["file"])
                        checked.append(c)
        low = [c["test_precision"] for c in checked if c["test_precision"] is not None]
        failed = sum(p < TARGET for p in low)
        print(f"| {way} | {len(checked)} | {failed} | {min(low) if low else float('nan'):.3f} |")
    if "default" in ways:
        print("\nThe queue's estimate (audit labels in all, at its first fit with >= 50 audit)")
        print("against the audit labels its first certificate took:")
        print("| task | estimate | took |")
        print("|---|---|---|")
        for name, runs in report["tasks"].items():
            est = [estimate(r) for r in runs["default"]]
            took = [None if (c := first(r, 0.0)) is None else c["audit"] for r in runs["default"]]
            print(
                f"| {name} | {', '.join('-' if e is None else str(e) for e in est)} | "
                f"{', '.join('-' if t is None else str(t) for t in took)} |"
            )


if __name__ == "__main__":
    main()
