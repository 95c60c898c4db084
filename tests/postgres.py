"""A throwaway PostgreSQL server for the test session, and a fresh database for each test.

The server is Debian's (``/usr/lib/postgresql/<version>/bin``), started by an unprivileged
user (PostgreSQL refuses root: as root, ``runuser -u postgres``) on a free loopback port and
a unix socket in its own temporary directory, with trust authentication for local
connections. Durability is off (``initdb --no-sync``, ``fsync=off``): nothing whose
durability is under test runs on it. It is stopped (``pg_ctl stop -m immediate``) and removed
when the session ends.

Without the binaries the tests that need them skip, unless ``JUDGE_REQUIRE_POSTGRES=1`` (CI
sets it), when they fail. Test modules import the fixtures:

    from postgres import postgres_database, postgres_url  # noqa: F401
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from server import free_port

USER = "postgres"  # the server's operating-system user when the tests run as root


def binaries() -> Path | None:
    """The newest installed PostgreSQL's bin directory (it has initdb and pg_ctl), or None."""
    found = [
        folder
        for folder in Path("/usr/lib/postgresql").glob("*/bin")
        if (folder / "initdb").is_file() and (folder / "pg_ctl").is_file()
    ]
    return (
        max(found, key=lambda f: int(f.parent.name) if f.parent.name.isdigit() else 0)
        if found
        else None
    )


def _unavailable(reason: str) -> None:
    if os.environ.get("JUDGE_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"{reason}, and JUDGE_REQUIRE_POSTGRES=1 requires PostgreSQL")
    pytest.skip(reason)


class PostgresServer:
    """initdb, start and stop one server; ``url`` connects to its ``postgres`` database."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="judge-postgres-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:
            account = pwd.getpwnam(USER)
            os.chown(self.root, account.pw_uid, account.pw_gid)
            self._as = ["runuser", "-u", USER, "--"]
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _command(self, *args: str) -> None:
        done = subprocess.run(
            [*self._as, *args], capture_output=True, text=True, timeout=60, check=False
        )
        if done.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(args)} failed: {done.stdout}{done.stderr}{tail}")

    def start(self) -> None:
        self._command(
            str(self.bin / "initdb"),
            "--pgdata",
            str(self.data),
            "--username",
            "postgres",
            "--auth",
            "trust",
            "--encoding",
            "UTF8",
            "--locale",
            "C",
            "--no-sync",
        )
        settings = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port} "
            f"-c unix_socket_directories={self.root} "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        self._command(
            str(self.bin / "pg_ctl"),
            "--pgdata",
            str(self.data),
            "--log",
            str(self.root / "server.log"),
            "--options",
            settings,
            "--wait",
            "--timeout",
            "60",
            "start",
        )

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._command(
                    str(self.bin / "pg_ctl"), "--pgdata", str(self.data), "-m", "immediate", "stop"
                )
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A URL of a running throwaway server's ``postgres`` database (for the whole session)."""
    bin_dir = binaries()
    if bin_dir is None:
        _unavailable("no PostgreSQL binaries under /usr/lib/postgresql/*/bin")
        return
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _unavailable("psycopg is not installed (pip install '.[postgres]')")
        return
    server = PostgresServer(bin_dir)
    try:
        server.start()
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def postgres_database(postgres_url: str) -> Iterator[str]:
    """The URL of a new, empty database on the session's server, dropped after the test."""
    import psycopg

    name = f"test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield postgres_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
