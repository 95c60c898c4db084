"""A new task's first labels from a file of unlabelled items (issue 57): the streams drawn
before any label, each label written as given, a resumed session, and the taught labels that
fit a profile but never certify it."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
from fakes import FINGERPRINT, FakeEngine, judgment_of

from calibration import FitSettings, load_profile, save_profile
from calibration.limits import allot
from calibration.maps.probe import candidate_layers
from calibration.monitoring.labelling import margins
from calibration.report import next_steps
from calibration.tasks import (
    ItemQueue,
    LabeledScores,
    Looks,
    Task,
    TaskError,
    advise,
    count_look,
    judge_pool,
    load_pool,
    load_split,
    load_task,
    looks_path,
    read_looks,
    taught_items,
)
from judge import Judge, Judgment, Query
from service.cli.label_queue import run_item_queue

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "reviews"


def task_at(tmp_path: Path) -> Task:
    (tmp_path / "task.json").write_text(
        json.dumps({"name": "toy", "choices": ["yes", "no"], "instruction": "Is it so?"})
    )
    return load_task(tmp_path)


def pool_of(
    n: int, seed: int = 0, low: float = 0.01, high: float = 0.99
) -> tuple[list[tuple[str, str]], LabeledScores]:
    """``n`` items whose P(yes) is uniform in [low, high] or, half of them, in [1 - high, 1 - low]."""
    rng = np.random.default_rng(seed)
    p_yes = rng.uniform(low, high, n)
    p_yes = np.where(rng.random(n) < 0.5, p_yes, 1 - p_yes)
    pool = [(f"i{i}", f"item {i}") for i in range(n)]
    return pool, scored(np.log(np.stack([p_yes, 1 - p_yes], axis=1)))


def scored(z: np.ndarray) -> LabeledScores:
    """A pool's scores as judge_pool gives them: log-probabilities, labels unset."""
    n = z.shape[0]
    return LabeledScores(log_probabilities=z, choice_mass=np.ones(n), labels=np.zeros(n, int))


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
    m = margins(np.exp(z.log_probabilities))
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


def test_how_many_more_from_the_fitted_map(tmp_path: Path) -> None:
    task = task_at(tmp_path)
    pool, z = pool_of(400, seed=2, low=0.9, high=0.999)  # a sharp model
    queue = ItemQueue(task, pool, z, "l", streams=["audit"])
    assert not queue.ready()
    label_as_calibrated(queue, 60)
    assert queue.ready()
    advice = advise(task, "l", queue.snapshot(), FINGERPRINT, name="toy", looks=Looks(delta=0.1))
    needed = advice.needed or pytest.fail()
    assert needed.given == 60 and advice.audit == 60 and advice.labels == 60
    assert needed.labels is not None and needed.precision is not None and needed.precision > 0.9
    # The profile is judge calibrate's on the same split: its file, its prompt, its name.
    assert advice.profile.dataset == "toy/l" and advice.profile.name == "toy"
    assert advice.profile.template is not None
    # A model that is never sure, and a map that cannot make it so: no number of labels would
    # certify 0.9, and the advice says more will not help this map.
    pool, z = pool_of(400, seed=2, low=0.55, high=0.7)
    dull = ItemQueue(task, pool, z, "d", streams=["audit"])
    label_as_calibrated(dull, 60)
    advice = advise(task, "d", dull.snapshot(), FINGERPRINT, name="toy", looks=Looks(delta=0.1))
    assert (advice.needed or pytest.fail()).labels is None and not advice.looked
    steps = next_steps(advice.profile)
    assert "more labels will not" in steps[1]


def test_a_splits_looks_are_counted_and_spend_one_delta(tmp_path: Path) -> None:
    task = task_at(tmp_path)
    assert read_looks(task, "labelled", 0.1) is None  # no lineage: judge calibrate fits once
    begun = read_looks(task, "labelled", 0.1, start=True)
    assert begun == Looks(delta=0.1, looks=0) and looks_path(task, "labelled").exists()
    first = begun.next("labelled.jsonl")
    assert first.look == 1 and first.spent == pytest.approx(0.1 * 6 / np.pi**2)
    counted = count_look(task, "labelled", begun)
    assert read_looks(task, "labelled", 0.1) == counted == Looks(delta=0.1, looks=1)
    assert counted.next("labelled.jsonl").spent == pytest.approx(0.1 * 6 / (4 * np.pi**2))
    # A lineage's delta is fixed when it begins: another one is refused, naming the file.
    with pytest.raises(TaskError, match=r"looked at 1 times under a lineage spending delta 0\.1"):
        read_looks(task, "labelled", 0.05)


def test_a_fit_is_a_look_only_when_its_labels_are_likely_enough(tmp_path: Path) -> None:
    """The map's own confidence says when (no label read); until then its certificate is
    computed with the map, but unread: only a look's counts."""
    task = task_at(tmp_path)
    pool, z = pool_of(1000, seed=2, low=0.9, high=0.999)  # a sharp, calibrated model
    queue = ItemQueue(task, pool, z, "l", streams=["audit"])
    label_as_calibrated(queue, 30)
    looks = Looks(delta=0.1)
    early = advise(task, "l", queue.snapshot(), FINGERPRINT, name="toy", looks=looks)
    assert not early.looked and not early.certified
    assert "calibrated confidence" in (early.needed or pytest.fail()).reason  # no label read
    while not (
        advice := advise(task, "l", queue.snapshot(), FINGERPRINT, name="toy", looks=looks)
    ).looked:
        assert queue.count() < 400, "a sharp model's labels were never likely enough"
        label_as_calibrated(queue, 20)
    r = advice.profile.recertification
    assert r is not None and r.look == 1 and advice.profile.threshold.delta == r.spent
    assert advice.certified == (advice.profile.threshold.threshold is not None)
    # A fit that is not a look certifies nothing, whatever its unread certificate says.
    unread = dataclasses.replace(advice, looked=False)
    assert not unread.certified


class Person:
    """Keys on stdin from someone who knows each item's true label: reads each item's id off
    the screen, and waits for a background fit it was told of before the next key (as a
    person slower than the fit would see it); quits once the gate opens."""

    def __init__(self, capsys: pytest.CaptureFixture[str], truth: dict[str, int]) -> None:
        self.capsys, self.truth, self.screen = capsys, truth, ""

    def isatty(self) -> bool:
        return False

    def __iter__(self) -> Iterator[str]:
        shown = 0  # how much of the screen had been read at the last key
        while True:
            self.screen += self.capsys.readouterr().out
            started = re.findall(r"fitting a profile on the (\d+) labels", self.screen)
            deadline = time.monotonic() + 60
            while started and f"[fit on {started[-1]} labels" not in self.screen:
                assert time.monotonic() < deadline, "a background fit never finished"
                time.sleep(0.02)
                self.screen += self.capsys.readouterr().out
            since = self.screen[shown:]
            cards = re.findall(r"^\[(?:audit|teach): \d+ left\] (\S+)", since, re.M)
            if "q quit" not in since or not cards:
                return
            if "] the gate opens:" in self.screen:
                yield "q\n"
                return
            shown = len(self.screen)
            yield str(self.truth[cards[-1]] + 1) + "\n"


def test_the_queue_says_the_gate_opens_where_the_fitted_map_certifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The raw model is near chance (it says "no" to most items); a map fitted on the labels
    (its bias) answers well. The queue's fits say how far the labels are from a certificate,
    then that the gate opens, and write the profile judge calibrate would write."""
    task = task_at(tmp_path)
    rng = np.random.default_rng(11)
    n = 600
    truth_yes = rng.random(n) < 0.5
    margin = np.where(truth_yes, 1.5, -1.5) + rng.normal(0, 1, n) - 2.5  # log P(yes)/P(no)
    z = np.stack([margin / 2, -margin / 2], axis=1)
    z -= np.logaddexp(z[:, :1], z[:, 1:])
    raw_accuracy = ((margin > 0) == truth_yes).mean()
    assert raw_accuracy < 0.65
    pool = [(f"i{i}", f"item {i}") for i in range(n)]
    queue = ItemQueue(task, pool, scored(z), "labelled", seed=2)
    truth = {key: 0 if yes else 1 for (key, _), yes in zip(pool, truth_yes, strict=True)}
    person = Person(capsys, truth)
    monkeypatch.setattr("sys.stdin", person)
    profiles = tmp_path / "profiles"
    code = run_item_queue(
        queue,
        "judge calibrate --task T --split labelled",
        fingerprint=FINGERPRINT,
        settings=FitSettings(n_bootstrap=20),
        name="toy",
        profiles_dir=profiles,
        every=20,
    )
    assert code == 0
    screen = person.screen + capsys.readouterr().out
    assert "not yet a look" in screen and "would likely certify" in screen
    assert "the gate opens" in screen
    assert "will not" not in screen  # the fitted map has signal: more labels help
    # A fit that is not a look leaves its certificate unread: only looks say how close it came.
    assert screen.count("best lower bound") == screen.count("certified nothing")
    written = load_profile(profiles / "toy.json")
    assert written.threshold.threshold is not None
    assert (profiles / "toy.report.md").exists()
    # The look that wrote it is counted in the split's lineage, at its share of the delta.
    r = written.recertification
    looks = read_looks(task, "labelled", 0.1) or pytest.fail()
    assert r is not None and r.look == looks.looks >= 1
    assert written.threshold.delta == r.spent == pytest.approx(0.1 * 6 / (np.pi * r.look) ** 2)
    # What judge calibrate fits on the file as it stood when the profile was written.
    items, _ = load_split(task, "labelled", written.n_examples)
    assert written.dataset_sha256 != "" and written.split.taught == sum(i.taught for i in items)


class Counting(FakeEngine):
    """A fake engine that counts the items it judges, and answers "yes" more for longer items."""

    def __init__(self) -> None:
        self.judged = 0

    def judgment(self, query: Query) -> Judgment:
        self.judged += 1
        p = min(0.95, 0.05 * len(query.prompt) % 1 + 0.05)
        return judgment_of({"yes": p, "no": 1 - p}, prompt=query.prompt)


def test_a_files_scores_are_kept_beside_the_task_and_reused(tmp_path: Path) -> None:
    task = task_at(tmp_path)
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"text": f"item {'x' * i}"}) + "\n" for i in range(12)))
    pool, digest = load_pool(items)
    texts = [text for _, text in pool]
    engine = Counting()
    said: list[str] = []
    first = judge_pool(engine, task, texts, digest, say=said.append)
    assert engine.judged == 12 and "judging 12 items once" in said[-1]
    kept = list((tmp_path / ".scores").glob("*.npz"))
    assert len(kept) == 1
    again = judge_pool(engine, task, texts, digest, say=said.append)
    assert engine.judged == 12 and "kept from an earlier start" in said[-1]
    assert np.array_equal(again.log_probabilities, first.log_probabilities)
    assert np.array_equal(again.choice_mass, first.choice_mass)
    # Another file (or model, prompt, layers) is another key: judged, and kept beside.
    items.write_text(items.read_text() + json.dumps({"text": "one more"}) + "\n")
    pool, other = load_pool(items)
    judge_pool(engine, task, [text for _, text in pool], other)
    assert engine.judged == 12 + 13 and len(list((tmp_path / ".scores").glob("*.npz"))) == 2
    # A kept file that cannot be read is judged again, and says so.
    kept[0].write_bytes(b"not a numpy file")
    judge_pool(engine, task, texts, digest, say=said.append)
    assert engine.judged == 12 + 13 + 12 and "cannot be read" in said[-1]


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


def test_judge_label_items_then_calibrate(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    loaded_once: list[dict[str, object]],
    judge: Judge,
) -> None:
    """The CLI end to end on the default model and the example task: label a file's items
    from the keyboard (a pipe: a key a line), then judge calibrate fits on them, the taught
    labels in its fit split alone; the file's scores are kept, and the queue's fits are
    judge calibrate's."""
    from service.cli.main import main

    task_dir = tmp_path / "reviews"
    task_dir.mkdir()
    (task_dir / "task.json").write_text((EXAMPLE / "task.json").read_text())
    rows = [json.loads(line) for line in (EXAMPLE / "test.jsonl").read_text().splitlines()[:30]]
    truth = {f"t{i}": row["label"] for i, row in enumerate(rows)}
    items = tmp_path / "items.jsonl"
    items.write_text(
        "".join(
            json.dumps({"id": k, "text": r["text"]}) + "\n"
            for k, r in zip(truth, rows, strict=True)
        )
    )
    task = load_task(task_dir)
    assert task.name == "reviews"  # task.json names none: the folder's name
    index = {key: task.choices.index(label) for key, label in truth.items()}
    monkeypatch.setattr("sys.stdin", Person(capsys, index))
    argv = ["label", "--queue", "--items", str(items), "--task", str(task_dir)]
    argv += ["--dtype", "float32", "--profiles-dir", str(tmp_path / "queue-profiles")]
    assert main(argv) == 0
    labelled, _ = load_split(task, "labelled")
    assert sorted(item.id for item in labelled) == sorted(truth)
    assert all(item.label == truth[item.id] for item in labelled)
    taught = sum(item.taught for item in labelled)
    assert 5 < taught < 25
    profiles = tmp_path / "profiles"
    argv = ["calibrate", "--task", str(task_dir), "--split", "labelled", "--dtype", "float32"]
    assert main([*argv, "--profiles-dir", str(profiles)]) == 0
    profile = load_profile(profiles / "reviews.json")
    # The taught labels fill the fit split (3 of 10 of all labels, fewer than they are), so
    # every audit label sets the conformal quantile or certifies.
    assert profile.split.taught == taught and profile.split.allotment == "by_role"
    fit_u, quantile, certify = allot(taught, 30 - taught, probe=False)
    assert fit_u == 0
    assert (profile.split.fit, profile.split.conformal, profile.split.certify) == (
        taught,
        quantile,
        certify,
    )
    # A second start reads the file's scores where the first kept them: no item is judged.
    kept = list((task_dir / ".scores").glob("*.npz"))
    assert len(kept) == 1
    pool, digest = load_pool(items)
    judged = []
    monkeypatch.setattr(judge, "judge_batch", lambda queries: judged.append(queries))
    layers = candidate_layers(judge.num_layers or 0)
    scores = judge_pool(judge, task, [text for _, text in pool], digest, layers=layers)
    assert not judged
    # judge calibrate was a look of the lineage the queue began on its split (the queue's
    # own fits on 30 labels were not: too few to be likely), and the queue's fit on those
    # scores, as that look, is the profile judge calibrate wrote, all but its date.
    assert profile.recertification is not None and profile.recertification.look == 1
    assert (read_looks(task, "labelled", 0.1) or pytest.fail()).looks == 1
    queue = ItemQueue(task, pool, scores, "labelled")
    looks = Looks(delta=0.1)
    advice = advise(
        task, "labelled", queue.snapshot(), judge.fingerprint(), name="reviews", looks=looks
    )
    assert msgspec.structs.replace(advice.profile, created_at="") == msgspec.structs.replace(
        profile, created_at=""
    )
    # A later look that certifies less does not replace an earlier one of the lineage (a
    # queue's certificate, here one written in its place): the file is kept, and it says so.
    opened = msgspec.structs.replace(
        profile,
        threshold=msgspec.structs.replace(
            profile.threshold, threshold=0.6, coverage=1.0, feasible=True
        ),
    )
    save_profile(opened, profiles / "reviews.json")
    before = (profiles / "reviews.json").read_bytes()
    capsys.readouterr()
    assert main([*argv, "--profiles-dir", str(profiles)]) == 0
    said = capsys.readouterr().out
    assert "this look (look 2" in said and "--name NAME" in said, said[-600:]
    assert (profiles / "reviews.json").read_bytes() == before
    assert (read_looks(task, "labelled", 0.1) or pytest.fail()).looks == 2
