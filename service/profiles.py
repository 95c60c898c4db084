"""Calibration profiles kept in a directory, one ``<name>.json`` each, surviving restarts.

Writes go through ``calibration.profile.save_profile`` (temporary file, fsync, rename), so
a crash never leaves half a profile and a reader never sees one; the temporaries a killed
writer leaves behind are removed when the store opens and on every write. Loaded profiles are cached
by file modification time, so a profile replaced on disk is picked up on the next request.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import atomicio
from calibration.errors import ProfileNotFoundError
from calibration.profile import NAME_PATTERN, CalibrationProfile, load_profile, save_profile

__all__ = ["ProfileStore"]


class ProfileStore:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)  # created on the first write
        self._cache: dict[str, tuple[int, CalibrationProfile]] = {}
        self._lock = threading.Lock()
        atomicio.remove_orphans(self.directory)

    def _path(self, name: str) -> Path:
        if not re.fullmatch(NAME_PATTERN, name):
            raise ProfileNotFoundError(f"no profile named {name!r}: names match {NAME_PATTERN}")
        return self.directory / f"{name}.json"

    def names(self) -> list[str]:
        return sorted(
            p.stem for p in self.directory.glob("*.json") if re.fullmatch(NAME_PATTERN, p.stem)
        )

    def get(self, name: str) -> CalibrationProfile:
        path = self._path(name)
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            raise ProfileNotFoundError(f"no profile named {name!r}") from None
        with self._lock:
            cached = self._cache.get(name)
            if cached is not None and cached[0] == mtime:
                return cached[1]
        profile = load_profile(path)
        with self._lock:
            self._cache[name] = (mtime, profile)
        return profile

    def put(self, profile: CalibrationProfile) -> None:
        save_profile(profile, self._path(profile.name))
        atomicio.remove_orphans(self.directory)

    def delete(self, name: str) -> None:
        path = self._path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            raise ProfileNotFoundError(f"no profile named {name!r}") from None
        with self._lock:
            self._cache.pop(name, None)
