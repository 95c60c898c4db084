"""Label-free prior correction: contextual and batch calibration, profiles and the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from fakes import FINGERPRINT, Scored

from calibration import (
    BatchTemperatureScaler,
    BiasTemperature,
    FitError,
    FitSettings,
    LabeledScores,
    Provenance,
    decode_profile,
    estimate_prior,
    evaluate_policy,
    fit_calibrator,
    fit_label_free_profile,
    fit_profile,
    prior_correction,
)
from calibration.gate import Gate
from calibration.maps.scaling import softmax
from calibration.report import profile_markdown
from calibration.tasks import content_free_prompts, load_task
from judge import Judge
from service.cli.main import main

CHOICES = ["a", "b", "c"]
DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
TREC = DATA / "trec"
needs_data = pytest.mark.skipif(not TREC.exists(), reason="the shared datasets are not here")


def biased(n: int, seed: int, shift: tuple[float, ...] = (3.0, 0.0, -3.0)) -> tuple[Any, Any]:
    """Balanced labels; the scores know the label (+2) but carry a fixed per-choice bias."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=n)
    z = rng.normal(0, 1, size=(n, 3)) + np.array(shift)
    z[np.arange(n), y] += 2.0
    return z - np.log(np.exp(z).sum(1, keepdims=True)), y


def test_the_correction_is_a_bias_temperature_map_dividing_out_the_prior() -> None:
    prior = [0.7, 0.2, 0.1]
    m = prior_correction(prior)
    assert isinstance(m, BiasTemperature) and m.temperature == 1.0
    assert sum(m.bias) == pytest.approx(0.0, abs=1e-12)
    z = np.log(np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    expected = np.exp(z) / np.array(prior)
    expected /= expected.sum(1, keepdims=True)
    np.testing.assert_allclose(m.apply(z), expected, rtol=1e-12)
    # The prior itself becomes uniform: that is what "divide out the prior" means.
    np.testing.assert_allclose(m.apply(np.log(prior)), [1 / 3] * 3, rtol=1e-12)


def test_estimate_prior_is_the_mean_probability_vector() -> None:
    z, _ = biased(200, seed=0)
    np.testing.assert_allclose(estimate_prior(z), softmax(z).mean(0), rtol=1e-12)
    with pytest.raises(FitError, match="empty"):
        estimate_prior(np.zeros((0, 3)), name="unlabeled inputs")


def test_batch_calibration_fixes_a_prior_without_labels() -> None:
    z, y = biased(3000, seed=1)
    raw_acc = float((z.argmax(1) == y).mean())
    profile = fit_label_free_profile(
        "bc",
        z[:1000],
        CHOICES,
        method="batch",
        source="synthetic unlabeled",
        fingerprint=FINGERPRINT,
        dataset="d",
        dataset_sha256="0",
    )
    probs = profile.calibration_map.apply(z[1000:])
    assert float((probs.argmax(1) == y[1000:]).mean()) > raw_acc + 0.2
    # Honest about what it is: no labels, so no certificate, no metrics, no signal verdict.
    assert profile.label_free is not None and profile.label_free.method == "batch"
    assert profile.label_free.n_inputs == 1000 == profile.n_examples
    assert profile.threshold.threshold is None and "no labels" in profile.threshold.reason
    assert profile.metrics_before is None and profile.metrics_after is None
    assert profile.signal is None and profile.conformal_quantile is None
    assert decode_profile(msgspec.json.encode(profile)) == profile
    report = profile_markdown(profile)
    assert "signal: untested" in report and "batch" in report and "No metrics" in report
    # Served: every decision escalates for want of a threshold, with no conformal gate.
    d = Gate(profile).decide(Scored(dict(zip(CHOICES, z[0], strict=True))))
    assert d.reason_codes == ["no_certified_threshold"] and d.prediction_set is None
    evaluation = evaluate_policy(profile, z[1000:], y[1000:], threshold=0.5)
    assert evaluation.conformal_coverage is None and evaluation.after.accuracy.value > raw_acc


def test_an_empty_unlabeled_set_is_a_clear_error() -> None:
    for method, words in [("batch", "unlabeled inputs is empty"), ("contextual", "content-free")]:
        with pytest.raises(FitError, match=words):
            fit_label_free_profile(
                "x",
                np.zeros((0, 3)),
                CHOICES,
                method=method,
                source="s",
                fingerprint=FINGERPRINT,
                dataset="d",
                dataset_sha256="0",
            )


def test_batch_temperature_is_a_labeled_candidate_chosen_by_cv_nll() -> None:
    z, y = biased(600, seed=2)
    scaler = BatchTemperatureScaler().fit(z, y)
    np.testing.assert_allclose(scaler.prior_, softmax(z).mean(0), rtol=1e-12)
    manual = softmax((z - np.log(scaler.prior_)) / scaler.temperature_)
    np.testing.assert_allclose(scaler.predict_proba(z), manual, rtol=1e-9)
    fit = fit_calibrator(z, y, methods=("temperature", "batch_temperature"))
    assert fit.method == "batch_temperature" and fit.prior is not None
    assert fit.cv_nll["batch_temperature"] < fit.cv_nll["temperature"]
    assert isinstance(fit.map, BiasTemperature)
    np.testing.assert_allclose(fit.map.apply(z), manual, rtol=1e-9)
    profile = fit_profile(
        "bt",
        LabeledScores(z, np.ones(len(y)), y),
        CHOICES,
        Provenance(fingerprint=FINGERPRINT, dataset="d", dataset_sha256="0"),
        FitSettings(n_bootstrap=20, methods=("temperature", "batch_temperature")),
    ).profile
    assert profile.label_free is not None and profile.label_free.method == "batch"
    assert profile.label_free.n_inputs == profile.split.fit
    assert profile.metrics_after is not None and profile.signal is not None


# --- the command line, real model ----------------------------------------------------------


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch, judge: Judge) -> Judge:
    monkeypatch.setattr(Judge, "load", staticmethod(lambda model=None, **options: judge))
    return judge


@needs_data
def test_calibrate_unlabeled_contextual_and_batch(
    tmp_path: Path, model: Judge, capsys: pytest.CaptureFixture[str]
) -> None:
    task = load_task(TREC)
    assert len(content_free_prompts(task)) == 3
    common = ["calibrate", "--task", str(TREC), "--profiles-dir", str(tmp_path)]
    assert main([*common, "--unlabeled", "contextual", "--name", "ctx"]) == 0
    ctx = decode_profile((tmp_path / "ctx.json").read_bytes())
    assert ctx.label_free is not None and ctx.label_free.method == "contextual"
    assert ctx.label_free.n_inputs == 3 and ctx.dataset == "trec/content-free"
    # The stored correction is the content-free prior, divided out.
    z = np.array(
        [
            [j.log_probabilities[c] for c in task.choices]
            for j in model.judge_batch(
                [{"prompt": p, "choices": task.choices} for p in content_free_prompts(task)]
            )
        ]
    )
    np.testing.assert_allclose(ctx.label_free.prior, softmax(z).mean(0), rtol=1e-4)
    assert "untested" in capsys.readouterr().out

    assert main([*common, "--unlabeled", "--limit", "16", "--name", "bat"]) == 0
    bat = decode_profile((tmp_path / "bat.json").read_bytes())
    assert bat.label_free is not None and bat.label_free.method == "batch"
    assert bat.n_examples == 16 and bat.dataset == "trec/calibration"
    assert "labels ignored" in bat.label_free.source

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": f"What is {w}?"}) for w in ("NASA", "Paris")) + "\n"
    )
    assert main([*common, "--unlabeled", "batch", "--input", str(prompts), "--name", "jl"]) == 0
    assert decode_profile((tmp_path / "jl.json").read_bytes()).n_examples == 2


@needs_data
def test_empty_unlabeled_sets_are_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model must not be loaded for an empty set")

    monkeypatch.setattr(Judge, "load", staticmethod(no_model))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    common = ["calibrate", "--task", str(TREC), "--profiles-dir", str(tmp_path)]
    assert main([*common, "--unlabeled", "batch", "--input", str(empty)]) == 2
    assert "--input" in capsys.readouterr().err
    assert main([*common, "--unlabeled", "contextual", "--input", str(empty)]) == 2
    assert "--input" in capsys.readouterr().err
