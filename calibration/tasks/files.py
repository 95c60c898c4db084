"""Labeled tasks on disk: ``task.json`` plus one ``<split>.jsonl`` per split.

A task directory holds ``task.json`` with ``choices`` and ``instruction`` (and optionally
``name``, else the folder's; every field it reads is in ``TASK_FIELDS``), and one JSON object
per line in ``calibration.jsonl`` / ``test.jsonl`` with ``text`` and ``label`` (and optionally
``id``, and ``stream``: "teach" marks a label chosen to teach the map, which may fit a profile
but never certify one; "audit", or none, a label of a uniform sample). A graded task adds
``"kind": "score"`` and ``values`` (the number each choice stands for; default: the numerals
themselves). The prompt for an item is the instruction, the item's text, and the list of
allowed answers. Reading a split also returns the file's sha256, which a calibration profile
records so that it can say exactly which data it was fitted on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import numpy as np

from calibration.template import PromptTemplate
from judge.scores import ValuesError, check_values

__all__ = [
    "STREAMS",
    "LabeledItem",
    "LabeledItems",
    "Task",
    "TaskError",
    "load_split",
    "load_task",
    "task_item_span",
    "task_prompt",
    "task_template",
    "taught_items",
]


# Where a labelled line came from: a uniform sample (it may certify) or a pick to teach.
STREAMS = ("audit", "teach")


class TaskError(ValueError):
    """A task directory or one of its files is missing or malformed.

    Not a ``JudgeError``: the engine is fine, the data on disk is not.
    """


class LabeledItem(msgspec.Struct, frozen=True):
    """One line of a split: its id (the 1-based line number if the line has none)."""

    id: str
    text: str
    label: str
    # Chosen to teach (``judge label --queue --items``): it may fit a map, never certify one.
    taught: bool = False


@dataclass(frozen=True)
class LabeledItems:
    """Labelled items and where they came from, in the words and hash a profile records."""

    items: Sequence[LabeledItem]
    dataset: str  # what they are, in words: "sst2/calibration", "decision log ..."
    sha256: str  # of the bytes they were read from


class Task(msgspec.Struct, frozen=True):
    """A task's ``task.json``, and the directory it was read from."""

    name: str
    choices: list[str]
    instruction: str
    path: str
    kind: Literal["classification", "score"] = "classification"
    values: dict[str, float] | None = None  # a score task's number per choice
    # The prompt around each item, where it is not the instruction's (``task_template``): a
    # task read back from a profile fitted on another prompt (a refit from its log).
    template: PromptTemplate | None = None


class _TaskFile(msgspec.Struct):
    """The fields of ``task.json`` that judge reads (any other, such as ``source`` or
    ``license``, is for people and left alone)."""

    choices: Annotated[list[str], msgspec.Meta(min_length=2)]
    instruction: str
    name: str | None = None
    kind: Literal["classification", "score"] = "classification"
    values: dict[str, float] | None = None


# What each field of task.json is, for the message that says one is missing or malformed.
TASK_FIELDS = {
    "choices": "the answers the model chooses between, at least two distinct strings, e.g. "
    '["negative", "positive"] (required)',
    "instruction": "the question put to the model before each item, e.g. "
    '"Is this product review negative or positive?" (required)',
    "name": "the task's name, and the default name of a profile fitted on it (default: the "
    "folder's name)",
    "kind": '"classification" (the default) or "score" (the choices stand for numbers)',
    "values": 'a score task\'s number for each choice, e.g. {"low": 1, "high": 5} (default: '
    "the numerals themselves)",
}


def load_task(path: str | Path) -> Task:
    """Read ``<path>/task.json``: ``choices`` and ``instruction`` are required, ``name``
    defaults to the folder's name, and ``kind`` and ``values`` describe a score task
    (``TASK_FIELDS``); other fields are left for people. A TaskError names the field that is
    missing or malformed and what it should hold."""
    folder = Path(path)
    file = folder / "task.json"
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise TaskError(f"{str(folder)!r} has no task.json; pass a task directory") from None
    except OSError as exc:
        raise TaskError(f"cannot read {file}: {exc.strerror}") from None
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise TaskError(f"{file} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise TaskError(
            f'{file} must be a JSON object, such as {{"choices": [...], "instruction": "..."}}'
        )
    for field in ("choices", "instruction"):
        if field not in raw:
            raise TaskError(f"{file} is missing {field!r}: {TASK_FIELDS[field]}")
    try:
        spec = msgspec.convert(raw, _TaskFile)
    except msgspec.ValidationError as exc:
        raise TaskError(f"{file}: {_field_problem(exc)}") from None
    if len(set(spec.choices)) != len(spec.choices):
        raise TaskError(f"{file}: choices must be distinct, got {spec.choices}")
    if spec.values is not None:
        try:
            check_values(spec.values, spec.choices)
        except ValuesError as exc:
            raise TaskError(f"{file}: {exc}") from exc
    return Task(
        name=folder.resolve().name if spec.name is None else spec.name,
        choices=spec.choices,
        instruction=spec.instruction,
        path=str(folder),
        kind=spec.kind,
        values=spec.values,
    )


def _field_problem(exc: msgspec.ValidationError) -> str:
    """msgspec's message with the field's meaning after it: "Expected `str`, got `int` - at
    `$.instruction`" becomes "instruction: expected `str`, got `int` (the question ...)"."""
    message, _, where = str(exc).partition(" - at `$.")
    field = where.rstrip("`").split(".")[0].split("[")[0]
    if field not in TASK_FIELDS:
        return str(exc)
    return f"{field}: {message[:1].lower()}{message[1:]}; it should be {TASK_FIELDS[field]}"


def load_split(task: Task, split: str, limit: int | None = None) -> tuple[list[LabeledItem], str]:
    """The items of ``<split>.jsonl`` (the first ``limit``) and the file's sha256."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise TaskError(f"limit must be a positive number of items, got {limit!r}")
    file = Path(task.path) / f"{split}.jsonl"
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise TaskError(f"task {task.name!r} has no split {split!r} ({file} is missing)") from None
    items = []
    for n, line in _jsonl_lines(data):
        try:
            row = json.loads(line)
            stream = row.get("stream", "audit")
            item = LabeledItem(
                id=str(row.get("id", n)),
                text=row["text"],
                label=row["label"],
                taught=stream == "teach",
            )
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise TaskError(f"{file}:{n}: expected an object with text and label ({exc})") from exc
        if stream not in STREAMS:
            raise TaskError(f"{file}:{n}: stream must be one of {list(STREAMS)}, got {stream!r}")
        if not isinstance(item.text, str):
            raise TaskError(f"{file}:{n}: text must be a string, got {type(item.text).__name__}")
        if item.label not in task.choices:
            raise TaskError(f"{file}:{n}: label {item.label!r} is not one of {task.choices}")
        items.append(item)
        if limit is not None and len(items) >= limit:
            break
    return items, hashlib.sha256(data).hexdigest()


def taught_items(items: Sequence[LabeledItem]) -> np.ndarray | None:
    """Which ``items`` were chosen to teach (``LabeledScores.fit_only``); None where none
    was, so that a split of uniform labels alone is the one it always was."""
    taught = np.array([item.taught for item in items], dtype=np.bool_)
    return taught if taught.any() else None


def _jsonl_lines(data: bytes) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a JSONL file, each with its line number (from 1) for messages."""
    for n, line in enumerate(data.decode().splitlines(), start=1):
        if line.strip():
            yield n, line


def task_template(task: Task) -> PromptTemplate:
    """The task's prompt with the item left out: the instruction, the item, then the allowed
    answers (or the task's own ``template``). A profile fitted on the task keeps it
    (``CalibrationProfile.template``)."""
    if task.template is not None:
        return task.template
    allowed = ", ".join(task.choices)
    return PromptTemplate(
        before=f"{task.instruction}\n\n", after=f"\n\nAnswer with one of: {allowed}."
    )


def task_prompt(task: Task, text: str) -> str:
    """The prompt for one item: the task's template around the text."""
    return task_template(task).render(text)[0]


def task_item_span(task: Task, text: str) -> tuple[int, int] | None:
    """Where ``text`` lies in ``task_prompt(task, text)``: its [start, end) characters, the
    item's own span (``Query.item_span``); None for an empty text, which has none."""
    return task_template(task).render(text)[1]
