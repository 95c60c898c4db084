"""Labeled tasks: files on disk, judging a labeled set in batches, fitting a profile on it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from fakes import FakeEngine, judgment_of

from calibration import FitSettings, Provenance
from calibration.errors import ProfileMismatchError
from calibration.tasks import (
    LabeledItem,
    LabeledScores,
    Task,
    TaskError,
    fit_labeled,
    judge_labeled,
    judge_task_items,
    labeled_queries,
    load_split,
    load_task,
    scores_from_judgments,
    task_prompt,
)
from judge import Engine, Fingerprint, Judge, JudgeError, Judgment, Query

CHOICES = ["ham", "spam"]


class PromptEngine(FakeEngine):
    """P(spam) is read off the prompt ("p=0.9"), so results are known; batches are recorded."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def fingerprint(
        self,
        *,
        system: str | None = None,
        response_prefix: str | None = None,
        response_suffix: str | None = None,
    ) -> Fingerprint:
        return super().fingerprint(
            system=system,
            response_prefix=response_prefix or "<",
            response_suffix=response_suffix or ">",
        )

    def judge_batch(self, queries: Sequence[Query | Mapping[str, Any]]) -> list[Judgment]:
        self.batches.append(len(queries))
        return super().judge_batch(queries)

    def judgment(self, query: Query) -> Judgment:
        p_spam = float(query.prompt.split("=")[1])
        probs = {c: p_spam if c == "spam" else 1 - p_spam for c in query.choices}
        return judgment_of(probs, prompt=query.prompt, mass=0.5 + p_spam / 4)


def test_engines_satisfy_the_protocol(judge: Judge) -> None:
    fake: Engine = PromptEngine()  # checked by mypy: no cast, no ignore
    real: Engine = judge
    assert isinstance(fake, Engine) and isinstance(real, Engine)


def test_judge_labeled_runs_in_batches_and_reports_progress() -> None:
    engine, done = PromptEngine(), list[int]()
    p_spam = [0.9, 0.2, 0.7, 0.6, 0.1, 0.95, 0.3]
    labels = ["spam", "ham", "spam", "ham", "ham", "spam", "spam"]
    # The queries list the choices spam-first; the columns follow CHOICES all the same.
    queries = labeled_queries([f"p={p}" for p in p_spam], ["spam", "ham"])
    scores = judge_labeled(engine, queries, labels, CHOICES, batch_size=3, progress=done.append)
    assert engine.batches == [3, 3, 1] and done == [3, 3, 1]
    np.testing.assert_allclose(np.exp(scores.log_probabilities[:, 1]), p_spam)
    np.testing.assert_allclose(scores.choice_mass, [0.5 + p / 4 for p in p_spam])
    assert scores.labels.tolist() == [1, 0, 1, 0, 0, 1, 1] and scores.labels.dtype == np.int64
    assert len(scores) == 7


def test_labeled_queries_carry_the_template() -> None:
    queries = labeled_queries(["a", "b"], CHOICES, system="s", response_prefix="p")
    assert [q.prompt for q in queries] == ["a", "b"]
    assert all(q.choices == CHOICES and q.system == "s" for q in queries)
    assert all(q.response_prefix == "p" and q.response_suffix is None for q in queries)
    with pytest.raises(TypeError, match="single str"):
        labeled_queries("ab", CHOICES)


def test_scores_from_judgments_names_what_does_not_fit() -> None:
    engine = PromptEngine()
    judgments = engine.judge_batch(labeled_queries(["p=0.8", "p=0.3"], CHOICES))
    with pytest.raises(TaskError, match="2 judgments but 1 labels"):
        scores_from_judgments(judgments, ["spam"], CHOICES)
    with pytest.raises(TaskError, match="label 1 is 'maybe'"):
        scores_from_judgments(judgments, ["spam", "maybe"], CHOICES)
    with pytest.raises(TaskError, match="judgment 0 was made between"):
        scores_from_judgments(judgments, ["spam", "ham"], ["spam", "ham", "maybe"])
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        judge_labeled(engine, [], [], CHOICES, batch_size=0)


def test_labeled_scores_check_their_shapes() -> None:
    z = np.log(np.full((3, 2), 0.5))
    with pytest.raises(ValueError, match=r"choice_mass must have shape \(3,\)"):
        LabeledScores(z, np.ones(2), np.zeros(3, dtype=int))
    with pytest.raises(ValueError, match=r"labels must be indices in \[0, 2\)"):
        LabeledScores(z, np.ones(3), np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="labels must be choice indices"):
        LabeledScores(z, np.ones(3), np.array([0.0, 1.0, 0.5]))
    with pytest.raises(ValueError, match=r"shape \(n, k\) with k >= 2"):
        LabeledScores(np.zeros(3), np.ones(3), np.zeros(3, dtype=int))


def test_fit_labeled_records_the_engine_and_the_data() -> None:
    engine = PromptEngine()
    rng = np.random.default_rng(0)
    p_spam = rng.beta(2, 2, 120)
    labels = ["spam" if rng.random() < p else "ham" for p in p_spam]
    queries = labeled_queries([f"p={p}" for p in p_spam], CHOICES)
    scores = judge_labeled(engine, queries, labels, CHOICES, batch_size=50)
    fingerprint = engine.fingerprint(system="Be brief.")
    source = Provenance(
        fingerprint=fingerprint, dataset="fake/calibration", dataset_sha256="ab" * 32
    )
    settings = FitSettings(target_precision=0.8, delta=0.2, alpha=0.2)
    profile = fit_labeled("fake", scores, CHOICES, source, settings).profile
    assert profile.name == "fake" and profile.choices == CHOICES and profile.n_examples == 120
    assert profile.fingerprint == fingerprint
    assert (fingerprint.model, fingerprint.dtype, fingerprint.response_prefix) == (
        "fake",
        "float32",
        "<",
    )
    assert profile.dataset == "fake/calibration" and profile.conformal_alpha == 0.2
    assert profile.threshold.target_precision == 0.8 and profile.threshold.delta == 0.2
    profile.check(engine.fingerprint(system="Be brief."), choices=["spam", "ham"])
    with pytest.raises(ProfileMismatchError) as info:
        profile.check(engine.fingerprint(), choices=["spam", "ham"])
    assert info.value.field == "system"

    with pytest.raises(TypeError, match=r"fingerprint must be a judge\.Fingerprint"):
        as_dict = msgspec.to_builtins(fingerprint)
        fit_labeled(
            "x", scores, CHOICES, Provenance(fingerprint=as_dict, dataset="d", dataset_sha256="0")
        )
    with pytest.raises(ValueError, match="2 columns but there are 3 choices"):
        fit_labeled("x", scores, [*CHOICES, "maybe"], source)


def test_judge_labeled_agrees_with_judging_one_at_a_time(judge: Judge) -> None:
    prompts = ["Is this spam? WIN a prize now!", "Is this spam? See you at lunch.", "Spam? Hi"]
    queries = labeled_queries(prompts, ["spam", "ham"])
    scores = judge_labeled(judge, queries, ["spam", "ham", "ham"], CHOICES, batch_size=2)
    for row, prompt in enumerate(prompts):
        single = judge.judge(prompt, ["spam", "ham"])
        for col, choice in enumerate(CHOICES):
            assert scores.log_probabilities[row, col] == pytest.approx(
                single.log_probabilities[choice], abs=1e-4
            )
        assert scores.choice_mass[row] == pytest.approx(single.choice_mass, abs=1e-4)


def _task(tmp_path: Path, lines: str) -> Path:
    (tmp_path / "task.json").write_text(
        '{"name": "t", "choices": ["ham", "spam"], "instruction": "Is this spam?"}'
    )
    (tmp_path / "calibration.jsonl").write_text(lines)
    return tmp_path


def test_task_files_round_trip(tmp_path: Path) -> None:
    task = load_task(
        _task(
            tmp_path,
            '{"text": "hi", "label": "ham", "id": 9}\n\n{"text": "WIN", "label": "spam"}\n',
        )
    )
    items, digest = load_split(task, "calibration")
    assert [(i.id, i.text, i.label) for i in items] == [("9", "hi", "ham"), ("3", "WIN", "spam")]
    assert len(digest) == 64
    assert [i.id for i in load_split(task, "calibration", 1)[0]] == ["9"]
    assert task_prompt(task, "hi") == "Is this spam?\n\nhi\n\nAnswer with one of: ham, spam."


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ('{"text": "hi"}\n', "calibration.jsonl:1: expected an object with text and label"),
        ("[1]\n", "calibration.jsonl:1: expected an object with text and label"),
        ('{"text": 3, "label": "ham"}\n', "calibration.jsonl:1: text must be a string"),
        ('{"text": "a", "label": "ham"}\n{"text": "b", "label": "eggs"}\n', ":2: label 'eggs'"),
    ],
)
def test_bad_split_lines_are_named(tmp_path: Path, lines: str, message: str) -> None:
    task = load_task(_task(tmp_path, lines))
    with pytest.raises(TaskError, match=message):
        load_split(task, "calibration")


def test_task_errors_are_value_errors_not_engine_errors(tmp_path: Path) -> None:
    assert issubclass(TaskError, ValueError) and not issubclass(TaskError, JudgeError)
    with pytest.raises(TaskError, match=r"has no task\.json"):
        load_task(tmp_path)
    task = load_task(_task(tmp_path, ""))
    with pytest.raises(TaskError, match="has no split 'test'"):
        load_split(task, "test")
    with pytest.raises(TaskError, match="limit must be a positive number"):
        load_split(task, "calibration", 0)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ('{"ham": 0}', r"values is missing \['spam'\]"),
        ('{"ham": 0, "spam": 1, "eggs": 2}', r"values names \['eggs'\]"),
    ],
)
def test_a_task_file_with_bad_values_is_named(tmp_path: Path, values: str, message: str) -> None:
    # The same rules as every other values (judge.scores), reported as a task file error.
    (tmp_path / "task.json").write_text(
        '{"name": "t", "choices": ["ham", "spam"], "instruction": "Rate it.", '
        f'"values": {values}}}'
    )
    with pytest.raises(TaskError, match=r"task\.json: " + message):
        load_task(tmp_path)


def test_a_task_needs_only_its_choices_and_instruction(tmp_path: Path) -> None:
    """The README's task.json: the name is the folder's, fields for people are left alone."""
    folder = tmp_path / "reviews"
    folder.mkdir()
    (folder / "task.json").write_text(
        '{"choices": ["negative", "positive"], "instruction": "Is this review negative or '
        'positive?", "source": "a person", "license": "CC0"}'
    )
    task = load_task(folder)
    assert (task.name, task.choices, task.kind) == (
        "reviews",
        ["negative", "positive"],
        "classification",
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"choices": ["a", "b"]}', r"is missing 'instruction': the question put to the model"),
        ('{"instruction": "x"}', r"is missing 'choices': the answers the model chooses between"),
        ('{"choices": ["a"], "instruction": "x"}', r"choices: expected `array` of length >= 2"),
        ('{"choices": ["a", "a"], "instruction": "x"}', r"choices must be distinct"),
        ('{"choices": ["a", "b"], "instruction": 3}', r"instruction: expected `str`, got `int`"),
        ('{"choices": ["a", "b"], "instruction": "x", "kind": "grade"}', r"kind: invalid enum"),
        ('{"choices": "a, b", "instruction": "x"}', r"choices: expected `array`, got `str`"),
        ("[1, 2]", r"must be a JSON object"),
        ("{choices: 1}", r"is not JSON"),
    ],
)
def test_a_malformed_task_file_names_the_field_and_the_fix(
    tmp_path: Path, text: str, message: str
) -> None:
    (tmp_path / "task.json").write_text(text)
    with pytest.raises(TaskError, match=message) as raised:
        load_task(tmp_path)
    assert "task.json" in str(raised.value)


def test_the_example_task_loads_and_names_its_source_and_license() -> None:
    import json

    folder = Path(__file__).resolve().parent.parent / "examples" / "reviews"
    task = load_task(folder)
    assert task.name == "reviews" and task.choices == ["negative", "positive"]
    spec = json.loads((folder / "task.json").read_text())
    assert "CC BY 4.0" in spec["license"] and "10.24432/C57604" in spec["source"]
    for split, n in (("calibration", 495), ("test", 495)):
        items, _ = load_split(task, split)
        assert len(items) == n and {i.label for i in items} == set(task.choices)
    calibration, test = ({i.text for i in load_split(task, s)[0]} for s in ("calibration", "test"))
    assert not calibration & test  # no sentence in both


class RecordingEngine(FakeEngine):
    """Uniform judgments; remembers every query it was given."""

    def __init__(self) -> None:
        self.queries: list[Query] = []

    def judgment(self, query: Query) -> Judgment:
        self.queries.append(query)
        return super().judgment(query)


def test_judge_task_items_uses_the_task_prompt_and_column_order() -> None:
    task = Task(name="t", choices=["ham", "spam"], instruction="Spam?", path=".")
    labels = ["ham", "spam", "ham"]
    items = [LabeledItem(id=str(i), text=f"message {i}", label=y) for i, y in enumerate(labels)]
    engine, done = RecordingEngine(), list[int]()
    scores = judge_task_items(engine, task, items, batch_size=2, progress=done.append)
    assert [q.prompt for q in engine.queries] == [task_prompt(task, it.text) for it in items]
    assert all(q.choices == task.choices for q in engine.queries) and done == [2, 1]
    assert scores.labels.tolist() == [0, 1, 0]
    flipped = judge_task_items(engine, task, items, choices=["spam", "ham"])
    assert flipped.labels.tolist() == [1, 0, 1]


def test_features_of_picks_layers_in_the_order_asked() -> None:
    features = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)  # (n, m, H)
    scores = LabeledScores(
        log_probabilities=np.zeros((2, 2)),
        choice_mass=np.ones(2),
        labels=np.array([0, 1]),
        features=features,
        feature_layers=(10, 20, 30),
    )
    assert scores.features_of(()) is None
    picked = scores.features_of((30, 10))
    assert picked is not None and picked.shape == (2, 2, 4)
    assert np.array_equal(picked[:, 0], features[:, 2]) and np.array_equal(
        picked[:, 1], features[:, 0]
    )
    with pytest.raises(ProfileMismatchError, match=r"not of \[15\]"):
        scores.features_of((15,))
