"""Temperature and bias+temperature scaling, and choosing between them by cross-validation."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from sklearn.exceptions import NotFittedError

from calibration.errors import RuleError
from calibration.maps.scaling import (
    BiasTemperature,
    BiasTemperatureScaler,
    CalibrationFit,
    Identity,
    Temperature,
    TemperatureScaler,
    fit_calibrator,
    softmax,
)
from calibration.metrics import nll


def sample_labels(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
    """One categorical draw per row of ``probs``."""
    u = rng.random((probs.shape[0], 1))
    return np.minimum((u > np.cumsum(probs, axis=1)).sum(axis=1), probs.shape[1] - 1)


def synthetic(
    seed: int,
    *,
    temperature: float = 1.0,
    bias: list[float] | None = None,
    n: int = 5000,
    k: int = 4,
) -> tuple[np.ndarray, np.ndarray]:
    """Logits z ~ N(0, 3^2) and labels drawn from softmax(z / temperature + bias)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, 3.0, size=(n, k))
    offsets = np.zeros(k) if bias is None else np.asarray(bias)
    return z, sample_labels(rng, softmax(z / temperature + offsets))


def test_softmax_is_stable_and_normalized() -> None:
    p = softmax([[1000.0, 1000.0, -1000.0], [0.0, np.log(3.0), -50.0]])
    assert p.dtype == np.float64
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    np.testing.assert_allclose(p[0], [0.5, 0.5, 0.0], atol=1e-300)
    np.testing.assert_allclose(p[1, :2], [0.25, 0.75], rtol=1e-12)
    np.testing.assert_allclose(softmax([0.0, 0.0]), [0.5, 0.5])


def test_recovers_a_known_temperature() -> None:
    z, y = synthetic(0, temperature=2.5)
    scaler = TemperatureScaler().fit(z, y)
    assert scaler.temperature_ == pytest.approx(2.5, abs=0.15)
    assert scaler.n_classes_ == 4
    assert isinstance(scaler.temperature_, float)


def test_stays_near_one_on_calibrated_data() -> None:
    z, y = synthetic(1)
    assert TemperatureScaler().fit(z, y).temperature_ == pytest.approx(1.0, abs=0.1)


@settings(max_examples=40, deadline=None)
@given(
    logits=hnp.arrays(
        np.float64,
        st.tuples(st.integers(1, 8), st.integers(2, 6)),
        elements=st.floats(-30, 30),
    ),
    temperature=st.floats(0.01, 100.0),
)
def test_temperature_keeps_the_argmax_and_rows_sum_to_one(
    logits: np.ndarray, temperature: float
) -> None:
    scaled = Temperature(temperature=temperature).apply(logits)
    np.testing.assert_allclose(scaled.sum(axis=1), 1.0, rtol=1e-12)
    # Order is kept weakly everywhere (a larger score never gets a smaller probability) ...
    for z_row, p_row in zip(logits, scaled, strict=True):
        larger = z_row[:, None] > z_row[None, :]
        p_i = np.broadcast_to(p_row[:, None], larger.shape)[larger]
        p_j = np.broadcast_to(p_row[None, :], larger.shape)[larger]
        assert np.all(p_i >= p_j)
    # ... and the top choice strictly wherever its lead survives float64 rounding after
    # division by T <= 100 (a lead of 1e-300 rounds to a tie, which argmax breaks to the left).
    top2 = np.sort(logits, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-6
    np.testing.assert_array_equal(scaled.argmax(axis=1)[clear], logits.argmax(axis=1)[clear])


def test_predict_proba_rows_sum_to_one_and_keep_the_argmax() -> None:
    z, y = synthetic(2, temperature=0.5, n=500)
    scaler = TemperatureScaler().fit(z, y)
    p = scaler.predict_proba(z)
    assert p.shape == z.shape
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-12)
    np.testing.assert_array_equal(p.argmax(axis=1), z.argmax(axis=1))


def test_fitted_temperature_does_not_hurt_held_out_nll() -> None:
    z, y = synthetic(3, temperature=2.0)
    z_test, y_test = synthetic(4, temperature=2.0)
    scaler = TemperatureScaler().fit(z, y)
    assert nll(scaler.predict_proba(z_test), y_test) < nll(softmax(z_test), y_test)


def test_fit_calibrator_keeps_calibrated_data_unscaled() -> None:
    z, y = synthetic(5, n=2000)
    fit = fit_calibrator(z, y)
    assert fit.map == Identity()
    assert fit.method == fit.map.method == "none" and fit.map.temperature == 1.0
    assert set(fit.cv_nll) == {"none", "temperature", "bias_temperature"}
    assert "temperature stays 1.0" in fit.note
    # Held-out check on a fresh draw: applying the fit loses nothing against no scaling.
    z_test, y_test = synthetic(6, n=2000)
    applied = fit.map.apply(z_test)
    assert nll(applied, y_test) <= nll(softmax(z_test), y_test) + 1e-12


def test_fit_calibrator_picks_temperature_and_improves_held_out_nll() -> None:
    z, y = synthetic(7, temperature=2.5, n=2000)
    fit = fit_calibrator(z, y)
    # Labels follow softmax(z / 2.5) with no offset: one parameter explains the data, so the
    # per-choice offsets cannot beat it by a standard error and the simpler method wins.
    assert isinstance(fit.map, Temperature)
    assert fit.method == fit.map.method == "temperature"
    assert fit.cv_nll["temperature"] < fit.cv_nll["none"]
    assert fit.map.temperature == pytest.approx(2.5, abs=0.3)
    assert fit.note.startswith("temperature won")
    z_test, y_test = synthetic(8, temperature=2.5, n=2000)
    applied = fit.map.apply(z_test)
    assert nll(applied, y_test) < nll(softmax(z_test), y_test) - 0.05


def test_bias_recovery_and_selection() -> None:
    b_true = np.array([0.0, 1.0, -1.0])
    z, y = synthetic(9, bias=list(b_true), k=3)
    scaler = BiasTemperatureScaler().fit(z, y)
    assert scaler.temperature_ == pytest.approx(1.0, abs=0.1)
    assert scaler.bias_.shape == (3,)
    assert scaler.bias_.sum() == pytest.approx(0.0, abs=1e-12)
    # Only differences of offsets are identified.
    np.testing.assert_allclose(np.diff(scaler.bias_), np.diff(b_true), atol=0.2)
    np.testing.assert_allclose(scaler.predict_proba(z).sum(axis=1), 1.0, rtol=1e-12)

    fit = fit_calibrator(z, y)
    # Calibrated up to the offsets: only bias_temperature can fit them.
    assert isinstance(fit.map, BiasTemperature)
    assert fit.method == "bias_temperature"
    assert fit.cv_nll["bias_temperature"] < fit.cv_nll["temperature"]
    assert fit.note.startswith("bias_temperature won")
    assert len(fit.map.bias) == 3
    assert all(type(v) is float for v in fit.map.bias)
    np.testing.assert_allclose(np.diff(fit.map.bias), np.diff(b_true), atol=0.2)
    np.testing.assert_allclose(fit.map.apply(z), scaler.predict_proba(z))


def test_bias_stays_finite_for_an_absent_class() -> None:
    z, y = synthetic(10, n=300, k=3)
    keep = y != 2
    scaler = BiasTemperatureScaler().fit(z[keep], y[keep])
    assert np.all(np.isfinite(scaler.bias_))
    assert scaler.bias_[2] < scaler.bias_[0]


def test_calibration_fit_is_plain_frozen_data() -> None:
    z, y = synthetic(11, bias=[0.0, 1.0, -1.0], n=600, k=3)
    fit = fit_calibrator(z, y, methods=("bias_temperature",), cv=3)
    assert set(fit.cv_nll) == {"none", "bias_temperature"}
    assert type(fit.map.temperature) is float
    assert all(type(v) is float for v in fit.cv_nll.values())
    encoded = msgspec.json.encode(fit)
    assert b'"map":{"method":"' in encoded  # a tagged union: the method names the parameters
    decoded = msgspec.json.decode(encoded, type=CalibrationFit)
    assert decoded == fit
    with pytest.raises(AttributeError):
        fit.map = Identity()  # type: ignore[misc]


def test_tiny_and_unstratifiable_sets_still_fit() -> None:
    z = np.array([[2.0, 0.0], [0.0, 2.0], [1.0, 0.0]])
    fit = fit_calibrator(z, [0, 1, 1], cv=5)  # cv reduced to n=3, class 0 has one member
    # Leave-one-out on 3 items: without the third, the other two are separable, so a scaler
    # fitted on them goes to T_MIN and is confidently wrong on the third (whose label is not
    # its top score). That one fold costs every scaler far more than it saves elsewhere.
    assert fit.map == Identity()
    assert fit.method == "none"
    assert fit.cv_nll["none"] < min(fit.cv_nll["temperature"], fit.cv_nll["bias_temperature"])
    assert "3-fold CV" in fit.note


def test_validation_errors() -> None:
    with pytest.raises(ValueError, match="2-D"):
        TemperatureScaler().fit(np.zeros(4), np.zeros(4, dtype=int))
    with pytest.raises(ValueError, match="empty"):
        TemperatureScaler().fit(np.zeros((0, 3)), np.zeros(0, dtype=int))
    with pytest.raises(ValueError, match="3 labels but there are 2 rows"):
        TemperatureScaler().fit(np.zeros((2, 3)), [0, 1, 2])
    with pytest.raises(ValueError, match=r"y\[1\] = 3 is out of range"):
        TemperatureScaler().fit(np.zeros((2, 3)), [0, 3])
    with pytest.raises(ValueError, match=r"y\[0\] = 0.5 is not an integer"):
        TemperatureScaler().fit(np.zeros((2, 3)), [0.5, 1.0])
    with pytest.raises(ValueError, match=r"logits\[1, 0\] = nan is not finite"):
        BiasTemperatureScaler().fit([[0.0, 1.0], [np.nan, 0.0]], [0, 1])
    with pytest.raises(ValueError, match="at least 2 choices"):
        softmax(np.zeros((3, 1)))
    with pytest.raises(NotFittedError):
        TemperatureScaler().predict_proba(np.zeros((1, 2)))
    with pytest.raises(ValueError, match="fitted on 2"):
        TemperatureScaler().fit([[0.0, 1.0]], [1]).predict_proba(np.zeros((1, 3)))
    with pytest.raises(ValueError, match="unknown calibration method 'platt'"):
        fit_calibrator(np.zeros((4, 2)), [0, 1, 0, 1], methods=("platt",))
    with pytest.raises(ValueError, match="cv must be >= 2, got 1"):
        fit_calibrator(np.zeros((4, 2)), [0, 1, 0, 1], cv=1)
    with pytest.raises(ValueError, match="at least 2 labelled items"):
        fit_calibrator(np.zeros((1, 2)), [0])
    with pytest.raises(RuleError, match=r"temperature must be in \[0.01, 100\]"):
        Temperature(temperature=0.0)
    with pytest.raises(RuleError, match="temperature must be in"):
        Temperature(temperature=1e-300)
    with pytest.raises(RuleError, match="bias must be"):
        BiasTemperature(temperature=1.0, bias=[1e308, -1e308])
    with pytest.raises(ValueError, match="3 per-choice offsets but the logits have 2"):
        BiasTemperature(temperature=1.0, bias=[0.0, 0.0, 0.0]).apply(np.zeros((1, 2)))


def test_maps_decode_by_their_method_tag() -> None:
    from calibration.maps.scaling import CalibrationMap

    def decode(text: str) -> object:
        return msgspec.json.decode(text, type=CalibrationMap)

    assert decode('{"method": "none"}') == Identity()
    assert decode('{"method": "temperature", "temperature": 2.0}') == Temperature(temperature=2.0)
    with pytest.raises(msgspec.ValidationError):
        decode('{"method": "none", "temperature": 2.0}')  # "none" has no parameters
    with pytest.raises(msgspec.ValidationError, match="bias"):
        decode('{"method": "bias_temperature", "temperature": 2.0}')
    with pytest.raises(msgspec.ValidationError):
        decode('{"method": "platt", "temperature": 2.0}')
