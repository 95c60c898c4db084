"""Limits that the fitters enforce and the wire schemas state, in a module with no scipy.

``service.schemas`` (and so the client) reads them without loading the fitters.
"""

from __future__ import annotations

__all__ = ["MIN_EXAMPLES", "PROBE_SPLIT", "SPLIT", "certify_share"]

MIN_EXAMPLES = 20  # labeled examples a profile is fitted on, at least

# How a fit splits its labeled examples (``calibration.fitting.split_examples``): of every ten
# (per label, in random order), 0 fits the map, 1 sets the conformal quantile, 2 certifies the
# threshold. Three fit, two set the quantile, five certify; when a probe is among the
# candidates, five fit, one sets the quantile, four certify.
SPLIT = (0, 0, 0, 1, 1, 2, 2, 2, 2, 2)
PROBE_SPLIT = (0, 0, 0, 0, 0, 1, 2, 2, 2, 2)


def certify_share(probe: bool) -> float:
    """The share of a fit's labeled examples that certify its threshold."""
    pattern = PROBE_SPLIT if probe else SPLIT
    return pattern.count(2) / len(pattern)
