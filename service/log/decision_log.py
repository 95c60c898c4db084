"""An append-only log of every decision the service makes, in a real database.

Monitoring, audits and feedback all start from what was decided, so each decision is appended
here as it is made, and its true label is attached later by feedback. This module is the log
whatever the database: its interface (``DecisionLog``, with the SQL every backend runs), the
table, retention and errors. The record each row holds is ``service.log.record``'s
(``LoggedDecision``); the two backends, SQLite and PostgreSQL, are ``service.log.backends``'s,
whose ``open_log`` chooses one by its target.

The table. One row per decision in ``decisions``: the scalar columns that reads filter on
(``judgment_id`` the primary key, ``created_at``, ``profile``, ``profile_etag``, ``decision``,
``audit``, ``label``, ``labeled_at``), each indexed, and the whole ``LoggedDecision`` as
msgspec JSON text in ``record``, which round-trips every float64 exactly (JSON has no NaN or
infinity, so ``append`` refuses a record holding one). The JSON keeps the decision as it was
made; a label lives in the ``label``/``labeled_at`` columns only, and a read returns the record
with them. ``meta`` holds the schema version (``SCHEMA_VERSION``); a log with another version
is refused at open, so a later version can migrate rather than misread.

Durability. ``append`` commits before it returns. SQLite in WAL mode with
``synchronous=NORMAL`` (``sync="normal"``, the default) keeps every committed transaction
through a crash of the process (kill -9): the commit is in the WAL file, in the operating
system's cache. A power loss or kernel crash may lose the last transactions before a
checkpoint; ``sync="full"`` fsyncs the WAL on every commit and keeps them too, at the price of
a disk flush per append. PostgreSQL's durability is the server's (``synchronous_commit``).

Retention (``Retention``): by default a decision is kept 90 days and the log keeps at most the
newest 1,000,000 rows; either limit can be None (no limit). The log prunes when it opens and
after every ``PRUNE_EVERY`` (1,000) records it appends, right after the append's commit; a
prune that fails is logged and tried again later, never reported as a failed append. A label
for a decision pruned since is an ``UnknownJudgmentError``.

Concurrency. The service appends and labels from several worker threads at once. SQLite: one
connection per thread, writes in ``BEGIN IMMEDIATE`` transactions (one writer at a time,
others wait up to ``busy_timeout``, 5 s). PostgreSQL: one connection per log, used under a
lock, so one replica's calls run one after another (a replica writes a handful of rows per
decision; several replicas write in parallel); autocommit off, one transaction per call. A
connection the server closed is reopened once and the call tried again, unless the failure
came at the commit, whose outcome is then unknown. Labeling reads, checks and writes in one
transaction with the rows locked (``SELECT ... FOR UPDATE`` in PostgreSQL, the write lock in
SQLite), so two replicas labeling one decision at once cannot both win: one labels it, the
other finds it labeled.

Errors:

    DecisionLogError         the database cannot be opened, read or written; a duplicate id
    UnknownJudgmentError     (a LookupError) no decision with that judgment_id is in the log
    LabelNotAChoiceError     (a ValueError) the label is not one of the decision's choices
    RelabelError             (a ValueError) the decision has another label; replace=True changes it

Each has ``.field``, the field to blame (``judgment_id``, ``label``), or None.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import msgspec

from service.log.record import LoggedDecision

__all__ = [
    "PRUNE_EVERY",
    "SCHEMA_VERSION",
    "Cursor",
    "DecisionLog",
    "DecisionLogError",
    "LabelFailure",
    "LabelNotAChoiceError",
    "LabelOutcome",
    "RelabelError",
    "Retention",
    "UnknownJudgmentError",
]

SCHEMA_VERSION = 1
PRUNE_EVERY = 1_000  # appended records between two prunes
_CHUNK = 500  # ids per IN (...) list: far below SQLite's limit on parameters
_SECONDS_PER_DAY = 86_400.0

log = logging.getLogger("judge.service")

T = TypeVar("T")


class DecisionLogError(Exception):
    """The decision log cannot be opened, read or written, or refused a duplicate judgment_id."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field  # "judgment_id" for a duplicate; None for the database's own errors


class UnknownJudgmentError(LookupError):
    """No decision with that judgment_id is in the log."""

    def __init__(self, judgment_id: str) -> None:
        super().__init__(
            f"no decision with judgment_id {judgment_id!r} is in the decision log: it may be "
            "older than the log's retention, or from another log (another server's)"
        )
        self.judgment_id = judgment_id
        self.field = "judgment_id"


class LabelNotAChoiceError(ValueError):
    """The label is not one of the decision's choices."""

    def __init__(self, judgment_id: str, label: str, choices: Sequence[str]) -> None:
        super().__init__(
            f"label {label!r} is not one of the choices of decision {judgment_id!r} "
            f"({', '.join(map(repr, choices))}); label it with one of them"
        )
        self.field = "label"


class RelabelError(ValueError):
    """The decision already has another label, and replace was not asked for."""

    def __init__(self, judgment_id: str, existing: str, label: str) -> None:
        super().__init__(
            f"decision {judgment_id!r} is already labeled {existing!r}; "
            f"pass replace=true to change it to {label!r}"
        )
        self.field = "label"


class LabelOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What ``label`` did: labeled (none before), relabeled (replaced ``previous``), unchanged."""

    judgment_id: str
    label: str
    status: Literal["labeled", "relabeled", "unchanged"]
    previous: str | None  # the label before this call


class LabelFailure(msgspec.Struct, frozen=True, kw_only=True):
    """One item of ``label_many`` that was refused, in its place among the outcomes."""

    judgment_id: str
    label: str
    error: Literal["unknown_judgment", "not_a_choice", "relabel"]
    detail: str  # the error's message


class Retention(msgspec.Struct, frozen=True, kw_only=True):
    """How long decisions are kept: by age, and by count (the oldest go first). None: no limit."""

    max_age_days: float | None = 90.0
    max_rows: int | None = 1_000_000

    def __post_init__(self) -> None:
        age = self.max_age_days
        if age is not None and (isinstance(age, bool) or not (math.isfinite(age) and age > 0)):
            raise ValueError(
                f"Retention max_age_days must be a positive number of days, got {age!r}; "
                "use None to keep decisions of any age"
            )
        rows = self.max_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0):
            raise ValueError(
                f"Retention max_rows must be a positive integer, got {rows!r}; "
                "use None to keep any number of decisions"
            )


class _Choices(msgspec.Struct):
    """The part of a record that labeling needs (msgspec skips the rest unread)."""

    choices: list[str]


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(LoggedDecision)
_CHOICES_DECODER = msgspec.json.Decoder(_Choices)


# Column order of a row as written, and the DDL, shared by both backends. {real} and
# {boolean} are the types each database spells its own way.
_COLUMNS = (
    "judgment_id, created_at, profile, profile_etag, decision, audit, label, labeled_at, record"
)
_META_DDL = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
_DDL = (
    """CREATE TABLE IF NOT EXISTS decisions (
        judgment_id TEXT PRIMARY KEY,
        created_at {real} NOT NULL,
        profile TEXT,
        profile_etag TEXT,
        decision TEXT NOT NULL,
        audit {boolean} NOT NULL,
        label TEXT,
        labeled_at {real},
        record TEXT NOT NULL
    )""",
    # created_at with the id: the order of reads ("the newest N") and of pruning by count.
    "CREATE INDEX IF NOT EXISTS decisions_created_at ON decisions (created_at, judgment_id)",
    "CREATE INDEX IF NOT EXISTS decisions_profile ON decisions (profile, created_at)",
    "CREATE INDEX IF NOT EXISTS decisions_profile_etag ON decisions (profile_etag, created_at)",
    "CREATE INDEX IF NOT EXISTS decisions_decision ON decisions (decision, created_at)",
    "CREATE INDEX IF NOT EXISTS decisions_audit ON decisions (audit, created_at)",
    "CREATE INDEX IF NOT EXISTS decisions_label ON decisions (label, created_at)",
    "CREATE INDEX IF NOT EXISTS decisions_labeled_at ON decisions (labeled_at)",
)


class Cursor(ABC):
    """One transaction's statements, written with ``?`` placeholders for either database."""

    @abstractmethod
    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one statement; its rows (none for a statement that returns none)."""

    @abstractmethod
    def change(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; how many rows it changed."""

    @abstractmethod
    def change_many(self, sql: str, params: Sequence[Sequence[Any]]) -> None:
        """Run one statement once per parameter row."""


class DecisionLog(ABC):
    """An append-only decision log; see the module docstring. Open one with
    ``service.log.backends.open_log``."""

    # Each backend's spelling of what the databases write differently.
    _REAL = "REAL"
    _BOOLEAN = "INTEGER"
    _FOR_UPDATE = ""  # row locks for labeling; SQLite's transaction holds the write lock
    _ALL_ROWS = "LIMIT -1"  # "no limit", before an OFFSET
    _SCHEMA_LOCK = ""  # taken before creating the tables; SQLite's BEGIN IMMEDIATE is one

    def __init__(self, target: str, retention: Retention | None) -> None:
        if retention is not None and not isinstance(retention, Retention):
            raise TypeError(
                f"retention must be a Retention, got {type(retention).__name__}; "
                "write Retention(max_age_days=..., max_rows=...)"
            )
        self._target = target
        self.retention = retention if retention is not None else Retention()
        self._appended = 0  # records appended since the last prune
        self._appended_lock = threading.Lock()

    @property
    def target(self) -> str:
        """Where the log is, for messages: any password masked."""
        return self._target

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._target!r})"

    def __enter__(self) -> DecisionLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def close(self) -> None:
        """Close the log's connections; call it once the threads using the log are done."""

    @abstractmethod
    def _run(self, what: str, work: Callable[[Cursor], T], *, write: bool = True) -> T:
        """``work`` in one transaction, committed when it returns and rolled back when it raises.

        The database's errors become DecisionLogError naming the target and ``what`` was being
        done; the errors ``work`` raises itself pass through.
        """

    def _create_schema(self, cur: Cursor) -> None:
        """Create what is missing and check the version; the upsert is the open's write probe."""
        if self._SCHEMA_LOCK:
            cur.rows(self._SCHEMA_LOCK)
        cur.rows(_META_DDL)
        found = cur.rows("SELECT value FROM meta WHERE key = ?", ("schema_version",))
        if found and found[0][0] != str(SCHEMA_VERSION):
            raise DecisionLogError(
                f"the decision log {self._target} has schema version {found[0][0]}, and this "
                f"version of judge reads version {SCHEMA_VERSION}: open it with the judge that "
                "wrote it, or give this server a new log",
                field=None,
            )
        for statement in _DDL:
            cur.rows(statement.format(real=self._REAL, boolean=self._BOOLEAN))
        cur.change(
            "INSERT INTO meta (key, value) VALUES (?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            ("schema_version", str(SCHEMA_VERSION)),
        )

    def _open(self) -> None:
        """Create the schema (or check it) with a real write, then apply the retention."""
        self._run("open it for writing (create or check its tables)", self._create_schema)
        self.prune()

    # -- writing ---------------------------------------------------------------------------

    def append(self, records: Sequence[LoggedDecision]) -> None:
        """Store ``records`` in one transaction, committed before this returns.

        Raises
        ------
        DecisionLogError
            The database failed, or a judgment_id is already in the log or twice in
            ``records`` (``.field == "judgment_id"``); nothing of the batch is stored.
        TypeError, ValueError
            A record is not a LoggedDecision, or holds a NaN or an infinity (JSON has none).
        """
        records = list(records)
        if not records:
            return
        rows = [_row(record) for record in records]
        ids = [row[0] for row in rows]
        if len(set(ids)) != len(ids):
            twice = sorted({i for i in ids if ids.count(i) > 1})
            raise DecisionLogError(
                f"judgment_id {', '.join(map(repr, twice))} appears more than once in the batch "
                f"for {self._target}; each decision is appended once",
                field="judgment_id",
            )

        def work(cur: Cursor) -> None:
            stored = _existing(cur, ids)
            if stored:
                raise DecisionLogError(
                    f"judgment_id {', '.join(map(repr, sorted(stored)))} is already in the "
                    f"decision log {self._target}; a decision is appended once, never "
                    "overwritten (nothing of this batch was stored)",
                    field="judgment_id",
                )
            cur.change_many(
                f"INSERT INTO decisions ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows
            )

        self._run(f"append {len(rows)} decision(s)", work)
        with self._appended_lock:
            self._appended += len(rows)
            due = self._appended >= PRUNE_EVERY
            if due:
                self._appended = 0
        if due:
            try:
                self.prune()
            except DecisionLogError:  # the append is committed: say so, and prune next time
                log.warning("pruning the decision log failed; trying again later", exc_info=True)

    def label(
        self, judgment_id: str, label: str, *, replace: bool = False, now: float | None = None
    ) -> LabelOutcome:
        """Attach the true ``label`` to a logged decision, atomically (see the module docstring).

        The same label again is "unchanged" and writes nothing; another label needs
        ``replace=True``. ``now`` (unix seconds) is the time recorded as ``labeled_at``.

        Raises
        ------
        UnknownJudgmentError
            No decision with ``judgment_id`` is in the log.
        LabelNotAChoiceError
            ``label`` is not one of the decision's choices.
        RelabelError
            The decision has another label, and ``replace`` is False.
        DecisionLogError
            The database failed.
        """
        at = time.time() if now is None else now

        def work(cur: Cursor) -> LabelOutcome:
            state = self._lock_for_labels(cur, [judgment_id])
            return _label_one(cur, state, judgment_id, label, replace, at)

        return self._run(f"label decision {judgment_id!r}", work)

    def label_many(
        self, items: Sequence[tuple[str, str]], *, replace: bool = False, now: float | None = None
    ) -> list[LabelOutcome | LabelFailure]:
        """Label each ``(judgment_id, label)`` on its own terms, in one transaction.

        A refused item becomes a LabelFailure in its place; the others are stored all the
        same. An id given twice is labeled in order (the second sees the first's label).

        Raises
        ------
        DecisionLogError
            The database failed; then nothing is stored.
        """
        items = [(str(i), str(lab)) for i, lab in items]
        if not items:
            return []
        at = time.time() if now is None else now

        def work(cur: Cursor) -> list[LabelOutcome | LabelFailure]:
            state = self._lock_for_labels(cur, [i for i, _ in items])
            results: list[LabelOutcome | LabelFailure] = []
            for judgment_id, label in items:
                error: Literal["unknown_judgment", "not_a_choice", "relabel"]
                try:
                    results.append(_label_one(cur, state, judgment_id, label, replace, at))
                    continue
                except UnknownJudgmentError as exc:
                    error, detail = "unknown_judgment", str(exc)
                except LabelNotAChoiceError as exc:
                    error, detail = "not_a_choice", str(exc)
                except RelabelError as exc:
                    error, detail = "relabel", str(exc)
                failure = LabelFailure(
                    judgment_id=judgment_id, label=label, error=error, detail=detail
                )
                results.append(failure)
            return results

        return self._run(f"label {len(items)} decision(s)", work)

    def _lock_for_labels(
        self, cur: Cursor, ids: Sequence[str]
    ) -> dict[str, tuple[list[str], str | None]]:
        """Each known id's choices and label, its row locked until the transaction ends.

        Rows are locked in id order, so that two label_many calls never wait for each other
        in a cycle (a deadlock).
        """
        unique = sorted(set(ids))
        state: dict[str, tuple[list[str], str | None]] = {}
        for start in range(0, len(unique), _CHUNK):
            chunk = unique[start : start + _CHUNK]
            marks = ", ".join("?" * len(chunk))
            sql = (
                f"SELECT judgment_id, record, label FROM decisions WHERE judgment_id IN ({marks}) "
                f"ORDER BY judgment_id{self._FOR_UPDATE}"
            )
            for judgment_id, record, label in cur.rows(sql, chunk):
                state[judgment_id] = (_CHOICES_DECODER.decode(record).choices, label)
        return state

    def prune(self, now: float | None = None) -> int:
        """Delete what the retention no longer keeps; return how many decisions went.

        ``now`` (unix seconds) is the time the age limit counts back from.
        """
        keep = self.retention
        if keep.max_age_days is None and keep.max_rows is None:
            return 0
        at = time.time() if now is None else now

        def work(cur: Cursor) -> int:
            deleted = 0
            if keep.max_age_days is not None:
                cutoff = at - keep.max_age_days * _SECONDS_PER_DAY
                deleted += cur.change("DELETE FROM decisions WHERE created_at < ?", (cutoff,))
            if keep.max_rows is not None:
                deleted += cur.change(
                    "DELETE FROM decisions WHERE judgment_id IN (SELECT judgment_id FROM "
                    "decisions ORDER BY created_at DESC, judgment_id DESC "
                    f"{self._ALL_ROWS} OFFSET ?)",
                    (keep.max_rows,),
                )
            return deleted

        return self._run("prune old decisions", work)

    # -- reading ---------------------------------------------------------------------------

    def get(self, judgment_id: str) -> LoggedDecision | None:
        """The logged decision with ``judgment_id``, with its label; None if none is logged."""
        sql = "SELECT record, label, labeled_at FROM decisions WHERE judgment_id = ?"
        found = self._run(
            f"read decision {judgment_id!r}", lambda cur: cur.rows(sql, (judgment_id,)), write=False
        )
        return _decode(*found[0]) if found else None

    def decisions(
        self,
        *,
        profile: str | None = None,
        profile_etag: str | None = None,
        since: float | None = None,
        limit: int | None = None,
        audit: bool | None = None,
        labeled: bool | None = None,
    ) -> list[LoggedDecision]:
        """The logged decisions that pass every filter given, oldest first.

        ``since``: created at or after (unix seconds). ``labeled``: True, only those with a
        label; False, only those without. ``limit``: the newest ``limit`` of them (still
        returned oldest first): "the last N decisions".
        """
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 0
        ):
            raise ValueError(f"limit must be a non-negative integer or None, got {limit!r}")
        where: list[str] = []
        params: list[Any] = []
        for column, value in (("profile", profile), ("profile_etag", profile_etag)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if since is not None:
            where.append("created_at >= ?")
            params.append(float(since))
        if audit is not None:
            where.append("audit = ?")
            params.append(bool(audit))
        if labeled is not None:
            where.append("label IS NOT NULL" if labeled else "label IS NULL")
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        columns = "record, label, labeled_at, created_at, judgment_id"
        if limit is None:
            sql = f"SELECT {columns} FROM decisions{clause} ORDER BY created_at, judgment_id"
        else:
            sql = (
                f"SELECT {columns} FROM (SELECT {columns} FROM decisions{clause} "
                "ORDER BY created_at DESC, judgment_id DESC LIMIT ?) AS newest "
                "ORDER BY created_at, judgment_id"
            )
            params.append(limit)
        found = self._run("read decisions", lambda cur: cur.rows(sql, params), write=False)
        return [_decode(record, label, at) for record, label, at, _, _ in found]

    def count(self, profile: str | None = None, *, labeled: bool | None = None) -> int:
        """How many decisions the log holds (with ``profile``: under that profile; with
        ``labeled``: only those with, or without, a label)."""
        where, params = [], []
        if profile is not None:
            where.append("profile = ?")
            params.append(profile)
        if labeled is not None:
            where.append("label IS NOT NULL" if labeled else "label IS NULL")
        sql = "SELECT count(*) FROM decisions" + (f" WHERE {' AND '.join(where)}" if where else "")
        found = self._run("count decisions", lambda cur: cur.rows(sql, params), write=False)
        return int(found[0][0])


def _existing(cur: Cursor, ids: Sequence[str]) -> set[str]:
    """The ones of ``ids`` the log holds."""
    found: set[str] = set()
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        marks = ", ".join("?" * len(chunk))
        sql = f"SELECT judgment_id FROM decisions WHERE judgment_id IN ({marks})"
        found |= {row[0] for row in cur.rows(sql, chunk)}
    return found


def _label_one(
    cur: Cursor,
    state: dict[str, tuple[list[str], str | None]],
    judgment_id: str,
    label: str,
    replace: bool,
    at: float,
) -> LabelOutcome:
    """Label one decision whose row ``_lock_for_labels`` locked (``state``: each locked id's
    choices and label, kept up to date for an id given twice)."""
    if judgment_id not in state:
        raise UnknownJudgmentError(judgment_id)
    choices, existing = state[judgment_id]
    if label not in choices:
        raise LabelNotAChoiceError(judgment_id, label, choices)
    if existing == label:
        return LabelOutcome(
            judgment_id=judgment_id, label=label, status="unchanged", previous=existing
        )
    if existing is not None and not replace:
        raise RelabelError(judgment_id, existing, label)
    cur.change(
        "UPDATE decisions SET label = ?, labeled_at = ? WHERE judgment_id = ?",
        (label, at, judgment_id),
    )
    state[judgment_id] = (choices, label)
    status: Literal["labeled", "relabeled"] = "labeled" if existing is None else "relabeled"
    return LabelOutcome(judgment_id=judgment_id, label=label, status=status, previous=existing)


def _row(record: LoggedDecision) -> tuple[Any, ...]:
    """The row ``record`` is stored as; its JSON is the decision as made, without the label."""
    if not isinstance(record, LoggedDecision):
        raise TypeError(f"append takes LoggedDecision records, got {type(record).__name__}")
    numbers: list[tuple[str, float | None]] = [
        ("created_at", record.created_at),
        ("choice_mass", record.choice_mass),
        ("confidence", record.confidence),
        ("threshold", record.threshold),
        ("labeled_at", record.labeled_at),
    ]
    numbers += [("log_probs", v) for v in record.log_probs]
    numbers += [("probabilities", v) for v in record.probabilities.values()]
    for field, value in numbers:
        if value is not None and not math.isfinite(value):
            raise ValueError(
                f"decision {record.judgment_id!r}: {field} holds {value!r}, which JSON cannot "
                "carry; the decision log stores finite numbers only"
            )
    made = msgspec.structs.replace(record, label=None, labeled_at=None)
    return (
        record.judgment_id,
        record.created_at,
        record.profile,
        record.profile_etag,
        record.decision,
        record.audit,
        record.label,
        record.labeled_at,
        _ENCODER.encode(made).decode(),
    )


def _decode(record: str | bytes, label: str | None, labeled_at: float | None) -> LoggedDecision:
    return msgspec.structs.replace(_DECODER.decode(record), label=label, labeled_at=labeled_at)
