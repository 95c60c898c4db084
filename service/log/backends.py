"""The decision log's two databases, and ``open_log``, which chooses one by its target.

    SQLiteLog      ``sqlite:///abs/path`` or a plain file path: embedded, the default. WAL
                   mode, one connection per thread; the file is created, its directory is not.
    PostgresLog    ``postgresql://...`` or ``postgres://...``: several replicas, on several
                   machines, writing one log (the ``postgres`` extra).

Each runs the SQL that ``service.log.decision_log.DecisionLog`` writes once for both, through
a cursor of its own (``Cursor``). That module's docstring says what each database keeps
through a crash and how writers take turns. A target's password never reaches a message
(``mask_target``).
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import unquote, urlsplit

from service.install import install_hint
from service.log.decision_log import Cursor, DecisionLog, DecisionLogError, Retention

if TYPE_CHECKING:
    import psycopg

__all__ = ["PostgresLog", "SQLiteLog", "Sync", "mask_target", "open_log"]

BUSY_TIMEOUT_MS = 5_000  # how long a SQLite writer waits for another's transaction
CONNECT_TIMEOUT_S = 10  # PostgreSQL, unless the URL says otherwise

log = logging.getLogger("judge.service")

T = TypeVar("T")
Sync = Literal["normal", "full"]


def mask_target(target: str) -> str:
    """``target`` for messages and logs: any password in a URL replaced by ``***``."""
    masked = re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:/@?#]*):[^@/?#]*@", r"\1:***@", target)
    return re.sub(r"([?&]password=)[^&#]*", r"\1***", masked, flags=re.IGNORECASE)


def _secrets(url: str) -> list[str]:
    """The passwords a URL holds, as written and decoded, to scrub from a driver's messages."""
    found: list[str] = []
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    if password:
        found += [password, unquote(password)]
    found += [unquote(m) for m in re.findall(r"[?&]password=([^&#]*)", url, re.IGNORECASE) if m]
    found += [m for m in re.findall(r"[?&]password=([^&#]*)", url, re.IGNORECASE) if m]
    return sorted({s for s in found if s}, key=len, reverse=True)


def open_log(
    target: str, *, retention: Retention | None = None, sync: Sync = "normal"
) -> DecisionLog:
    """Open (creating its tables if missing) the decision log at ``target``.

    Parameters
    ----------
    target : str
        ``postgresql://user:password@host:port/database`` (or ``postgres://``) for PostgreSQL;
        ``sqlite:///abs/path`` or a plain file path for SQLite.
    retention : Retention, optional
        What to keep; None: ``Retention()`` (90 days, 1,000,000 rows).
    sync : {"normal", "full"}
        SQLite only: "full" makes every commit survive a power loss too (see the module
        docstring). PostgreSQL's durability is the server's setting.

    Raises
    ------
    DecisionLogError
        The target cannot be opened, its tables created, or written (open writes to ``meta``,
        so a read-only log fails here and not at the first decision); its schema version is
        another; psycopg is missing for a PostgreSQL URL.
    """
    if not isinstance(target, str) or not target.strip():
        raise DecisionLogError(
            f"decision log target {target!r} is empty; give a file path, sqlite:///abs/path "
            "or postgresql://user@host/database"
        )
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", target)
    if scheme is None or scheme[1].lower() == "sqlite":
        return SQLiteLog(target, retention=retention, sync=sync)
    if scheme[1].lower() in ("postgresql", "postgres"):
        if sync != "normal":
            raise ValueError(
                f"sync={sync!r} is for SQLite logs; for {mask_target(target)} the PostgreSQL "
                "server's synchronous_commit decides durability: leave sync as 'normal'"
            )
        return PostgresLog(target, retention=retention)
    raise DecisionLogError(
        f"decision log target {mask_target(target)} has an unsupported scheme {scheme[1]!r}; "
        "use postgresql://..., sqlite:///abs/path or a plain file path"
    )


# -- SQLite --------------------------------------------------------------------------------


class _SQLiteCursor(Cursor):
    def __init__(self, connection: sqlite3.Connection) -> None:
        self._connection = connection

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self._connection.execute(sql, tuple(params)).fetchall()

    def change(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self._connection.execute(sql, tuple(params)).rowcount

    def change_many(self, sql: str, params: Sequence[Sequence[Any]]) -> None:
        self._connection.executemany(sql, params)


def _sqlite_path(target: str | os.PathLike[str]) -> Path:
    text = os.fspath(target)
    if text.lower().startswith("sqlite:"):
        rest = text[len("sqlite:") :]
        if not rest.startswith("///"):
            raise DecisionLogError(
                f"decision log target {text!r} has no absolute path; write sqlite:///abs/path "
                "(three slashes, then the path) or give a plain file path"
            )
        text = rest[2:]
    return Path(text).expanduser().absolute()


class SQLiteLog(DecisionLog):
    """The decision log in one SQLite file (WAL mode), for the threads of one machine.

    Each thread gets its own connection (SQLite's connections are not for sharing); writes
    are ``BEGIN IMMEDIATE`` transactions, so a writer takes the lock before it reads and never
    has to give up halfway. ``sync``: "normal" (kept through a crash of the process) or "full"
    (through a power loss too, at a flush per commit).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        retention: Retention | None = None,
        sync: Sync = "normal",
    ) -> None:
        if sync not in ("normal", "full"):
            raise ValueError(f"sync must be 'normal' or 'full', got {sync!r}")
        self.path = _sqlite_path(path)
        super().__init__(f"sqlite://{self.path}", retention)
        self._sync = sync
        self._local = threading.local()
        self._connections: dict[threading.Thread, sqlite3.Connection] = {}
        self._connections_lock = threading.Lock()
        self._closed = False
        if not self.path.parent.is_dir():
            raise DecisionLogError(
                f"cannot open the decision log {self._target}: the directory {self.path.parent} "
                "does not exist; create it first (the log creates its file, not directories)"
            )
        if self.path.is_dir():
            raise DecisionLogError(
                f"cannot open the decision log {self._target}: it is a directory; give the path "
                "of a file in it, e.g. decisions.sqlite"
            )
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _connection(self) -> sqlite3.Connection:
        connection: sqlite3.Connection | None = getattr(self._local, "connection", None)
        if connection is not None:
            return connection
        if self._closed:
            raise DecisionLogError(f"the decision log {self._target} is closed")
        # check_same_thread=False only so that close() can close every thread's connection;
        # each is used by its own thread alone. isolation_level=None: we say BEGIN ourselves.
        connection = sqlite3.connect(
            self.path,
            timeout=BUSY_TIMEOUT_MS / 1000,
            isolation_level=None,
            check_same_thread=False,
        )
        try:
            connection.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"journal_mode is {mode!r}, and WAL is needed")
            connection.execute(f"PRAGMA synchronous = {self._sync.upper()}")
        except BaseException:
            connection.close()
            raise
        self._local.connection = connection
        with self._connections_lock:
            for thread in [t for t in self._connections if not t.is_alive()]:
                self._connections.pop(thread).close()  # its thread ended without closing it
            self._connections[threading.current_thread()] = connection
        return connection

    def _run(self, what: str, work: Callable[[Cursor], T], *, write: bool = True) -> T:
        connection: sqlite3.Connection | None = None
        try:
            connection = self._connection()
            if write:
                connection.execute("BEGIN IMMEDIATE")
            result = work(_SQLiteCursor(connection))
            if write:
                connection.execute("COMMIT")
            return result
        except sqlite3.Error as exc:
            _rollback(connection)
            if "locked" in str(exc) or "busy" in str(exc):
                hint = (
                    f"another connection held its write lock for over {BUSY_TIMEOUT_MS // 1000} s"
                    "; if several processes write this file, give them PostgreSQL instead"
                )
            else:
                hint = (
                    "check that the file and its directory exist and are writable by this "
                    f"process (SQLite in WAL mode also writes {self.path.name}-wal and "
                    f"{self.path.name}-shm beside it)"
                )
            raise DecisionLogError(
                f"decision log {self._target}: cannot {what}: {exc}; {hint}"
            ) from exc
        except BaseException:
            _rollback(connection)
            raise

    def close(self) -> None:
        self._closed = True
        with self._connections_lock:
            connections, self._connections = list(self._connections.values()), {}
        for connection in connections:
            connection.close()
        self._local = threading.local()


def _rollback(connection: sqlite3.Connection | None) -> None:
    if connection is not None and connection.in_transaction:
        try:
            connection.execute("ROLLBACK")
        except sqlite3.Error:
            log.warning("rolling back a decision log transaction failed", exc_info=True)


# -- PostgreSQL ----------------------------------------------------------------------------


class _PostgresCursor(Cursor):
    def __init__(self, cursor: psycopg.Cursor[Any]) -> None:
        self._cursor = cursor

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self._cursor.execute(sql.replace("?", "%s"), tuple(params))
        return self._cursor.fetchall() if self._cursor.description else []

    def change(self, sql: str, params: Sequence[Any] = ()) -> int:
        self._cursor.execute(sql.replace("?", "%s"), tuple(params))
        return self._cursor.rowcount

    def change_many(self, sql: str, params: Sequence[Sequence[Any]]) -> None:
        self._cursor.executemany(sql.replace("?", "%s"), params)


class PostgresLog(DecisionLog):
    """The decision log in a PostgreSQL database, for replicas on several machines.

    One connection, used under a lock (see the module docstring); the tables ``decisions``
    and ``meta`` are created in the connection's schema (the first of its search_path), so a
    log can share a database with others in a schema of its own
    (``?options=-csearch_path%3Dmy_schema`` in the URL).
    """

    _REAL = "DOUBLE PRECISION"
    _BOOLEAN = "BOOLEAN"
    _FOR_UPDATE = " FOR UPDATE"
    _ALL_ROWS = "LIMIT ALL"
    # Replicas opening at once would race in CREATE ... IF NOT EXISTS; this lock (held to the
    # transaction's end) makes them take turns. Its key: "judge_lg", unlikely to be another's.
    _SCHEMA_LOCK = f"SELECT pg_advisory_xact_lock({0x6A75_6467_655F_6C67})"

    def __init__(self, url: str, *, retention: Retention | None = None) -> None:
        super().__init__(mask_target(url), retention)
        self._url = url
        self._secrets = _secrets(url)
        self._lock = threading.Lock()
        self._connection: psycopg.Connection[Any] | None = None
        self._closed = False
        try:
            import psycopg
        except ImportError as exc:
            raise DecisionLogError(
                f"the decision log {self._target} is in PostgreSQL, and psycopg is not "
                f"installed: {install_hint('postgres')}"
            ) from exc
        self._psycopg = psycopg
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _scrub(self, text: str) -> str:
        """A driver's message on one line, without the URL's password."""
        text = " ".join(text.split())
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _connect(self) -> psycopg.Connection[Any]:
        if self._closed:
            raise DecisionLogError(f"the decision log {self._target} is closed")
        if self._connection is not None and not self._connection.closed:
            return self._connection
        options: dict[str, Any] = {}
        if "connect_timeout" not in self._url:
            options["connect_timeout"] = CONNECT_TIMEOUT_S
        if "application_name" not in self._url:
            options["application_name"] = "judge-decision-log"
        try:
            self._connection = self._psycopg.connect(self._url, autocommit=False, **options)
            # No server-side prepared statements: psycopg prepares a query after five runs,
            # and PostgreSQL then keeps the plan it made for the table as it was (a new log:
            # empty, so a sequential scan) until the next ANALYZE. Measured: appends fell from
            # 5,529 to 655 decisions/s by 24,000 rows with it, flat at about 6,000 without.
            self._connection.prepare_threshold = None
        except self._psycopg.Error as exc:
            raise DecisionLogError(
                f"cannot connect to the decision log {self._target}: "
                f"{self._scrub(str(exc))}; check that the server is up and reachable "
                "from here, and the user, password and database name in the URL"
            ) from exc
        return self._connection

    def _run(self, what: str, work: Callable[[Cursor], T], *, write: bool = True) -> T:
        errors = self._psycopg.errors
        with self._lock:
            reconnected = False
            retries = 0
            while True:
                connection = self._connect()
                committing = False
                try:
                    with connection.cursor() as cursor:
                        result = work(_PostgresCursor(cursor))
                    committing = True
                    connection.commit()
                    return result
                except self._psycopg.Error as exc:
                    self._rollback(connection)
                    if connection.closed or connection.broken:
                        connection.close()
                        self._connection = None
                        if committing:
                            raise DecisionLogError(
                                f"decision log {self._target}: the connection was lost while "
                                f"committing ({what}), so whether it was stored is unknown: "
                                f"{self._scrub(str(exc))}; check with get()"
                            ) from exc
                        if not reconnected:  # closed by the server while idle: once more
                            reconnected = True
                            continue
                    elif (
                        isinstance(exc, errors.DeadlockDetected | errors.SerializationFailure)
                        and retries < 3
                    ):
                        retries += 1
                        continue
                    field = "judgment_id" if isinstance(exc, errors.UniqueViolation) else None
                    raise DecisionLogError(
                        f"decision log {self._target}: cannot {what}: "
                        f"{self._scrub(str(exc))}; check that the server is up and "
                        "that the user may create tables and write in this database",
                        field=field,
                    ) from exc
                except BaseException:
                    self._rollback(connection)
                    raise

    def _rollback(self, connection: psycopg.Connection[Any]) -> None:
        if connection.closed:
            return
        try:
            connection.rollback()
        except self._psycopg.Error:
            log.warning("rolling back a decision log transaction failed", exc_info=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._connection is not None:
                self._connection.close()
                self._connection = None
