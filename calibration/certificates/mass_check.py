"""The choice-mass check, chosen from the labels where it helps.

A judgment whose choices hold little of the model's next-token probability (the model wanted to
say something else: on sms_spam ``spam`` splits into ``sp`` + ``am`` after the prefix, and the
choices' first tokens hold 0.5% of it) is one to distrust, and the check ``low_choice_mass``
escalates it. Which minimum, if any, is a choice made on the labels: ``choose_min_choice_mass``
tries the choice mass's 5%, 10%, 20% and 30% quantiles (a check that escalates up to that share
of items) against no check, and keeps the one under which the most coverage certifies on the
fit and conformal splits, if it beats no check by ``MARGIN``; otherwise no check, and the
profile's note says so.

Why the certificate still holds: the minimum is a function of the fit and conformal splits
only, so, as for the map and the conformal quantile, the certify split's items are fresh draws
given it, and the threshold certified there with that check in the rule (``fit_rule``) covers the
rule as served. The estimate itself reads the map's own probabilities on its fit items, which
flatter it (a probe's most); that can only make the choice worse, not the certificate wrong.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from calibration.certificates.certify import select_threshold

__all__ = ["MARGIN", "QUANTILES", "choose_min_choice_mass"]

QUANTILES = (0.05, 0.1, 0.2, 0.3)
# The coverage a check must add, on the independent items, to be worth the escalations it makes.
MARGIN = 0.02


def _certified_coverage(
    confidence: npt.NDArray[np.float64],
    correct: npt.NDArray[np.bool_],
    target_precision: float,
    delta: float,
) -> float:
    """The coverage certified on these items (Bonferroni over the grid, so that no start is
    needed); 0 where nothing certifies."""
    result = select_threshold(
        confidence,
        correct,
        target_precision=target_precision,
        delta=delta,
        procedure="bonferroni",
    )
    return result.coverage if result.threshold is not None else 0.0


def choose_min_choice_mass(
    confidence: npt.NDArray[np.float64],
    correct: npt.NDArray[np.bool_],
    mass: npt.NDArray[np.float64],
    *,
    target_precision: float,
    delta: float,
) -> tuple[float, str]:
    """The minimum choice mass for the served rule, and a sentence for the profile's note.

    ``confidence`` (n,) is each independent item's confidence under every other check (0 where
    one escalates it), ``correct`` (n,) whether its top choice is the label, ``mass`` (n,) its
    choice mass.
    """
    base = _certified_coverage(confidence, correct, target_precision, delta)
    best, best_coverage = 0.0, base
    tried = []
    for q in QUANTILES:
        m = float(np.quantile(mass, q))
        if m <= 0.0 or m in tried:
            continue
        tried.append(m)
        gated = np.where(mass >= m, confidence, 0.0)
        coverage = _certified_coverage(gated, correct, target_precision, delta)
        if coverage > best_coverage + MARGIN:
            best, best_coverage = m, coverage
    n = int(mass.shape[0])
    if best > 0.0:
        return best, (
            f"; choice-mass check: {best:.4g}, chosen on the {n} fit and conformal items: it "
            f"raised the coverage certified there from {base:.3f} to {best_coverage:.3f}"
        )
    shown = ", ".join(f"{m:.3g}" for m in tried) or "none (the mass does not vary)"
    return 0.0, (
        f"; choice-mass check: none, since no minimum at the mass's 5-30% quantiles ({shown}) "
        f"raised the coverage certified on the {n} fit and conformal items by {MARGIN} or more "
        f"(without one: {base:.3f})"
    )
