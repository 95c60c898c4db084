"""What a fit is given: the labelled scores, and where they came from.

``fit_profile(name, scores, choices, provenance, settings)`` reads three records instead of a
score of keywords: ``LabeledScores`` (the arrays: log-probabilities, labels, choice mass, the
hidden states a probe reads, which labels were taught), ``Provenance`` (what the profile
records about their origin: the engine's fingerprint, the data's name and hash, the prompt,
the look of a lineage) and ``calibration.fit_settings.FitSettings`` (what to certify and how).

A leaf, like ``fit_settings``: it imports neither scipy nor scikit-learn, so an engine's scores
are gathered (``calibration.tasks.judge_labeled``), kept and cut without loading the fitter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from calibration.certificates.recertify import Recertification
from calibration.errors import ProfileMismatchError
from calibration.maps.map_types import ProbeSpan
from calibration.template import PromptTemplate
from judge.fingerprint import Fingerprint

__all__ = ["LabeledScores", "Provenance"]


@dataclass(frozen=True)
class LabeledScores:
    """An engine's scores on n labeled items with k choices, in one fixed choice order.

    Attributes
    ----------
    log_probabilities : np.ndarray, shape (n, k)
        log P(choice) per item; column j is the j-th choice of the order they were made in.
    choice_mass : np.ndarray, shape (n,)
        The choices' share of the model's full next-token distribution, per item (ones where
        it was not measured: nothing is then known against the choices).
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
    fit_only : np.ndarray, shape (n,), bool, optional
        The items whose labels were chosen to teach (a labelling queue's teach stream,
        ``calibration.tasks.taught_items``) rather than drawn at random: they may fit a map,
        never certify it. None: every label is a uniform sample.
    """

    log_probabilities: np.ndarray
    choice_mass: np.ndarray
    labels: np.ndarray
    features: np.ndarray | None = None
    feature_layers: tuple[int, ...] = ()
    span_features: np.ndarray | None = None
    span: ProbeSpan | None = None
    fit_only: np.ndarray | None = None

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
        if self.fit_only is not None:
            only = np.asarray(self.fit_only)
            if only.shape != (n,) or only.dtype != np.bool_:
                raise ValueError(f"fit_only must be {n} booleans, got {only.shape} {only.dtype}")
            object.__setattr__(self, "fit_only", only)
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
            fit_only=None if self.fit_only is None else self.fit_only[index],
        )

    def features_of(self, layers: Sequence[int]) -> np.ndarray | None:
        """(n, len(layers), H) features of ``layers``, in that order (a probe profile's
        ``feature_layers``); None when ``layers`` is empty."""
        carried = f"features of layers {list(self.feature_layers)}, not of {list(layers)}"
        return self._of_layers(self.features, layers, carried, "feature_layers")

    def span_features_of(self, layers: Sequence[int]) -> np.ndarray | None:
        """(n, len(layers), H) means over the items of ``layers`` (a probe profile's
        ``span_layers``); None when ``layers`` is empty."""
        carried = f"no means over the items of layers {list(layers)}: judge them with span_layers"
        return self._of_layers(self.span_features, layers, carried, "span_layers")

    def _of_layers(
        self, values: np.ndarray | None, layers: Sequence[int], carried: str, field: str
    ) -> np.ndarray | None:
        """``values`` (n, len(feature_layers), H) of ``layers``, in that order; a
        ProfileMismatchError (``field``: what the profile reads) saying what these scores carry
        where they lack one."""
        if not layers:
            return None
        if values is None or any(n not in self.feature_layers for n in layers):
            raise ProfileMismatchError(field, f"these scores carry {carried}")
        return values[:, [self.feature_layers.index(n) for n in layers], :]


class Provenance(msgspec.Struct, frozen=True, kw_only=True):
    """Where a profile's labelled scores came from: what ``fit_profile`` records in the
    profile beside what it fits.

    fingerprint
        The engine's (``judge.fingerprint(...)`` for the template the scores were judged
        with): a gate refuses the profile on another model, template or prompt.
    dataset, dataset_sha256
        What the scores were computed on, in words, and a hash of those bytes.
    template
        The prompt the scores were judged on, with the item left out (a task's:
        ``calibration.tasks.task_template``), so that a request sends only the item; None
        where the prompts were whole.
    recertification
        A refit of a lineage (from a decision log, or a labelling queue's next look): the look
        it is (``calibration.certificates.recertify``). The settings' delta must then be its
        share, ``recertification.spent``. None: a first fit.
    """

    fingerprint: Fingerprint
    dataset: str
    dataset_sha256: str
    template: PromptTemplate | None = None
    recertification: Recertification | None = None
