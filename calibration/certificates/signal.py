"""Does the judge beat the label prior? A calibrated judge can be a prior predictor in disguise.

When the model knows nothing about a task, the best calibration map is the one that ignores
it: the temperature runs to its upper bound (softmax(z / 100) is nearly uniform) and a bias
supplies the class frequencies, so the "judge" answers the majority label with a
well-calibrated confidence. Its ECE is excellent and its decisions are worthless. So every
profile and every evaluation compares the calibrated judge with the prior predictor, which
gives every item the class frequencies of the data the map was fitted on, on items neither
was fitted on:

* accuracy gain (judge - prior) and NLL gain (prior - judge, in nats per item), each with a
  paired bootstrap 95% percentile interval over the items;
* AUROC of the judge's confidence for its own correctness: 0.5 means the confidence does not
  rank right answers above wrong ones (None when every answer is right, or every one wrong);
* whether the fitted temperature sits at a bound of its search range (within 1%).

The judge ``beats_prior`` when either gain's interval lies above 0. ``verdict`` says so in
words, and says plainly when it does not.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np
import numpy.typing as npt
from msgspec import Meta

from calibration.errors import RuleError
from calibration.maps.map_types import T_MAX, T_MIN
from calibration.metrics import Interval
from calibration.validation import check_int, check_probs_labels

__all__ = ["SignalReport", "auroc", "label_prior", "signal_report"]

_NLL_CLIP = 1e-12
_AT_BOUND = 0.01  # relative distance from T_MIN or T_MAX that counts as "at the bound"


class SignalReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The calibrated judge against the label prior, on held-out items."""

    n: Annotated[int, Meta(ge=1)]  # held-out items compared on
    beats_prior: bool  # an accuracy or NLL gain whose 95% interval lies above 0
    verdict: str  # the comparison in words
    prior: list[float]  # the prior predictor: class frequencies of the fit data, choice order
    accuracy: float  # the calibrated judge's
    prior_accuracy: float  # always answering the most frequent class of the fit data
    nll: float  # the calibrated judge's
    prior_nll: float
    accuracy_gain: Interval  # judge - prior
    nll_gain: Interval  # prior - judge: positive when the judge's probabilities are better
    auroc: (
        Annotated[float, Meta(ge=0.0, le=1.0)] | None
    )  # of the confidence for correctness; None when all right or all wrong
    temperature: float
    temperature_at_bound: bool  # within 1% of the search range's ends (T_MIN, T_MAX)

    def __post_init__(self) -> None:
        numbers = [self.accuracy, self.prior_accuracy, self.nll, self.prior_nll, self.temperature]
        if self.n < 1 or not all(np.isfinite(numbers)) or not np.all(np.isfinite(self.prior)):
            raise RuleError("signal: n must be >= 1 and every number finite")
        if self.auroc is not None and not 0 <= self.auroc <= 1:
            raise RuleError(f"signal.auroc must be in [0, 1], got {self.auroc!r}")


def label_prior(labels: npt.ArrayLike, k: int) -> npt.NDArray[np.float64]:
    """Class frequencies of ``labels`` over k classes, with add-1/2 smoothing.

    The smoothing (Jeffreys) keeps a class absent from the fit data from getting probability 0,
    which would make the prior's NLL infinite on the first held-out item of that class.
    """
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=k).astype(np.float64)
    return (counts + 0.5) / (counts.sum() + 0.5 * k)


def auroc(scores: npt.ArrayLike, positive: npt.ArrayLike) -> float | None:
    """Area under the ROC curve of ``scores`` for ``positive`` (Mann-Whitney U / (n1 n0)).

    Ties count one half. None when every item is positive or every one negative.
    """
    s = np.asarray(scores, dtype=np.float64)
    pos = np.asarray(positive, dtype=bool)
    n1, n0 = int(pos.sum()), int((~pos).sum())
    if n1 == 0 or n0 == 0:
        return None
    from scipy import stats  # here: scipy is a server dependency, not the client's

    ranks = stats.rankdata(s)  # average ranks for ties
    u = float(ranks[pos].sum()) - n1 * (n1 + 1) / 2
    return u / (n1 * n0)


def _bounded_interval(value: float, samples: npt.NDArray[np.float64]) -> Interval:
    low, high = np.percentile(samples, [2.5, 97.5])
    return Interval(value=value, low=min(float(low), value), high=max(float(high), value))


def signal_report(
    probabilities: npt.ArrayLike,
    labels: npt.ArrayLike,
    prior: npt.ArrayLike,
    temperature: float,
    choices: list[str],
    *,
    n_bootstrap: int = 1000,
    seed: int = 0,
) -> SignalReport:
    """Compare calibrated ``probabilities`` (n, k) with the ``prior`` (k,) on labels (n,).

    ``probabilities`` and ``labels`` must be items neither the map nor the prior was fitted
    on; ``temperature`` is the map's; ``choices`` names the columns, for the verdict.
    """
    p, y = check_probs_labels(probabilities, labels)
    n, k = p.shape
    n_bootstrap = check_int(n_bootstrap, "n_bootstrap", 1)
    q = np.asarray(prior, dtype=np.float64)
    if q.shape != (k,) or not np.all(np.isfinite(q)) or np.any(q <= 0):
        raise ValueError(f"prior must be {k} finite positive numbers, got {prior!r}")
    q = q / q.sum()
    rows = np.arange(n)
    hit = (p.argmax(axis=1) == y).astype(np.float64)  # (n,)
    prior_hit = (y == int(q.argmax())).astype(np.float64)  # (n,)
    item_nll = -np.log(np.clip(p[rows, y], _NLL_CLIP, 1.0))  # (n,)
    prior_nll = -np.log(q[y])  # (n,)
    acc_diff = hit - prior_hit
    nll_diff = prior_nll - item_nll
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_bootstrap, n))  # paired: the same items for both
    accuracy_gain = _bounded_interval(float(acc_diff.mean()), acc_diff[idx].mean(axis=1))
    nll_gain = _bounded_interval(float(nll_diff.mean()), nll_diff[idx].mean(axis=1))
    area = auroc(p.max(axis=1), hit.astype(bool))
    at_bound = bool(
        temperature >= T_MAX * (1 - _AT_BOUND) or temperature <= T_MIN * (1 + _AT_BOUND)
    )
    beats = bool(accuracy_gain.low > 0 or nll_gain.low > 0)
    majority = choices[int(q.argmax())]
    gains = (
        f"accuracy {hit.mean():.3f} vs {prior_hit.mean():.3f} for always answering "
        f"{majority!r} (gain {accuracy_gain.value:+.3f}, 95% CI [{accuracy_gain.low:+.3f}, "
        f"{accuracy_gain.high:+.3f}]); NLL {item_nll.mean():.4f} vs {prior_nll.mean():.4f} for "
        f"the label prior (gain {nll_gain.value:+.4f} nats/item, 95% CI [{nll_gain.low:+.4f}, "
        f"{nll_gain.high:+.4f}]); AUROC of confidence for correctness "
        + ("n/a" if area is None else f"{area:.3f}")
        + f"; {n} held-out items"
    )
    if beats:
        verdict = f"the judge beats the label prior: {gains}"
    else:
        verdict = (
            f"NO SIGNAL: the calibrated judge does not beat the label prior on held-out items; "
            f"its decisions are no better than always answering {majority!r} ({gains})"
        )
    if at_bound:
        edge = "upper" if temperature >= 1 else "lower"
        verdict += f". The fitted temperature {temperature:.4g} sits at its {edge} bound" + (
            ": the map flattened the model's scores, so what is left is mostly the "
            "bias, i.e. the label prior"
            if edge == "upper"
            else ": the map sharpened the scores as far as it could"
        )
    return SignalReport(
        n=int(n),
        beats_prior=beats,
        verdict=verdict,
        prior=[float(v) for v in q],
        accuracy=float(hit.mean()),
        prior_accuracy=float(prior_hit.mean()),
        nll=float(item_nll.mean()),
        prior_nll=float(prior_nll.mean()),
        accuracy_gain=accuracy_gain,
        nll_gain=nll_gain,
        auroc=area,
        temperature=float(temperature),
        temperature_at_bound=at_bound,
    )
