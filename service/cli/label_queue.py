"""``judge label --queue``: label the decision log's decisions one key at a time.

The queue (``service.log.labelling_queue``) picks each decision; this module only shows it
and reads a key: 1-9 labels it with that choice, ``s`` skips it, ``q`` quits. On a terminal a
key acts at once (cbreak mode, restored on exit); from a pipe, each line's first character
is a key. Each label is stored as it is given.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from calibration import CalibrationProfile
from service.cli.common import UsageError
from service.log.decision_log import DecisionLog
from service.log.health import ProfileHealth
from service.log.labelling_queue import STREAMS, LabellingQueue, QueueItem

__all__ = ["run_queue"]

MAX_CHOICES = 9  # one digit key each
ITEM_CHARS = 600  # an item longer than this is shown cut, with its length


def run_queue(log: DecisionLog, profile: CalibrationProfile, etag: str, stream: str) -> int:
    """Label ``profile``'s unlabelled decisions in ``log`` from the terminal, until none is
    left or q; ``stream``: "audit", "teach" or "both"."""
    if len(profile.choices) > MAX_CHOICES:
        raise UsageError(
            f"--queue labels with one digit per choice; {profile.name} has "
            f"{len(profile.choices)} choices (at most {MAX_CHOICES})"
        )
    streams = STREAMS if stream == "both" else tuple(s for s in STREAMS if s == stream)
    out = sys.stdout
    queue = LabellingQueue(log, profile, etag, streams=streams)
    out.write(_opening(queue) + "\n")
    with _keys(sys.stdin) as keys:
        while (item := queue.next()) is not None:
            out.write(_shown(item, queue))
            out.flush()
            key = next(keys, "q")
            while key not in ("q", "s") and not (
                key.isdigit() and 1 <= int(key) <= len(item.choices)
            ):
                out.write(f"no such key {key!r}: 1-{len(item.choices)}, s or q\n")
                out.flush()
                key = next(keys, "q")
            if key == "q":
                break
            if key == "s":
                queue.skip(item)
                out.write("skipped\n")
                continue
            label = item.choices[int(key) - 1]
            outcome = queue.label(item, label)
            out.write(f"labelled {label} ({outcome.status}, {item.stream})\n")
            out.write(_state(queue.health()) + "\n")
    out.write(_closing(queue) + "\n")
    out.flush()
    return 0


@contextmanager
def _keys(stream: TextIO) -> Iterator[Iterator[str]]:
    """One key at a time: at once from a terminal (cbreak mode from here on, so that a key
    pressed early is kept, and restored on the way out), else each line's first character."""
    if not stream.isatty():
        yield (line.strip()[0] for line in stream if line.strip())
        return
    import termios
    import tty

    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd, termios.TCSANOW)  # not TCSAFLUSH: that drops keys typed ahead

    def read() -> Iterator[str]:
        while chunk := os.read(fd, 1):
            key = chunk.decode("utf-8", errors="replace")
            if not key.isspace():
                yield key

    try:
        yield read()
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _opening(queue: LabellingQueue) -> str:
    lines = [
        f"labelling {queue.profile.name}: {queue.pending('audit')} audit decisions (a uniform "
        f"sample: they certify) and {queue.pending('teach')} others (the least certain first: "
        f"they teach a refit) unlabelled; streams: {', '.join(queue.streams)}"
    ]
    if queue.unreadable:
        lines.append(
            f"{queue.unreadable} unlabelled decisions have no logged request and are left out "
            "(serve with --log-requests to label them here)"
        )
    return "\n".join(lines)


def _shown(item: QueueItem, queue: LabellingQueue) -> str:
    text = item.item if len(item.item) <= ITEM_CHARS else item.item[:ITEM_CHARS] + "..."
    ranked = sorted(item.probabilities.items(), key=lambda kv: -kv[1])
    model = ", ".join(f"{c} {p:.2f}" for c, p in ranked)
    keys = " · ".join(f"{i} {c}" for i, c in enumerate(item.choices, 1))
    return (
        f"\n[{item.stream}: {queue.pending(item.stream)} left] {item.judgment_id} "
        f"({item.decision})\n  {text}\n  the model: {model}\n  {keys} · s skip · q quit\n"
    )


def _state(health: ProfileHealth) -> str:
    """What the labelled audit decisions say of the certificate, in a line or two."""
    parts = [f"audit: {health.n_audited_labeled} of {health.n_audited} labelled"]
    check = health.precision
    if check is not None and check.n and check.precision is not None:
        parts.append(
            f"live precision {check.precision:.3f} on {check.n} accepted "
            f"[{check.lower:.3f}, {check.upper:.3f}] against the certified {check.target}"
        )
    needed = health.labels
    if needed is not None:
        if needed.more is None:
            parts.append(f"gate: {needed.reason}")
        elif needed.more == 0:
            parts.append(f"enough labels to refit and certify (about {needed.labels})")
        else:
            parts.append(f"about {needed.more} more audit labels would open the gate")
    return "; ".join(parts)


def _closing(queue: LabellingQueue) -> str:
    done = sum(queue.labelled.values())
    line = (
        f"labelled {done} (audit {queue.labelled['audit']}, teach {queue.labelled['teach']}); "
        f"left: audit {queue.pending('audit')}, teach {queue.pending('teach')}"
    )
    if queue.skipped["audit"]:
        line += (
            f"; {queue.skipped['audit']} audit decisions skipped: the labelled audit sample is "
            "uniform only if they are labelled too"
        )
    return line
