"""Post-hoc scaling of choice log-scores into calibrated probabilities.

The engine's choice probabilities are exact for the model, but the model itself is usually
over- or under-confident, and on lettered multiple choice it often prefers some letters
regardless of content. Two small parametric fixes learned on a labelled calibration set handle
most of this without touching the model:

* temperature scaling, softmax(z / T) (Guo et al. 2017, "On Calibration of Modern Neural
  Networks"): one parameter, never changes the most probable choice;
* bias + temperature, softmax(z / T + b): a per-choice offset that also corrects label-prior
  and letter bias (in the spirit of vector scaling, Guo et al. 2017, and of contextual
  calibration, Zhao et al. 2021, "Calibrate Before Use"). It can change the top choice;
* batch + temperature, softmax((z - log p_prior) / T): the prior p_prior is the mean
  probability vector of the fitting items, estimated without their labels (batch calibration,
  Zhou et al. 2023), and only T is fitted on labels. Opt-in: pass it in ``methods``. It is
  stored as a ``BiasTemperature``, since it is one.

* a probe (``calibration.maps.probe``): a learned head on the pass's own hidden state, for when
  the choice logits carry too little signal for any rescaling to help.

``fit_calibrator`` chooses between them, and no scaling at all, by cross-validated NLL on the
same folds, so a calibration set too small or too clean to support a method leaves the
probabilities alone. The fitted map is one typed value (``calibration.maps.map_types.CalibrationMap``:
``Identity``, ``Temperature``, ``BiasTemperature`` or ``Probe``) whose ``apply`` is a pure
function for serving time.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import msgspec
import numpy as np
import numpy.typing as npt
from scipy import optimize
from sklearn import exceptions, model_selection
from threadpoolctl import ThreadpoolController

from calibration.maps.map_types import (
    MAX_ABS_BIAS,
    T_MAX,
    T_MIN,
    BiasTemperature,
    CalibrationMap,
    Identity,
    Probe,
    ProbeSpan,
    Temperature,
    _log_softmax,
    _softmax,
    softmax,
)
from calibration.maps.probe import check_features, fit_probe
from calibration.validation import _FloatArray, _IntArray, check_int, check_labels, check_logits

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from typing import Self

    from numpy.typing import ArrayLike

__all__ = [
    "MAX_ABS_BIAS",
    "METHODS",
    "T_MAX",
    "T_MIN",
    "BatchTemperatureScaler",
    "BiasTemperature",
    "BiasTemperatureScaler",
    "CalibrationFit",
    "CalibrationMap",
    "Identity",
    "Probe",
    "ProbeInputs",
    "Temperature",
    "TemperatureScaler",
    "fit_calibrator",
    "softmax",
]


METHODS = ("none", "temperature", "batch_temperature", "bias_temperature", "probe")
"""Every calibration method, from the simplest to the most flexible."""

# The search runs over beta = 1/T, in which the NLL is convex (it is a log-sum-exp of functions
# linear in beta minus a linear term), so a bounded scalar search finds the global minimum.
_BETA_MIN = 1.0 / T_MAX
_BETA_MAX = 1.0 / T_MIN
_NLL_CLIP = 1e-12


class CalibrationFit(msgspec.Struct, frozen=True, kw_only=True):
    """The map ``fit_calibrator`` chose, and the evidence for choosing it."""

    map: CalibrationMap
    cv_nll: dict[str, float]  # cross-validated NLL of every candidate, including "none"
    note: str  # which method won and by how much, or why nothing was applied
    method: str = ""  # the winning candidate ("batch_temperature" is stored as bias_temperature)
    prior: list[float] | None = None  # batch_temperature's label-free prior, choice order
    # A probe's probabilities for the items it was fitted on, each from the fold that did not
    # see it (n, k): unlike its in-sample probabilities, they show how it does on new items.
    heldout_probabilities: list[list[float]] | None = None


def _fit_beta(z: _FloatArray, labels: _IntArray) -> float:
    z_true = z[np.arange(z.shape[0]), labels]

    def objective(beta: float) -> float:
        s = beta * z
        m = s.max(axis=1)
        lse = m + np.log(np.exp(s - m[:, None]).sum(axis=1))
        return float(np.mean(lse - beta * z_true))

    result = optimize.minimize_scalar(
        objective, bounds=(_BETA_MIN, _BETA_MAX), method="bounded", options={"xatol": 1e-7}
    )
    return float(result.x)


def _check_fitted(estimator: object, attribute: str) -> None:
    if not hasattr(estimator, attribute):
        # sklearn's NotFittedError is both a ValueError and an AttributeError.
        raise exceptions.NotFittedError(
            f"this {type(estimator).__name__} is not fitted yet; call fit(logits, y) first"
        )


def _check_width(z: _FloatArray, n_classes: int) -> None:
    if z.shape[1] != n_classes:
        raise ValueError(
            f"logits have {z.shape[1]} choices per row but the scaler was fitted on {n_classes}"
        )


# ---------------------------------------------------------------------------------------------
# Estimators.


class _Scaling:
    """What every scaler does once fitted: softmax of its log-scores rescaled by ``_rescale``.

    The scalers differ in how they fit; predicting is this one path for all of them.
    """

    temperature_: float
    n_classes_: int
    # What fit sets and ``_rescale`` reads: while it is unset, predicting is NotFittedError.
    _fitted: ClassVar[str] = "temperature_"

    def predict_proba(self, logits: ArrayLike) -> _FloatArray:
        """Calibrated probabilities of shape (n, k) for log-scores of shape (n, k)."""
        _check_fitted(self, self._fitted)
        z = check_logits(logits)
        _check_width(z, self.n_classes_)
        return _softmax(self._rescale(z))

    def _rescale(self, z: _FloatArray) -> _FloatArray:
        return z / self.temperature_


class _BiasScaling(_Scaling):
    """A scaler with a per-choice offset after the temperature: softmax(logits / T + bias_)."""

    bias_: _FloatArray
    _fitted: ClassVar[str] = "bias_"

    def _rescale(self, z: _FloatArray) -> _FloatArray:
        return z / self.temperature_ + self.bias_


class TemperatureScaler(_Scaling):
    """Temperature scaling: probabilities softmax(logits / T) with one fitted T > 0.

    T is chosen to minimize the mean negative log-likelihood of the labels, searched over the
    inverse temperature 1/T in [0.01, 100] where the objective is convex. Dividing every score
    of a row by the same positive T never changes which choice is most probable.

    Attributes
    ----------
    temperature_ : float
    n_classes_ : int
    """

    def fit(self, logits: ArrayLike, y: ArrayLike) -> Self:
        """Fit T on log-scores of shape (n, k) and correct choice indices of shape (n,)."""
        z = check_logits(logits)
        labels = check_labels(y, z.shape[0], z.shape[1])
        self.temperature_ = 1.0 / _fit_beta(z, labels)
        self.n_classes_ = int(z.shape[1])
        return self


class BiasTemperatureScaler(_BiasScaling):
    """Bias + temperature scaling: probabilities softmax(logits / T + b).

    ``b`` is a per-choice offset that absorbs a label prior or a position/letter bias. The
    inverse temperature and the offsets are fitted jointly by L-BFGS-B with an analytic gradient
    on mean NLL + ``l2`` * ||b||^2; the objective is convex, since the scores are linear in
    (1/T, b). The penalty keeps the offset of a choice that is rare or absent in the
    calibration set finite, and it also makes b identifiable: adding a constant to every offset
    leaves the probabilities unchanged, and among those equivalent offsets the penalty picks
    the one that sums to zero. ``bias_`` is stored exactly centered.

    Parameters
    ----------
    l2 : float, default 1e-3
        Weight of the squared-norm penalty on ``b``, in units of mean NLL (nats per item).

    Attributes
    ----------
    temperature_ : float
    bias_ : float array of shape (n_classes_,), summing to 0
    n_classes_ : int
    """

    def __init__(self, l2: float = 1e-3) -> None:
        self.l2 = l2

    def fit(self, logits: ArrayLike, y: ArrayLike) -> Self:
        """Fit T and b on log-scores of shape (n, k) and correct choice indices of shape (n,)."""
        if isinstance(self.l2, bool) or not isinstance(self.l2, int | float) or self.l2 < 0:
            raise ValueError(f"l2 must be a non-negative number, got {self.l2!r}")
        z = check_logits(logits)
        n, k = z.shape
        labels = check_labels(y, n, k)
        onehot = np.zeros((n, k))
        onehot[np.arange(n), labels] = 1.0
        l2 = float(self.l2)

        def objective(x: _FloatArray) -> tuple[float, _FloatArray]:
            beta, b = x[0], x[1:]
            logp = _log_softmax(beta * z + b)
            diff = np.exp(logp) - onehot  # d(NLL_i)/d(score_ij)
            loss = -float(np.mean(logp[np.arange(n), labels])) + l2 * float(b @ b)
            grad = np.empty_like(x)
            grad[0] = np.mean(np.sum(diff * z, axis=1))
            grad[1:] = diff.mean(axis=0) + 2.0 * l2 * b
            return loss, grad

        # Start from the temperature-only optimum, which is the b = 0 slice of this problem.
        x0 = np.concatenate([[_fit_beta(z, labels)], np.zeros(k)])
        result = optimize.minimize(
            objective,
            x0,
            jac=True,
            method="L-BFGS-B",
            bounds=[(_BETA_MIN, _BETA_MAX)] + [(None, None)] * k,
            options={"maxiter": 1000, "gtol": 1e-8},
        )
        x = np.asarray(result.x, dtype=np.float64)
        # L-BFGS-B can stop with a line-search warning at machine precision; its iterate is
        # still the best found, but never accept one worse than the starting point.
        if not np.all(np.isfinite(x)) or objective(x)[0] > objective(x0)[0]:
            x = x0
        self.temperature_ = 1.0 / float(x[0])
        self.bias_ = x[1:] - x[1:].mean()
        self.n_classes_ = int(k)
        return self


class BatchTemperatureScaler(_BiasScaling):
    """Batch calibration, then temperature: probabilities softmax((logits - log prior) / T).

    ``prior_`` is the mean of softmax(logits) over the fitting items (their labels unused);
    T is then fitted on the corrected scores like ``TemperatureScaler``. ``bias_`` is the
    equivalent centred offset, -log(prior_) / T minus its mean, so that the map is
    softmax(logits / T + bias_).

    Attributes
    ----------
    prior_ : float array of shape (n_classes_,), summing to 1
    temperature_ : float
    bias_ : float array of shape (n_classes_,), summing to 0
    n_classes_ : int
    """

    prior_: _FloatArray

    def fit(self, logits: ArrayLike, y: ArrayLike) -> Self:
        """Estimate the prior on log-scores (n, k), then fit T on the labels (n,)."""
        z = check_logits(logits)
        labels = check_labels(y, z.shape[0], z.shape[1])
        prior = _softmax(z).mean(axis=0)  # (k,)
        log_prior = np.log(np.maximum(prior, 1e-300))
        self.temperature_ = 1.0 / _fit_beta(z - log_prior, labels)
        bias = -log_prior / self.temperature_
        self.prior_ = prior / prior.sum()
        self.bias_ = bias - bias.mean()
        self.n_classes_ = int(z.shape[1])
        return self


# ---------------------------------------------------------------------------------------------
# Model selection.

_Scaler = TemperatureScaler | BatchTemperatureScaler | BiasTemperatureScaler


def _make_scaler(method: str) -> _Scaler:
    if method == "temperature":
        return TemperatureScaler()
    if method == "batch_temperature":
        return BatchTemperatureScaler()
    return BiasTemperatureScaler()


def _folds(
    labels: _IntArray, cv: int, random_state: int
) -> tuple[Iterator[tuple[_IntArray, _IntArray]], bool]:
    n = labels.shape[0]
    _, counts = np.unique(labels, return_counts=True)
    # Stratification needs every present class in every fold; with a class rarer than the fold
    # count sklearn would warn and produce uneven folds, so fall back to plain shuffled folds.
    stratified = bool(counts.min() >= cv)
    splitter = (
        model_selection.StratifiedKFold(n_splits=cv, shuffle=True, random_state=random_state)
        if stratified
        else model_selection.KFold(n_splits=cv, shuffle=True, random_state=random_state)
    )
    return iter(list(splitter.split(np.zeros((n, 1)), labels))), stratified


@dataclass(frozen=True)
class ProbeInputs:
    """What ``fit_calibrator``'s "probe" candidate reads besides the log-probabilities.

    features
        Array of shape (n, m, H): the hidden states at the decision point for ``layers``.
    layers
        The m layers (the judgment's ``feature_layers``).
    num_layers
        The model's depth, recorded in the probe.
    span_features
        Optional, shape (n, m, H): the same layers' means over each item's tokens (``span``:
        "item" or "prompt"), which the probe may read instead of the decision point's states,
        or beside them.
    """

    features: ArrayLike
    layers: Sequence[int]
    num_layers: int
    span_features: ArrayLike | None = None
    span: ProbeSpan | None = None

    def rows(self, index: npt.NDArray[np.intp]) -> ProbeInputs:
        """The same inputs for the items ``index`` selects."""
        means = self.span_features
        return dataclasses.replace(
            self,
            features=np.asarray(self.features)[index],
            span_features=None if means is None else np.asarray(means)[index],
        )

    def checked(self, n: int) -> ProbeInputs:
        """The inputs as float32 arrays, checked against n items (ValueError if not)."""
        means = self.span_features
        return dataclasses.replace(
            self,
            features=check_features(self.features, n, self.layers),
            span_features=None if means is None else np.asarray(means, dtype=np.float32),
        )


def fit_calibrator(
    logits: ArrayLike,
    y: ArrayLike,
    *,
    methods: Sequence[str] = ("temperature", "bias_temperature"),
    cv: int = 5,
    random_state: int = 0,
    min_improvement_se: float = 1.0,
    probe: ProbeInputs | None = None,
) -> CalibrationFit:
    """Choose and fit a calibration method by cross-validated NLL.

    Every candidate ("none", i.e. plain softmax, and each of ``methods``) is scored by its
    held-out NLL under ``cv``-fold cross-validation (stratified by label when every present
    class has at least ``cv`` items, else plain shuffled K-fold; ``cv`` is reduced to n on tiny
    sets). Candidates are then considered from the simplest to the most flexible ("none",
    "temperature", "bias_temperature", "probe"), and a more flexible one replaces the current choice
    only if it lowers the cross-validated NLL, by more than ``min_improvement_se`` standard
    errors of the paired per-item difference (the one-standard-error rule, Hastie, Tibshirani
    & Friedman, "The Elements of Statistical Learning", 7.10). Ties and improvements within
    noise keep the simpler method, so no scaling is applied unless it measurably lowers
    held-out NLL; with ``min_improvement_se=0`` the rule is plain "lowest cross-validated NLL".
    The chosen method is then refitted on all items.

    Parameters
    ----------
    logits : array of shape (n, k)
        Per-choice log-scores (the engine's log-probabilities), n >= 2.
    y : array of shape (n,)
        Correct choice indices in 0..k-1.
    methods : sequence of str
        Candidates besides "none", from ``METHODS``.
    cv : int
        Number of folds, >= 2.
    random_state : int
        Seed of the fold shuffle.
    min_improvement_se : float
        Required improvement, in standard errors, for a more flexible method to be chosen.
    probe : ProbeInputs, optional
        The hidden states the "probe" candidate reads (needed when ``methods`` has it); its
        layer and regularisation are chosen in the same folds (``calibration.maps.probe``).
    """
    z = check_logits(logits)
    n, k = z.shape
    labels = check_labels(y, n, k)
    if isinstance(methods, str):
        raise ValueError(f"methods must be a sequence of method names, got the string {methods!r}")
    for method in methods:
        if method not in METHODS:
            raise ValueError(f"unknown calibration method {method!r}; expected one of {METHODS}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"methods lists a method more than once: {list(methods)}")
    cv = check_int(cv, "cv", 2)
    random_state = check_int(random_state, "random_state", 0)
    if (
        isinstance(min_improvement_se, bool)
        or not isinstance(min_improvement_se, int | float)
        or not min_improvement_se >= 0
    ):
        raise ValueError(f"min_improvement_se must be >= 0, got {min_improvement_se!r}")
    if n < 2:
        raise ValueError(f"need at least 2 labelled items to cross-validate, got n={n}")
    cv = min(cv, n)
    probe_inputs = None
    if "probe" in methods:
        if probe is None or not probe.layers:
            raise ValueError(
                "the probe needs its inputs (ProbeInputs: features, layers, num_layers): the "
                "hidden states the engine returns for a judgment's feature_layers"
            )
        probe_inputs = probe.checked(n)

    # These problems have a handful of parameters: a multi-threaded BLAS only adds thread
    # hand-offs, which cost 10x the whole fit on a busy machine (measured: 4 s vs 0.28 s for
    # ten fits while the model ran on the other cores).
    with _thread_pools().limit(limits=1, user_api="blas"):
        return _fit_calibrator(
            z, labels, methods, cv, random_state, min_improvement_se, probe_inputs
        )


@functools.cache
def _thread_pools() -> ThreadpoolController:
    """This process's thread pools, found once. ``threadpool_limits`` looks for them in every
    loaded library on each call: 4 ms in a process with torch loaded, where a whole
    temperature fit takes about 10. The pools a fit runs on are loaded by this module's own
    imports (numpy's, scipy's and scikit-learn's), so they are there at the first fit."""
    return ThreadpoolController()


def _fit_calibrator(
    z: _FloatArray,
    labels: _IntArray,
    methods: Sequence[str],
    cv: int,
    random_state: int,
    min_improvement_se: float,
    probe_inputs: ProbeInputs | None,
) -> CalibrationFit:
    n = z.shape[0]
    candidates = [m for m in METHODS if m == "none" or m in methods]
    heldout = {m: np.empty(n) for m in candidates}
    rows = np.arange(n)
    heldout["none"] = -np.log(np.clip(_softmax(z)[rows, labels], _NLL_CLIP, 1.0))
    fold_iter, stratified = _folds(labels, cv, random_state)
    folds = list(fold_iter)
    probe_fit = None
    if probe_inputs is not None:
        p = probe_inputs
        probe_fit = fit_probe(
            np.asarray(p.features),
            p.layers,
            p.num_layers,
            z,
            labels,
            folds,
            span_features=None if p.span_features is None else np.asarray(p.span_features),
            span=p.span,
        )
        heldout["probe"] = np.clip(probe_fit.heldout_nll, 0.0, -np.log(_NLL_CLIP))
    for train, test in folds:
        for method in [m for m in candidates[1:] if m != "probe"]:
            probs = _make_scaler(method).fit(z[train], labels[train]).predict_proba(z[test])
            true_p = probs[np.arange(test.shape[0]), labels[test]]
            heldout[method][test] = -np.log(np.clip(true_p, _NLL_CLIP, 1.0))
    cv_nll = {m: float(heldout[m].mean()) for m in candidates}

    chosen = "none"
    for method in candidates[1:]:
        diff = heldout[method] - heldout[chosen]
        se = float(diff.std(ddof=1) / np.sqrt(n))
        if diff.mean() < 0 and diff.mean() < -min_improvement_se * se:
            chosen = method

    scheme = f"{cv}-fold {'stratified ' if stratified else ''}CV, n={n}"
    others = ", ".join(f"{m} {cv_nll[m]:.4f}" for m in candidates[1:]) or "no other candidates"
    if chosen == "none":
        note = (
            f"no scaling: no method lowered the cross-validated NLL of {cv_nll['none']:.4f} "
            f"(without scaling) by more than {min_improvement_se:g} standard error(s) "
            f"({others}; {scheme}); temperature stays 1.0"
        )
        return CalibrationFit(map=Identity(), cv_nll=cv_nll, note=note, method="none")

    gain = cv_nll["none"] - cv_nll[chosen]
    if chosen == "probe":
        assert probe_fit is not None
        note = (
            f"probe won: cross-validated NLL {cv_nll['probe']:.4f} vs {cv_nll['none']:.4f} "
            f"without scaling ({gain:.4f} nats/item, {100 * gain / cv_nll['none']:.1f}% lower; "
            f"{others}; {scheme}); {probe_fit.note}; refitted on all items"
        )
        return CalibrationFit(
            map=probe_fit.probe,
            cv_nll=cv_nll,
            note=note,
            method="probe",
            heldout_probabilities=probe_fit.heldout_probabilities.tolist(),
        )
    scaler = _make_scaler(chosen).fit(z, labels)
    bias = None if isinstance(scaler, TemperatureScaler) else [float(v) for v in scaler.bias_]
    if bias is not None and max(abs(b) for b in bias) > MAX_ABS_BIAS:
        # Only a prior near 0 at a temperature near T_MIN gets here; a stored map must obey
        # the bound that profiles enforce (the note below shows the clipped offsets).
        bias = [float(np.clip(b, -MAX_ABS_BIAS, MAX_ABS_BIAS)) for b in bias]
    prior = (
        [float(v) for v in scaler.prior_] if isinstance(scaler, BatchTemperatureScaler) else None
    )
    note = (
        f"{chosen} won: cross-validated NLL {cv_nll[chosen]:.4f} vs {cv_nll['none']:.4f} "
        f"without scaling ({gain:.4f} nats/item, {100 * gain / cv_nll['none']:.1f}% lower; "
        f"{others}; {scheme}); refitted on all items: T={scaler.temperature_:.4g}"
        + ("" if bias is None else ", bias=[" + ", ".join(f"{v:.3f}" for v in bias) + "]")
    )
    fitted: CalibrationMap = (
        Temperature(temperature=float(scaler.temperature_))
        if bias is None
        else BiasTemperature(temperature=float(scaler.temperature_), bias=bias)
    )
    return CalibrationFit(map=fitted, cv_nll=cv_nll, note=note, method=chosen, prior=prior)
