"""A new task's first labels from a file of unlabelled items (issue 57): the streams drawn
before any label, each label written as given, a resumed session, and the taught labels that
fit a profile but never certify it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from calibration import load_profile
from calibration.monitoring.labelling import margins
from calibration.tasks import (
    ItemQueue,
    Task,
    TaskError,
    load_pool,
    load_split,
    load_task,
    taught_items,
)

ROOT = Path(__file__).resolve().parent.parent
SST2 = ROOT.parent / "shared" / "data" / "sst2"


def task_at(tmp_path: Path) -> Task:
    (tmp_path / "task.json").write_text(
        json.dumps({"name": "toy", "choices": ["yes", "no"], "instruction": "Is it so?"})
    )
    return load_task(tmp_path)


def pool_of(
    n: int, seed: int = 0, low: float = 0.01, high: float = 0.99
) -> tuple[list[tuple[str, str]], np.ndarray]:
    """``n`` items whose P(yes) is uniform in [low, high] or, half of them, in [1 - high, 1 - low]."""
    rng = np.random.default_rng(seed)
    p_yes = rng.uniform(low, high, n)
    p_yes = np.where(rng.random(n) < 0.5, p_yes, 1 - p_yes)
    pool = [(f"i{i}", f"item {i}") for i in range(n)]
    return pool, np.log(np.stack([p_yes, 1 - p_yes], axis=1))


def drain(queue: ItemQueue, stream: str) -> list[str]:
    """The ids of ``stream`` in the order the queue offers them, each labelled "yes"."""
    order = []
    while (item := queue.next()) is not None:
        assert item.stream == stream
        order.append(item.id)
        queue.label(item, "yes")
    return order


def test_the_streams_are_drawn_before_any_label(tmp_path: Path) -> None:
    task = task_at(tmp_path)
    pool, z = pool_of(200)
    audit = ItemQueue(task, pool, z, "a", streams=["audit"], seed=3)
    teach = ItemQueue(task, pool, z, "t", streams=["teach"], seed=3)
    audit_ids, teach_ids = drain(audit, "audit"), drain(teach, "teach")
    # Every item in exactly one stream, about half in each.
    assert sorted(audit_ids + teach_ids) == sorted(key for key, _ in pool)
    assert 70 < len(audit_ids) < 130
    # The audit stream does not lean to the uncertain items, which teach takes first.
    index = {key: i for i, (key, _) in enumerate(pool)}
    m = margins(np.exp(z))
    first_teach = [m[index[k]] for k in teach_ids[:20]]
    assert max(first_teach) < np.median([m[index[k]] for k in teach_ids])
    assert abs(np.mean([m[index[k]] for k in audit_ids[:40]]) - m.mean()) < 0.15
    # Another seed, another draw; the same seed, the same queue.
    other = ItemQueue(task, pool, z, "o", streams=["audit"], seed=4)
    assert drain(other, "audit") != audit_ids
    again = ItemQueue(task, pool, z, "g", streams=["audit"], seed=3)
    assert drain(again, "audit") == audit_ids


def test_each_label_is_written_and_a_session_resumes(tmp_path: Path) -> None:
    task = task_at(tmp_path)
    pool, z = pool_of(30)
    out = tmp_path / "labelled.jsonl"
    queue = ItemQueue(task, pool, z, "labelled", seed=1)
    first = queue.next()
    assert first is not None and first.stream == "audit"
    with pytest.raises(ValueError, match="label must be one of"):
        queue.label(first, "maybe")
    queue.label(first, "no")
    second = queue.next()
    assert second is not None and second.stream == "teach"
    queue.label(second, "yes")
    skipped = queue.next()
    assert skipped is not None
    queue.skip(skipped)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [
        {"id": first.id, "text": first.text, "label": "no", "stream": "audit"},
        {"id": second.id, "text": second.text, "label": "yes", "stream": "teach"},
    ]
    # A new session leaves out what is labelled, not what was skipped, in the same order.
    resumed = ItemQueue(task, pool, z, "labelled", seed=1)
    assert resumed.pending("audit") + resumed.pending("teach") == 28
    assert resumed.total("audit") == 1 and resumed.total("teach") == 1
    assert (resumed.next() or pytest.fail()).id == skipped.id
    # The file is the split judge calibrate reads: the taught label fits, never certifies.
    items, _ = load_split(task, "labelled")
    assert [item.taught for item in items] == [False, True]
    taught = taught_items(items)
    assert taught is not None and taught.tolist() == [False, True]


def label_as_calibrated(queue: ItemQueue, count: int) -> None:
    """Label ``count`` items as a calibrated model's world would: its answer is right with the
    probability it gives it."""
    for _ in range(count):
        item = queue.next() or pytest.fail()
        right = np.random.default_rng(int(item.id[1:])).random() < item.probabilities[item.choice]
        wrong = next(c for c in item.choices if c != item.choice)
        queue.label(item, item.choice if right else wrong)


def test_how_many_more_from_the_audit_labels(tmp_path: Path) -> None:
    task = task_at(tmp_path)
    pool, z = pool_of(400, seed=2, low=0.9, high=0.999)  # a sharp model
    queue = ItemQueue(task, pool, z, "l", streams=["audit"])
    assert queue.needed() is None and not queue.ready()
    label_as_calibrated(queue, 60)
    needed = queue.needed() or pytest.fail()
    assert needed.given == 60 and queue.ready()
    assert needed.labels is not None and needed.precision is not None and needed.precision > 0.9
    # A model that is never sure: no number of labels would certify 0.9.
    pool, z = pool_of(400, seed=2, low=0.55, high=0.7)
    dull = ItemQueue(task, pool, z, "d", streams=["audit"])
    label_as_calibrated(dull, 60)
    assert (dull.needed() or pytest.fail()).labels is None


def test_bad_files_name_the_line(tmp_path: Path) -> None:
    task = task_at(tmp_path)
    items = tmp_path / "items.jsonl"
    items.write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(TaskError, match=r"items.jsonl:2: expected an object with a text"):
        load_pool(items)
    items.write_text('{"text": "a", "id": "x"}\n\n{"text": "b", "id": "x"}\n')
    with pytest.raises(TaskError, match=r"items.jsonl:3: id 'x' appears twice"):
        load_pool(items)
    (tmp_path / "labelled.jsonl").write_text(
        '{"id": "1", "text": "a", "label": "yes", "stream": "both"}\n'
    )
    with pytest.raises(TaskError, match=r"labelled\.jsonl:1: stream must be one of"):
        load_split(task, "labelled")
    pool, z = pool_of(5)
    # A resumed queue reads its file as judge calibrate will: the same line is refused.
    with pytest.raises(TaskError, match=r"labelled\.jsonl:1: stream must be one of"):
        ItemQueue(task, pool, z, "labelled")


@pytest.mark.usefixtures("loaded_once")
def test_judge_label_items_then_calibrate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI end to end on the default model: label a file's items from the keyboard (a
    pipe: a key a line), then judge calibrate fits on them, the taught labels in its fit
    split alone."""
    from service.cli.main import main

    task_dir = tmp_path / "sst2"
    task_dir.mkdir()
    (task_dir / "task.json").write_text((SST2 / "task.json").read_text())
    rows = [json.loads(line) for line in (SST2 / "test.jsonl").read_text().splitlines()[:30]]
    truth = {f"t{i}": row["label"] for i, row in enumerate(rows)}
    items = tmp_path / "items.jsonl"
    items.write_text(
        "".join(
            json.dumps({"id": k, "text": r["text"]}) + "\n"
            for k, r in zip(truth, rows, strict=True)
        )
    )
    task = load_task(task_dir)

    # The keys a person who knows the truth would press: read each item's id off the screen.
    class Person:
        def isatty(self) -> bool:
            return False

        def __iter__(self) -> Iterator[str]:
            while True:
                shown = capsys.readouterr().out
                if "q quit" not in shown:
                    return
                key = next(line.split()[-1] for line in shown.splitlines() if line.startswith("["))
                yield str(task.choices.index(truth[key]) + 1) + "\n"

    monkeypatch.setattr("sys.stdin", Person())
    argv = [
        "label",
        "--queue",
        "--items",
        str(items),
        "--task",
        str(task_dir),
        "--dtype",
        "float32",
    ]
    assert main(argv) == 0
    labelled, _ = load_split(task, "labelled")
    assert sorted(item.id for item in labelled) == sorted(truth)
    assert all(item.label == truth[item.id] for item in labelled)
    taught = sum(item.taught for item in labelled)
    assert 5 < taught < 25
    profiles = tmp_path / "profiles"
    argv = ["calibrate", "--task", str(task_dir), "--split", "labelled", "--dtype", "float32"]
    assert main([*argv, "--profiles-dir", str(profiles), "--method", "temperature"]) == 0
    profile = load_profile(profiles / "sst2.json")
    assert profile.split.taught == taught
    assert profile.split.fit + profile.split.conformal + profile.split.certify == 30
    assert profile.split.fit > taught  # the audit labels are split 3:2:5 as ever
