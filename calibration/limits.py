"""Limits that the fitters enforce and the wire schemas state, in a module with no scipy.

``service.schemas`` (and so the client) reads them without loading the fitters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "FEW_LABELS",
    "MIN_EXAMPLES",
    "PROBE_SPLIT",
    "SPLIT",
    "allot",
    "certify_share",
    "labels_wanted",
    "uniform_to_certify",
]

MIN_EXAMPLES = 20  # labeled examples a profile is fitted on, at least
# Below this many uniform labels, a map that shows no certifiable threshold says too little
# about whether more labels would help: the map itself is fitted on few, and their precision
# is known only to within ten points or more.
FEW_LABELS = 50

# How a fit splits its labeled examples (``calibration.fitting.split_examples``): of every ten
# (per label, in random order), 0 fits the map, 1 sets the conformal quantile, 2 certifies the
# threshold. Three fit, two set the quantile, five certify; when a probe is among the
# candidates, five fit, one sets the quantile, four certify.
SPLIT = (0, 0, 0, 1, 1, 2, 2, 2, 2, 2)
PROBE_SPLIT = (0, 0, 0, 0, 0, 1, 2, 2, 2, 2)


def certify_share(probe: bool) -> float:
    """The share of a fit's labeled examples that certify its threshold, with no taught ones."""
    pattern = PROBE_SPLIT if probe else SPLIT
    return pattern.count(2) / len(pattern)


def allot(taught: int, uniform: int, probe: bool) -> tuple[int, int, int]:
    """How many of ``uniform`` labels (a uniform sample) fit the map, set the conformal
    quantile and certify, beside ``taught`` labels that may only fit it.

    The fit split takes its pattern's share of all the labels, the taught ones first, so that
    uniform labels fit only where the taught ones fall short of it; the uniform labels left
    set the quantile and certify in the pattern's ratio. A function of the counts alone,
    fixed before any label is read, so each guarantee stays exact.
    """
    pattern = PROBE_SPLIT if probe else SPLIT
    fit, quantile, certify = (pattern.count(part) for part in range(3))
    wanted = round((taught + uniform) * fit / len(pattern))
    fitting = min(uniform, max(0, wanted - taught))
    rest = uniform - fitting
    conformal = round(rest * quantile / (quantile + certify))
    return fitting, conformal, rest - conformal


def uniform_to_certify(
    certify: int,
    taught: int,
    probe: bool,
    *,
    given: int = 0,
    alternating: bool = False,
    limit: int = 10**7,
) -> int | None:
    """The fewest uniform labels that ``allot`` gives ``certify`` certify items beside
    ``taught`` ones; None past ``limit``. ``alternating``: each uniform label beyond the
    ``given`` ones comes with a taught one (a queue that offers both streams in turn)."""

    def certified(uniform: int) -> int:
        more = max(0, uniform - given) if alternating else 0
        return allot(taught + more, uniform, probe)[2]

    if certified(limit) < certify:
        return None
    low, high = 0, limit
    while low < high:  # the certify count grows with the uniform labels
        mid = (low + high) // 2
        if certified(mid) >= certify:
            high = mid
        else:
            low = mid + 1
    return low


def labels_wanted(taught: int, probe: bool) -> dict[str, Any]:
    """``labels_to_certify``'s ``certify_share`` and ``labels_for`` for a fit beside
    ``taught`` fit-only labels (kept as they are): the uniform labels that give it a number of
    certify items under ``allot``."""
    labels_for: Callable[[int], int | None] = lambda certify: uniform_to_certify(  # noqa: E731
        certify, taught, probe
    )
    return {"certify_share": certify_share(probe), "labels_for": labels_for}
