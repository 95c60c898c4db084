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
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO, TypeVar

import msgspec

from calibration import CalibrationProfile, FitSettings
from calibration.certificates.recertify import LabelsNeeded, look_delta
from calibration.report import next_steps
from calibration.tasks.files import TaskError, taught_items
from calibration.tasks.item_queue import (
    Advice,
    ItemQueue,
    Labelled,
    Looks,
    PoolItem,
    advise,
    count_look,
    read_looks,
)
from service.command_line import UsageError
from service.log.decision_log import DecisionLog
from service.log.health import ProfileHealth
from service.log.labelling_queue import STREAMS, LabellingQueue, QueueItem, Stream

if TYPE_CHECKING:
    from judge import Fingerprint

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

    screen = _Screen()
    _label_loop(queue, lambda item: _shown(item, queue), give, screen)
    screen.say(_closing(queue))
    return 0


def run_item_queue(
    queue: ItemQueue,
    command: str,
    *,
    fingerprint: Fingerprint,
    settings: FitSettings,
    name: str,
    profiles_dir: Path,
    every: int = 10,
) -> int:
    """Label a file's items from the terminal (``calibration.tasks.ItemQueue``), until none
    is left or q. Every ``every`` labels, the profile ``command`` (a ``judge calibrate``)
    would fit on the labels so far is fitted in the background (``_Advisor``): where it
    certifies it is written to ``profiles_dir``, and it says so."""
    _check_keys(queue.task.name, queue.task.choices)
    screen = _Screen()
    screen.say(
        f"labelling {queue.task.name} into {queue.out}: {queue.pending('audit')} audit items "
        f"(a uniform sample: they certify) and {queue.pending('teach')} others (the least "
        f"certain first: they teach) unlabelled; streams: {', '.join(queue.streams)}; every "
        f"{every} labels the profile `{command}` would fit is fitted in the background"
    )
    try:
        # The split's lineage of looks, begun here where it has none: judge calibrate on the
        # split goes on counting it.
        looks = read_looks(queue.task, queue.split, settings.delta, start=True)
    except TaskError as exc:
        raise UsageError(str(exc), field="--delta") from None
    assert looks is not None
    if looks.looks:
        screen.say(
            f"these labels were looked at {looks.looks} times before: the next look is at "
            f"delta {looks.next('').spent:.3g}, its share of {looks.delta:g}"
        )
    advisor = _Advisor(
        queue,
        lambda labelled, looks: advise(
            queue.task,
            queue.split,
            labelled,
            fingerprint,
            name=name,
            looks=looks,
            settings=settings,
            alternating=len(queue.streams) > 1,
        ),
        looks=looks,
        every=every,
        screen=screen,
        profiles_dir=profiles_dir,
    )

    def shown(item: PoolItem) -> str:
        advisor.adopt()  # the teach stream ordered by the newest fit, where there is one
        header = f"[{item.stream}: {queue.pending(item.stream)} left] {item.id}"
        whose = "the map fitted so far" if advisor.adopted else "the model (uncalibrated)"
        return _card(header, item.text, item.probabilities, item.choices, whose)

    def give(item: PoolItem, label: str) -> str:
        queue.label(item, label)
        started = advisor.labelled()
        return (
            f"labelled {label} ({item.stream}); in the file: audit {queue.total('audit')}, "
            f"teach {queue.total('teach')}" + (f"; {started}" if started else "")
        )

    try:
        _label_loop(queue, shown, give, screen)
    finally:
        last = advisor.finish()
    done = sum(queue.labelled.values())
    screen.say(
        f"labelled {done} (audit {queue.labelled['audit']}, teach {queue.labelled['teach']}) "
        f"into {queue.out}; left: audit {queue.pending('audit')}, teach {queue.pending('teach')}"
        + (f"; fit a profile on them: {command}" if queue.ready() and last is None else "")
    )
    return 0


class _Screen:
    """The terminal, written by the key loop and by the background fits: a line at a time,
    never two writers at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        with self._lock:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
            sys.stdout.flush()


class _Advisor:
    """Fits, in a background thread, the profile ``judge calibrate`` would fit on the labels
    so far (``calibration.tasks.advise``), at most one fit at a time, once ``every`` labels
    have come since the last one began; says what it found the moment it has it. A fit whose
    labels are likely enough is a look: it is counted in the split's lineage (``looks``)
    before its certificate is read, and where it certifies the profile is written to
    ``profiles_dir``. The key loop never waits for it."""

    def __init__(
        self,
        queue: ItemQueue,
        fit: Callable[[Labelled, Looks], Advice],
        *,
        looks: Looks,
        every: int,
        screen: _Screen,
        profiles_dir: Path,
    ) -> None:
        self.queue, self.fit, self.every, self.looks = queue, fit, every, looks
        self.screen, self.profiles_dir = screen, profiles_dir
        self.newest: Advice | None = None  # the newest fit's, once it has finished
        self.adopted: Advice | None = None  # the one the teach stream is ordered by
        self._fitted_at = 0  # labels in the file when the last fit began
        self._thread: threading.Thread | None = None

    def labelled(self) -> str:
        """After each label: begin a fit if one is due and none is running; what to say."""
        total = self.queue.count()
        due = total - self._fitted_at >= self.every
        if not due or not self.queue.ready() or self._running():
            return ""
        self._begin()
        return f"fitting a profile on the {total} labels so far in the background"

    def adopt(self) -> None:
        """Order the teach stream by the newest fit's map, once (in the key loop's thread)."""
        newest = self.newest
        if newest is not None and newest is not self.adopted:
            self.queue.reorder(newest.profile)
            self.adopted = newest

    def finish(self) -> Advice | None:
        """At the end: wait for the running fit, then fit once more on any labels it did not
        read; the newest advice."""
        if self._thread is not None:
            self._thread.join()
        if self.queue.ready() and self.queue.count() > self._fitted_at:
            self.screen.say(f"fitting a profile on all {self.queue.count()} labels")
            self._begin()
            assert self._thread is not None
            self._thread.join()
        return self.newest

    def _running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _begin(self) -> None:
        labelled = self.queue.snapshot()
        self._fitted_at = len(labelled.items)
        self._thread = threading.Thread(target=self._run, args=(labelled,), daemon=True)
        self._thread.start()

    def _run(self, labelled: Labelled) -> None:
        try:
            advice = self.fit(labelled, self.looks)
        except Exception as exc:  # a fit that fails says why; labelling goes on
            self.screen.say(f"[fit on {len(labelled.items)} labels] failed: {exc}")
            return
        if advice.looked:  # counted before anything reads its certificate
            self.looks = count_look(self.queue.task, self.queue.split, self.looks)
        wrote = None
        if advice.certified and not advice.missing:
            from service.cli.profile_files import save_fitted

            save_fitted(
                advice.profile,
                labelled.scores,
                taught_items(labelled.items),
                self.profiles_dir,
            )
            wrote = self.profiles_dir / f"{advice.profile.name}.json"
        self.newest = advice
        self.screen.say(_advice_text(advice, wrote))


def _advice_text(advice: Advice, wrote: Path | None) -> str:
    """What a fit on the labels so far found, in a few lines: a look's certificate, or for a
    fit that is not a look, only how far the labels are from one."""
    p = advice.profile
    r = p.recertification
    assert p.metrics_after is not None and r is not None  # a labelled fit, a look's
    taught = advice.labels - advice.audit
    head = f"[fit on {advice.labels} labels: {advice.audit} audit, {taught} taught]"
    fitted = (
        f"method {p.calibration_map.method}, accuracy {p.metrics_after.accuracy.value:.3f} on "
        "the labels it was not fitted on"
    )
    look = f"look {r.look} (at delta {r.spent:.3g}, its share of {r.delta:g})"
    t = p.threshold
    if advice.certified:
        what = (
            f"threshold {t.threshold:.2f} certified at precision >= {t.target_precision:g}, "
            f"accepting {t.coverage:.0%} of its {t.n} certify labels"
            if t.threshold is not None
            else "thresholds certified for some classes"
        )
        lines = [f"{head} the gate opens: {look} {what}; {fitted}"]
        if wrote is not None:
            lines.append(
                f"  wrote {wrote} (and its .report.md, .reliability.png): serve it with "
                f"judge serve --profiles-dir {wrote.parent}; more labels may certify more, "
                "at the next look's share of the delta"
            )
    elif advice.looked:
        lines = [f"{head} {look} certified nothing; {fitted}"]
        lines += [f"  {line}" for line in next_steps(p)[:1]]
        lines.append(
            f"  the next look is at delta {look_delta(r.delta, r.look + 1):.3g}; keep labelling"
        )
    else:
        lines = [f"{head} not yet a look; {fitted}"]
        steps = next_steps(
            msgspec.structs.replace(p, labels_needed=advice.needed),
            labels="audit labels",
            then="keep labelling (the queue offers a taught item beside each audit one); a fit "
            "with labels enough is the look, and says whether the gate opens",
            shortfall=False,  # a fit that is not a look leaves its certificate unread
        )
        lines += [f"  {line}" for line in steps]
    if advice.missing:
        lines.append(
            f"  {advice.missing} labelled items are not in this file: the fit left them out "
            "(judge calibrate judges them) and wrote no profile"
        )
    return "\n".join(lines)


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
    queue: _Queue[Item],
    shown: Callable[[Item], str],
    give: Callable[[Item, str], str],
    screen: _Screen,
) -> None:
    """Show each item, read a key: a digit labels it (``give`` stores the label and says what
    follows), s skips it, q quits."""
    with _keys(sys.stdin) as keys:
        while (item := queue.next()) is not None:
            screen.say(shown(item))
            key = next(keys, "q")
            while key not in ("q", "s") and not (
                key.isdigit() and 1 <= int(key) <= len(item.choices)
            ):
                screen.say(f"no such key {key!r}: 1-{len(item.choices)}, s or q")
                key = next(keys, "q")
            if key == "q":
                break
            if key == "s":
                queue.skip(item)
                screen.say("skipped")
                continue
            screen.say(give(item, item.choices[int(key) - 1]))


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
