"""The decision log keeps every decision exactly, refuses what it must, and survives its writers.

The behaviour is tested on both backends: SQLite in a temporary directory and a throwaway
PostgreSQL server (tests/postgres.py), a database of its own per test. What only one backend
promises is tested on it: SQLite keeps every acknowledged append through a kill -9 of its
writer; two processes (two replicas) write and label one PostgreSQL log at once.
"""

from __future__ import annotations

import ast
import math
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
from postgres import postgres_database, postgres_url  # noqa: F401
from server import free_port

from judge.identity import new_judgment_id
from service.log.backends import PostgresLog, SQLiteLog, mask_target, open_log
from service.log.decision_log import (
    PRUNE_EVERY,
    DecisionLog,
    DecisionLogError,
    LabelFailure,
    LabelNotAChoiceError,
    LabelOutcome,
    RelabelError,
    Retention,
    UnknownJudgmentError,
)
from service.log.record import LoggedDecision

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
DAY = 86_400.0
NOW = time.time()  # the tests' decisions are from the last hour, inside the default retention


def decision(judgment_id: str | None = None, **changes: Any) -> LoggedDecision:
    """A decision as the service would log it; ``changes`` override its fields."""
    fields: dict[str, Any] = {
        "judgment_id": judgment_id or new_judgment_id(),
        "created_at": time.time(),
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "model_sha256": "a" * 64,
        "tokens_sha256": "b" * 64,
        "policy_sha256": "c" * 64,
        "profile": "support",
        "profile_etag": '"e1"',
        "choices": ["yes", "no"],
        "log_probs": [-1.2039728043259361, -0.35667494393873245],
        "choice_mass": 0.9999999999999999,
        "probabilities": {"yes": 0.30000000000000004, "no": 0.7},
        "choice": "no",
        "confidence": 0.7,
        "decision": "accept",
        "reason_codes": [],
        "threshold": 0.6,
        "certified": True,
        "audit": False,
    }
    fields.update(changes)
    return LoggedDecision(**fields)


@pytest.fixture(params=["sqlite", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a log for this test goes: a new SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "decisions.sqlite")
    return str(request.getfixturevalue("postgres_database"))


@pytest.fixture
def log(target: str) -> Iterator[DecisionLog]:
    with open_log(target) as opened:
        yield opened


def _raw_execute(target: str, sql: str) -> None:
    """Run ``sql`` on the log's database behind its back."""
    if target.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(target, autocommit=True) as admin:
            admin.execute(sql)
        return
    behind = sqlite3.connect(target)
    with behind:  # commits
        behind.execute(sql)
    behind.close()


# -- round trip, appends ---------------------------------------------------------------------


def test_round_trip_keeps_every_field_exactly(log: DecisionLog) -> None:
    full = decision(
        created_at=1_733_000_000.123456789,
        log_probs=[-5e-324, -745.1332191019411, -1e-300],
        choices=["yes", "no", "maybe"],
        choice="maybe",
        probabilities={"yes": 1 / 3, "no": 2 / 3 - 1e-16, "maybe": 5e-324},
        choice_mass=math.nextafter(1.0, 0.0),
        confidence=0.1 + 0.2,
        decision="escalate",
        reason_codes=["low_confidence", "not_certified"],
        threshold=None,
        certified=False,
        audit=True,
        profile=None,
        profile_etag=None,
        request={"prompt": 'Is it ü 🙂?\n"quoted"', "choices": ["yes", "no"], "n": [1, 0.1]},
    )
    plain = decision()
    log.append([full, plain])
    assert log.get(full.judgment_id) == full
    assert log.get(plain.judgment_id) == plain
    got = log.get(full.judgment_id)
    assert got is not None
    assert [x.hex() for x in got.log_probs] == [x.hex() for x in full.log_probs]
    assert got.created_at.hex() == full.created_at.hex()
    assert log.decisions() == sorted([full, plain], key=lambda d: d.created_at)
    assert log.get("no-such-id") is None
    assert log.count() == 2


def test_append_is_atomic(log: DecisionLog) -> None:
    first = decision()
    log.append([first])
    fresh, also_fresh = decision(), decision()
    with pytest.raises(DecisionLogError) as raised:
        log.append([fresh, decision(first.judgment_id, choice="yes"), also_fresh])
    assert raised.value.field == "judgment_id"
    assert first.judgment_id in str(raised.value)
    assert log.get(fresh.judgment_id) is None
    assert log.get(also_fresh.judgment_id) is None
    assert log.count() == 1

    twice = decision()
    with pytest.raises(DecisionLogError, match="more than once"):
        log.append([twice, fresh, twice])
    assert log.count() == 1


def test_a_duplicate_id_is_refused_never_overwritten(log: DecisionLog) -> None:
    original = decision(choice="no")
    log.append([original])
    with pytest.raises(DecisionLogError, match="already in the decision log") as raised:
        log.append([decision(original.judgment_id, choice="yes", confidence=0.9)])
    assert raised.value.field == "judgment_id"
    assert log.get(original.judgment_id) == original


def test_append_refuses_what_json_cannot_hold(log: DecisionLog) -> None:
    with pytest.raises(ValueError, match="log_probs"):
        log.append([decision(log_probs=[-math.inf, 0.0])])
    with pytest.raises(TypeError, match="LoggedDecision"):
        log.append([{"judgment_id": "x"}])  # type: ignore[list-item]
    assert log.count() == 0
    log.append([])  # nothing to do


# -- labels ----------------------------------------------------------------------------------


def test_label_outcomes(log: DecisionLog) -> None:
    first, second = decision("j1"), decision("j2")
    log.append([first, second])

    assert log.label("j1", "yes", now=NOW) == LabelOutcome(
        judgment_id="j1", label="yes", status="labeled", previous=None
    )
    got = log.get("j1")
    assert got is not None and (got.label, got.labeled_at) == ("yes", NOW)
    # The record is the decision as made, with the label beside it.
    assert msgspec.structs.replace(got, label=None, labeled_at=None) == first

    assert log.label("j1", "yes", now=NOW + 5) == LabelOutcome(
        judgment_id="j1", label="yes", status="unchanged", previous="yes"
    )
    got = log.get("j1")
    assert got is not None and got.labeled_at == NOW  # unchanged: nothing written

    with pytest.raises(RelabelError) as relabel:
        log.label("j1", "no")
    assert relabel.value.field == "label"
    assert "'yes'" in str(relabel.value) and "replace=true" in str(relabel.value)

    assert log.label("j1", "no", replace=True, now=NOW + 1) == LabelOutcome(
        judgment_id="j1", label="no", status="relabeled", previous="yes"
    )
    got = log.get("j1")
    assert got is not None and (got.label, got.labeled_at) == ("no", NOW + 1)

    with pytest.raises(UnknownJudgmentError) as unknown:
        log.label("j-missing", "yes")
    assert unknown.value.field == "judgment_id"
    assert "'j-missing'" in str(unknown.value) and "retention" in str(unknown.value)

    with pytest.raises(LabelNotAChoiceError) as not_a_choice:
        log.label("j2", "maybe")
    assert not_a_choice.value.field == "label"
    assert all(f"'{word}'" in str(not_a_choice.value) for word in ("maybe", "yes", "no"))
    got = log.get("j2")
    assert got is not None and got.label is None and got.labeled_at is None


def test_label_many_stores_the_good_items_and_places_each_failure(log: DecisionLog) -> None:
    log.append([decision(i) for i in ("a", "b", "c", "d")])
    log.label("d", "yes")
    results = log.label_many(
        [
            ("a", "yes"),
            ("missing", "no"),
            ("b", "maybe"),
            ("d", "no"),
            ("a", "no"),
            ("c", "no"),
            ("a", "yes"),
        ]
    )
    kinds = [r.status if isinstance(r, LabelOutcome) else r.error for r in results]
    assert kinds == [
        "labeled",
        "unknown_judgment",
        "not_a_choice",
        "relabel",
        "relabel",
        "labeled",
        "unchanged",
    ]
    assert [(r.judgment_id, r.label) for r in results][:2] == [("a", "yes"), ("missing", "no")]
    failure = results[1]
    assert isinstance(failure, LabelFailure) and "'missing'" in failure.detail
    labels = {i: d.label for i in "abcd" if (d := log.get(i)) is not None}
    assert labels == {"a": "yes", "b": None, "c": "no", "d": "yes"}

    replaced = log.label_many([("d", "no"), ("b", "no")], replace=True)
    assert [r.status for r in replaced if isinstance(r, LabelOutcome)] == ["relabeled", "labeled"]
    assert log.label_many([]) == []


def test_concurrent_labels_of_one_decision_have_one_winner(log: DecisionLog) -> None:
    log.append([decision("contested")])
    start = threading.Barrier(8)

    def attempt(k: int) -> LabelOutcome | LabelFailure:
        start.wait()
        return log.label_many([("contested", "yes" if k % 2 else "no")])[0]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(attempt, range(8)))
    winners = [r for r in results if isinstance(r, LabelOutcome) and r.status == "labeled"]
    assert len(winners) == 1, results
    stored = log.get("contested")
    assert stored is not None and stored.label == winners[0].label
    for r in results:
        if r is winners[0]:
            continue
        expected = "unchanged" if r.label == stored.label else "relabel"
        assert (r.status if isinstance(r, LabelOutcome) else r.error) == expected


# -- reading ---------------------------------------------------------------------------------


def test_filters_and_limit_keeps_the_newest(log: DecisionLog) -> None:
    t = NOW - 3600
    rows = [
        decision("d0", created_at=t + 0, profile="a", profile_etag='"1"', audit=False),
        decision("d1", created_at=t + 1, profile="a", profile_etag='"2"', audit=True),
        decision("d2", created_at=t + 2, profile="b", profile_etag='"1"', audit=False),
        decision("d3", created_at=t + 3, profile=None, profile_etag=None, audit=True),
        decision("d4", created_at=t + 4, profile="a", profile_etag='"2"', audit=False),
        decision("d5", created_at=t + 4, profile="a", profile_etag='"2"', audit=False),  # a tie
    ]
    log.append(list(reversed(rows)))  # stored order is not the read order
    log.label("d1", "yes")
    log.label("d4", "no")

    def ids(**filters: Any) -> list[str]:
        return [d.judgment_id for d in log.decisions(**filters)]

    assert ids() == ["d0", "d1", "d2", "d3", "d4", "d5"]
    assert ids(profile="a") == ["d0", "d1", "d4", "d5"]
    assert ids(profile_etag='"2"') == ["d1", "d4", "d5"]
    assert ids(profile="b", profile_etag='"2"') == []
    assert ids(since=t + 2) == ["d2", "d3", "d4", "d5"]
    assert ids(audit=True) == ["d1", "d3"]
    assert ids(audit=False) == ["d0", "d2", "d4", "d5"]
    assert ids(labeled=True) == ["d1", "d4"]
    assert ids(labeled=False) == ["d0", "d2", "d3", "d5"]
    assert ids(limit=3) == ["d3", "d4", "d5"]
    assert ids(limit=2, profile="a", labeled=False) == ["d0", "d5"]
    assert ids(limit=100) == ids()
    assert ids(limit=0) == []
    assert [d.label for d in log.decisions(labeled=True)] == ["yes", "no"]
    with pytest.raises(ValueError, match="limit"):
        log.decisions(limit=-1)
    assert log.count() == 6
    assert log.count("a") == 4
    assert log.count("nobody") == 0


# -- retention -------------------------------------------------------------------------------


def test_retention_by_age(target: str) -> None:
    with open_log(target, retention=Retention(max_age_days=1, max_rows=None)) as log:
        ages = {"old": 2.0, "older": 1.5, "recent": 0.5, "now": 0.0}
        log.append([decision(name, created_at=NOW - days * DAY) for name, days in ages.items()])
        assert log.prune(now=NOW) == 2
        assert [d.judgment_id for d in log.decisions()] == ["recent", "now"]
        assert log.prune(now=NOW) == 0
        assert log.prune(now=NOW + 0.75 * DAY) == 1


def test_retention_by_rows_drops_the_oldest(target: str) -> None:
    with open_log(target, retention=Retention(max_age_days=None, max_rows=3)) as log:
        log.append([decision(f"r{i}", created_at=NOW - 10 + i) for i in range(5)])
        assert log.count() == 5  # pruning waits for PRUNE_EVERY appends, or prune()
        assert log.prune() == 2
        assert [d.judgment_id for d in log.decisions()] == ["r2", "r3", "r4"]


def test_the_log_prunes_at_open_and_every_thousand_appends(target: str) -> None:
    with open_log(target, retention=Retention(max_age_days=None, max_rows=None)) as log:
        log.append([decision(created_at=NOW - 100 + i) for i in range(5)])
    with open_log(target, retention=Retention(max_age_days=None, max_rows=2)) as log:
        assert log.count() == 2
    with open_log(target, retention=Retention(max_age_days=None, max_rows=10)) as log:
        log.append([decision(created_at=NOW - 50 + i * 1e-3) for i in range(PRUNE_EVERY - 1)])
        assert log.count() == 2 + PRUNE_EVERY - 1
        newest = decision(created_at=NOW)
        log.append([newest])
        assert log.count() == 10
        assert log.decisions()[-1] == newest


def test_retention_is_checked() -> None:
    assert Retention() == Retention(max_age_days=90.0, max_rows=1_000_000)
    for bad in ({"max_rows": 0}, {"max_rows": -5}, {"max_rows": 2.5}, {"max_rows": True}):
        with pytest.raises(ValueError, match="max_rows"):
            Retention(**bad)
    for bad in ({"max_age_days": 0}, {"max_age_days": -1.0}, {"max_age_days": math.nan}):
        with pytest.raises(ValueError, match="max_age_days"):
            Retention(**bad)


# -- opening ---------------------------------------------------------------------------------


def test_another_schema_version_is_refused(target: str) -> None:
    with open_log(target) as log:
        log.append([decision()])
    _raw_execute(target, "UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    with pytest.raises(DecisionLogError, match="schema version 2") as raised:
        open_log(target)
    assert "reads version 1" in str(raised.value)


def test_targets_choose_the_backend(tmp_path: Path) -> None:
    with open_log(f"sqlite://{tmp_path}/a.sqlite") as log:
        assert isinstance(log, SQLiteLog)
        assert log.target == f"sqlite://{tmp_path}/a.sqlite"
    with open_log(str(tmp_path / "b.sqlite"), sync="full") as log:
        assert log.target == f"sqlite://{tmp_path}/b.sqlite"
        log.append([decision()])
    with pytest.raises(DecisionLogError, match="sqlite:///abs/path"):
        open_log("sqlite://relative.sqlite")
    with pytest.raises(DecisionLogError, match="unsupported scheme") as raised:
        open_log("mysql://judge:hunter2@db/decisions")
    assert "hunter2" not in str(raised.value)
    with pytest.raises(DecisionLogError, match="empty"):
        open_log("")
    with pytest.raises(ValueError, match="sync"):
        open_log("postgresql://db/decisions", sync="full")
    with pytest.raises(ValueError, match="sync"):
        SQLiteLog(tmp_path / "c.sqlite", sync="always")  # type: ignore[arg-type]


def test_a_missing_directory_is_not_created(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "decisions.sqlite"
    with pytest.raises(DecisionLogError) as raised:
        open_log(str(missing))
    assert str(missing.parent) in str(raised.value)
    assert "create it first" in str(raised.value)
    assert not missing.parent.exists()
    with pytest.raises(DecisionLogError, match="is a directory"):
        open_log(str(tmp_path))


def _open_unprivileged(target: str) -> str:
    """Open the log in a forked child: as nobody when we are root, whom permissions don't bind.

    Returns "opened", or the error the child got as "<class>: <message>".
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanup
        try:
            os.close(read)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            try:
                open_log(target).close()
                message = "opened"
            except BaseException as exc:
                message = f"{type(exc).__name__}: {exc}"
            os.write(write, message.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    return message


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory outside pytest's (which only its owner may enter), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="judge-decision-log-"))
    try:
        yield folder
    finally:
        folder.chmod(0o700)
        for path in folder.iterdir():
            path.chmod(0o600)
        subprocess.run(["rm", "-rf", str(folder)], check=False)


def test_a_read_only_file_or_directory_is_refused_at_open(shared_dir: Path) -> None:
    file = shared_dir / "decisions.sqlite"
    with open_log(str(file)) as log:
        log.append([decision()])
    shared_dir.chmod(0o777)
    file.chmod(0o444)
    message = _open_unprivileged(str(file))
    assert message.startswith("DecisionLogError"), message
    assert str(file) in message

    file.unlink()
    shared_dir.chmod(0o555)
    message = _open_unprivileged(str(file))
    assert message.startswith("DecisionLogError"), message
    assert str(file) in message
    assert not file.exists()


def test_an_unreachable_server_is_named_with_its_password_masked() -> None:
    url = f"postgresql://judge:s3cr%40t-pw@127.0.0.1:{free_port()}/decisions?connect_timeout=3"
    with pytest.raises(DecisionLogError) as raised:
        open_log(url)
    message = str(raised.value)
    assert "s3cr" not in message
    assert "postgresql://judge:***@127.0.0.1" in message


def test_missing_psycopg_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg raises ImportError
    with pytest.raises(
        DecisionLogError, match=r"pip install 'calibrated-judge\[postgres\]'"
    ) as raised:
        open_log("postgres://judge:pw@db.example/decisions")
    assert "postgres://judge:***@db.example/decisions" in str(raised.value)


def test_mask_target() -> None:
    assert mask_target("postgresql://u:p%40ss@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert mask_target("postgresql://u@h/db") == "postgresql://u@h/db"
    assert mask_target("postgresql://h/db?user=u&password=pw&sslmode=require") == (
        "postgresql://h/db?user=u&password=***&sslmode=require"
    )
    assert mask_target("/var/lib/judge/decisions.sqlite") == "/var/lib/judge/decisions.sqlite"


def test_a_closed_log_refuses_work(log: DecisionLog) -> None:
    log.close()
    with pytest.raises(DecisionLogError, match="closed"):
        log.append([decision()])
    log.close()  # twice is fine


# -- concurrency and durability --------------------------------------------------------------


def test_threads_append_at_once(log: DecisionLog) -> None:
    def writer(k: int) -> None:
        for i in range(200):
            log.append([decision(f"t{k}-{i:03d}")])

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(writer, range(4)))
    assert log.count() == 800
    assert len({d.judgment_id for d in log.decisions()}) == 800


def test_postgres_reconnects_when_the_server_closed_the_connection(
    postgres_database: str,  # noqa: F811
) -> None:
    import psycopg

    with open_log(postgres_database) as log:
        assert isinstance(log, PostgresLog)
        log.append([decision()])
        with psycopg.connect(postgres_database, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        log.append([decision()])
        assert log.count() == 2


def _subprocess_env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


KILLED_WRITER = """
import sys
from service.log.backends import SQLiteLog
from test_decision_log import decision
log = SQLiteLog(sys.argv[1])
n = 0
while True:
    batch = [decision(f"k{n:06d}-{k}") for k in range(1 + n % 5)]
    log.append(batch)
    print(" ".join(d.judgment_id for d in batch), flush=True)
    n += 1
"""


def test_sqlite_keeps_every_acknowledged_append_through_kill_9(tmp_path: Path) -> None:
    path = tmp_path / "decisions.sqlite"
    writer = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_subprocess_env(),
    )
    watchdog = threading.Timer(60, writer.kill)
    watchdog.start()
    try:
        assert writer.stdout is not None
        acknowledged: list[str] = []
        for _ in range(50):
            line = writer.stdout.readline()
            assert line.endswith("\n"), (
                f"the writer stopped: {writer.stderr.read() if writer.stderr else ''}"
            )
            acknowledged += line.split()
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        # Lines it finished writing before the kill were acknowledged too.
        acknowledged += [
            i
            for line in writer.stdout.read().splitlines(keepends=True)
            if line.endswith("\n")
            for i in line.split()
        ]
    finally:
        watchdog.cancel()
        writer.kill()
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    with SQLiteLog(path) as log:
        missing = [i for i in acknowledged if log.get(i) is None]
        assert not missing, (
            f"{len(missing)} of {len(acknowledged)} acknowledged decisions lost: {missing[:5]}"
        )
        assert log.count() >= len(acknowledged)
    with sqlite3.connect(path) as check:
        assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    check.close()


REPLICA = """
import random, sys, time
from service.log.backends import PostgresLog
from service.log.decision_log import LabelFailure
from test_decision_log import decision, replica_ids
url, me, other = sys.argv[1:4]
mine, theirs = replica_ids(me), replica_ids(other)
log = PostgresLog(url)
print("ready", flush=True)
sys.stdin.readline()
rng = random.Random(me)
outcomes = {}
# Label every third of the other's decisions "no", and its contested ones (i % 10 == 5) too,
# which their own replica labels "yes" as soon as it has appended them.
pending = [j for i, j in enumerate(theirs) if i % 3 == 0 or i % 10 == 5]

def note(results):
    left = []
    for r in results:
        if isinstance(r, LabelFailure) and r.error == "unknown_judgment":
            left.append(r.judgment_id)  # not appended yet: try again later
        else:
            outcomes[r.judgment_id] = r.error if isinstance(r, LabelFailure) else r.status
    return left

i = 0
while i < len(mine):
    n = rng.randint(1, 5)
    log.append([decision(j) for j in mine[i : i + n]])
    note(log.label_many([(mine[k], "yes") for k in range(i, min(i + n, len(mine))) if k % 10 == 5]))
    i += n
    pending = note(log.label_many([(j, "no") for j in pending]))
deadline = time.monotonic() + 300  # a watchdog: the other replica may be slow to append
while pending and time.monotonic() < deadline:
    time.sleep(0.01)
    pending = note(log.label_many([(j, "no") for j in pending]))
log.close()
print(repr(outcomes), flush=True)
"""


def replica_ids(replica: str) -> list[str]:
    return [f"{replica}-{i:03d}" for i in range(300)]


def test_two_replicas_write_and_label_one_postgres_log(
    postgres_database: str,  # noqa: F811
) -> None:
    open_log(postgres_database).close()  # the tables exist before either replica starts
    replicas = {
        name: subprocess.Popen(
            [sys.executable, "-c", REPLICA, postgres_database, name, other],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=_subprocess_env(),
        )
        for name, other in (("A", "B"), ("B", "A"))
    }
    try:
        for process in replicas.values():
            assert process.stdout is not None and process.stdin is not None
            assert process.stdout.readline() == "ready\n", process.communicate()[1]
        for process in replicas.values():  # both start appending at once
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        outputs = {name: p.communicate(timeout=600) for name, p in replicas.items()}
    finally:
        for process in replicas.values():
            process.kill()
            process.wait()
    for name, (_, err) in outputs.items():
        assert replicas[name].returncode == 0, err
    outcomes = {name: ast.literal_eval(out.strip()) for name, (out, _) in outputs.items()}
    with open_log(postgres_database) as log:
        assert log.count() == 600
        stored = {d.judgment_id: d.label for d in log.decisions()}
    for owner, other in (("A", "B"), ("B", "A")):
        for i, judgment_id in enumerate(replica_ids(owner)):
            if i % 10 == 5:  # both labeled it at once: exactly one of them won
                results = sorted([outcomes[owner][judgment_id], outcomes[other][judgment_id]])
                assert results == ["labeled", "relabel"], (judgment_id, results)
                winner = owner if outcomes[owner][judgment_id] == "labeled" else other
                assert stored[judgment_id] == ("yes" if winner == owner else "no")
            elif i % 3 == 0:
                assert outcomes[other][judgment_id] == "labeled"
                assert stored[judgment_id] == "no"
            else:
                assert stored[judgment_id] is None
