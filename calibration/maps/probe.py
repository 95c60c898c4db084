"""A learned head: multinomial logistic regression on the pass's own hidden state.

Temperature and bias can only rescale the choice logits; when the model's logits carry little
signal (the 135M default model's sst2 accuracy is 0.64), no rescaling opens a gate. The hidden
state at the decision point, from the very pass that scored the choices, often carries much
more: a linear head on a middle layer of the default model reaches 0.84 on sst2. ``Probe`` is
that head: L2-regularised multinomial logistic regression (scikit-learn's, lbfgs) on the
standardised hidden state of one layer plus the choices' log-probabilities, with the
standardisation folded into the stored weights so that serving is one matrix product.

The same pass also gives the mean of the hidden states over the item's own tokens
(``Query.span_layers``): where the fitter is given those too, the probe may read the mean
instead of the decision point's state, or both (``Probe.reads``). On the shared tasks the mean
lifted test accuracy past a TF-IDF classifier on every set with signal
(``benchmarks/bench_span_features.py``).

The layer, what it reads and the regularisation are chosen by cross-validated NLL on the items
it is fitted on, and nothing else (``fit_probe``); the certificate's items are never seen (see
``calibration.fitting``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from calibration.errors import FitError
from calibration.maps.map_types import (
    MAX_PROBE_WEIGHTS,
    CalibrationMap,
    Probe,
    ProbeReads,
    ProbeSpan,
    _log_softmax,
)
from calibration.validation import _FloatArray, _IntArray, check_labels, check_logits

__all__ = [
    "MIN_PROBE_EXAMPLES",
    "PROBE_CS",
    "ProbeFit",
    "candidate_layers",
    "check_features",
    "fit_probe",
    "fit_probe_weights",
    "map_features",
    "probe_input",
    "probe_weights",
]


# Where the decision is read, as fractions of the model's depth. In small decoders the middle
# and upper-middle layers carry the most linearly decodable task signal (measured with the
# default model: layer 20 of 30 beat 10 and 30 on sst2), so the search spans the upper two
# thirds and the last layer.
_DEPTHS = (1 / 3, 1 / 2, 2 / 3, 5 / 6, 1.0)

# Inverse regularisation strengths, on standardised features. With a few hundred items and
# hundreds of features the useful range is strong regularisation; the largest value lets a
# clean, separable task fit sharply.
PROBE_CS = (0.001, 0.01, 0.1, 1.0)

# Fewer labeled examples than this and a probe is not tried. The probe is fitted on half of
# them (see calibration.fitting), five-fold cross-validated, so each fold trains on 40 items:
# below that a few hundred weights are chosen on noise. At 100 the probe already pays with the
# default model (benchmarks/RESULTS.md, "What N labels buy"): the cross-validation chose it over
# the scalar maps in 11 of 12 draws of 100 labels (sst2, sms_spam, ag_news, trec), with test
# accuracy 0.69, 0.94, 0.60 and 0.75 against 0.63, 0.88, 0.36 and 0.36 for the scalar maps
# fitted on all 500 (trec: 200).
MIN_PROBE_EXAMPLES = 100


def candidate_layers(num_layers: int) -> tuple[int, ...]:
    """The layers a probe is chosen among, for a model with ``num_layers`` blocks."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    return tuple(sorted({max(1, round(num_layers * f)) for f in _DEPTHS}))


def probe_weights(choices: int, hidden_size: int) -> int:
    """The weights a probe on one layer holds: a row per choice of the layer's hidden state
    and the choices' log-probabilities (``MAX_PROBE_WEIGHTS`` bounds it)."""
    return choices * (hidden_size + choices)


def check_features(
    features: npt.ArrayLike, n: int, layers: Sequence[int], name: str = "features"
) -> npt.NDArray[np.float32]:
    """``features`` as a finite (n, m, H) float32 array for the m ``layers``, or a ValueError."""
    arr = np.asarray(features, dtype=np.float32)
    if arr.ndim != 3 or arr.shape[0] != n or arr.shape[1] != len(layers) or arr.shape[2] < 1:
        raise ValueError(
            f"{name} must have shape ({n}, {len(layers)}, H) for layers {list(layers)}, "
            f"got {arr.shape}"
        )
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite numbers")
    return arr


def map_features(
    calibration_map: CalibrationMap,
    features: npt.NDArray[np.float32] | None,
    feature_layers: Sequence[int],
    span_features: npt.NDArray[np.float32] | None = None,
) -> _FloatArray | None:
    """The (n, slots * H) input a probe map reads, cut from (n, M, H) features of
    ``feature_layers`` (the decision point's states) and ``span_features`` (the means over
    the item, of the same layers); None for any other map."""
    if not isinstance(calibration_map, Probe):
        return None
    return probe_input(
        calibration_map.reads, calibration_map.layers, features, span_features, feature_layers
    )


def probe_input(
    reads: ProbeReads,
    layers: Sequence[int],
    features: npt.NDArray[np.float32] | None,
    span_features: npt.NDArray[np.float32] | None,
    feature_layers: Sequence[int],
) -> _FloatArray:
    """(n, slots * H): what a probe that ``reads`` ``layers`` takes in, in its order (the
    points of every layer, then the means), from (n, M, H) arrays of ``feature_layers``."""
    index = [list(feature_layers).index(n) for n in layers]
    parts = []
    for kind, arr in (("point", features), ("mean", span_features)):
        if kind not in reads.split("+"):
            continue
        if arr is None:
            what = "hidden states" if kind == "point" else "means over the item"
            raise ValueError(f"the probe reads the {what} of layers {list(layers)}; none given")
        parts.append(arr[:, index, :].reshape(arr.shape[0], -1))
    return np.concatenate(parts, axis=1).astype(np.float64)


def fit_probe_weights(
    x: _FloatArray, z: _FloatArray, labels: _IntArray, k: int, c: float
) -> tuple[_FloatArray, _FloatArray]:
    """Fit the head on (n, d) features and (n, k) log-probabilities; return the weights
    (k, d + k) and intercept (k,) that act on the raw, unstandardised inputs.

    A choice absent from ``labels`` gets zero weights and an intercept 10 nats below the
    lowest fitted one: the head cannot learn what it never saw, and says so by rarely
    choosing it, while the choices' own log-probabilities still order the rest.
    """
    inputs = np.concatenate([x, z], axis=1)  # (n, d + k)
    present = np.unique(labels)
    if present.shape[0] == 1:
        # One class only (a cross-validation fold of a rare class, say): logistic regression
        # cannot fit it, and the head has learned nothing but that class. The others sit
        # 10 nats below it, as an absent class does.
        bias = np.full(k, -10.0)
        bias[present[0]] = 0.0
        return np.zeros((k, inputs.shape[1])), bias
    from sklearn.linear_model import LogisticRegression  # here: a server dependency
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(inputs)
    model = LogisticRegression(C=c, max_iter=2000, tol=1e-6)
    model.fit(scaler.transform(inputs), labels)
    coef = np.asarray(model.coef_, dtype=np.float64)
    intercept = np.asarray(model.intercept_, dtype=np.float64)
    if coef.shape[0] == 1:  # binary: P(classes_[1]) = sigmoid(w.x + b) = softmax([0, w.x + b])
        coef = np.vstack([np.zeros_like(coef), coef])
        intercept = np.array([0.0, intercept[0]])
    # w . (u - mean) / scale + b  ==  (w / scale) . u + (b - w . (mean / scale))
    scale = np.asarray(scaler.scale_, dtype=np.float64)
    mean = np.asarray(scaler.mean_, dtype=np.float64)
    raw = coef / scale  # (c, d + k)
    raw_intercept = intercept - raw @ mean
    weights = np.zeros((k, inputs.shape[1]))
    bias = np.full(k, raw_intercept.min() - 10.0)
    classes = np.asarray(model.classes_, dtype=np.int64)
    weights[classes] = raw
    bias[classes] = raw_intercept
    return weights, bias


def _log_probs(weights: _FloatArray, bias: _FloatArray, x: _FloatArray) -> _FloatArray:
    return _log_softmax(x @ weights.T + bias)  # (n, k)


@dataclass(frozen=True)
class ProbeFit:
    """The probe ``fit_probe`` chose, and the evidence for choosing it."""

    probe: Probe
    heldout_nll: _FloatArray  # (n,) per-item held-out NLL of the chosen layer and C
    heldout_probabilities: _FloatArray  # (n, k) each item's probabilities from the fold
    # that did not see it (the chosen layer and C): what the probe does on new items
    cv_nll: dict[str, float]  # mean held-out NLL of every (layer, C) tried, "layer 20, C 0.1"
    note: str


def fit_probe(
    features: npt.ArrayLike,
    layers: Sequence[int],
    num_layers: int,
    logits: npt.ArrayLike,
    y: npt.ArrayLike,
    folds: Sequence[tuple[_IntArray, _IntArray]],
    *,
    cs: Sequence[float] = PROBE_CS,
    span_features: npt.ArrayLike | None = None,
    span: ProbeSpan | None = None,
) -> ProbeFit:
    """Choose a layer, what to read of it and a C by held-out NLL over ``folds``, then refit
    on every item.

    Parameters
    ----------
    features : array of shape (n, m, H)
        Hidden states at the decision point, one (H,) row per layer of ``layers``.
    layers : sequence of int, length m
        The layers of ``features``, each a candidate.
    num_layers : int
        The model's depth, recorded in the probe.
    logits : array of shape (n, k)
        The choices' log-probabilities, the rest of the head's input.
    y : array of shape (n,)
        Correct choice indices.
    folds : sequence of (train, test) index arrays
        The cross-validation folds (``calibration.maps.scaling`` makes them, shared by every
        candidate method so their held-out NLLs compare item by item).
    cs : sequence of float
        Candidate inverse regularisation strengths.
    span_features : array of shape (n, m, H), optional
        Each item's hidden states of ``layers`` averaged over its own tokens (``span``: the
        item marked in its prompt, or the whole prompt). Given, the probe may read the mean
        instead of the decision point's state, or both, as the folds choose.
    span : "item" or "prompt"
        Over which tokens ``span_features`` were averaged; recorded in the probe.
    """
    z = check_logits(logits)
    n, k = z.shape
    labels = check_labels(y, n, k)
    f = check_features(features, n, layers)
    means = None
    if span_features is not None:
        if span not in ("item", "prompt"):
            raise ValueError(f"span must be 'item' or 'prompt' with span_features, got {span!r}")
        means = check_features(span_features, n, layers, "span_features")
        if means.shape != f.shape:
            raise ValueError(f"span_features {means.shape} must match features {f.shape}")
    reads: tuple[ProbeReads, ...] = ("point",) if means is None else ("point", "mean", "point+mean")
    z_std = _log_softmax(z)  # normalised, as Probe.apply normalises: shifts change nothing
    # (n, k) out-of-fold log-probabilities of each (layer, what it reads, C)
    heldout: dict[tuple[int, ProbeReads, float], _FloatArray] = {}
    for layer in layers:
        for read in reads:
            if k * (len(read.split("+")) * f.shape[2] + k) > MAX_PROBE_WEIGHTS:
                continue
            x = probe_input(read, [layer], f, means, layers)  # (n, slots * H)
            for c in cs:
                logp = np.empty((n, k))
                for train, test in folds:
                    w, b = fit_probe_weights(x[train], z_std[train], labels[train], k, c)
                    logp[test] = _log_probs(w, b, np.concatenate([x[test], z_std[test]], axis=1))
                heldout[(layer, read, c)] = logp
    if not heldout:
        raise FitError(
            f"a probe on {f.shape[2]} features for {k} choices would hold "
            f"{probe_weights(k, f.shape[2])} weights, over the limit of {MAX_PROBE_WEIGHTS}"
        )
    rows = np.arange(n)
    nll = {key: -logp[rows, labels] for key, logp in heldout.items()}  # (n,) each
    cv_nll = {_candidate(*key): float(v.mean()) for key, v in nll.items()}
    (layer, read, c), best = min(nll.items(), key=lambda item: float(item[1].mean()))
    x = probe_input(read, [layer], f, means, layers)
    w, b = fit_probe_weights(x, z_std, labels, k, c)
    probe = Probe(
        layers=[int(layer)],
        num_layers=int(num_layers),
        feature_dim=int(f.shape[2]),
        weights=w.tolist(),
        intercept=b.tolist(),
        l2=float(c),
        reads=read,
        span=None if read == "point" else span,
    )
    others = sorted(cv_nll.items(), key=lambda item: item[1])[1:4]
    note = (
        f"probe on {_candidate(layer, read, c)}: held-out NLL {float(best.mean()):.4f}, the "
        f"lowest of {len(nll)} candidates (next: "
        + ", ".join(f"{name} {value:.4f}" for name, value in others)
        + ")"
    )
    return ProbeFit(
        probe=probe,
        heldout_nll=best,
        heldout_probabilities=np.exp(heldout[(layer, read, c)]),
        cv_nll=cv_nll,
        note=note,
    )


def _candidate(layer: int, read: ProbeReads, c: float) -> str:
    """A candidate in words: "layer 20, C 0.1" reads the decision point, "layer 20 mean, C
    0.1" the mean over the item, "layer 20 point+mean, C 0.1" both."""
    what = "" if read == "point" else f" {read}"
    return f"layer {layer}{what}, C {c:g}"
