"""What the decision log costs per decision: its raw appends, and the HTTP service with it.

(a) appends   ``DecisionLog.append`` from one thread, one transaction per call, of 1 and of 16
              records (a realistic two-choice ``LoggedDecision``, no request kept), for
              SQLite in WAL mode with ``sync="normal"`` (kept through a kill -9) and
              ``sync="full"`` (an fsync per commit: kept through a power loss), and
              PostgreSQL with ``synchronous_commit`` on (the WAL flushed per commit) and off.
              Decisions per second, and the milliseconds one append takes. Retention is the
              default, so the prune every 1,000 records is in the cost.
(b) service   a real server (uvicorn, in its own process) on a fake engine that answers at
              once (tests/fakes.py), so the log's cost is not hidden behind a model: ``POST
              /judge`` from httpx at concurrency 1 and 8 without a log, with a SQLite log,
              with a SQLite log and ``log_requests`` (the prompt kept too) and with a
              PostgreSQL log (synchronous_commit on). The server's defaults otherwise,
              ``max_wait_ms`` 5 included (a lone request waits that long for company).
(c) model     the same on the real default model (``judge serve``, ``--dtype auto``) at
              concurrency 1 and 4, without a log and with a SQLite log: the log's cost
              against a real forward pass, which is the number users care about.

Every contender is measured side by side: (a)'s logs and (b)'s and (c)'s servers are all up
at once, and each round measures each contender once, in an order that rotates from round
to round. Reported: medians over rounds, and each round's ratio to the baseline (SQLite
normal with as many records per append; no log), median over rounds. After (b) and (c), each
log holds one row per decision served (checked). The files live in a temporary directory
(``--dir``), whose file system the result names: fsync costs what its disk does.

PostgreSQL is tests/postgres.py's throwaway server (Debian's binaries), restarted with
fsync, synchronous_commit and full_page_writes back on: the tests turn them off, and here
durability is what is measured. On loopback, so a remote database adds its round trip per
append. Without the binaries or psycopg its rows are skipped, with a printed note. Its cost
per append grows with the table in a new log (see "first..last round" and "rows at end"):
psycopg prepares a statement run 5 times, and PostgreSQL's cached generic plan of the
duplicate check (``judgment_id IN (...)``), made while the table was nearly empty, stays a
sequential scan until an ANALYZE (autovacuum's, within minutes) replans it.

    python benchmarks/bench_decision_log.py [--quick] [--model | --no-model] [--dir DIR]

The full run takes about 4 minutes on 2 cores; ``--quick`` (fewer rounds and requests, and
no (c) unless ``--model``) about 20 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench_service import free_port, load, start_server, stop_server
from benchlib import cpu_flags, cpu_model

from judge.atomicio import write_text
from judge.identity import new_judgment_id
from service.log.backends import Sync, open_log
from service.log.decision_log import DecisionLog
from service.log.record import LoggedDecision

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))
from postgres import PostgresServer, binaries  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

FAKE_SERVER = """
import json, sys
from pathlib import Path

import uvicorn
from fakes import FakeEngine

from service import ServiceConfig, create_app

port, options = int(sys.argv[1]), json.loads(sys.argv[2])
options["profiles_dir"] = Path(options["profiles_dir"])
app = create_app(FakeEngine(), config=ServiceConfig(**options))
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
"""


# --- the machine ------------------------------------------------------------------------------


def file_system(path: Path) -> str:
    """The type and device of the file system ``path`` is on (/proc/mounts' longest match)."""
    best, found = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, kind = line.split()[:3]
            inside = str(path).startswith(mount.rstrip("/") + "/") or str(path) == mount
            if inside and len(mount) > len(best):
                best, found = mount, f"{kind} ({device} on {mount})"
    except OSError:
        pass
    return found


def machine(folder: Path, postgres_version: str | None) -> dict[str, Any]:
    try:
        import psycopg

        psycopg_version: str | None = psycopg.__version__
    except ImportError:
        psycopg_version = None
    return {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "postgresql": postgres_version,
        "psycopg": psycopg_version,
        "file_system": file_system(folder),
    }


# --- PostgreSQL -------------------------------------------------------------------------------


class DurablePostgres(PostgresServer):
    """tests/postgres.py's server, restarted with the durability settings at their defaults."""

    def start(self) -> None:
        super().start()  # initdb, then a start with fsync and synchronous_commit off
        settings = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port} "
            f"-c unix_socket_directories={self.root}"
        )
        self._command(
            str(self.bin / "pg_ctl"), "--pgdata", str(self.data), "--log",
            str(self.root / "server.log"), "--options", settings, "--wait", "--timeout", "60",
            "--mode", "fast", "restart",
        )  # fmt: skip

    def database(self, name: str, *, synchronous_commit: bool = True) -> str:
        """The URL of a new database ``name`` with that synchronous_commit."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {name}")
            setting = "on" if synchronous_commit else "off"
            admin.execute(f"ALTER DATABASE {name} SET synchronous_commit = {setting}")
        return self.url.rsplit("/", 1)[0] + f"/{name}"

    def version(self) -> str:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as admin:
            row = admin.execute("SHOW server_version").fetchone()
            checks = admin.execute("SHOW fsync").fetchone()
        assert row is not None and checks is not None and checks[0] == "on", checks
        return str(row[0])


@contextmanager
def postgres(skipped: list[str]) -> Iterator[DurablePostgres | None]:
    """A durable throwaway server, or None (and why, in ``skipped``) where none can run."""
    bin_dir = binaries()
    try:
        import psycopg  # noqa: F401
    except ImportError:
        bin_dir = None
        skipped.append("PostgreSQL: psycopg is not installed (pip install '.[postgres]')")
    else:
        if bin_dir is None:
            skipped.append("PostgreSQL: no binaries under /usr/lib/postgresql/*/bin")
    if bin_dir is None:
        print(f"note: {skipped[-1]}; its rows are skipped", flush=True)
        yield None
        return
    server = DurablePostgres(bin_dir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


# --- (a) appends ------------------------------------------------------------------------------


def decision() -> LoggedDecision:
    """A two-choice decision as the service logs one (tests/test_decision_log.py's)."""
    return LoggedDecision(
        judgment_id=new_judgment_id(),
        created_at=time.time(),
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        model_sha256="a" * 64,
        tokens_sha256="b" * 64,
        policy_sha256="c" * 64,
        profile="support",
        profile_etag='"e1"',
        choices=["yes", "no"],
        log_probs=[-1.2039728043259361, -0.35667494393873245],
        choice_mass=0.9999999999999999,
        probabilities={"yes": 0.30000000000000004, "no": 0.7},
        choice="no",
        confidence=0.7,
        decision="accept",
        reason_codes=[],
        threshold=0.6,
        certified=True,
        audit=False,
    )


@dataclass
class Appender:
    """One log of (a) and its measurements."""

    backend: str
    durability: str
    per_append: int
    log: DecisionLog
    appends: int  # per round
    rates: list[float] = field(default_factory=list)  # decisions per second, one per round
    rows_at_end: int = 0


def append_rows(
    folder: Path, server: DurablePostgres | None, rounds: int, scale: float
) -> list[dict[str, Any]]:
    """(a): decisions per second of each log and batch size, interleaved round by round."""

    def sqlite_target(sync: str) -> Callable[[int], str]:
        return lambda k: str(folder / f"{sync}_{k}.sqlite")

    def postgres_target(on: bool) -> Callable[[int], str]:
        assert server is not None
        setting = "on" if on else "off"
        return lambda k: server.database(f"append_{setting}_{k}", synchronous_commit=on)

    # (backend, durability, the target of a new log for k records per append)
    targets = [("sqlite", sync, sqlite_target(sync)) for sync in ("normal", "full")]
    if server is not None:
        targets += [
            ("postgresql", f"synchronous_commit {'on' if on else 'off'}", postgres_target(on))
            for on in (True, False)
        ]
    # Appends per round at 1 record (at 16, a quarter as many): about 0.2-0.5 s each here.
    counts = {"normal": 1000, "full": 100, "synchronous_commit on": 150}
    contenders: list[Appender] = []
    with ExitStack() as stack:
        for backend, durability, target in targets:
            for per_append in (1, 16):
                sync: Sync = "full" if durability == "full" else "normal"
                log = stack.enter_context(open_log(target(per_append), sync=sync))
                appends = counts.get(durability, 500) // (1 if per_append == 1 else 4)
                appends = max(5, round(appends * scale))
                for _ in range(3):  # warm-up: the connection, the statements, the file
                    log.append([decision() for _ in range(per_append)])
                contenders.append(Appender(backend, durability, per_append, log, appends))
        for r in range(rounds):
            for c in contenders[r % len(contenders) :] + contenders[: r % len(contenders)]:
                batches = [[decision() for _ in range(c.per_append)] for _ in range(c.appends)]
                start = time.perf_counter()
                for batch in batches:
                    c.log.append(batch)
                c.rates.append(c.appends * c.per_append / (time.perf_counter() - start))
        for c in contenders:
            c.rows_at_end = c.log.count()
    rows = []
    for c in contenders:
        base = next(
            b for b in contenders if b.durability == "normal" and b.per_append == c.per_append
        )
        rate = statistics.median(c.rates)
        rows.append(
            {
                "backend": c.backend,
                "durability": c.durability,
                "records_per_append": c.per_append,
                "appends_per_round": c.appends,
                "decisions_per_s": rate,
                "ms_per_append": 1000 * c.per_append / rate,
                "ratio_to_sqlite_normal": statistics.median(
                    x / y for x, y in zip(c.rates, base.rates, strict=True)
                ),
                "rounds": c.rates,  # decisions/s, in the order measured
                "rows_at_end": c.rows_at_end,
            }
        )
    return rows


# --- (b), (c) the service ---------------------------------------------------------------------


def fake_server(port: int, options: dict[str, Any]) -> subprocess.Popen[bytes]:
    """The fake-engine server in its own process group, once GET /ready answers 200."""
    path = os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])
    process = subprocess.Popen(
        [sys.executable, "-c", FAKE_SERVER, str(port), json.dumps(options)],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": path},
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the fake server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    raise RuntimeError("the fake server never became ready")


def measure_service(
    urls: dict[str, str], levels: Sequence[int], requests: dict[int, int], rounds: int
) -> list[dict[str, Any]]:
    """Each server at each concurrency once per round, in a rotating order; the first of
    ``urls`` is the baseline the ratios are to."""
    names = list(urls)
    baseline = names[0]
    found: dict[tuple[str, int], list[dict[str, Any]]] = {(n, c): [] for n in names for c in levels}
    for url in urls.values():
        asyncio.run(load(url, 2, 8))  # warm-up: connections, code paths, the log's file
    for r in range(rounds):
        for concurrency in levels:
            for name in names[r % len(names) :] + names[: r % len(names)]:
                run = asyncio.run(load(urls[name], concurrency, requests[concurrency]))
                found[name, concurrency].append(run)
    rows = []
    for concurrency in levels:
        base = found[baseline, concurrency]
        for name in names:
            runs = found[name, concurrency]
            errors: dict[str, int] = {}
            for run in runs:
                for key, n in run["errors"].items():
                    errors[key] = errors.get(key, 0) + n
            rps = [run["throughput_rps"] for run in runs]
            p50 = [run["p50_ms"] for run in runs]
            rows.append(
                {
                    "log": name,
                    "concurrency": concurrency,
                    "requests_per_round": requests[concurrency],
                    "throughput_rps": statistics.median(rps),
                    "p50_ms": statistics.median(p50),
                    "p95_ms": statistics.median(run["p95_ms"] for run in runs),
                    "throughput_ratio": statistics.median(
                        x / b["throughput_rps"] for x, b in zip(rps, base, strict=True)
                    ),
                    "p50_ratio": statistics.median(
                        x / b["p50_ms"] for x, b in zip(p50, base, strict=True)
                    ),
                    "p50_added_ms": statistics.median(
                        x - b["p50_ms"] for x, b in zip(p50, base, strict=True)
                    ),
                    "errors": errors,
                    "rounds_rps": rps,
                }
            )
    return rows


def logged_counts(targets: dict[str, str]) -> dict[str, int]:
    counts = {}
    for name, target in targets.items():
        with open_log(target) as log:
            counts[name] = log.count()
    return counts


def service_rows(
    folder: Path, server: DurablePostgres | None, quick: bool, rounds: int
) -> tuple[list[dict[str, Any]], dict[str, int], int]:
    """(b): the fake-engine server with each log; the rows, each log's rows and the
    requests each server answered with a 200 (its log must hold as many)."""
    targets: dict[str, str | None] = {
        "none": None,
        "sqlite": str(folder / "service.sqlite"),
        "sqlite+requests": str(folder / "service_requests.sqlite"),
    }
    if server is not None:
        targets["postgresql"] = server.database("service")
    (folder / "profiles").mkdir(exist_ok=True)
    levels = [1, 8]
    requests = {1: 60, 8: 120} if quick else {1: 300, 8: 600}
    processes = []
    try:
        urls = {}
        for name, target in targets.items():
            port = free_port()
            options = {
                "profiles_dir": str(folder / "profiles"),
                "decision_log": target,
                "log_requests": name == "sqlite+requests",
            }
            processes.append(fake_server(port, options))
            urls[name] = f"http://127.0.0.1:{port}"
        rows = measure_service(urls, levels, requests, rounds)
    finally:
        for process in processes:
            stop_server(process)
    served = 8 + rounds * sum(requests.values())  # the warm-up's, then the rounds'
    return rows, logged_counts({k: v for k, v in targets.items() if v}), served


def model_rows(folder: Path, quick: bool, rounds: int) -> tuple[list[dict[str, Any]], int, int]:
    """(c): ``judge serve`` on the default model without a log and with a SQLite log; the
    rows, the log's rows and the requests answered."""
    target = str(folder / "model.sqlite")
    (folder / "profiles").mkdir(exist_ok=True)
    flags = ["--profiles-dir", str(folder / "profiles")]
    levels = [1, 4]
    requests = {1: 4, 4: 8} if quick else {1: 8, 4: 16}
    processes = []
    try:
        urls = {}
        for name, extra in (("none", flags), ("sqlite", [*flags, "--decision-log", target])):
            port = free_port()
            processes.append(start_server(port, 16, "auto", extra))
            urls[name] = f"http://127.0.0.1:{port}"
        rows = measure_service(urls, levels, requests, rounds)
    finally:
        for process in processes:
            stop_server(process)
    served = 8 + rounds * sum(requests.values())
    return rows, logged_counts({"sqlite": target})["sqlite"], served


# --- the report -------------------------------------------------------------------------------


def print_appends(rows: list[dict[str, Any]]) -> None:
    print("\n(a) appends, one transaction each; ratio to SQLite sync normal at that batch size")
    print(
        "| backend | durability | records/append | decisions/s | ms/append | x sqlite normal "
        "| first..last round | rows at end |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['durability']} | {r['records_per_append']} | "
            f"{r['decisions_per_s']:,.0f} | {r['ms_per_append']:.2f} | "
            f"{r['ratio_to_sqlite_normal']:.3f} | {r['rounds'][0]:,.0f}..{r['rounds'][-1]:,.0f} "
            f"| {r['rows_at_end']:,} |"
        )


def print_service(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}; ratios to no log, median of per-round ratios")
    print("| log | concurrency | req/s | p50 ms | p95 ms | x req/s | x p50 | p50 +ms | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['log']} | {r['concurrency']} | {r['throughput_rps']:.1f} | "
            f"{r['p50_ms']:.2f} | {r['p95_ms']:.2f} | {r['throughput_ratio']:.3f} | "
            f"{r['p50_ratio']:.3f} | {r['p50_added_ms']:+.2f} | {r['errors'] or 0} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer rounds, less")
    parser.add_argument(
        "--model",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run (c), the real model (default: yes, and no with --quick)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="where the logs go (default: /tmp)")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_decision_log.json")
    args = parser.parse_args()
    started = time.perf_counter()
    rounds = 2 if args.quick else 5
    skipped: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="bench-decision-log-", dir=args.dir))
    try:
        with postgres(skipped) as server:
            pg_version = server.version() if server is not None else None
            facts = machine(folder, pg_version)
            print(
                f"{facts['cpu']} ({facts['cores']} cores; {' '.join(facts['cpu_flags'])}), "
                f"SQLite {facts['sqlite']}, PostgreSQL {pg_version}, logs on "
                f"{facts['file_system']}",
                flush=True,
            )
            appends = append_rows(folder, server, rounds, 0.2 if args.quick else 1.0)
            print_appends(appends)
            service, logged, served = service_rows(folder, server, args.quick, rounds)
            print_service("(b) POST /judge on a fake engine", service)
        for name, n in logged.items():
            assert n == served, f"the {name} log holds {n} decisions for {served} served"
        model: list[dict[str, Any]] = []
        model_logged = None
        model_rounds = 0
        if not (args.model if args.model is not None else not args.quick):
            skipped.append("(c) the real model: --no-model, or --quick without --model")
        else:
            # Short rounds, many of them: the machine's speed drifts over seconds.
            model_rounds = 2 if args.quick else 9
            model, model_logged, model_served = model_rows(folder, args.quick, model_rounds)
            assert model_logged == model_served, (model_logged, model_served)
            print_service("(c) POST /judge on the default model (judge serve)", model)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    elapsed = time.perf_counter() - started
    print(f"\n{elapsed:.0f} s; skipped: {skipped or 'nothing'}")
    result = {
        "machine": facts,
        "quick": args.quick,
        "config": {"rounds": rounds, "model_rounds": model_rounds},
        "appends": appends,
        "service": service,
        "service_logged": {"served": served, "logged": logged},
        "model": model,
        "model_logged": model_logged,
        "skipped": skipped,
        "elapsed_s": elapsed,
    }
    write_text(args.out, json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
