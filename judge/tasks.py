"""Labeled tasks on disk (``task.json`` plus ``<split>.jsonl``) and running the judge over them.

A task directory holds ``task.json`` with ``name``, ``choices`` and ``instruction``, and one
JSON object per line in ``calibration.jsonl`` / ``test.jsonl`` with ``text`` and ``label``.
The prompt for an item is the instruction, the item's text, and the list of allowed answers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import numpy as np

from judge.engine import Judge, Query
from judge.errors import JudgeError

__all__ = [
    "LabeledItem",
    "Task",
    "TaskError",
    "judge_items",
    "load_split",
    "load_task",
    "task_prompt",
]


class TaskError(JudgeError, ValueError):
    """A task directory or one of its files is missing or malformed."""


class LabeledItem(msgspec.Struct, frozen=True):
    id: str
    text: str
    label: str


class Task(msgspec.Struct, frozen=True):
    name: str
    choices: list[str]
    instruction: str
    path: str


class _TaskFile(msgspec.Struct):
    name: str
    choices: list[str]
    instruction: str


def load_task(path: str | Path) -> Task:
    folder = Path(path)
    try:
        spec = msgspec.json.decode((folder / "task.json").read_bytes(), type=_TaskFile)
    except FileNotFoundError:
        raise TaskError(f"{str(folder)!r} has no task.json; pass a task directory") from None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise TaskError(f"{folder / 'task.json'} is malformed: {exc}") from exc
    return Task(
        name=spec.name, choices=spec.choices, instruction=spec.instruction, path=str(folder)
    )


def load_split(task: Task, split: str, limit: int | None = None) -> tuple[list[LabeledItem], str]:
    """The items of ``<split>.jsonl`` (the first ``limit``) and the file's sha256."""
    file = Path(task.path) / f"{split}.jsonl"
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise TaskError(f"task {task.name!r} has no split {split!r} ({file} is missing)") from None
    items = []
    for n, line in enumerate(data.decode().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            item = LabeledItem(id=str(row.get("id", n)), text=row["text"], label=row["label"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise TaskError(f"{file}:{n}: expected an object with text and label ({exc})") from exc
        if item.label not in task.choices:
            raise TaskError(f"{file}:{n}: label {item.label!r} is not one of {task.choices}")
        items.append(item)
        if limit is not None and len(items) >= limit:
            break
    return items, hashlib.sha256(data).hexdigest()


def task_prompt(task: Task, text: str) -> str:
    allowed = ", ".join(task.choices)
    return f"{task.instruction}\n\n{text}\n\nAnswer with one of: {allowed}."


def judge_items(
    judge: Judge,
    task: Task,
    items: Sequence[LabeledItem],
    *,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-choice logits (n, k) in ``task.choices`` order and label indices (n,)."""
    logits = np.empty((len(items), len(task.choices)))
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        queries = [
            Query(prompt=task_prompt(task, item.text), choices=task.choices) for item in chunk
        ]
        for i, result in enumerate(judge.judge_batch(queries)):
            logits[start + i] = [result.logits[c] for c in task.choices]
        if progress is not None:
            progress(len(chunk))
    labels = np.array([task.choices.index(item.label) for item in items], dtype=np.int64)
    return logits, labels
