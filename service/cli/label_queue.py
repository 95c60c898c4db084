"""``judge label --queue``: label the decision log's decisions, or a file's items, one key at a
time.

The queue (``service.log.labelling_queue`` over a log, ``calibration.tasks.item_queue`` over
a file of a new task's items) picks each item; this module only shows it and reads a key: 1-9 labels it with that choice, ``s`` skips it, ``q`` quits. On a terminal a
key acts at once (cbreak mode, restored on exit); from a pipe, each line's first character
is a key. Each label is stored as it is given.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, TextIO, TypeVar

from calibration import CalibrationProfile
from calibration.certificates.recertify import LabelsNeeded
from calibration.tasks.item_queue import ItemQueue, PoolItem
from service.command_line import UsageError
from service.log.decision_log import DecisionLog
from service.log.health import ProfileHealth
from service.log.labelling_queue import STREAMS, LabellingQueue, QueueItem, Stream

__all__ = ["run_item_queue", "run_queue"]

MAX_CHOICES = 9  # one digit key each
ITEM_CHARS = 600  # an item longer than this is shown cut, with its length


def run_queue(log: DecisionLog, profile: CalibrationProfile, etag: str, stream: str) -> int:
    """Label ``profile``'s unlabelled decisions in ``log`` from the terminal, until none is
    left or q; ``stream``: "audit", "teach" or "both"."""
    _check_keys(profile.name, profile.choices)
    queue = LabellingQueue(log, profile, etag, streams=_streams(stream))
    sys.stdout.write(_opening(queue) + "\n")

    def give(item: QueueItem, label: str) -> str:
        outcome = queue.label(item, label)
        return f"labelled {label} ({outcome.status}, {item.stream})\n{_state(queue.health())}"

    _label_loop(queue, lambda item: _shown(item, queue), give)
    sys.stdout.write(_closing(queue) + "\n")
    sys.stdout.flush()
    return 0


def run_item_queue(queue: ItemQueue, command: str) -> int:
    """Label a file's items from the terminal (``calibration.tasks.ItemQueue``), until none
    is left or q; ``command``: the ``judge calibrate`` that fits on the labels written."""
    _check_keys(queue.task.name, queue.task.choices)
    sys.stdout.write(
        f"labelling {queue.task.name} into {queue.out}: {queue.pending('audit')} audit items "
        f"(a uniform sample: they certify) and {queue.pending('teach')} others (the model's "
        f"least certain first: they teach) unlabelled; streams: {', '.join(queue.streams)}\n"
    )

    def shown(item: PoolItem) -> str:
        header = f"[{item.stream}: {queue.pending(item.stream)} left] {item.id}"
        return _card(
            header, item.text, item.probabilities, item.choices, "the model (uncalibrated)"
        )

    def give(item: PoolItem, label: str) -> str:
        queue.label(item, label)
        return f"labelled {label} ({item.stream})\n{_pool_state(queue, command)}"

    _label_loop(queue, shown, give)
    done = sum(queue.labelled.values())
    sys.stdout.write(
        f"labelled {done} (audit {queue.labelled['audit']}, teach {queue.labelled['teach']}) "
        f"into {queue.out}; left: audit {queue.pending('audit')}, teach {queue.pending('teach')}"
        + (f"; fit a profile on them: {command}" if queue.ready() else "")
        + "\n"
    )
    sys.stdout.flush()
    return 0


class _Labelled(Protocol):
    @property
    def choices(self) -> list[str]: ...

    @property
    def stream(self) -> Any: ...


Item = TypeVar("Item", bound=_Labelled)


class _Queue(Protocol[Item]):
    def next(self) -> Item | None: ...

    def skip(self, item: Item) -> None: ...


def _label_loop(
    queue: _Queue[Item], shown: Callable[[Item], str], give: Callable[[Item, str], str]
) -> None:
    """Show each item, read a key: a digit labels it (``give`` stores the label and says what
    follows), s skips it, q quits."""
    out = sys.stdout
    with _keys(sys.stdin) as keys:
        while (item := queue.next()) is not None:
            out.write(shown(item))
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
            out.write(give(item, item.choices[int(key) - 1]) + "\n")


def _check_keys(name: str, choices: Sequence[str]) -> None:
    if len(choices) > MAX_CHOICES:
        raise UsageError(
            f"--queue labels with one digit per choice; {name} has {len(choices)} choices "
            f"(at most {MAX_CHOICES})"
        )


def _streams(stream: str) -> tuple[Stream, ...]:
    return STREAMS if stream == "both" else tuple(s for s in STREAMS if s == stream)


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
    header = (
        f"[{item.stream}: {queue.pending(item.stream)} left] {item.judgment_id} ({item.decision})"
    )
    return _card(header, item.item, item.probabilities, item.choices, "the model")


def _card(
    header: str, text: str, probabilities: dict[str, float], choices: list[str], whose: str
) -> str:
    """An item as the queue shows it: where it comes from, its text (cut past ITEM_CHARS),
    the model's probabilities, the keys."""
    if len(text) > ITEM_CHARS:
        text = text[:ITEM_CHARS] + "..."
    ranked = sorted(probabilities.items(), key=lambda kv: -kv[1])
    model = ", ".join(f"{c} {p:.2f}" for c, p in ranked)
    keys = " · ".join(f"{i} {c}" for i, c in enumerate(choices, 1))
    return f"\n{header}\n  {text}\n  {whose}: {model}\n  {keys} · s skip · q quit\n"


def _pool_state(queue: ItemQueue, command: str) -> str:
    """What the file's labels say so far: how many of each stream, and about how many audit
    labels a fitted profile would need to certify its target."""
    parts = [f"in the file: audit {queue.total('audit')}, teach {queue.total('teach')}"]
    needed = queue.needed()
    if needed is not None:
        goal = f"likely certify {queue.target_precision:g} (the model's confidence so far)"
        parts.append(_needed(needed, goal))
    if queue.ready():
        parts.append(f"fit: {command}")
    return "; ".join(parts)


def _state(health: ProfileHealth) -> str:
    """What the labelled audit decisions say of the certificate, in a line or two."""
    parts = [f"audit: {health.n_audited_labeled} of {health.n_audited} labelled"]
    check = health.precision
    if check is not None and check.n and check.precision is not None:
        parts.append(
            f"live precision {check.precision:.3f} on {check.n} accepted "
            f"[{check.lower:.3f}, {check.upper:.3f}] against the certified {check.target}"
        )
    if health.labels is not None:
        parts.append(_needed(health.labels, "open the gate"))
    return "; ".join(parts)


def _needed(needed: LabelsNeeded, goal: str) -> str:
    """What ``needed`` says in a few words: why no number of labels would reach ``goal``,
    that there are enough, or how many more would."""
    if needed.more is None:
        return f"gate: {needed.reason}"
    if needed.more == 0:
        return f"likely enough audit labels (about {needed.labels} in all)"
    return f"about {needed.more} more audit labels would {goal}"


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
