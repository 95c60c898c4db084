"""A probe on the item's own tokens: the mean hidden state over the item, beside or instead of
the decision point's state, from fitting to serving.

Synthetic worlds whose truth is known: the label follows the mean over the item of one layer,
and the decision point's states are noise. The real model's figures are benchmarks'
(bench_span_features.py, bench_calibration.py).
"""

from __future__ import annotations

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from fakes import FINGERPRINT, judgment_of
from sklearn.model_selection import StratifiedKFold
from threadpoolctl import threadpool_limits

from calibration import FitSettings, Provenance, evaluate_policy, fit_profile
from calibration.errors import ProfileMismatchError, RuleError
from calibration.gate import Gate
from calibration.maps.map_types import Probe, softmax
from calibration.maps.probe import fit_probe, map_features
from calibration.profile import CalibrationProfile
from calibration.tasks import LabeledScores, Task, task_item_span, task_prompt
from judge import Judgment, Query

CHOICES = ["a", "b", "c"]
LAYERS = (4, 8, 12)
NUM_LAYERS, H = 12, 8
SIGNAL_LAYER = 8
A = np.random.default_rng(7).normal(0.0, 1.5, size=(len(CHOICES), H))
FloatArray = npt.NDArray[np.float64]


def mean_world(n: int, seed: int) -> tuple[FloatArray, np.ndarray, np.ndarray, np.ndarray]:
    """(log-probabilities, labels, points (n, 3, H), means (n, 3, H)): the label follows the
    mean over the item at ``SIGNAL_LAYER``; everything else is noise."""
    rng = np.random.default_rng(seed)
    points = rng.normal(size=(n, len(LAYERS), H))
    means = rng.normal(size=(n, len(LAYERS), H))
    p = softmax(means[:, LAYERS.index(SIGNAL_LAYER)] @ A.T)
    u = rng.random((n, 1))
    y = np.minimum((u > np.cumsum(p, axis=1)).sum(axis=1), len(CHOICES) - 1)
    z = np.log(softmax(rng.normal(size=(n, len(CHOICES)))))
    return z, y.astype(np.int64), points.astype(np.float32), means.astype(np.float32)


def folds(y: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    return list(StratifiedKFold(5, shuffle=True, random_state=0).split(np.zeros((len(y), 1)), y))


@pytest.fixture(scope="module")
def profile() -> CalibrationProfile:
    z, y, points, means = mean_world(500, seed=0)
    fingerprint = msgspec.structs.replace(FINGERPRINT, num_layers=NUM_LAYERS, hidden_size=H)
    fitted = fit_profile(
        "span",
        LabeledScores(
            z,
            np.ones(len(y)),
            y,
            features=points,
            feature_layers=LAYERS,
            span_features=means,
            span="item",
        ),
        CHOICES,
        Provenance(fingerprint=fingerprint, dataset="mean world", dataset_sha256="0" * 64),
        FitSettings(methods=["probe"], n_bootstrap=20),
    ).profile
    assert isinstance(fitted.calibration_map, Probe)
    return fitted


def judged(
    z: FloatArray,
    point: dict[int, list[float]] | None,
    means: dict[int, list[float]] | None,
    item_span: tuple[int, int] | None,
) -> Judgment:
    made = judgment_of(dict(zip(CHOICES, np.exp(z).tolist(), strict=True)))
    return msgspec.structs.replace(made, features=point, span_features=means, item_span=item_span)


def test_fit_probe_reads_the_mean_where_the_label_lives() -> None:
    z, y, points, means = mean_world(400, seed=1)
    with threadpool_limits(limits=1, user_api="blas"):
        result = fit_probe(
            points, LAYERS, NUM_LAYERS, z, y, folds(y), span_features=means, span="item"
        )
        alone = fit_probe(points, LAYERS, NUM_LAYERS, z, y, folds(y))
    probe = result.probe
    assert (probe.layers, probe.reads, probe.span) == ([SIGNAL_LAYER], "mean", "item")
    assert probe.feature_layers == () and probe.span_layers == (SIGNAL_LAYER,)
    # Every layer was tried reading the point, the mean and both, at every C.
    assert len(result.cv_nll) == len(LAYERS) * 3 * 4
    assert "layer 8 mean, C" in result.note
    # Without means, only the points compete, and they are noise here.
    assert alone.probe.reads == "point" and alone.probe.span is None
    assert result.heldout_nll.mean() < alone.heldout_nll.mean() - 0.2


def test_a_probe_reading_both_takes_the_points_then_the_means() -> None:
    rng = np.random.default_rng(3)
    k, width = len(CHOICES), 2 * H + len(CHOICES)
    probe = Probe(
        layers=[SIGNAL_LAYER],
        num_layers=NUM_LAYERS,
        feature_dim=H,
        weights=rng.normal(size=(k, width)).tolist(),
        intercept=[0.0] * k,
        l2=1.0,
        reads="point+mean",
        span="prompt",
    )
    assert probe.feature_layers == probe.span_layers == (SIGNAL_LAYER,)
    z, _, points, means = mean_world(5, seed=4)
    x = map_features(probe, points, LAYERS, means)
    assert x is not None and x.shape == (5, 2 * H)
    m = LAYERS.index(SIGNAL_LAYER)
    np.testing.assert_array_equal(x[:, :H], points[:, m])
    np.testing.assert_array_equal(x[:, H:], means[:, m])
    got = Gate(profile_with(probe)).decide(
        judged(
            z[0],
            {SIGNAL_LAYER: points[0, m].tolist()},
            {SIGNAL_LAYER: means[0, m].tolist()},
            None,
        )
    )
    np.testing.assert_allclose(
        [got.probabilities[c] for c in CHOICES], probe.apply(z[0], x[0]), rtol=1e-12
    )
    assert msgspec.json.decode(msgspec.json.encode(probe), type=Probe) == probe


def profile_with(probe: Probe) -> CalibrationProfile:
    """A profile of ``mean_world`` with ``probe`` as its map (the rest as fitted)."""
    z, y, _, _ = mean_world(200, seed=9)
    fingerprint = msgspec.structs.replace(FINGERPRINT, num_layers=NUM_LAYERS, hidden_size=H)
    base = fit_profile(
        "base",
        LabeledScores(z, np.ones(len(y)), y),
        CHOICES,
        Provenance(fingerprint=fingerprint, dataset="mean world", dataset_sha256="0" * 64),
        FitSettings(methods=["temperature"], n_bootstrap=20),
    ).profile
    return msgspec.structs.replace(base, calibration_map=probe)


def test_a_probe_on_points_keeps_its_json() -> None:
    """Reading the point is the default, left out of the JSON: a probe fitted before means
    existed encodes (and hashes, in a policy without an ETag) as it did."""
    probe = Probe(
        layers=[2],
        num_layers=4,
        feature_dim=1,
        weights=[[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]],
        intercept=[0.0, 0.0],
        l2=1.0,
    )
    assert set(msgspec.json.decode(msgspec.json.encode(probe))) == {
        "method",
        "layers",
        "num_layers",
        "feature_dim",
        "weights",
        "intercept",
        "l2",
    }


@pytest.mark.parametrize(("reads", "span"), [("mean", None), ("point", "item")])
def test_a_probe_names_its_span_exactly_when_it_reads_means(reads: str, span: str | None) -> None:
    with pytest.raises(RuleError, match=r"calibration_map\.span"):
        Probe(
            layers=[2],
            num_layers=4,
            feature_dim=1,
            weights=[[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]],
            intercept=[0.0, 0.0],
            l2=1.0,
            reads=reads,  # type: ignore[arg-type]
            span=span,  # type: ignore[arg-type]
        )


def test_the_gate_asks_for_the_means_and_decides_on_them(profile: CalibrationProfile) -> None:
    gate = Gate(profile)
    assert gate.span_layers == (SIGNAL_LAYER,) and gate.feature_layers == ()
    asked = gate.asks(Query(prompt="p", choices=CHOICES, item_span=(0, 1)))
    assert asked.span_layers == (SIGNAL_LAYER,) and asked.item_span == (0, 1)
    z, _, _, means = mean_world(30, seed=5)
    m = LAYERS.index(SIGNAL_LAYER)
    probe = profile.calibration_map
    assert isinstance(probe, Probe)
    expected = probe.apply(z, means[:, m].astype(np.float64))
    for i in range(30):
        got = gate.decide(judged(z[i], None, {SIGNAL_LAYER: means[i, m].tolist()}, (0, 1)))
        np.testing.assert_allclose([got.probabilities[c] for c in CHOICES], expected[i], rtol=1e-12)


def test_means_missing_or_over_other_tokens_are_a_mismatch_naming_the_field(
    profile: CalibrationProfile,
) -> None:
    z, _, _, means = mean_world(1, seed=6)
    row = {SIGNAL_LAYER: means[0, LAYERS.index(SIGNAL_LAYER)].tolist()}
    gate = Gate(profile)
    cases = [
        (judged(z[0], None, None, (0, 1)), "span_layers"),
        (judged(z[0], None, {4: row[SIGNAL_LAYER]}, (0, 1)), "span_layers"),
        (judged(z[0], None, row, None), "item_span"),  # fitted on marked items
    ]
    for judgment, field in cases:
        with pytest.raises(ProfileMismatchError) as info:
            gate.decide(judgment)
        assert info.value.field == field
        with pytest.raises(ProfileMismatchError):
            profile.calibrate(judgment)
    probe = profile.calibration_map
    assert isinstance(probe, Probe)
    whole = profile_with(msgspec.structs.replace(probe, span="prompt"))
    with pytest.raises(ProfileMismatchError, match="send no item_span") as info:
        Gate(whole).decide(judged(z[0], None, row, (0, 1)))
    assert info.value.field == "item_span"


def test_evaluate_policy_reads_the_means(profile: CalibrationProfile) -> None:
    z, y, points, means = mean_world(300, seed=8)
    layers = [LAYERS.index(SIGNAL_LAYER)]
    with pytest.raises(ValueError, match="span_features"):
        evaluate_policy(profile, z, y, features=points[:, layers], n_bootstrap=10)
    report = evaluate_policy(profile, z, y, span_features=means[:, layers], n_bootstrap=10)
    assert report.method == "probe" and report.after.accuracy.value > 0.6


def test_labeled_scores_name_the_span_of_their_means() -> None:
    z, y, points, means = mean_world(10, seed=2)
    with pytest.raises(ValueError, match="span names the tokens"):
        LabeledScores(z, np.ones(10), y, points, LAYERS, span_features=means)
    with pytest.raises(ValueError, match="shape of features"):
        LabeledScores(z, np.ones(10), y, points, LAYERS, means[:, :2], "item")
    scores = LabeledScores(z, np.ones(10), y, points, LAYERS, means, "item")
    got = scores.span_features_of([SIGNAL_LAYER])
    assert got is not None
    np.testing.assert_array_equal(got[:, 0], means[:, LAYERS.index(SIGNAL_LAYER)])


def test_a_task_item_is_marked_where_task_prompt_puts_it() -> None:
    task = Task(name="t", choices=["x", "y"], instruction="Classify the text.", path="")
    prompt = task_prompt(task, "some text")
    span = task_item_span(task, "some text")
    assert span is not None and prompt[span[0] : span[1]] == "some text"
    assert task_item_span(task, "") is None


def test_the_labels_estimate_reads_the_means_too(profile: CalibrationProfile) -> None:
    """``judge check``'s estimate judges the profile's own map on its held-out items: a probe
    on means needs them there as well (here the map certifies, so: enough already)."""
    from calibration.fitting import labels_for_next_look

    z, y, points, means = mean_world(500, seed=0)  # the items the profile was fitted from
    needed = labels_for_next_look(
        profile, z, y, features=points, feature_layers=LAYERS, span_features=means
    )
    assert needed.given == 500 and needed.labels is not None
    with pytest.raises(ValueError, match="means over the item"):
        labels_for_next_look(profile, z, y, features=points, feature_layers=LAYERS)
