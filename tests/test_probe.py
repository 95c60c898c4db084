"""The probe: a learned head on the pass's hidden state, from fitting to serving and bad input.

Fast tests on synthetic worlds whose truth is known: in one the label follows one layer's
features and the model's log-probabilities are noise, in the other the features are noise and
the log-probabilities carry the label. Whether the certificate survives a probe is
tests/test_gating_simulation.py's question; the real model's probe is benchmarks'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from fakes import FINGERPRINT, Scored, judgment_of
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from calibration import (
    FitSettings,
    LabeledScores,
    ProbeInputs,
    Provenance,
    decode_profile,
    evaluate_policy,
    fit_calibrator,
    fit_profile,
)
from calibration.errors import FitError, ProfileError, ProfileMismatchError, RuleError
from calibration.gate import Gate
from calibration.maps.map_types import MAX_PROBE_WEIGHTS, Probe, Temperature, softmax
from calibration.maps.probe import MIN_PROBE_EXAMPLES, fit_probe, fit_probe_weights, map_features
from calibration.profile import CalibrationProfile
from judge import Fingerprint, Judgment

CHOICES = ["a", "b", "c"]
LAYERS = (4, 8, 12)  # the layers judged, of a model with NUM_LAYERS blocks of width H
NUM_LAYERS, H = 12, 8
SIGNAL_LAYER = 8  # the one whose features carry the label in ``layer_world``
# Fixed weights of the truth p = softmax(A h): the best possible head's accuracy is 0.83.
A = np.random.default_rng(99).normal(0.0, 1.5, size=(len(CHOICES), H))

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def sample(p: FloatArray, rng: np.random.Generator) -> IntArray:
    """One label per row of (n, k) probabilities ``p``."""
    u = rng.random((p.shape[0], 1))
    return np.minimum((u > np.cumsum(p, axis=1)).sum(axis=1), p.shape[1] - 1).astype(np.int64)


def layer_world(n: int, seed: int) -> tuple[FloatArray, IntArray, npt.NDArray[np.float32]]:
    """(log-probabilities, labels, features (n, 3, H) of ``LAYERS``): the label follows the
    features of ``SIGNAL_LAYER`` alone; the log-probabilities and the other layers are noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, len(LAYERS), H))
    y = sample(softmax(x[:, LAYERS.index(SIGNAL_LAYER)] @ A.T), rng)
    z = np.log(softmax(rng.normal(size=(n, len(CHOICES)))))
    return z, y, x.astype(np.float32)


def logit_world(n: int, seed: int) -> tuple[FloatArray, IntArray, npt.NDArray[np.float32]]:
    """The reverse: labels follow softmax(u), the model reports log_softmax(2 u), overconfident
    (temperature 2 recovers the truth), and every layer's features are noise."""
    rng = np.random.default_rng(seed)
    u = rng.normal(0.0, 2.0, size=(n, len(CHOICES)))
    y = sample(softmax(u), rng)
    z = np.log(softmax(2.0 * u))
    return z, y, rng.normal(size=(n, len(LAYERS), H)).astype(np.float32)


def engine(**changes: Any) -> Fingerprint:
    """The fingerprint of ``fakes.FINGERPRINT``'s engine with hidden states of NUM_LAYERS x H."""
    shape = {"num_layers": NUM_LAYERS, "hidden_size": H}
    return msgspec.structs.replace(FINGERPRINT, **{**shape, **changes})


def folds(y: IntArray) -> list[tuple[IntArray, IntArray]]:
    splitter = StratifiedKFold(n_splits=5, shuffle=True, random_state=0)
    return list(splitter.split(np.zeros((y.shape[0], 1)), y))


def fit(
    z: FloatArray,
    y: IntArray,
    x: Any,
    *,
    methods: Sequence[str] | str,
    choices: list[str] = CHOICES,
) -> CalibrationProfile:
    """``fit_profile`` on synthetic items and their features (n, 3, H) of ``LAYERS`` (None:
    none), with the engine of ``engine()``, choosing among ``methods``."""
    layers = LAYERS if x is not None else ()
    return fit_profile(
        "probe-v1",
        LabeledScores(z, np.ones(len(y)), y, features=x, feature_layers=layers),
        choices,
        Provenance(fingerprint=engine(), dataset="synthetic", dataset_sha256="0"),
        FitSettings(methods=methods, n_bootstrap=20),
    ).profile


@pytest.fixture(scope="module")
def profile() -> CalibrationProfile:
    """A probe profile: fitted on 500 items of ``layer_world``, where the probe must win."""
    z, y, x = layer_world(500, seed=0)
    fitted = fit(z, y, x, methods=["probe"])
    assert isinstance(fitted.calibration_map, Probe)
    return fitted


def judgment(z: FloatArray, features: dict[int, list[float]] | None) -> Judgment:
    """An engine judgment with log-probabilities ``z`` (k,) over CHOICES and ``features``."""
    made = judgment_of(dict(zip(CHOICES, np.exp(z).tolist(), strict=True)))
    return msgspec.structs.replace(made, features=features)


# ---------------------------------------------------------------------------------------------
# The map against an independent computation.


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("c", [0.01, 1.0])
def test_probe_apply_equals_a_scikit_learn_pipeline(k: int, c: float) -> None:
    rng = np.random.default_rng(k)
    n, d = 300, 6
    # Features of very different scales and offsets, so that the folded standardisation matters.
    x = rng.normal(size=(n, d)) * rng.uniform(0.1, 10.0, size=d) + rng.normal(0.0, 5.0, size=d)
    z = rng.normal(0.0, 3.0, size=(n, k)) + 7.0  # unnormalised: apply normalises over choices
    y = sample(softmax(x[:, :k] / 5.0 + z), rng)
    log_p = np.log(softmax(z))
    weights, intercept = fit_probe_weights(x, log_p, y, k, c)
    probe = Probe(
        layers=[3],
        num_layers=4,
        feature_dim=d,
        weights=weights.tolist(),
        intercept=intercept.tolist(),
        l2=c,
    )
    # The same solver settings as the probe's, so that both reach the same optimum: what is
    # compared is the folding of the scaler into the weights and the binary case's two rows.
    reference = make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000, tol=1e-6))
    inputs = np.concatenate([x, log_p], axis=1)
    reference.fit(inputs, y)
    np.testing.assert_allclose(probe.apply(z, x), reference.predict_proba(inputs), atol=1e-6)
    np.testing.assert_allclose(probe.apply(z[0], x[0]), reference.predict_proba(inputs[:1])[0])


# ---------------------------------------------------------------------------------------------
# Choosing the layer, and the probe against the scalar maps.


def test_fit_probe_picks_the_layer_that_carries_the_label() -> None:
    z, y, x = layer_world(300, seed=1)
    # One BLAS thread, as fit_calibrator runs it: more only add hand-offs on so small a problem.
    with threadpool_limits(limits=1, user_api="blas"):
        result = fit_probe(x, LAYERS, NUM_LAYERS, z, y, folds(y))
    assert result.probe.layers == [SIGNAL_LAYER]
    assert result.probe.num_layers == NUM_LAYERS and result.probe.feature_dim == H
    assert len(result.cv_nll) == len(LAYERS) * 4  # every (layer, C) of the grid was tried
    best = min(result.cv_nll.values())
    assert all(v > best for name, v in result.cv_nll.items() if not name.startswith("layer 8,"))
    # The held-out probabilities are each item's from the fold that did not see it.
    held = result.heldout_probabilities
    np.testing.assert_allclose(held.sum(axis=1), 1.0)
    np.testing.assert_allclose(-np.log(held[np.arange(300), y]), result.heldout_nll, rtol=1e-9)
    assert result.heldout_nll.mean() == pytest.approx(best)


def test_fit_calibrator_chooses_the_probe_when_a_layer_carries_the_label() -> None:
    z, y, x = layer_world(300, seed=2)
    result = fit_calibrator(
        z,
        y,
        methods=["temperature", "bias_temperature", "probe"],
        probe=ProbeInputs(x, LAYERS, NUM_LAYERS),
    )
    assert result.method == "probe"
    assert isinstance(result.map, Probe) and result.map.layers == [SIGNAL_LAYER]
    # The log-probabilities are noise, so no scalar map can do better than the label prior.
    assert result.cv_nll["probe"] < result.cv_nll["temperature"] - 0.3
    assert result.heldout_probabilities is not None


@pytest.mark.parametrize("seed", [0, 3, 6])
def test_the_probe_does_not_win_when_the_features_are_noise(seed: int) -> None:
    z, y, x = logit_world(300, seed)
    result = fit_calibrator(
        z,
        y,
        methods=["temperature", "bias_temperature", "probe"],
        probe=ProbeInputs(x, LAYERS, NUM_LAYERS),
    )
    assert result.method == "temperature"
    assert isinstance(result.map, Temperature)
    assert result.map.temperature == pytest.approx(2.0, rel=0.25)
    # The probe can be a temperature (its weights on the log-probabilities), so its held-out
    # NLL is close to temperature scaling's; its 24 weights on noise add variance. Measured on
    # seeds 0 to 19: temperature chosen every time, the probe's cross-validated NLL from 0.015
    # below it (seed 3: within one standard error, so the rule keeps the simpler map) to 0.057
    # above (18 of 20 above). Never better by more than noise:
    assert result.cv_nll["probe"] > result.cv_nll["temperature"] - 0.03


# ---------------------------------------------------------------------------------------------
# Classes the fit never saw.


def test_a_class_absent_from_the_fit_labels_gets_a_tiny_probability() -> None:
    z, y, x = layer_world(400, seed=3)
    seen = y != 2
    flat = x[:, LAYERS.index(SIGNAL_LAYER)].astype(np.float64)
    weights, intercept = fit_probe_weights(flat[seen], np.log(softmax(z[seen])), y[seen], 3, 1.0)
    assert not weights[2].any()
    probe = Probe(
        layers=[SIGNAL_LAYER],
        num_layers=NUM_LAYERS,
        feature_dim=H,
        weights=weights.tolist(),
        intercept=intercept.tolist(),
        l2=1.0,
    )
    p = probe.apply(z, flat)  # every item, those of the unseen class included
    assert np.all(np.isfinite(p))
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    assert np.all(p[:, 2] > 0) and p[:, 2].max() < 1e-4  # 10 nats below every fitted class


def test_a_single_class_fits_a_head_that_answers_it() -> None:
    z, _, x = layer_world(5, seed=4)
    weights, intercept = fit_probe_weights(x[:, 0].astype(np.float64), z, np.ones(5, int), 3, 1)
    assert not weights.any() and intercept.tolist() == [-10.0, 0.0, -10.0]


def test_a_rare_class_does_not_break_the_fit() -> None:
    # One item of 150 is "b": the fold that holds it out trains on "a" alone, which logistic
    # regression cannot fit. That fold's head answers "a"; the item's held-out NLL is large.
    z, _, x = layer_world(150, seed=4)
    z = z[:, :2] - np.logaddexp(z[:, 0], z[:, 1])[:, None]
    y = np.zeros(150, dtype=np.int64)
    y[90] = 1
    result = fit_calibrator(
        z, y, methods=["temperature", "probe"], probe=ProbeInputs(x, LAYERS, 12)
    )
    assert all(math.isfinite(v) for v in result.cv_nll.values())
    assert np.all(np.isfinite(result.map.apply(z, map_features(result.map, x, LAYERS))))
    # Through fit_profile: with two "b" among 150, the fit split holds no "b" at all.
    y[10] = 1
    profile = fit(z, y, x, choices=["a", "b"], methods="auto")
    assert {"probe", "temperature"} <= profile.cv_nll.keys()
    assert all(math.isfinite(v) for v in profile.cv_nll.values())


# ---------------------------------------------------------------------------------------------
# Bad input: the map itself, and a profile's JSON.


def probe_fields(**changes: Any) -> dict[str, Any]:
    """A valid 2-choice probe on one layer of width 2, with ``changes``."""
    fields: dict[str, Any] = {
        "layers": [8],
        "num_layers": 12,
        "feature_dim": 2,
        "weights": [[0.5, -0.5, 1.0, 0.0], [0.0, 0.25, 0.0, 1.0]],
        "intercept": [0.0, 0.1],
        "l2": 1.0,
    }
    return {**fields, **changes}


WIDE = MAX_PROBE_WEIGHTS // 2  # 2 rows of WIDE + 2 numbers: just over the limit


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"weights": [[0.0] * 4] * 3}, r"calibration_map\.weights must be 2 rows"),
        ({"weights": [[0.0] * 4, [0.0] * 3]}, r"calibration_map\.weights must be 2 rows"),
        ({"intercept": [0.0, 0.0, 0.0]}, r"one per entry of calibration_map\.intercept"),
        ({"intercept": [0.0]}, r"calibration_map\.intercept must hold one number per choice"),
        ({"weights": [[math.nan, 0, 0, 0], [0] * 4]}, r"calibration_map\.weights must be finite"),
        ({"weights": [[math.inf, 0, 0, 0], [0] * 4]}, r"calibration_map\.weights must be finite"),
        ({"weights": [[1e7, 0, 0, 0], [0] * 4]}, r"calibration_map\.weights must be finite"),
        ({"intercept": [0.0, -math.inf]}, r"calibration_map\.intercept must be finite"),
        (
            {"feature_dim": WIDE, "weights": [[0.0] * (WIDE + 2)] * 2},
            rf"calibration_map\.weights holds {2 * (WIDE + 2)} numbers, over the limit",
        ),
        ({"layers": [8, 8], "weights": [[0.0] * 6] * 2}, r"calibration_map\.layers \[8, 8\]"),
        ({"layers": [13]}, r"calibration_map\.layers \[13\] must be distinct layers of the 12"),
        ({"layers": []}, r"calibration_map\.layers \[\]"),
        ({"layers": [0]}, r"calibration_map\.layers \[0\]"),
        ({"l2": math.nan}, r"calibration_map\.l2 must be a positive number"),
    ],
)
def test_a_bad_probe_is_a_rule_error_naming_the_field(
    changes: dict[str, Any], message: str
) -> None:
    Probe(**probe_fields())  # the valid one is valid
    with pytest.raises(RuleError, match=message):
        Probe(**probe_fields(**changes))


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit of a profile's builtins that sets ``path`` ("a.b.0") to ``value``."""

    def edit(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return edit


HUGE = "a number JSON can write and a float cannot hold"  # replaced by 1e400 in the JSON


def _wide(data: dict[str, Any]) -> None:
    # Three rows of 2**17 + 3 numbers, over the limit, and a profile whose width agrees.
    data["calibration_map"]["feature_dim"] = data["fingerprint"]["hidden_size"] = 2**17
    data["calibration_map"]["weights"] = [[0.0] * (2**17 + 3)] * 3


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["calibration_map"]["weights"].pop(), r"calibration_map\.weights must be 3"),
        (lambda d: d["calibration_map"]["weights"][1].pop(), r"calibration_map\.weights must be"),
        (lambda d: d["calibration_map"]["intercept"].append(0.0), r"calibration_map\.intercept"),
        (_set("calibration_map.weights.0.0", HUGE), r"calibration_map\.weights\[0\]\[0\]"),
        (_set("calibration_map.weights.2.5", 1e7), r"calibration_map\.weights must be finite"),
        (_set("calibration_map.intercept.1", HUGE), r"calibration_map\.intercept\[1\]"),
        (_set("calibration_map.intercept.1", 1e9), r"calibration_map\.intercept must be finite"),
        (_wide, r"calibration_map\.weights holds 393225 numbers, over the limit of 262144"),
        (_set("calibration_map.layers", [8, 8]), r"calibration_map\.layers \[8, 8\]"),
        (_set("calibration_map.layers", [13]), r"calibration_map\.layers \[13\]"),
        (_set("calibration_map.layers", [0]), r"calibration_map\.layers\[0\]"),
        (_set("calibration_map.l2", 0.0), r"calibration_map\.l2"),
        (_set("calibration_map.feature_dim", 0), r"calibration_map\.feature_dim"),
        (_set("fingerprint.num_layers", 24), r"fingerprint\.num_layers is 24 but the probe was"),
        (_set("fingerprint.hidden_size", 16), r"fingerprint\.hidden_size is 16 but the probe"),
    ],
)
def test_a_bad_probe_profile_is_a_profile_error_naming_the_field(
    profile: CalibrationProfile, edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    data = msgspec.to_builtins(profile)
    decode_profile(msgspec.json.encode(data))  # unedited, it decodes
    edit(data)
    with pytest.raises(ProfileError, match=message):
        decode_profile(msgspec.json.encode(data).replace(b'"' + HUGE.encode() + b'"', b"1e400"))


# ---------------------------------------------------------------------------------------------
# Serving: features missing or of the wrong width, and the engine's shape.


def test_missing_features_are_a_mismatch_naming_features(profile: CalibrationProfile) -> None:
    z, _, x = layer_world(3, seed=5)
    probe = profile.calibration_map
    assert isinstance(probe, Probe)
    with pytest.raises(ProfileMismatchError, match="judge with feature_layers=") as info:
        probe.apply(z)
    assert info.value.field == "features"
    row = x[0, LAYERS.index(SIGNAL_LAYER)].tolist()
    for judged in (
        Scored(dict(zip(CHOICES, z[0].tolist(), strict=True))),
        judgment(z[0], None),
        judgment(z[0], {4: row}),  # features, but not of the probe's layer
    ):
        with pytest.raises(ProfileMismatchError) as info:
            Gate(profile).decide(judged)
        assert info.value.field == "features"
    with pytest.raises(ProfileMismatchError) as info:
        profile.calibrate(Scored(dict(zip(CHOICES, z[0].tolist(), strict=True))))
    assert info.value.field == "features"
    with pytest.raises(ValueError, match="pass the items' features"):
        evaluate_policy(profile, z, [0, 1, 2], n_bootstrap=10)


def test_features_of_the_wrong_width_are_a_mismatch_naming_hidden_size(
    profile: CalibrationProfile,
) -> None:
    z, _, x = layer_world(3, seed=6)
    probe = profile.calibration_map
    assert isinstance(probe, Probe)
    flat = x[:, LAYERS.index(SIGNAL_LAYER)]  # (3, H)
    for wrong in (flat[:, :-1], np.concatenate([flat, flat], axis=1)):
        with pytest.raises(ProfileMismatchError, match=f"width {H}") as info:
            probe.apply(z, wrong)
        assert info.value.field == "hidden_size"
    with pytest.raises(ProfileMismatchError) as info:
        Gate(profile).decide(judgment(z[0], {SIGNAL_LAYER: flat[0, :-1].tolist()}))
    assert info.value.field == "hidden_size"
    # Features for another number of items are refused, not dealt out across the rows.
    with pytest.raises(ValueError, match="one row per row of the logits"):
        probe.apply(z[:2], flat[:1].repeat(2, axis=1))


def test_check_refuses_an_engine_of_another_shape_for_a_probe_only(
    profile: CalibrationProfile,
) -> None:
    profile.check(engine())
    for field, fitted, value in (("num_layers", NUM_LAYERS, 24), ("hidden_size", H, 16)):
        with pytest.raises(ProfileMismatchError, match=f"{field} {fitted}, not {value}") as info:
            profile.check(engine(**{field: value}))
        assert info.value.field == field
    # A scalar profile reads no hidden state: another shape changes nothing for it.
    z, y, x = layer_world(200, seed=7)
    scalar = fit(z, y, x, methods=["temperature"])
    assert not isinstance(scalar.calibration_map, Probe)
    scalar.check(engine(num_layers=24, hidden_size=16))
    scalar.check(engine(num_layers=None, hidden_size=None))


# ---------------------------------------------------------------------------------------------
# Which methods are tried.


def test_auto_falls_back_to_the_scalar_maps_below_the_minimum_and_says_why() -> None:
    z, y, x = layer_world(60, seed=8)
    assert MIN_PROBE_EXAMPLES > 60
    fallback = fit(z, y, x, methods="auto")
    assert not isinstance(fallback.calibration_map, Probe)
    assert "probe" not in fallback.cv_nll and "temperature" in fallback.cv_nll
    assert f"probe not tried: 60 labeled examples, fewer than the {MIN_PROBE_EXAMPLES}" in (
        fallback.note
    )
    assert fallback.baseline is None
    no_features = fit(z, y, None, methods="auto")
    assert "probe not tried: no hidden-state features were given" in no_features.note


def test_an_explicit_probe_needs_the_examples_and_the_features() -> None:
    z, y, x = layer_world(60, seed=8)
    with pytest.raises(FitError, match=r"method 'probe' needs at least 100 labeled .*got 60"):
        fit(z, y, x, methods=["probe"])
    z, y, _ = layer_world(200, seed=8)
    with pytest.raises(FitError, match="method 'probe' needs the hidden-state features"):
        fit(z, y, None, methods=["probe"])


# ---------------------------------------------------------------------------------------------
# A fitted probe profile: JSON, decisions, evaluation.


def test_a_probe_profile_round_trips_and_decides_identically(profile: CalibrationProfile) -> None:
    data = msgspec.json.encode(profile)
    decoded = decode_profile(data)
    assert decoded == profile
    assert decoded.feature_layers == (SIGNAL_LAYER,)
    z, _, x = layer_world(50, seed=9)
    judged = [
        judgment(z[i], {n: x[i, LAYERS.index(n)].tolist() for n in LAYERS}) for i in range(50)
    ]
    assert Gate(decoded).decide_many(judged) == Gate(profile).decide_many(judged)


def test_a_probe_profile_of_the_default_model_is_small() -> None:
    # k = 2 on the 576-wide hidden state of the default model: 2 x (576 + 2) = 1156 weights.
    rng = np.random.default_rng(10)
    hidden = 576
    x = rng.normal(size=(200, 1, hidden)).astype(np.float32)
    y = sample(softmax(np.stack([np.zeros(200), x[:, 0, :20].sum(axis=1)], axis=1)), rng)
    z = np.log(softmax(rng.normal(size=(200, 2))))
    fitted = fit_profile(
        "sst2-probe",
        LabeledScores(z, np.ones(len(y)), y, features=x, feature_layers=(20,)),
        ["negative", "positive"],
        Provenance(
            fingerprint=engine(num_layers=30, hidden_size=hidden),
            dataset="synthetic",
            dataset_sha256="0",
        ),
        FitSettings(methods=["probe"], n_bootstrap=10),
    ).profile
    assert isinstance(fitted.calibration_map, Probe)
    data = msgspec.json.encode(fitted)
    # A float is at most 24 characters of JSON and a comma: the weights take at most 29 KB
    # (about 15 KB measured), and everything else in the profile, the baseline included,
    # about 5 KB.
    assert len(msgspec.json.encode(fitted.calibration_map)) <= 25 * 1156 + 200
    assert len(data) < 40_000
    assert decode_profile(data) == fitted


def test_evaluate_policy_evaluates_the_baseline_on_the_same_items(
    profile: CalibrationProfile,
) -> None:
    z, y, x = layer_world(400, seed=11)
    features = x[:, [LAYERS.index(n) for n in profile.feature_layers]]  # (n, 1, H)
    report = evaluate_policy(profile, z, y, features=features, n_bootstrap=20)
    assert report.method == "probe"
    base = report.baseline
    assert base is not None and profile.baseline is not None
    assert base.method == profile.baseline.calibration_map.method
    assert base.baseline is None
    assert base.n == report.n == 400
    assert base.before == report.before  # the same items' raw probabilities
    baseline_profile = profile.baseline_profile()
    assert baseline_profile is not None
    assert base == evaluate_policy(baseline_profile, z, y, n_bootstrap=20)
    # Here the log-probabilities are noise and the features carry the label.
    assert report.after.nll.value < base.after.nll.value - 0.3


def test_decide_reads_the_judgments_features_as_apply_does(profile: CalibrationProfile) -> None:
    z, _, x = layer_world(20, seed=12)
    probe = profile.calibration_map
    assert isinstance(probe, Probe)
    flat = x[:, LAYERS.index(SIGNAL_LAYER)].astype(np.float64)  # (20, H)
    expected = probe.apply(z, flat)
    for i in range(20):
        # The engine's judgment: every judged layer, as lists of floats.
        judged = judgment(z[i], {n: x[i, LAYERS.index(n)].tolist() for n in LAYERS})
        decision = Gate(profile).decide(judged)
        got = [decision.probabilities[c] for c in CHOICES]
        np.testing.assert_allclose(got, expected[i], rtol=1e-12)
        calibrated = profile.calibrate(judged)
        np.testing.assert_allclose([calibrated[c] for c in CHOICES], expected[i], rtol=1e-12)
