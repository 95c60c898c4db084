"""A labelling queue over a file of unlabelled items: a new task's first labels, before any
profile serves it and so before a decision log holds anything to label.

The pool (``load_pool``: one ``{"text": ..., "id": ...}`` a line) is judged once by the model
as loaded, in the task's prompt, as ``judge calibrate`` judges a split (``judge_pool``, which
keeps the scores beside the task), and split at random, by a seed, into two streams kept apart
(``calibration.monitoring.labelling``):

* **audit** (``audit_share`` of the pool, default half): a uniform sample in a seeded order.
  Its labels may certify a profile fitted on the file.
* **teach**: the rest, the least certain first, spread over the items' hidden states: first
  under the model's own probabilities, then under the map fitted so far (``reorder``). Its
  labels are marked ``"stream": "teach"`` and only fit a map (``taught_items``).

Because the split is made before anything is labelled, the audit labels are a uniform sample
of the whole file however the teach stream picks. Each label is written to ``out`` as it is
given (the whole file rewritten atomically: a quit or a crash loses nothing), in the split
format ``judge calibrate --task DIR --split NAME`` reads; labelled items are left out of the
queue on the next run, so a session resumes where the last stopped.

What the labels so far are worth is ``advise``: the profile ``judge calibrate`` would fit on
them, from the same scores (whether it certifies, and at what coverage), and, read from that
map's out-of-sample probabilities of the audit labels, about how many more audit labels would
certify. The command line runs it in the background every few labels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from calibration.certificates.recertify import Recertification, look_delta
from calibration.fit_data import Provenance
from calibration.fit_settings import DEFAULT_SETTINGS, FitSettings
from calibration.limits import MIN_EXAMPLES
from calibration.maps.map_types import softmax
from calibration.monitoring.labelling import audit_order, next_stream, teach_rounds
from calibration.tasks.files import (
    STREAMS,
    LabeledItem,
    Task,
    TaskError,
    _jsonl_lines,
    load_split,
    task_prompt,
    task_template,
    taught_items,
)
from calibration.tasks.labeled import LabeledScores, checks_on_scores, fit_labeled
from judge.atomicio import write_text

if TYPE_CHECKING:
    from calibration import CalibrationProfile
    from calibration.certificates.recertify import LabelsNeeded
    from judge import Fingerprint

__all__ = [
    "Advice",
    "ItemQueue",
    "Labelled",
    "Looks",
    "PoolItem",
    "advise",
    "count_look",
    "load_pool",
    "looks_path",
    "read_looks",
]


class PoolItem(msgspec.Struct, frozen=True, kw_only=True):
    """One item of the pool to label, as a person sees it."""

    id: str
    stream: str  # "audit" or "teach"
    text: str
    prompt: str  # the task's prompt around it, as the model read it
    choices: list[str]
    # The map fitted so far (``ItemQueue.reorder``), else the model's own: no profile serves
    # the task yet.
    probabilities: dict[str, float]
    choice: str  # the top choice under them


def load_pool(path: str | Path) -> tuple[list[tuple[str, str]], str]:
    """The items of a JSONL file, one ``{"text": ...}`` a line with an optional ``id``
    (default: the line number), as (id, text), and the file's sha256; any other field (a
    label) is ignored. A TaskError names the line of anything else, or a repeated id."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise TaskError(f"cannot read items from {str(file)!r}: {exc.strerror}") from None
    items: list[tuple[str, str]] = []
    seen: set[str] = set()
    for n, line in _jsonl_lines(data):
        try:
            row = json.loads(line)
            text, key = row["text"], str(row.get("id", n))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise TaskError(f"{file}:{n}: expected an object with a text ({exc})") from None
        if not isinstance(text, str):
            raise TaskError(f"{file}:{n}: text must be a string, got {type(text).__name__}")
        if key in seen:
            raise TaskError(f"{file}:{n}: id {key!r} appears twice")
        seen.add(key)
        items.append((key, text))
    if not items:
        raise TaskError(f"{file} holds no items")
    return items, hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Labelled:
    """What a fit on the labels so far reads: the split's lines and their scores."""

    items: list[LabeledItem]  # ``out``'s lines, in its order
    scores: LabeledScores  # theirs, labels set
    sha256: str  # of ``out``'s bytes, as judge calibrate records them
    missing: int  # labelled lines not in the pool (other items): judge calibrate judges them


@dataclass
class ItemQueue:
    """The unlabelled items of ``pool`` ((id, text), as ``load_pool`` reads them) in the order
    a person should label them, each label written to ``out``.

    ``scores``: the pool's, as ``judge_pool`` judges them (labels unset): the model's
    log-probabilities in ``task.choices`` order, and where the engine has layers their
    hidden states, whose means over each item at the middle layer spread the teach picks."""

    task: Task
    pool: Sequence[tuple[str, str]]
    scores: LabeledScores
    split: str  # the labels go to ``<task>/<split>.jsonl`` (``out``)
    seed: int = 0
    audit_share: float = 0.5
    streams: Sequence[str] = STREAMS
    labelled: dict[str, int] = field(init=False)  # this session's, per stream
    skipped: dict[str, int] = field(init=False)
    _labelled: list[LabeledItem] = field(init=False)  # every line of ``out``, old and new
    _pending: dict[str, list[int]] = field(init=False)  # pool indices, in order
    _index: dict[str, int] = field(init=False)  # each pool item's index by its id
    _p: np.ndarray = field(init=False)  # (n, k) the probabilities shown and ordered by
    _turn: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        n, k = len(self.pool), len(self.task.choices)
        if self.scores.log_probabilities.shape != (n, k):
            raise ValueError(
                f"scores must be of ({n}, {k}) items and choices, got "
                f"{self.scores.log_probabilities.shape}"
            )
        if not 0 < self.audit_share <= 1:
            raise ValueError(f"audit_share must be in (0, 1], got {self.audit_share}")
        if not self.streams or set(self.streams) - set(STREAMS):
            raise ValueError(f"streams must be some of {STREAMS}, got {list(self.streams)}")
        # What earlier sessions labelled, read (and checked) as judge calibrate will read it.
        self._labelled = load_split(self.task, self.split)[0] if self.out.exists() else []
        done = {item.id for item in self._labelled}
        self._index = {key: i for i, (key, _) in enumerate(self.pool)}
        self._p = softmax(self.scores.log_probabilities)
        # The split is drawn over the whole pool, labelled or not, so that a resumed session
        # sees the same streams. A generator of its own: audit_order draws from ``seed``.
        audit = np.random.default_rng([self.seed, 1]).random(n) < self.audit_share
        audit_idx, teach_idx = np.flatnonzero(audit), np.flatnonzero(~audit)
        audit_idx = audit_idx[audit_order(audit_idx.shape[0], self.seed)]
        self._pending = {
            "audit": [int(i) for i in audit_idx if self.pool[int(i)][0] not in done],
            "teach": [int(i) for i in teach_idx if self.pool[int(i)][0] not in done],
        }
        self._order_teach()
        self.labelled = dict.fromkeys(STREAMS, 0)
        self.skipped = dict.fromkeys(STREAMS, 0)

    def pending(self, stream: str) -> int:
        """Items of ``stream`` still to label."""
        return len(self._pending[stream])

    def next(self) -> PoolItem | None:
        """The next item to label: the streams asked for in turn; None when none is left."""
        found = next_stream(self.streams, self._pending, self._turn)
        if found is None:
            return None
        stream, self._turn = found
        return self._item(self._pending[stream][0], stream)

    def label(self, item: PoolItem, label: str) -> None:
        """Write ``label`` for ``item`` (one of the task's choices) and take it off the queue."""
        if label not in self.task.choices:
            raise ValueError(f"label must be one of {self.task.choices}, got {label!r}")
        taught = item.stream == "teach"
        self._labelled.append(LabeledItem(id=item.id, text=item.text, label=label, taught=taught))
        write_text(self.out, _split_text(self._labelled))
        self._drop(item)
        self.labelled[item.stream] += 1

    def skip(self, item: PoolItem) -> None:
        """Take ``item`` off the queue unlabelled (for this session)."""
        self._drop(item)
        self.skipped[item.stream] += 1

    def count(self) -> int:
        """The labels in ``out``, of both streams, this session's and earlier ones."""
        return len(self._labelled)

    def total(self, stream: str) -> int:
        """The labels of ``stream`` in ``out``, this session's and earlier ones."""
        return sum(_stream(item) == stream for item in self._labelled)

    def ready(self) -> bool:
        """Whether ``out`` holds enough labels for ``judge calibrate`` to fit a profile."""
        labels = {item.label for item in self._labelled}
        return len(self._labelled) >= MIN_EXAMPLES and self.total("audit") > 0 and len(labels) > 1

    def snapshot(self) -> Labelled:
        """The labels so far and their scores, for ``advise`` (a copy: labelling goes on)."""
        items = list(self._labelled)
        inside = [
            item
            for item in items
            if item.id in self._index and self.pool[self._index[item.id]][1] == item.text
        ]
        choice = {c: j for j, c in enumerate(self.task.choices)}
        rows = self.scores.rows(np.array([self._index[i.id] for i in inside], dtype=np.int64))
        scores = LabeledScores(
            log_probabilities=rows.log_probabilities,
            choice_mass=rows.choice_mass,
            labels=np.array([choice[i.label] for i in inside], dtype=np.int64),
            features=rows.features,
            feature_layers=rows.feature_layers,
            span_features=rows.span_features,
            span=rows.span,
        )
        # What judge calibrate records: the file's own bytes (every label is in it).
        digest = hashlib.sha256(self.out.read_bytes() if items else b"").hexdigest()
        return Labelled(inside, scores, digest, len(items) - len(inside))

    def reorder(self, profile: CalibrationProfile) -> None:
        """Order the teach stream's pending items by ``profile``'s map (one fitted on the labels
        so far) instead of the model's own probabilities, and show those. The audit stream's
        order is never touched: it is a uniform sample whatever the map says."""
        self._p = checks_on_scores(profile, self.scores).probabilities
        self._order_teach()

    @property
    def out(self) -> Path:
        """The file the labels go to: the task's split ``split``."""
        return Path(self.task.path) / f"{self.split}.jsonl"

    def _order_teach(self) -> None:
        pending = np.asarray(self._pending["teach"], dtype=np.int64)
        if pending.shape[0] == 0:
            return
        s = self.scores
        # Spread over each item's mean state at the middle candidate layer (none without).
        x = (
            None
            if s.span_features is None
            else s.span_features[pending, len(s.feature_layers) // 2]
        )
        self._pending["teach"] = pending[teach_rounds(self._p[pending], features=x)].tolist()

    def _item(self, i: int, stream: str) -> PoolItem:
        key, text = self.pool[i]
        probabilities = {c: float(self._p[i, j]) for j, c in enumerate(self.task.choices)}
        return PoolItem(
            id=key,
            stream=stream,
            text=text,
            prompt=task_prompt(self.task, text),
            choices=list(self.task.choices),
            probabilities=probabilities,
            choice=self.task.choices[int(self._p[i].argmax())],
        )

    def _drop(self, item: PoolItem) -> None:
        self._pending[item.stream].remove(self._index[item.id])


@dataclass(frozen=True)
class Advice:
    """What the labels so far are worth (``advise``)."""

    labels: int  # the labels the fit read
    audit: int  # of them, a uniform sample
    missing: int  # labelled items outside the pool, left out (judge calibrate judges them)
    # The profile ``judge calibrate`` would fit on them now, at the lineage's next look.
    profile: CalibrationProfile
    # About how many audit labels would likely certify at that look, read from its map's
    # out-of-sample probabilities of the audit labels; None without any.
    needed: LabelsNeeded | None
    # Whether this fit is the look: the labels were likely enough (``needed.more`` 0), so its
    # certificate is read (and the look counted) whether it passes or not. A fit that is not
    # the look says nothing of its certificate: one read at every fit would be a look at
    # every fit, and a certificate found by looking again and again fails far more often than
    # its delta says (``calibration.certificates.recertify``).
    looked: bool

    @property
    def certified(self) -> bool:
        """Whether the look certified a threshold (the pooled one, or a class's); never for a
        fit that was not a look."""
        p = self.profile
        pooled = p.threshold.threshold is not None
        classes = any(t.threshold is not None for t in p.class_thresholds or [])
        return self.looked and (pooled or classes)


class Looks(msgspec.Struct, frozen=True, kw_only=True):
    """A split's lineage of looks: how many certificates have been read on its labels, and
    the delta the whole sequence spends (``calibration.certificates.recertify``). Kept
    beside the task (``looks_path``), so that a resumed queue, and ``judge calibrate`` on the
    split, go on counting."""

    delta: float
    looks: int = 0

    def next(self, split_file: str) -> Recertification:
        """The next look: its number, and the share of the delta it is tested at."""
        return Recertification(
            look=self.looks + 1,
            delta=self.delta,
            spent=look_delta(self.delta, self.looks + 1),
            log=split_file,
        )


def looks_path(task: Task, split: str) -> Path:
    """Where a split's lineage of looks is kept: ``<task>/.looks/<split>.json``."""
    return Path(task.path) / ".looks" / f"{split}.json"


def read_looks(task: Task, split: str, delta: float, *, start: bool = False) -> Looks | None:
    """The split's lineage: None where it has none (``start``: begin one spending ``delta``,
    with no look yet, as the labelling queue does on its split); a TaskError where it spends
    another delta: a lineage's delta is fixed when it begins."""
    path = looks_path(task, split)
    if not path.exists():
        if not start:
            return None
        begun = Looks(delta=delta)
        write_text(path, msgspec.json.encode(begun).decode() + "\n")
        return begun
    try:
        kept = msgspec.json.decode(path.read_bytes(), type=Looks)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TaskError(f"{path} cannot be read: {exc}") from None
    if kept.delta != delta:
        raise TaskError(
            f"the labels of {task.name}/{split} were looked at {kept.looks} times under a "
            f"lineage spending delta {kept.delta:g} ({path}), not {delta:g}: certify them at "
            f"delta {kept.delta:g}"
        )
    return kept


def count_look(task: Task, split: str, looks: Looks) -> Looks:
    """Record one more look in the split's lineage, before its certificate is read."""
    counted = Looks(delta=looks.delta, looks=looks.looks + 1)
    write_text(looks_path(task, split), msgspec.json.encode(counted).decode() + "\n")
    return counted


def advise(
    task: Task,
    split: str,
    labelled: Labelled,
    fingerprint: Fingerprint,
    *,
    name: str,
    looks: Looks,
    settings: FitSettings = DEFAULT_SETTINGS,
    alternating: bool = True,
) -> Advice:
    """Fit the profile ``judge calibrate --task DIR --split SPLIT --name NAME`` would fit on
    ``labelled`` (the same scores, labels and split) as the lineage's next look (at its share
    of the delta: ``looks``), and estimate from its map how many more audit labels would
    likely certify there (``labels_needed``, on the out-of-sample probabilities of the audit
    labels; ``alternating``: a taught label comes with each audit label, as the queue offers
    both streams in turn). The fit is the look when the labels are likely enough already;
    the caller counts it (``count_look``) before reading its certificate."""
    from calibration.fitting import labels_needed

    taught = taught_items(labelled.items)
    s = dataclasses.replace(labelled.scores, fit_only=taught)
    look = looks.next(str(Path(task.path) / f"{split}.jsonl"))
    provenance = Provenance(
        fingerprint=fingerprint,
        dataset=f"{task.name}/{split}",
        dataset_sha256=labelled.sha256,
        template=task_template(task),
        recertification=look,
    )
    fitted = fit_labeled(
        name, s, task.choices, provenance, msgspec.structs.replace(settings, delta=look.spent)
    )
    profile = fitted.profile
    # Whether to look is read off the map's own confidence in its answers to the audit items
    # (out of sample), never off their labels: a look timed by how the certify items came out
    # would pick a lucky draw. (Their labels, on the few items the certificate does not rest
    # on, were too few to time it: tens of them, where the certificate reads hundreds.)
    needed = labels_needed(
        profile,
        fitted.out_of_sample,
        s,
        settings=settings,
        alternating=alternating,
        delta=look.spent,
        calibrated=True,
    )
    audit = len(s) if taught is None else int((~taught).sum())
    return Advice(
        labels=len(s),
        audit=audit,
        missing=labelled.missing,
        profile=profile,
        needed=needed,
        looked=needed is not None and needed.more == 0,
    )


def _split_text(items: Sequence[LabeledItem]) -> str:
    """The split file's text: a line per label, with its stream."""
    rows = [{"id": i.id, "text": i.text, "label": i.label, "stream": _stream(i)} for i in items]
    return "".join(json.dumps(row) + "\n" for row in rows)


def _stream(item: LabeledItem) -> str:
    """The stream a labelled line came from, as the split file names it."""
    return "teach" if item.taught else "audit"
