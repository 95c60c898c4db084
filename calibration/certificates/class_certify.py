"""A guarantee for each class: a threshold certified per predicted class, all at once.

The pooled certificate (``calibration.certificates.certify``) bounds the precision of every accepted item
together. A rare class can hide in it: on sms_spam a rule that accepts every item is 97%
precise overall and says nothing of its ``spam`` decisions, which are what a spam filter's
user acts on. ``certify_per_class`` certifies one threshold t_c for each class c, on the
certify split's items whose top choice is c, so that the accepted decisions of each class are
at least the target precise.

Why it holds. Fix the map and the other gates (fitted on earlier splits). The certify items
are i.i.d.; those whose top choice is c are, given how many there are, i.i.d. draws from the
items decided as c, and the decision "confidence >= t" on them is what the served rule applies
to that class. So ``select_threshold`` on them, at level delta_c, returns a t_c whose precision
over decisions of c is >= target with probability >= 1 - delta_c (Learn then Test, Angelopoulos
et al. 2021: the same fixed-sequence argument, conditioned on the class). With delta_c = delta
/ K for K classes, the union bound gives: with probability >= 1 - delta, every class's
certified threshold holds at once (Bonferroni across classes; the classes' tests share data
only through the fixed map, so no independence is needed). ``tests/test_gating_simulation.py``
shows the family-wise failure rate below delta on synthetic judges.

A class with too few decided items, or too little precision, certifies nothing: its decisions
escalate (``no_certified_threshold``), they are not pooled into the others. Its result's reason
says about how many labels in all would likely certify it (``labels_to_certify``, on its own
certify decisions, with their share of the labels).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from calibration.certificates.certify import (
    ThresholdResult,
    select_threshold,
    sequence_start,
    untested,
)
from calibration.certificates.recertify import labels_to_certify

__all__ = ["certify_per_class"]


def certify_per_class(
    confidence: npt.NDArray[np.float64],
    best: npt.NDArray[np.int64],
    correct: npt.NDArray[np.bool_],
    certify_idx: npt.NDArray[np.int64],
    independent: tuple[npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.bool_]]
    | None,
    choices: Sequence[str],
    *,
    target_precision: float,
    delta: float,
    procedure: str,
) -> list[ThresholdResult]:
    """One certified threshold (or a reason for none) per class, in ``choices`` order.

    ``confidence`` (n,) is the top choice's calibrated confidence, 0 where another gate
    escalates; ``best`` (n,) the top choice; ``correct`` (n,) whether it is the label. The
    thresholds are certified on ``certify_idx``'s items decided as each class, at delta / K
    each; ``independent`` (the confidence, top choice and correctness of items the certify
    split does not depend on, or None) chooses where each class's fixed sequence starts: the
    threshold whose test is most likely to pass on that class's share of the certify items
    (``sequence_start`` with ``correct``; a class has few items, and a start judged by the
    accepted count alone begins too low to pass).
    """
    share = delta / len(choices)
    results = []
    for c, choice in enumerate(choices):
        mine = certify_idx[best[certify_idx] == c]
        if mine.shape[0] == 0:
            results.append(_none_decided(choice, target_precision, share, procedure))
            continue
        start = None
        if procedure == "fixed_sequence" and independent is not None:
            theirs = independent[1] == c
            if theirs.any():
                start = sequence_start(
                    independent[0][theirs],
                    int(mine.shape[0]),
                    target_precision=target_precision,
                    delta=share,
                    correct=independent[2][theirs],
                )
        result = select_threshold(
            confidence[mine],
            correct[mine],
            target_precision=target_precision,
            delta=share,
            procedure=procedure,
            start=start,
        )
        if result.threshold is None:
            # About how many labels would certify it: this class's certify decisions are
            # ``mine`` of the ``confidence.shape[0]`` labelled items, so that is their share.
            needed = labels_to_certify(
                confidence[mine],
                correct[mine],
                target_precision=target_precision,
                delta=share,
                certify_share=mine.shape[0] / confidence.shape[0],
                given=int(confidence.shape[0]),
            )
            reason = (
                f"class {choice!r} ({int(mine.shape[0])} certify items decided as it): "
                f"{result.reason}; labels needed: {needed.reason}"
            )
            result = msgspec.structs.replace(result, reason=reason)
        results.append(result)
    return results


def _none_decided(
    choice: str, target_precision: float, delta: float, procedure: str
) -> ThresholdResult:
    """The result for a class no certify item was decided as: nothing to test."""
    return untested(
        target_precision=target_precision,
        delta=delta,
        procedure=procedure,
        method="nothing tested",
        reason=f"class {choice!r}: no certify item was decided as it, so nothing vouches for "
        "its decisions",
    )
