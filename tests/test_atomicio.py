"""Atomic writes: the target is the old content or the new, and no temporary is left behind."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from judge import atomicio
from judge.atomicio import replacing, write_bytes, write_text


def test_round_trip_creates_missing_parents(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "report.md"
    assert write_text(target, "héllo\n") == target
    assert target.read_text(encoding="utf-8") == "héllo\n"
    assert write_bytes(target, b"\x00\x01") == target
    assert target.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in target.parent.iterdir()) == ["report.md"]


def test_failure_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "profile.json"
    write_text(target, "old")
    with pytest.raises(RuntimeError, match="boom"), replacing(target) as temp:
        temp.write_text("half of the new")
        raise RuntimeError("boom")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]


def test_the_temporary_is_hidden_beside_the_target_and_keeps_its_name(tmp_path: Path) -> None:
    target = tmp_path / "plot.png"
    with replacing(target) as temp:
        # Tools that pick a format from the extension (savefig, np.savez) see the real one.
        assert temp.name == "plot.png" and temp != target
        hidden = temp.relative_to(tmp_path).parts[0]
        assert hidden.startswith(".plot.png.")
        assert not temp.exists() and not target.exists()
        temp.write_bytes(b"png")
    assert target.read_bytes() == b"png"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def test_directory_replace(tmp_path: Path) -> None:
    target = tmp_path / "cache" / "model"
    with replacing(target) as temp:
        temp.mkdir()
        (temp / "weights.bin").write_bytes(b"w")
        (temp / "sub").mkdir()
        (temp / "sub" / "config.json").write_text("{}")
        assert not target.exists()
    assert (target / "weights.bin").read_bytes() == b"w"
    assert (target / "sub" / "config.json").read_text() == "{}"
    assert [p.name for p in target.parent.iterdir()] == ["model"]


def test_failed_directory_build_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "model"
    with pytest.raises(KeyboardInterrupt), replacing(target) as temp:
        temp.mkdir()
        (temp / "partial.bin").write_bytes(b"p")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_writing_nothing_is_an_error_that_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    write_text(target, "old")
    with pytest.raises(FileNotFoundError, match="nothing was written"), replacing(target):
        pass
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="use write_bytes"):
        write_text(tmp_path / "x", b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="use write_text"):
        write_bytes(tmp_path / "x", "text")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_orphans_of_killed_writers_are_removed_but_not_live_ones(tmp_path: Path) -> None:
    old = tmp_path / ".a.json.x1y2.tmp"
    (old / "a.json").parent.mkdir()
    (old / "a.json").write_text("half")
    live = tmp_path / ".b.json.z3.tmp"
    live.mkdir()
    keep = tmp_path / "c.json"
    keep.write_text("{}")
    past = time.time() - 3600
    os.utime(old, (past, past))
    assert atomicio.remove_orphans(tmp_path, older_than_s=60) == 1
    assert not old.exists() and live.exists() and keep.exists()
    assert atomicio.remove_orphans(tmp_path / "missing") == 0


def test_a_dead_writers_temporary_goes_at_once_a_live_writers_stays(tmp_path: Path) -> None:
    host = socket.gethostname()
    dead_pid = _exited_pid()
    dead = tmp_path / f".a.json.{dead_pid}@{host}~abc123.tmp"
    mine = tmp_path / f".b.json.{os.getpid()}@{host}~def456.tmp"
    elsewhere = tmp_path / f".c.json.{dead_pid}@another-host~ghi789.tmp"
    for holder in (dead, mine, elsewhere):
        holder.mkdir()
    assert atomicio.remove_orphans(tmp_path, older_than_s=60) == 1
    assert not dead.exists() and mine.exists() and elsewhere.exists()
    with replacing(tmp_path / "d.json") as temp:  # replacing's own names carry the writer
        assert f".d.json.{os.getpid()}@{host}~" in str(temp)
        temp.write_text("{}")


def _exited_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid
