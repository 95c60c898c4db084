"""Judge a labeled set, then fit a calibration profile on it.

The two halves of "calibrate on my data", shared by ``judge calibrate``, the service's
``POST /profiles/{name}/fit`` and the calibration benchmark, so all three fit the same way:

* ``judge_labeled`` runs an engine over labeled prompts in batches and keeps, per item, the
  per-choice log-probabilities in one fixed choice order, the choice mass and the label index;
* ``fit_labeled`` hands those arrays, with where they came from (``calibration.Provenance``:
  the engine's fingerprint, the data, the prompt), to ``calibration.fit_profile``.

Without labels, ``judge_unlabeled`` judges prompts alone (content-free ones from
``content_free_prompts``, a task's texts, or a JSONL file read by ``load_prompts``) and
``fit_unlabeled`` fits a label-free prior correction (``calibration.fit_label_free_profile``).

The arrays travel as ``LabeledScores`` (calibration's own, exported here too), plain numpy
data that can be cached on disk and refitted without the model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack

import msgspec
import numpy as np

from calibration.fit_data import LabeledScores, Provenance
from calibration.fit_settings import DEFAULT_SETTINGS, FitSettings
from calibration.maps.map_types import ProbeSpan
from calibration.tasks.files import (
    LabeledItem,
    Task,
    TaskError,
    _jsonl_lines,
    task_item_span,
    task_prompt,
)
from judge import Engine, Fingerprint, Judgment, Query
from judge.judgments import QueryTemplate

if TYPE_CHECKING:
    from calibration import CalibrationProfile
    from calibration.fitting import FittedProfile, TrainedHead
    from calibration.policy import Checks


class _Given(TypedDict, total=False):
    """What ``fit_labeled`` passes on to ``fit_profile`` beside the three records."""

    probe_split: bool | None
    trained: TrainedHead | None


__all__ = [
    "LabeledScores",
    "checks_on_scores",
    "content_free_prompts",
    "fit_labeled",
    "fit_unlabeled",
    "judge_labeled",
    "judge_task_items",
    "judge_task_pool",
    "judge_unlabeled",
    "labeled_queries",
    "load_prompts",
    "scores_from_judgments",
]


def checks_on_scores(profile: CalibrationProfile, scores: LabeledScores) -> Checks:
    """The gates a gate on ``profile`` serves on the items of ``scores``, as arrays
    (``calibration.fitting.served_checks``, with the features its map reads)."""
    from calibration.fitting import served_checks  # the fitters load scipy: here, not above

    _, gates = served_checks(
        profile,
        scores.log_probabilities,
        scores.choice_mass,
        features=scores.features_of(profile.feature_layers),
        span_features=scores.span_features_of(profile.span_layers),
    )
    return gates


def labeled_queries(
    prompts: Sequence[str],
    choices: Sequence[str],
    *,
    item_spans: Sequence[tuple[int, int] | None] | None = None,
    **template: Unpack[QueryTemplate],
) -> list[Query]:
    """One query per prompt, every one with the same choices and ``template`` (``Query``'s
    other fields: None template fields take the engine's defaults, as in ``Engine.judge``;
    ``feature_layers`` are the hidden-state layers each judgment returns, ``span_layers``
    those averaged over each prompt's item (``item_spans``, one per prompt; None: the whole
    prompts)).
    """
    if isinstance(prompts, str):
        raise TypeError("prompts must be a sequence of strings, got a single str")
    spans = [None] * len(prompts) if item_spans is None else list(item_spans)
    if len(spans) != len(prompts):
        raise ValueError(f"got {len(spans)} item spans for {len(prompts)} prompts")
    return [
        msgspec.convert(
            {"prompt": prompt, "choices": list(choices), "item_span": span, **template}, Query
        )
        for prompt, span in zip(prompts, spans, strict=True)
    ]


def scores_from_judgments(
    judgments: Sequence[Judgment],
    labels: Sequence[str],
    choices: Sequence[str],
    feature_layers: Sequence[int] = (),
    span_layers: Sequence[int] = (),
) -> LabeledScores:
    """Arrange judgments and their labels as arrays, columns in ``choices`` order.

    With ``feature_layers``, every judgment must carry those layers' features; with
    ``span_layers`` (the same layers), their means over the item too, every one over a
    marked item or every one over its whole prompt.

    Parameters
    ----------
    judgments : sequence of Judgment, length n
        Each judged between exactly ``choices`` (in any order).
    labels : sequence of str, length n
        Each item's correct choice.
    choices : sequence of str, length k
        The column order of the result.

    Raises
    ------
    TaskError
        If the lengths differ, a label is not one of ``choices``, or a judgment was made
        between other choices.
    """
    choices = list(choices)
    if len(judgments) != len(labels):
        raise TaskError(f"got {len(judgments)} judgments but {len(labels)} labels; pair them up")
    index = {c: j for j, c in enumerate(choices)}
    label_index = np.empty(len(labels), dtype=np.int64)
    for i, label in enumerate(labels):
        if label not in index:
            raise TaskError(f"label {i} is {label!r}, which is not one of the choices {choices}")
        label_index[i] = index[label]
    z = _rows(judgments, choices)  # (n, k)
    mass = np.array([j.choice_mass for j in judgments], dtype=np.float64)  # (n,)
    features = None
    if feature_layers:
        features = np.empty(
            (len(judgments), len(feature_layers), _hidden_size(judgments, feature_layers)),
            dtype=np.float32,
        )  # (n, m, H)
        for i, judgment in enumerate(judgments):
            for m, layer in enumerate(feature_layers):
                features[i, m] = judgment.features[layer]  # type: ignore[index]
    means, span = _span_features(judgments, feature_layers, span_layers)
    return LabeledScores(
        log_probabilities=z,
        choice_mass=mass,
        labels=label_index,
        features=features,
        feature_layers=tuple(feature_layers),
        span_features=means,
        span=span,
    )


def _span_features(
    judgments: Sequence[Judgment], feature_layers: Sequence[int], span_layers: Sequence[int]
) -> tuple[np.ndarray | None, ProbeSpan | None]:
    """(n, m, H) means over the items of ``span_layers`` and the tokens they cover; TaskError
    if a judgment lacks one, or some were marked and some not."""
    if not span_layers:
        return None, None
    if sorted(span_layers) != sorted(feature_layers):
        raise TaskError(
            f"span_layers {list(span_layers)} must be the feature_layers {list(feature_layers)}"
        )
    marked = {j.item_span is not None for j in judgments}
    if len(marked) > 1:
        raise TaskError("some items mark their item_span and some do not: mark all or none")
    rows = []
    for i, judgment in enumerate(judgments):
        if judgment.span_features is None or any(
            n not in judgment.span_features for n in feature_layers
        ):
            raise TaskError(f"judgment {i} carries no means for layers {list(feature_layers)}")
        rows.append([judgment.span_features[n] for n in feature_layers])
    means = np.asarray(rows, dtype=np.float32) if rows else np.zeros((0, len(feature_layers), 0))
    return means, "item" if marked == {True} else "prompt"


def _row(judgment: Judgment, choices: list[str], i: int) -> np.ndarray:
    """Judgment ``i``'s log-probabilities, (k,) in ``choices`` order; TaskError if it was made
    between other choices."""
    if sorted(judgment.choices) != sorted(choices):
        raise TaskError(
            f"judgment {i} was made between {list(judgment.choices)}, not the choices {choices}"
        )
    z = np.asarray(judgment.log_probs, dtype=np.float64)  # (k,) in the judgment's order
    if judgment.choices == choices:
        return z
    index = {c: j for j, c in enumerate(judgment.choices)}
    return z[[index[c] for c in choices]]


def _hidden_size(judgments: Sequence[Judgment], layers: Sequence[int]) -> int:
    """The width of the judgments' features; TaskError if one lacks a layer."""
    for i, judgment in enumerate(judgments):
        if judgment.features is None or any(n not in judgment.features for n in layers):
            raise TaskError(f"judgment {i} carries no features for layers {list(layers)}")
    return len(judgments[0].features[layers[0]]) if judgments else 0  # type: ignore[index]


def judge_labeled(
    engine: Engine,
    queries: Sequence[Query],
    labels: Sequence[str],
    choices: Sequence[str],
    *,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
) -> LabeledScores:
    """Judge labeled queries ``batch_size`` at a time and arrange the scores as arrays.

    The queries' ``feature_layers`` (the first query's; all must ask for the same) come back
    as ``LabeledScores.features``.

    Each batch goes through ``engine.judge_batch``, so a bad item fails the run with its
    engine error: a calibration set with an unjudgeable item is a broken calibration set.

    Parameters
    ----------
    engine : Engine
    queries : sequence of Query, length n
        Every one judged between ``choices`` (see ``labeled_queries``).
    labels : sequence of str, length n
        Each item's correct choice.
    choices : sequence of str, length k
        The column order of the result.
    batch_size : int
        Items per ``judge_batch`` call.
    progress : callable, optional
        Called with the number of items done after each batch (``tqdm.update`` fits).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if len(queries) != len(labels):
        raise TaskError(f"got {len(queries)} queries but {len(labels)} labels; pair them up")
    judgments: list[Judgment] = []
    for start in range(0, len(queries), batch_size):
        chunk = queries[start : start + batch_size]
        judged = engine.judge_batch(chunk)
        partial = [start + i for i, j in enumerate(judged) if j.unknown_mass > 0]
        if partial:
            # A fit or a measure on probabilities that were not all read would certify, or
            # qualify, numbers the model never gave.
            raise TaskError(
                f"item {partial[0]} (and {len(partial) - 1} more of {len(chunk)} in its batch) "
                f"was read only in part: up to {judged[partial[0] - start].unknown_mass:.3f} of "
                "its choices' probability was not among the served model's top next tokens; "
                "judge labeled items with every step read (read=echo, or a larger top=)"
            )
        judgments.extend(judged)
        if progress is not None:
            progress(len(chunk))
    layers = queries[0].feature_layers if queries else ()
    spans = queries[0].span_layers if queries else ()
    return scores_from_judgments(judgments, labels, choices, layers, spans)


def judge_task_items(
    engine: Engine,
    task: Task,
    items: Sequence[LabeledItem],
    *,
    choices: Sequence[str] | None = None,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
    feature_layers: Sequence[int] = (),
    span_layers: Sequence[int] = (),
    span: ProbeSpan = "item",
) -> LabeledScores:
    """``judge_labeled`` on a task's items, each prompt as ``task_prompt`` writes it; the
    columns follow ``choices`` (default: ``task.choices``). ``span_layers`` are averaged over
    each item's own text (``task_item_span``), or with ``span`` "prompt" over each prompt."""
    prompts = [task_prompt(task, item.text) for item in items]
    queries = labeled_queries(
        prompts,
        task.choices,
        feature_layers=feature_layers,
        span_layers=span_layers,
        item_spans=[task_item_span(task, item.text) for item in items]
        if span_layers and span == "item"
        else None,
    )
    labels = [item.label for item in items]
    columns = task.choices if choices is None else choices
    return judge_labeled(engine, queries, labels, columns, batch_size=batch_size, progress=progress)


def judge_task_pool(
    engine: Engine,
    task: Task,
    texts: Sequence[str],
    *,
    layer: int | None = None,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """A task's unlabelled items judged as ``judge_task_items`` judges labelled ones: their
    (n, k) log-probabilities in ``task.choices`` order and, with ``layer``, their (n, H) mean
    hidden states over each item's own text there (what a labelling queue spreads its picks
    over); None without."""
    layers = () if layer is None else (layer,)
    queries = labeled_queries(
        [task_prompt(task, text) for text in texts],
        task.choices,
        item_spans=[task_item_span(task, text) for text in texts] if layers else None,
        feature_layers=layers,
        span_layers=layers,
    )
    judgments = _judged(engine, queries, batch_size, progress)
    z = _rows(judgments, task.choices)
    if layer is None or not judgments:
        return z, None
    # An empty text has no span of its own: the mean is then over its whole prompt.
    means = [(j.span_features or {}).get(layer) for j in judgments]
    if any(m is None for m in means):
        raise TaskError(f"the engine returned no hidden states at layer {layer}")
    return z, np.asarray(means, dtype=np.float32)


def fit_labeled(
    name: str,
    scores: LabeledScores,
    choices: Sequence[str],
    provenance: Provenance,
    settings: FitSettings = DEFAULT_SETTINGS,
    **given: Unpack[_Given],
) -> FittedProfile:
    """``calibration.fit_profile`` on an engine's labelled ``scores`` (as ``judge_labeled``
    returns them, columns in ``choices`` order), imported when called: judging a labeled set
    needs no scipy or scikit-learn, only fitting does.

    A probe (the settings' ``methods`` "auto", the default, or with "probe") reads
    ``scores.features``: judge the items with
    ``feature_layers=calibration.candidate_layers(num_layers)``. ``provenance`` is the
    engine's fingerprint for the template the scores were judged with, the data's name and
    hash, and the prompt with the item left out (a task's: ``task_template``), so that a
    request to the profile sends only the item. ``given``: ``probe_split``, ``trained``.
    """
    from calibration import fit_profile

    return fit_profile(name, scores, choices, provenance, settings, **given)


def content_free_prompts(task: Task, inputs: Sequence[str] | None = None) -> list[str]:
    """The task's prompt with each content-free input where an item's text goes.

    ``inputs`` defaults to ``calibration.CONTENT_FREE_INPUTS`` ("N/A", "", "[MASK]"; Zhao et
    al. 2021).
    """
    if inputs is None:
        from calibration.maps.label_free import CONTENT_FREE_INPUTS

        inputs = CONTENT_FREE_INPUTS
    return [task_prompt(task, text) for text in inputs]


def load_prompts(path: str | Path) -> tuple[list[str], str]:
    """The prompts of a JSONL file, one ``{"prompt": "..."}`` per line, and its sha256.

    Blank lines are skipped; TaskError names the line of anything else that is not such an
    object.
    """
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise TaskError(f"cannot read prompts from {str(file)!r}: {exc}") from exc
    prompts = []
    for n, line in _jsonl_lines(data):
        try:
            row = json.loads(line)
            prompt = row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise TaskError(f"{file}:{n}: expected an object with a prompt ({exc})") from exc
        if not isinstance(prompt, str):
            raise TaskError(f"{file}:{n}: prompt must be a string, got {type(prompt).__name__}")
        prompts.append(prompt)
    return prompts, hashlib.sha256(data).hexdigest()


def judge_unlabeled(
    engine: Engine,
    prompts: Sequence[str],
    choices: Sequence[str],
    *,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
) -> np.ndarray:
    """(n, k) per-choice log-probabilities of ``prompts``, columns in ``choices`` order."""
    return _rows(_judged(engine, labeled_queries(prompts, choices), batch_size, progress), choices)


def _judged(
    engine: Engine,
    queries: Sequence[Query],
    batch_size: int,
    progress: Callable[[int], None] | None,
) -> list[Judgment]:
    """``queries`` judged ``batch_size`` at a time, ``progress`` told after each batch."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    judgments: list[Judgment] = []
    for start in range(0, len(queries), batch_size):
        chunk = queries[start : start + batch_size]
        judgments.extend(engine.judge_batch(chunk))
        if progress is not None:
            progress(len(chunk))
    return judgments


def _rows(judgments: Sequence[Judgment], choices: Sequence[str]) -> np.ndarray:
    """(n, k) the judgments' log-probabilities, columns in ``choices`` order."""
    z = np.empty((len(judgments), len(choices)))
    for i, judgment in enumerate(judgments):
        z[i] = _row(judgment, list(choices), i)
    return z


def fit_unlabeled(
    name: str,
    log_probabilities: np.ndarray,
    choices: Sequence[str],
    fingerprint: Fingerprint,
    *,
    method: str,
    source: str,
    dataset: str,
    dataset_sha256: str,
    settings: FitSettings = DEFAULT_SETTINGS,
) -> CalibrationProfile:
    """A label-free profile (``calibration.fit_label_free_profile``) for this engine.

    ``log_probabilities`` are (n, k) scores of content-free prompts (``method="contextual"``)
    or unlabeled items (``"batch"``), columns in ``choices`` order; ``source`` says which, in
    words, and is stored in the profile.
    """
    from calibration import fit_label_free_profile

    return fit_label_free_profile(
        name,
        log_probabilities,
        list(choices),
        method=method,
        source=source,
        fingerprint=fingerprint,
        dataset=dataset,
        dataset_sha256=dataset_sha256,
        settings=settings,
    )
