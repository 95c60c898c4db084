"""A labelling queue over a file of unlabelled items: a new task's first labels, before any
profile serves it and so before a decision log holds anything to label.

The pool (``load_pool``: one ``{"text": ..., "id": ...}`` a line) is judged once by the model
as loaded, in the task's prompt (``judge_task_pool``), and split at random, by a seed, into
two streams kept apart (``calibration.monitoring.labelling``):

* **audit** (``audit_share`` of the pool, default half): a uniform sample in a seeded order.
  Its labels may certify a profile fitted on the file.
* **teach**: the rest, the model's least certain first, spread over the items' hidden states.
  Its labels are marked ``"stream": "teach"`` and only fit a map (``taught_items``).

Because the split is made before anything is labelled, the audit labels are a uniform sample
of the whole file however the teach stream picks. Each label is written to ``out`` as it is
given (the whole file rewritten atomically: a quit or a crash loses nothing), in the split
format ``judge calibrate --task DIR --split NAME`` reads; labelled items are left out of the
queue on the next run, so a session resumes where the last stopped. The teach order is the
model's before any label, not refitted as labels arrive: once a profile serves the task, the
log's queue (``service.log.labelling_queue``) orders by the fitted map.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from calibration.certificates.recertify import LabelsNeeded, labels_to_certify
from calibration.limits import MIN_EXAMPLES, certify_share
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
)
from judge.atomicio import write_text

__all__ = ["ItemQueue", "PoolItem", "load_pool"]


class PoolItem(msgspec.Struct, frozen=True, kw_only=True):
    """One item of the pool to label, as a person sees it."""

    id: str
    stream: str  # "audit" or "teach"
    text: str
    prompt: str  # the task's prompt around it, as the model read it
    choices: list[str]
    probabilities: dict[str, float]  # the model's, uncalibrated: no profile serves it yet
    choice: str  # the model's answer


def load_pool(path: str | Path) -> list[tuple[str, str]]:
    """The items of a JSONL file, one ``{"text": ...}`` a line with an optional ``id``
    (default: the line number), as (id, text); any other field (a label) is ignored. A
    TaskError names the line of anything else, or a repeated id."""
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
    return items


@dataclass
class ItemQueue:
    """The unlabelled items of ``pool`` ((id, text), as ``load_pool`` reads them) in the order
    a person should label them, each label written to ``out``.

    ``log_probabilities`` (n, k): the model's, in ``task.choices`` order; ``features`` (n, d):
    what the teach stream spreads over (None: the margins alone)."""

    task: Task
    pool: Sequence[tuple[str, str]]
    log_probabilities: np.ndarray
    split: str  # the labels go to ``<task>/<split>.jsonl`` (``out``)
    features: np.ndarray | None = None
    seed: int = 0
    audit_share: float = 0.5
    streams: Sequence[str] = STREAMS
    target_precision: float = 0.9
    delta: float = 0.1
    labelled: dict[str, int] = field(init=False)  # this session's, per stream
    skipped: dict[str, int] = field(init=False)
    _labelled: list[LabeledItem] = field(init=False)  # every line of ``out``, old and new
    _pending: dict[str, list[int]] = field(init=False)  # pool indices, in order
    _index: dict[str, int] = field(init=False)  # each pool item's index by its id
    _p: np.ndarray = field(init=False)  # (n, k) the model's probabilities
    _turn: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        n, k = len(self.pool), len(self.task.choices)
        if self.log_probabilities.shape != (n, k):
            raise ValueError(
                f"log_probabilities must be ({n}, {k}), got {self.log_probabilities.shape}"
            )
        if not 0 < self.audit_share <= 1:
            raise ValueError(f"audit_share must be in (0, 1], got {self.audit_share}")
        if not self.streams or set(self.streams) - set(STREAMS):
            raise ValueError(f"streams must be some of {STREAMS}, got {list(self.streams)}")
        # What earlier sessions labelled, read (and checked) as judge calibrate will read it.
        self._labelled = load_split(self.task, self.split)[0] if self.out.exists() else []
        done = {item.id for item in self._labelled}
        self._index = {key: i for i, (key, _) in enumerate(self.pool)}
        self._p = softmax(self.log_probabilities)
        # The split is drawn over the whole pool, labelled or not, so that a resumed session
        # sees the same streams. A generator of its own: audit_order draws from ``seed``.
        audit = np.random.default_rng([self.seed, 1]).random(n) < self.audit_share
        audit_idx, teach_idx = np.flatnonzero(audit), np.flatnonzero(~audit)
        audit_idx = audit_idx[audit_order(audit_idx.shape[0], self.seed)]
        x = None if self.features is None else self.features[teach_idx]
        teach_idx = teach_idx[teach_rounds(self._p[teach_idx], features=x)]
        self._pending = {
            "audit": [int(i) for i in audit_idx if self.pool[i][0] not in done],
            "teach": [int(i) for i in teach_idx if self.pool[i][0] not in done],
        }
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
        rows = [
            {"id": i.id, "text": i.text, "label": i.label, "stream": _stream(i)}
            for i in self._labelled
        ]
        write_text(self.out, "".join(json.dumps(row) + "\n" for row in rows))
        self._drop(item)
        self.labelled[item.stream] += 1

    def skip(self, item: PoolItem) -> None:
        """Take ``item`` off the queue unlabelled (for this session)."""
        self._drop(item)
        self.skipped[item.stream] += 1

    def total(self, stream: str) -> int:
        """The labels of ``stream`` in ``out``, this session's and earlier ones."""
        return sum(_stream(item) == stream for item in self._labelled)

    def needed(self) -> LabelsNeeded | None:
        """About how many audit labels a profile fitted on ``out`` would need to certify the
        target (``labels_to_certify``), read from the model's own confidence in its answers
        to the audit labels so far: an estimate before any map is fitted (a fitted map is
        usually sharper). None before any audit label."""
        choice = {c: j for j, c in enumerate(self.task.choices)}
        rows = [i for i in self._labelled if not i.taught and i.id in self._index]
        if not rows:
            return None
        p = self._p[[self._index[i.id] for i in rows]]
        correct = p.argmax(axis=1) == np.array([choice[i.label] for i in rows])
        return labels_to_certify(
            p.max(axis=1),
            correct,
            target_precision=self.target_precision,
            delta=self.delta,
            certify_share=certify_share(False),
            given=self.total("audit"),
        )

    def ready(self) -> bool:
        """Whether ``out`` holds enough labels for ``judge calibrate`` to fit a profile."""
        return len(self._labelled) >= MIN_EXAMPLES and self.total("audit") > 0

    @property
    def out(self) -> Path:
        """The file the labels go to: the task's split ``split``."""
        return Path(self.task.path) / f"{self.split}.jsonl"

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


def _stream(item: LabeledItem) -> str:
    """The stream a labelled line came from, as the split file names it."""
    return "teach" if item.taught else "audit"
