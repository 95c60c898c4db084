"""Calibration profiles by name, behind one interface, with versions (ETags) and safe writes.

Two layers, so that a new place to keep profiles is only a few byte-level operations:

    ProfileStore      what the service uses: names, get, get_tagged, etag, put, delete. It
                      checks names, validates and decodes profiles, and caches the decoded ones
                      by a version token, so a profile changed by another process (another
                      replica) is picked up on the next request.
    ProfileBackend    the Protocol a place implements: bytes by name, each stored version with
                      an ETag, and compare-and-swap writes and deletes.
      LocalDirectory    one directory on this machine (the default): ``<name>.json`` files.
      SharedDirectory   a directory every replica mounts (NFS, a cluster file system).

An object store fits the same Protocol later: its ETag and its conditional PUT/DELETE
(``If-Match`` / ``If-None-Match``) are the same compare-and-swap.

Versions: a profile's ETag is the quoted sha256 of its stored bytes, so it is the same on every
replica and every host. ``put``/``delete`` take HTTP-style preconditions (RFC 9110 13.1),
``Preconditions``: ``if_match`` (ETags, or ``*`` for "any stored version") and ``if_none_match``
(``*`` for "none stored"), compared and swapped under an exclusive ``fcntl.flock`` on ``.lock``
in the directory, across threads and processes alike; a failed comparison raises
``PreconditionFailedError`` and writes nothing. Without preconditions the last write wins, and
the new ETag it returns tells the writer which version is stored.

Every version written is kept too (``<directory>/.versions/<name>/<sha256>.json``, the newest
``KEPT_VERSIONS`` per name, a deleted profile's included), so that a change, a background
refit's included, is one request to undo: ``ProfileStore.rollback`` stores a kept version
again (its ETag the one it had). A profile that carries an adapter is megabytes: twenty kept
versions of one are up to about 90 MB.

Writes go through ``atomicio`` (temporary file, fsync, rename), so a reader sees the old
profile or the new one, never half of one; the temporaries a killed writer leaves behind are
removed when the store opens and on every write.

The two directories differ in how a reader learns that a profile changed. A local one trusts
``stat``: the rename gives a new inode, so (inode, mtime_ns, size) changes with every write.
On a shared file system ``stat`` may be served from an attribute cache for seconds and hosts'
clocks differ, so a shared one reads the file on every lookup (``open`` revalidates under NFS's
close-to-open consistency) and compares its hash; most profiles are a few kilobytes (a probe's
weights can make one megabytes: 2**18 weights at most, about 6 MB of JSON).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

from calibration.errors import ProfileNotFoundError
from calibration.profile import (
    NAME_PATTERN,
    CalibrationProfile,
    decode_profile,
    etag_of,  # in calibration, so that a decision can carry its profile's ETag
    profile_bytes,
)
from judge import atomicio

__all__ = [
    "ALWAYS",
    "ANY",
    "LocalDirectory",
    "PreconditionFailedError",
    "Preconditions",
    "ProfileBackend",
    "ProfileStore",
    "SharedDirectory",
    "Stored",
    "Version",
    "etag_of",
    "parse_etags",
]

ANY = "*"  # in if_match: any stored version; in if_none_match: no stored version
LOCK_NAME = ".lock"  # hidden: never a profile, never an atomicio temporary


class PreconditionFailedError(Exception):
    """A conditional write or delete found another version stored than the one it expected."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field  # the request header that failed: If-Match or If-None-Match


class Version(NamedTuple):
    """One kept version of a profile: its ETag, and when it was (last) written."""

    etag: str
    stored_at: float  # unix seconds


class Stored(NamedTuple):
    """One stored version of a profile, as its backend read it."""

    data: bytes
    etag: str  # quoted sha256 of ``data``
    version: str  # changes whenever the stored bytes do; cheap to read again (see version())


def parse_etags(header: str | None) -> list[str] | None:
    """An ``If-Match``/``If-None-Match`` value as a list: ``["*"]`` or the quoted ETags.

    None when the header is absent. Weak validators (``W/"..."``) keep their prefix, so they
    never equal a stored (strong) ETag, as RFC 9110's strong comparison for If-Match requires.
    """
    if header is None:
        return None
    tags = [t.strip() for t in header.split(",") if t.strip()]
    return tags or None


@dataclass(frozen=True)
class Preconditions:
    """What a change asks of the stored version (RFC 9110 13.1): ``if_match``, one of these
    ETags (``*``: any stored version); ``if_none_match``, none of them (``*``: nothing stored).
    None: no condition; ``Preconditions()`` asks nothing, and the last write wins."""

    if_match: Sequence[str] | None = None
    if_none_match: Sequence[str] | None = None

    @classmethod
    def of(cls, headers: Mapping[str, str]) -> Preconditions:
        """A request's ``If-Match`` and ``If-None-Match`` headers (``parse_etags``)."""
        return cls(parse_etags(headers.get("if-match")), parse_etags(headers.get("if-none-match")))

    def check(self, name: str, current: str | None) -> None:
        """Raise PreconditionFailedError unless the stored ETag ``current`` (None: none)
        passes."""
        if self.if_match is not None:
            ok = current is not None and (ANY in self.if_match or current in self.if_match)
            if not ok:
                stored = (
                    "no version is stored" if current is None else f"the stored one is {current}"
                )
                raise PreconditionFailedError(
                    "If-Match",
                    f"profile {name!r}: If-Match {', '.join(self.if_match)} does not match "
                    f"({stored}); GET it again for its current ETag",
                )
        if self.if_none_match is not None and current is not None:
            weak = {t.removeprefix("W/") for t in self.if_none_match}
            if ANY in weak or current in weak:
                raise PreconditionFailedError(
                    "If-None-Match",
                    f"profile {name!r} already exists (ETag {current}); "
                    "send If-Match with that ETag to replace it",
                )


ALWAYS = Preconditions()
HISTORY = ".versions"  # <directory>/.versions/<name>/<sha256>.json: every version written
KEPT_VERSIONS = 20  # per name; the oldest beyond are dropped


@runtime_checkable
class ProfileBackend(Protocol):
    """Where profiles' bytes are kept: a name's stored version, and compare-and-swap changes."""

    @property
    def directory(self) -> Path:
        """A local directory for files kept beside the profiles (reliability diagrams)."""
        ...

    def names(self) -> list[str]:
        """Every stored name (unchecked: the store filters them)."""
        ...

    def version(self, name: str) -> str | None:
        """A token that changes whenever ``name``'s bytes change; None when nothing is stored."""
        ...

    def read(self, name: str) -> Stored | None:
        """The stored version, or None."""
        ...

    def write(self, name: str, data: bytes, when: Preconditions = ALWAYS) -> str:
        """Store ``data`` atomically if ``when`` holds; return its ETag."""
        ...

    def remove(self, name: str, when: Preconditions = ALWAYS) -> None:
        """Remove ``name`` if ``when`` holds; ProfileNotFoundError when absent."""
        ...

    def versions(self, name: str) -> list[Version]:
        """The versions of ``name`` written here (the current one among them), newest
        first; the oldest beyond ``KEPT_VERSIONS`` are dropped."""
        ...

    def keep(self, name: str, data: bytes) -> str:
        """Keep ``data`` among ``name``'s versions without serving it; return its ETag."""
        ...

    def read_version(self, name: str, etag: str) -> bytes | None:
        """The bytes of ``name``'s version ``etag``, if it is kept."""
        ...


@dataclass(frozen=True)
class LocalDirectory:
    """``<name>.json`` files in one directory of this machine; changes noticed by ``stat``.

    Plain data (just the path), so it pickles: a config holding it can be sent to a replica.
    """

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def directory(self) -> Path:
        return self.path

    def _file(self, name: str) -> Path:
        return self.path / f"{name}.json"

    def names(self) -> list[str]:
        return [p.stem for p in self.path.glob("*.json")]

    def version(self, name: str) -> str | None:
        try:
            return _stat_version(os.stat(self._file(name)))
        except FileNotFoundError:
            return None

    def read(self, name: str) -> Stored | None:
        try:
            with open(self._file(name), "rb") as f:
                data = f.read()
                st = os.fstat(f.fileno())  # the same file as the bytes, even if replaced since
        except FileNotFoundError:
            return None
        return Stored(data, etag_of(data), self._version(data, st))

    def _version(self, data: bytes, st: os.stat_result) -> str:
        return _stat_version(st)

    def write(self, name: str, data: bytes, when: Preconditions = ALWAYS) -> str:
        etag = etag_of(data)
        with self._locked():
            current = self.read(name)
            when.check(name, current.etag if current else None)
            # Kept first: a crash between the two leaves a version kept, never one lost. The
            # version replaced is kept too, if it was written by other means (a file copied
            # in, judge calibrate's save).
            if current is not None and not self._kept(name, current.etag):
                self._keep(name, current.etag, current.data)
            self._keep(name, etag, data)
            atomicio.write_bytes(self._file(name), data)
        atomicio.remove_orphans(self.path)
        return etag

    def keep(self, name: str, data: bytes) -> str:
        etag = etag_of(data)
        with self._locked():
            self._keep(name, etag, data)
        return etag

    def versions(self, name: str) -> list[Version]:
        kept = []
        for path in self._history(name).glob("*.json"):
            try:
                kept.append(Version(etag=f'"{path.stem}"', stored_at=path.stat().st_mtime))
            except FileNotFoundError:  # dropped meanwhile
                continue
        current = self.read(name)  # written by other means, it is not among them yet
        if current is not None and current.etag not in {v.etag for v in kept}:
            with contextlib.suppress(FileNotFoundError):
                stored_at = self._file(name).stat().st_mtime
                kept.append(Version(etag=current.etag, stored_at=stored_at))
        return sorted(kept, key=lambda v: (-v.stored_at, v.etag))

    def _kept(self, name: str, etag: str) -> bool:
        return self._version_file(name, etag).exists()

    def read_version(self, name: str, etag: str) -> bytes | None:
        if not re.fullmatch('"[0-9a-f]{64}"', etag):
            return None
        try:
            return self._version_file(name, etag).read_bytes()
        except FileNotFoundError:
            current = self.read(name)
            return current.data if current is not None and current.etag == etag else None

    def _history(self, name: str) -> Path:
        return self.path / HISTORY / name

    def _version_file(self, name: str, etag: str) -> Path:
        """Where version ``etag`` (a quoted sha256) of ``name`` is kept."""
        return self._history(name) / f"{etag.strip(chr(34))}.json"

    def _keep(self, name: str, etag: str, data: bytes) -> None:
        """Keep ``data`` among ``name``'s versions (its mtime: when it was last written) and
        drop the oldest beyond ``KEPT_VERSIONS``."""
        self._history(name).mkdir(parents=True, exist_ok=True)
        atomicio.write_bytes(self._version_file(name, etag), data)
        for old in self.versions(name)[KEPT_VERSIONS:]:
            self._version_file(name, old.etag).unlink(missing_ok=True)

    def remove(self, name: str, when: Preconditions = ALWAYS) -> None:
        with self._locked():
            current = self.read(name)
            if current is None:  # a 404 comes before any precondition (RFC 9110 13.2.1)
                raise ProfileNotFoundError(f"no profile named {name!r}")
            when.check(name, current.etag)
            self._file(name).unlink()
            _fsync_directory(self.path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive across processes and threads: each call opens its own file description."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock


@dataclass(frozen=True)
class SharedDirectory(LocalDirectory):
    """A directory every replica mounts; a change is noticed by reading the file's bytes.

    Locks are ``flock``, which NFSv4 and cluster file systems honour across hosts (Linux
    emulates it with a whole-file byte-range lock on NFS).
    """

    def version(self, name: str) -> str | None:
        stored = self.read(name)  # open() revalidates the file with the server
        return stored.etag if stored is not None else None

    def _version(self, data: bytes, st: os.stat_result) -> str:
        return etag_of(data)


def _stat_version(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


def _fsync_directory(path: Path) -> None:
    """Make a removal durable: the directory entry is gone only once the directory is flushed."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Cached(NamedTuple):
    version: str
    etag: str
    profile: CalibrationProfile


class ProfileStore:
    """Profiles by name in ``location``: a directory (a LocalDirectory) or any ProfileBackend."""

    def __init__(self, location: str | os.PathLike[str] | ProfileBackend) -> None:
        self.backend: ProfileBackend = (
            location if isinstance(location, ProfileBackend) else LocalDirectory(Path(location))
        )
        self._cache: dict[str, _Cached] = {}
        self._lock = threading.Lock()  # guards the cache only; writes lock in the backend
        atomicio.remove_orphans(self.backend.directory)

    @property
    def directory(self) -> Path:
        return self.backend.directory

    def _check_name(self, name: str) -> str:
        if not re.fullmatch(NAME_PATTERN, name):
            raise ProfileNotFoundError(f"no profile named {name!r}: names match {NAME_PATTERN}")
        return name

    def names(self) -> list[str]:
        return sorted(n for n in self.backend.names() if re.fullmatch(NAME_PATTERN, n))

    def get(self, name: str) -> CalibrationProfile:
        return self.get_tagged(name)[0]

    def etag(self, name: str) -> str:
        return self.get_tagged(name)[1]

    def get_tagged(self, name: str) -> tuple[CalibrationProfile, str]:
        """The profile and the ETag of the very bytes it was decoded from."""
        self._check_name(name)
        version = self.backend.version(name)
        with self._lock:
            cached = self._cache.get(name)
        if version is not None and cached is not None and cached.version == version:
            return cached.profile, cached.etag
        stored = self.backend.read(name)
        if stored is None:
            with self._lock:
                self._cache.pop(name, None)
            raise ProfileNotFoundError(f"no profile named {name!r}")
        profile = decode_profile(stored.data, source=f"profile {name!r}")
        with self._lock:
            self._cache[name] = _Cached(stored.version, stored.etag, profile)
        return profile, stored.etag

    def put(self, profile: CalibrationProfile, when: Preconditions = ALWAYS) -> str:
        """Store ``profile`` under its name if ``when`` holds; return the new ETag."""
        name = self._check_name(profile.name)
        data = profile_bytes(profile)  # CalibrationProfile.etag is the ETag of these bytes
        return self.backend.write(name, data, when)

    def delete(self, name: str, when: Preconditions = ALWAYS) -> None:
        self.backend.remove(self._check_name(name), when)
        with self._lock:
            self._cache.pop(name, None)

    def keep(self, profile: CalibrationProfile) -> str:
        """Keep ``profile`` among its name's versions without serving it (a refit not
        served); return its ETag."""
        return self.backend.keep(self._check_name(profile.name), profile_bytes(profile))

    def versions(self, name: str) -> list[Version]:
        """``name``'s kept versions, newest first (a deleted profile's too)."""
        return self.backend.versions(self._check_name(name))

    def version_of(self, name: str, etag: str) -> CalibrationProfile:
        """``name``'s kept version ``etag``; ProfileNotFoundError where none is kept."""
        data = self.backend.read_version(self._check_name(name), etag)
        if data is None:
            raise ProfileNotFoundError(f"no version {etag} of profile {name!r} is kept")
        return decode_profile(data, source=f"profile {name!r} version {etag}")

    def rollback(self, name: str, etag: str, when: Preconditions = ALWAYS) -> str:
        """Serve ``name``'s kept version ``etag`` again (if ``when`` holds of the current
        one); returns its ETag, the same as when it was first stored."""
        return self.put(self.version_of(name, etag), when)
