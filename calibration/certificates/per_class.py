"""Per-class evidence: how each choice fares, not only the accepted items pooled.

A pooled precision can hide a class: on sms_spam a rule that accepts every item is 97% precise
overall while saying nothing of how precise its ``spam`` decisions are, which is what a spam
filter's user needs. ``class_evidence`` reports, for each choice c, over n labelled items and
the gate's decisions on them:

* ``precision``: of the accepted items decided as c, the share whose label is c;
* ``recall``: of the items labelled c, the share accepted as c;
* ``coverage``: of the items labelled c, the share accepted (as anything);

each with its two-sided 95% Clopper-Pearson interval (None where there is nothing to count),
and the confusion matrices (rows: label, columns: the top choice) of every item and of the
accepted ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from calibration.certificates.certify import clopper_pearson_interval

__all__ = ["ClassEvidence", "ClassReport", "class_evidence"]


class ClassEvidence(msgspec.Struct, frozen=True, kw_only=True):
    """One choice's evidence (see the module docstring); shares are None over no items."""

    choice: str
    support: int  # items labelled with it
    accepted: int  # accepted items decided as it
    precision: float | None
    precision_interval: list[float] | None
    recall: float | None
    recall_interval: list[float] | None
    coverage: float | None
    coverage_interval: list[float] | None


class ClassReport(msgspec.Struct, frozen=True, kw_only=True):
    """Every choice's evidence, and the confusion matrices (``[label][top choice]`` counts)."""

    classes: list[ClassEvidence]
    confusion: list[list[int]]  # every item
    confusion_accepted: list[list[int]]  # the accepted items


def _share(k: int, n: int) -> tuple[float | None, list[float] | None]:
    return (k / n if n else None), clopper_pearson_interval(k, n)


def class_evidence(
    choices: Sequence[str],
    labels: npt.ArrayLike,
    best: npt.ArrayLike,
    accepted: npt.ArrayLike,
) -> ClassReport:
    """Per-class precision, recall and coverage of the accepted items, and the confusion
    matrices: ``labels`` and ``best`` (n,) are indices into ``choices``, ``accepted`` (n,)
    the gate's decisions."""
    y = np.asarray(labels, dtype=np.int64)
    top = np.asarray(best, dtype=np.int64)
    took = np.asarray(accepted, dtype=bool)
    k = len(choices)
    if not (y.shape == top.shape == took.shape and y.ndim == 1):
        raise ValueError(
            f"labels, best and accepted must be (n,) alike, got {y.shape}, {top.shape}, "
            f"{took.shape}"
        )
    for name, arr in (("labels", y), ("best", top)):
        if arr.size and (arr.min() < 0 or arr.max() >= k):
            raise ValueError(f"{name} must be indices in [0, {k}), got {arr.min()}..{arr.max()}")
    confusion = np.zeros((k, k), dtype=np.int64)
    np.add.at(confusion, (y, top), 1)
    kept = np.zeros((k, k), dtype=np.int64)
    np.add.at(kept, (y[took], top[took]), 1)
    classes = []
    for c, choice in enumerate(choices):
        support = int((y == c).sum())
        decided = int(kept[:, c].sum())
        right = int(kept[c, c])
        precision, p_int = _share(right, decided)
        recall, r_int = _share(right, support)
        coverage, c_int = _share(int(kept[c].sum()), support)
        classes.append(
            ClassEvidence(
                choice=choice,
                support=support,
                accepted=decided,
                precision=precision,
                precision_interval=p_int,
                recall=recall,
                recall_interval=r_int,
                coverage=coverage,
                coverage_interval=c_int,
            )
        )
    return ClassReport(
        classes=classes, confusion=confusion.tolist(), confusion_accepted=kept.tolist()
    )
