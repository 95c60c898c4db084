"""Judge a labeled set, then fit a calibration profile on it.

The two halves of "calibrate on my data", shared by ``judge calibrate``, the service's
``POST /profiles/{name}/fit`` and the calibration benchmark, so all three fit the same way:

* ``judge_labeled`` runs an engine over labeled prompts in batches and keeps, per item, the
  per-choice log-probabilities in one fixed choice order, the choice mass and the label index;
* ``fit_labeled`` hands those arrays, with the engine's fingerprint, to
  ``calibration.fit_profile``.

Without labels, ``judge_unlabeled`` judges prompts alone (content-free ones from
``content_free_prompts``, a task's texts, or a JSONL file read by ``load_prompts``) and
``fit_unlabeled`` fits a label-free prior correction (``calibration.fit_label_free_profile``).

The arrays travel as ``LabeledScores``, plain numpy data that can be cached on disk and
refitted without the model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack

import msgspec
import numpy as np

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
from calibration.template import PromptTemplate
from judge import Engine, Fingerprint, Judgment, Query
from judge.judgments import QueryTemplate

if TYPE_CHECKING:
    from calibration import CalibrationProfile
    from calibration.certificates.recertify import Recertification
    from calibration.fitting import TrainedHead
    from calibration.policy import Gates


class _Given(TypedDict, total=False):
    """What ``fit_labeled`` passes on to ``fit_profile`` as given."""

    probe_split: bool | None
    recertification: Recertification | None
    trained: TrainedHead | None


__all__ = [
    "LabeledScores",
    "content_free_prompts",
    "fit_labeled",
    "fit_unlabeled",
    "gates_on_scores",
    "judge_labeled",
    "judge_task_items",
    "judge_task_pool",
    "judge_unlabeled",
    "labeled_queries",
    "load_prompts",
    "scores_from_judgments",
]


@dataclass(frozen=True)
class LabeledScores:
    """An engine's scores on n labeled items with k choices, in one fixed choice order.

    Attributes
    ----------
    log_probabilities : np.ndarray, shape (n, k)
        log P(choice) per item; column j is the j-th choice of the order they were made in.
    choice_mass : np.ndarray, shape (n,)
        The choices' share of the model's full next-token distribution, per item.
    labels : np.ndarray, shape (n,), int64
        The index of each item's correct choice.
    features : np.ndarray, shape (n, m, H), float32, optional
        Each item's hidden state at the decision point for each of ``feature_layers`` (m of
        them); None when none were asked for.
    feature_layers : tuple of int
        The layers of ``features``, in its order.
    span_features : np.ndarray, shape (n, m, H), float32, optional
        The same layers' hidden states averaged over each item's tokens; None when not asked.
    span : "item" or "prompt", optional
        Over which tokens ``span_features`` were averaged: the item marked in each prompt
        (``Query.item_span``), or the whole prompt. Set exactly with ``span_features``.
    """

    log_probabilities: np.ndarray
    choice_mass: np.ndarray
    labels: np.ndarray
    features: np.ndarray | None = None
    feature_layers: tuple[int, ...] = ()
    span_features: np.ndarray | None = None
    span: ProbeSpan | None = None

    def __post_init__(self) -> None:
        z = np.asarray(self.log_probabilities, dtype=np.float64)
        mass = np.asarray(self.choice_mass, dtype=np.float64)
        labels = np.asarray(self.labels)
        if z.ndim != 2 or z.shape[1] < 2:
            raise ValueError(f"log_probabilities must have shape (n, k) with k >= 2, got {z.shape}")
        n, k = z.shape
        if mass.shape != (n,):
            raise ValueError(f"choice_mass must have shape ({n},), got {mass.shape}")
        if labels.shape != (n,):
            raise ValueError(f"labels must have shape ({n},), got {labels.shape}")
        if n and not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"labels must be choice indices (integers), got {labels.dtype}")
        if n and (labels.min() < 0 or labels.max() >= k):
            raise ValueError(
                f"labels must be indices in [0, {k}), got {labels.min()}..{labels.max()}"
            )
        if self.features is not None:
            f = np.asarray(self.features, dtype=np.float32)
            if f.ndim != 3 or f.shape[:2] != (n, len(self.feature_layers)):
                raise ValueError(
                    f"features must have shape ({n}, {len(self.feature_layers)}, H) for layers "
                    f"{list(self.feature_layers)}, got {f.shape}"
                )
            object.__setattr__(self, "features", f)
        elif self.feature_layers:
            raise ValueError(f"feature_layers {list(self.feature_layers)} given without features")
        if self.span_features is not None:
            means = np.asarray(self.span_features, dtype=np.float32)
            if self.features is None or means.shape != np.shape(self.features):
                raise ValueError(
                    f"span_features must have the shape of features, got {means.shape}"
                )
            object.__setattr__(self, "span_features", means)
        if (self.span is None) != (self.span_features is None):
            raise ValueError("span names the tokens of span_features: give both or neither")
        object.__setattr__(self, "feature_layers", tuple(int(x) for x in self.feature_layers))
        # Normalised copies: what is stored is what was checked.
        object.__setattr__(self, "log_probabilities", z)
        object.__setattr__(self, "choice_mass", mass)
        object.__setattr__(self, "labels", labels.astype(np.int64))

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def rows(self, index: np.ndarray) -> LabeledScores:
        """These scores of the items ``index`` selects (indices or a mask), every array cut
        alike."""
        return LabeledScores(
            log_probabilities=self.log_probabilities[index],
            choice_mass=self.choice_mass[index],
            labels=self.labels[index],
            features=None if self.features is None else self.features[index],
            feature_layers=self.feature_layers,
            span_features=None if self.span_features is None else self.span_features[index],
            span=self.span,
        )

    def features_of(self, layers: Sequence[int]) -> np.ndarray | None:
        """(n, len(layers), H) features of ``layers``, in that order (a probe profile's
        ``feature_layers``); None when ``layers`` is empty."""
        carried = f"features of layers {list(self.feature_layers)}, not of {list(layers)}"
        return self._of_layers(self.features, layers, carried)

    def span_features_of(self, layers: Sequence[int]) -> np.ndarray | None:
        """(n, len(layers), H) means over the items of ``layers`` (a probe profile's
        ``span_layers``); None when ``layers`` is empty."""
        carried = f"no means over the items of layers {list(layers)}: judge them with span_layers"
        return self._of_layers(self.span_features, layers, carried)

    def _of_layers(
        self, values: np.ndarray | None, layers: Sequence[int], carried: str
    ) -> np.ndarray | None:
        """``values`` (n, len(feature_layers), H) of ``layers``, in that order; a TaskError
        saying what these scores carry where they lack one."""
        if not layers:
            return None
        if values is None or any(n not in self.feature_layers for n in layers):
            raise TaskError(f"these scores carry {carried}")
        return values[:, [self.feature_layers.index(n) for n in layers], :]


def gates_on_scores(profile: CalibrationProfile, scores: LabeledScores) -> Gates:
    """The gates a gate on ``profile`` serves on the items of ``scores``, as arrays
    (``calibration.fitting.served_gates``, with the features its map reads)."""
    from calibration.fitting import served_gates  # the fitters load scipy: here, not above

    _, gates = served_gates(
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
    fingerprint: Fingerprint,
    *,
    dataset: str,
    dataset_sha256: str,
    settings: FitSettings = DEFAULT_SETTINGS,
    template: PromptTemplate | None = None,
    out_of_sample: list[np.ndarray] | None = None,
    fit_only: np.ndarray | None = None,
    **given: Unpack[_Given],
) -> CalibrationProfile:
    """Fit a calibration profile on ``scores``, for the engine that ``fingerprint`` describes.

    A probe (the settings' ``methods`` "auto", the default, or with "probe") reads
    ``scores.features``: judge the items with
    ``feature_layers=calibration.candidate_layers(num_layers)``.

    Parameters
    ----------
    name : str
        The profile's name.
    scores : LabeledScores
        Columns in ``choices`` order (as ``judge_labeled`` returns them).
    choices : sequence of str
    fingerprint : Fingerprint
        ``engine.fingerprint(...)`` for the template the scores were judged with.
    dataset, dataset_sha256 : str
        What the scores were computed on, recorded in the profile.
    settings : FitSettings
        What to certify and how (``calibration.fit_settings``); a score task's ``values`` (a
        task's own) and std bound go there too.
    template : PromptTemplate, optional
        The prompt the scores were judged on, with the item left out (a task's:
        ``task_template``): the profile keeps it, so that a request sends only the item.
    out_of_sample : list, optional
        Gets the items' calibrated probabilities as the map would judge new ones
        (``fit_profile``).
    fit_only : array of bool, optional
        The items chosen to teach (``taught_items``): they fit the map, never certify it.
    **given
        What ``fit_profile`` takes beside the scores: ``probe_split``, ``recertification`` (a
        refit's look), ``trained`` (a head trained with adapters).
    """
    # Imported here: judging a labeled set needs no scipy or scikit-learn, only fitting does.
    from calibration import fit_profile

    if scores.log_probabilities.shape[1] != len(choices):
        raise ValueError(
            f"scores have {scores.log_probabilities.shape[1]} columns but there are "
            f"{len(choices)} choices"
        )
    profile = fit_profile(
        name,
        scores.log_probabilities,
        scores.labels,
        list(choices),
        fingerprint=fingerprint,
        dataset=dataset,
        dataset_sha256=dataset_sha256,
        settings=settings,
        choice_mass=scores.choice_mass,
        features=scores.features,
        feature_layers=scores.feature_layers,
        span_features=scores.span_features,
        span=scores.span,
        out_of_sample=out_of_sample,
        fit_only=fit_only,
        **given,
    )
    return profile if template is None else msgspec.structs.replace(profile, template=template)


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
