"""A file of a task's unlabelled items, judged once and kept beside the task.

``judge label --queue --items FILE`` needs the model's scores of every item in the file before
the first keypress: the streams are drawn on them, the teach stream orders by them, and the
queue's background fits (``calibration.tasks.item_queue``) read them as ``judge calibrate``
would. Judging a thousand items takes a minute or more on a CPU, so the scores are kept in
``<task>/.scores/`` under a key of everything they depend on (the engine's fingerprint: model,
weights, dtype and template; the task's prompt and choices; the layers read; the file's
sha256) and read back on the next start. Any change to one of those is another key, so a kept
file is never read for other scores; one that cannot be read is judged again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import numpy as np

from calibration.tasks.files import LabeledItem, Task, task_template
from calibration.tasks.labeled import LabeledScores, judge_task_items
from judge import Engine, Fingerprint
from judge.atomicio import replacing

__all__ = ["judge_pool", "pool_key"]

FORMAT = 1  # of the kept file: a new format is a new key


def pool_key(fingerprint: Fingerprint, task: Task, layers: Sequence[int], items_sha256: str) -> str:
    """The sha256 of everything a pool's scores depend on."""
    template = task_template(task)
    parts = {
        "format": FORMAT,
        "fingerprint": msgspec.to_builtins(fingerprint),
        "prompt": [template.before, template.after],
        "choices": list(task.choices),
        "layers": [int(n) for n in layers],
        "items_sha256": items_sha256,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def judge_pool(
    engine: Engine,
    task: Task,
    texts: Sequence[str],
    items_sha256: str,
    *,
    layers: Sequence[int] = (),
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
    say: Callable[[str], None] | None = None,
) -> LabeledScores:
    """The scores of ``texts`` (the items of a file whose sha256 is ``items_sha256``) as
    ``judge calibrate`` computes a split's: log-probabilities in ``task.choices`` order, the
    choice mass, and with ``layers`` the hidden states there and their means over each item.
    The labels are placeholders (0): nothing is labelled yet. Read from ``<task>/.scores/``
    where kept, else judged and kept; ``say`` is told which."""
    key = pool_key(engine.fingerprint(), task, layers, items_sha256)
    path = Path(task.path) / ".scores" / f"{key}.npz"
    kept = _read(path, len(texts), len(task.choices), layers)
    if isinstance(kept, LabeledScores):
        if say is not None:
            say(f"the {len(texts)} items' scores, kept from an earlier start: {path}")
        return kept
    if say is not None:
        why = "" if kept is None else f" ({kept}: judged again)"
        say(f"judging {len(texts)} items once; their scores are kept in {path}{why}")
    items = [
        LabeledItem(id=str(i), text=text, label=task.choices[0]) for i, text in enumerate(texts)
    ]
    scores = judge_task_items(
        engine,
        task,
        items,
        batch_size=batch_size,
        progress=progress,
        feature_layers=layers,
        span_layers=layers,
    )
    arrays = {
        "log_probabilities": scores.log_probabilities,
        "choice_mass": scores.choice_mass,
        "feature_layers": np.asarray(scores.feature_layers, dtype=np.int64),
    }
    if scores.features is not None and scores.span_features is not None:
        arrays["features"] = scores.features
        arrays["span_features"] = scores.span_features
    with replacing(path) as tmp:
        np.savez(tmp, **arrays)  # type: ignore[arg-type]
    return scores


def _read(path: Path, n: int, k: int, layers: Sequence[int]) -> LabeledScores | str | None:
    """The scores kept at ``path``; None where there are none, or a string saying why they
    cannot be used."""
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as kept:
            arrays = {name: kept[name] for name in kept.files}
        scores = LabeledScores(
            log_probabilities=arrays["log_probabilities"],
            choice_mass=arrays["choice_mass"],
            labels=np.zeros(arrays["log_probabilities"].shape[0], dtype=np.int64),
            features=arrays.get("features"),
            feature_layers=tuple(int(x) for x in arrays["feature_layers"]),
            span_features=arrays.get("span_features"),
            span="item" if "span_features" in arrays else None,
        )
    except (OSError, ValueError, KeyError) as exc:
        return f"{path} cannot be read: {exc}"
    if scores.log_probabilities.shape != (n, k) or scores.feature_layers != tuple(layers):
        return f"{path} holds scores of another shape"
    return scores
