"""Atomic file writes: a reader sees the old file or the new one, never half of either.

Every file the project writes (profiles, reports, plots, benchmark results, the converted
model cache) goes through here. The new content is written under a temporary name beside the
target (same directory, so the same file system, so ``os.replace`` is atomic), flushed to
disk, then renamed over the target. On any error the temporary is removed and the target is
left as it was. The temporary's name starts with ``.`` so directory listings and globs such
as ``profiles/*.json`` never pick up a half-written file.

    write_bytes(path, data)   write_text(path, text)   with replacing(path) as temp: ...
    remove_orphans(directory)   temporaries of writers that were killed, removed

A leaf package: it imports nothing from the rest of the project, so every layer can use it.
"""

from atomicio.writes import remove_orphans, replacing, write_bytes, write_text

__all__ = ["remove_orphans", "replacing", "write_bytes", "write_text"]
