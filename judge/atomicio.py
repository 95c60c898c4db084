"""Atomic writes to files and directories: temporary beside the target, fsync, rename.

The temporary is ``<parent>/.<name>.<pid>@<host>~<random>.tmp/<name>``: a hidden, uniquely
named folder beside the target holding an entry with the target's own name; the writer's pid
and host in its name let ``remove_orphans`` tell a dead writer's temporary from a live one's. The folder makes the name
unique whether the caller writes a file or builds a directory; keeping the target's name
matters to writers that pick a format from the extension (matplotlib's ``savefig``) or add one
(``numpy.savez`` appends ``.npz`` to any other name).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["remove_orphans", "replacing", "write_bytes", "write_text"]


def _fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` (and ``root`` itself) to disk before it is renamed.

    Without this a crash just after the rename could leave the new name pointing at empty or
    truncated files: the rename may reach the disk before the data does.
    """
    if root.is_file():
        _fsync_path(root, os.O_RDONLY)
        return
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync_path(Path(folder, name), os.O_RDONLY)
        _fsync_path(Path(folder), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def _fsync_path(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success, rename it onto ``path``.

    The body creates a file or a directory at the yielded path (nothing exists there yet).
    When the body returns, everything written is fsynced and ``os.replace`` moves it onto
    ``path``; when it raises, the temporary is removed and ``path`` is untouched. Missing
    parent directories of ``path`` are created.

    A directory can only replace a missing or empty directory (``os.replace``'s rule); to
    rebuild a populated one, remove it first or build under a new name.

    Parameters
    ----------
    path : str or path-like
        The final destination.

    Yields
    ------
    pathlib.Path
        Where to write: ``<parent>/.<name>.<pid>@<host>~<random>.tmp/<name>``, which does not
        exist yet.

    Raises
    ------
    FileNotFoundError
        If the body returns without creating anything at the yielded path.
    """
    target = Path(path)
    if not target.name:
        raise ValueError(f"cannot write to {str(path)!r}: it names no file")
    target.parent.mkdir(parents=True, exist_ok=True)
    # mkdtemp reserves a unique name; the body gets a fresh path inside it, so it may create
    # either a file or a directory there.
    writer = f".{target.name}.{os.getpid()}@{socket.gethostname()}~"
    holder = Path(tempfile.mkdtemp(prefix=writer, suffix=".tmp", dir=target.parent))
    temp = holder / target.name
    try:
        yield temp
        if not temp.exists():
            raise FileNotFoundError(
                f"nothing was written to {str(temp)!r}, so {str(target)!r} was left as it was"
            )
        _fsync_tree(temp)
        os.replace(temp, target)
        # The rename itself is durable only once the directory holding it is flushed.
        _fsync_path(target.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    finally:
        _remove(holder)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; missing parent directories are created.

    Returns
    -------
    pathlib.Path
        ``path``, as a Path.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"data must be bytes, got {type(data).__name__}; use write_text for str")
    with replacing(path) as temp:
        temp.write_bytes(data)
    return Path(path)


def write_text(path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically, encoded as ``encoding`` (UTF-8 by default).

    Returns
    -------
    pathlib.Path
        ``path``, as a Path.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}; use write_bytes for bytes")
    return write_bytes(path, text.encode(encoding))


def remove_orphans(directory: str | os.PathLike[str], older_than_s: float = 60.0) -> int:
    """Remove temporaries left in ``directory`` by writers that died (kill -9, power loss).

    ``replacing`` removes its temporary on every exit it sees, but a killed process sees none.
    A temporary goes when its writer, named in it, was a process on this host that is no
    longer alive, or when it is older than ``older_than_s`` (a writer on another host sharing
    the directory, or a name without a writer): a live write takes milliseconds, and another
    process may be writing into the same directory right now. Returns how many went.
    """
    root = Path(directory)
    if not root.is_dir():
        return 0
    cutoff = time.time() - older_than_s
    host = socket.gethostname()
    removed = 0
    for holder in root.glob(".*.tmp"):
        writer = _WRITER.search(holder.name)
        dead = writer is not None and writer["host"] == host and not _alive(int(writer["pid"]))
        try:
            if holder.is_dir() and (dead or holder.stat().st_mtime < cutoff):
                _remove(holder)
                removed += 1
        except FileNotFoundError:  # another process removed it first
            continue
    return removed


_WRITER = re.compile(r"\.(?P<pid>\d+)@(?P<host>[^~/]+)~[^~/]*\.tmp$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # no signal sent: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True
