"""Reliability diagrams: calibration before and after, side by side, as a PNG.

A reliability diagram shows, per confidence bin, how often the top choice was right; a
calibrated judge sits on the diagonal. The histogram under it shows how many items each bin
holds, which is what says whether a gap is evidence or noise. The figure is drawn with
matplotlib's object API on an Agg canvas (no pyplot, so no global state and no GUI backend)
and written atomically, so a reader never sees a half-written file.
"""

from __future__ import annotations

import os
import pathlib
from typing import TYPE_CHECKING

import numpy as np
from matplotlib import figure
from matplotlib.backends import backend_agg

from calibration.metrics import calibration_bins, ece
from calibration.validation import check_int, check_probs_labels
from judge.atomicio import replacing

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from numpy.typing import ArrayLike

__all__ = ["reliability_diagram"]


def _draw_column(
    top: Axes, bottom: Axes, probs: ArrayLike, y: ArrayLike, n_bins: int, label: str
) -> None:
    counts, acc, conf = calibration_bins(probs, y, n_bins)
    error = ece(probs, y, n_bins)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    width = 1.0 / n_bins
    filled = counts > 0
    lefts = edges[:-1][filled]

    top.plot([0, 1], [0, 1], linestyle="--", color="0.4", linewidth=1, label="perfect")
    top.bar(
        lefts,
        acc[filled],
        width=width,
        align="edge",
        color="tab:blue",
        edgecolor="black",
        linewidth=0.5,
        label="accuracy",
    )
    # The shaded gap runs from each bin's accuracy to its mean confidence: that distance,
    # weighted by the bin's share of items, is what ECE sums.
    top.bar(
        lefts,
        conf[filled] - acc[filled],
        bottom=acc[filled],
        width=width,
        align="edge",
        color="tab:red",
        alpha=0.3,
        edgecolor="tab:red",
        hatch="//",
        linewidth=0.5,
        label="gap to confidence",
    )
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.set_ylabel("accuracy")
    top.set_title(f"{label} (n={int(counts.sum())})")
    top.legend(loc="upper left", fontsize="small", title=f"ECE = {error:.3f}")

    bottom.bar(edges[:-1], counts, width=width, align="edge", color="0.5", edgecolor="black")
    bottom.set_xlim(0, 1)
    bottom.set_xlabel("confidence (top choice)")
    bottom.set_ylabel("items")


def reliability_diagram(
    before: tuple[ArrayLike, ArrayLike],
    after: tuple[ArrayLike, ArrayLike],
    path: str | os.PathLike[str],
    *,
    n_bins: int = 15,
    title: str = "",
) -> pathlib.Path:
    """Write a before | after calibration reliability diagram to ``path`` as a PNG.

    Each column has the reliability bars (accuracy per equal-width confidence bin, the
    diagonal, the gap to the bin's mean confidence shaded, ECE in the title and legend) above
    the histogram of item counts per bin.

    Parameters
    ----------
    before, after : (probs, y) with probs of shape (n, k) and y of shape (n,)
        The same or different items; typically held-out probabilities without and with
        calibration.
    path : str or path-like
        Destination PNG; its directory must exist. Written with ``atomicio.replacing`` (a
        temporary beside it, then a rename), so it appears complete or not at all.
    n_bins : int
    title : str
        Figure title.

    Returns
    -------
    The path written, as a ``pathlib.Path``.
    """
    n_bins = check_int(n_bins, "n_bins", 1)
    columns = []
    for label, pair in (("before calibration", before), ("after calibration", after)):
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ValueError(f"{label.split()[0]} must be a (probs, y) tuple, got {pair!r}")
        columns.append((label, *check_probs_labels(*pair)))
    target = pathlib.Path(path)
    if not target.parent.is_dir():
        raise ValueError(
            f"cannot write {str(target)!r}: directory {str(target.parent)!r} is missing"
        )

    fig = figure.Figure(figsize=(10, 6), layout="constrained")
    backend_agg.FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2, sharex="col", gridspec_kw={"height_ratios": [3, 1]})
    for col, (label, probs, y) in enumerate(columns):
        _draw_column(axes[0, col], axes[1, col], probs, y, n_bins, label)
    if title:
        fig.suptitle(title)

    with replacing(target) as temp:
        fig.savefig(temp, format="png", dpi=100)
    return target
