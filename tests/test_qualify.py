"""`judge qualify`: the criteria on synthetic scores, and the command on the real model."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from calibration.maps.scaling import TemperatureScaler
from calibration.metrics import ece
from calibration.qualify import Criteria, Qualification, TaskQualification, qualify_task
from calibration.tasks import load_task, qualify_on_task
from judge import Judge
from service.cli.main import main

SMS = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "sms_spam"
needs_data = pytest.mark.skipif(
    not SMS.exists(), reason="the shared datasets are not beside this checkout"
)
CHOICES = ["no", "yes"]


def _scores(n: int, p_right: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(n, 2) log-probabilities that give the label p_right, right in about p_right of items
    (a calibrated model), and the labels."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    right = rng.random(n) < p_right
    top = np.where(right, labels, 1 - labels)
    p = np.full((n, 2), 1 - p_right)
    p[np.arange(n), top] = p_right
    return np.log(p), labels


def _qualify(
    z: np.ndarray,
    labels: np.ndarray,
    *,
    rerun: np.ndarray | None = None,
    reordered: np.ndarray | None = None,
    mass: float = 0.9,
    criteria: Criteria | None = None,
) -> TaskQualification:
    fit_z, fit_labels = _scores(400, 0.97, seed=9)
    return qualify_task(
        "synthetic",
        z,
        labels,
        np.full(len(labels), mass),
        rerun_log_probs=z if rerun is None else rerun,
        reordered_log_probs=z if reordered is None else reordered,
        fit_log_probs=fit_z,
        fit_labels=fit_labels,
        choices=CHOICES,
        criteria=criteria,
    )


def _flipped(z: np.ndarray, share: float) -> np.ndarray:
    """``z`` with the first ``share`` of rows' columns swapped: their decisions flip."""
    out = z.copy()
    m = int(len(z) * share)
    out[:m] = out[:m, ::-1]
    return out


def test_a_sure_calibrated_stable_model_qualifies() -> None:
    z, labels = _scores(400, 0.97, seed=1)
    result = _qualify(z, labels)
    assert result.misses == [] and result.qualifies
    assert result.flip_rate == result.order_flips == result.max_rerun_change == 0.0
    assert result.confident_share == 1.0
    assert result.accuracy_at_confidence is not None and result.accuracy_at_confidence > 0.93
    assert result.beats_prior


@pytest.mark.parametrize(
    ("change", "miss"),
    [
        ({"rerun": 0.05}, "flip rate 0.050 > 0.02"),
        ({"reordered": 0.2}, "order flips 0.200 > 0.1"),
        ({"mass": 0.3}, "choice mass 0.300 < 0.5"),
    ],
)
def test_each_criterion_is_missed_on_its_own(change: dict[str, float], miss: str) -> None:
    z, labels = _scores(400, 0.97, seed=2)
    options: dict[str, object] = {}
    if "rerun" in change:
        options["rerun"] = _flipped(z, change["rerun"])
    if "reordered" in change:
        options["reordered"] = _flipped(z, change["reordered"])
    if "mass" in change:
        options["mass"] = change["mass"]
    result = _qualify(z, labels, **options)  # type: ignore[arg-type]
    assert result.misses == [miss]


def test_an_unsure_model_decides_nothing_at_the_confidence() -> None:
    z, labels = _scores(400, 0.7, seed=3)  # calibrated, never at 0.9
    result = _qualify(z, labels)
    assert result.accuracy_at_confidence is None
    assert result.misses == ["no item reached confidence >= 0.9: the model decides nothing there"]
    # A lower bar, as a flag would set it, finds the items and their accuracy.
    lower = _qualify(z, labels, criteria=Criteria(confidence=0.6, min_accuracy=0.6))
    assert lower.confident_share == 1.0 and lower.misses == []


def test_an_overconfident_model_misses_ece_unless_read_calibrated() -> None:
    # Right 80% of the time at confidence 0.999: raw ECE ~0.2, scaled far below.
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 2, 400)
    top = np.where(rng.random(400) < 0.8, labels, 1 - labels)
    p = np.full((400, 2), 0.001)
    p[np.arange(400), top] = 0.999
    z = np.log(p)
    fit_labels = rng.integers(0, 2, 400)
    fit_top = np.where(rng.random(400) < 0.8, fit_labels, 1 - fit_labels)
    fit = np.full((400, 2), 0.001)
    fit[np.arange(400), fit_top] = 0.999
    common = dict(
        rerun_log_probs=z,
        reordered_log_probs=z,
        fit_log_probs=np.log(fit),
        fit_labels=fit_labels,
        choices=CHOICES,
    )
    raw = qualify_task("over", z, labels, np.full(400, 0.9), **common)
    assert raw.ece == pytest.approx(ece(np.exp(z), labels))
    assert any(m.startswith("ECE") for m in raw.misses)
    scaled = qualify_task(
        "over",
        z,
        labels,
        np.full(400, 0.9),
        criteria=Criteria(calibrated=True),
        **common,
    )
    scaler = TemperatureScaler().fit(np.log(fit), fit_labels)
    assert scaled.ece == pytest.approx(ece(scaler.predict_proba(z), labels))
    assert scaled.ece < 0.15 < raw.ece
    assert scaled.temperature == pytest.approx(scaler.temperature_)


def test_bad_input_is_refused_before_measuring() -> None:
    z, labels = _scores(20, 0.97, seed=5)
    with pytest.raises(ValueError, match="shape"):
        _qualify(z, labels, rerun=z[:10])
    with pytest.raises(ValueError, match=r"criteria.confidence must be in \[0, 1\]"):
        Criteria(confidence=1.5)


@needs_data
def test_the_real_model_flips_nothing_between_runs(judge: Judge) -> None:
    """Batch-invariant arithmetic: a rerun in other slots gives the same probabilities."""
    result = qualify_on_task(judge, load_task(SMS), limit=12, fit_limit=12)
    assert result.n == 12
    assert result.flip_rate == 0.0 and result.max_rerun_change == 0.0
    assert 0.0 <= result.order_flips <= 1.0 and 0.0 < result.choice_mass <= 1.0


@needs_data
def test_the_command_exits_by_the_criteria(
    loaded_once: list[dict[str, object]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    small = ["--task", str(SMS), "--limit", "8", "--fit-limit", "8", "--dtype", "float32"]
    out = tmp_path / "q.json"
    # The default model's choice mass on sms_spam is far below 0.5: it does not qualify.
    assert main(["qualify", *small, "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "| sms_spam | 8 |" in printed and "does NOT qualify" in printed
    saved = msgspec.json.decode(out.read_bytes(), type=Qualification)
    assert not saved.qualifies and saved.tasks[0].misses
    assert any(m.startswith("choice mass") for m in saved.tasks[0].misses)
    # Every bar lowered: it qualifies, and says so.
    lenient = ["--confidence", "0", "--min-accuracy", "0", "--max-ece", "1"]
    lenient += ["--max-order-flips", "1", "--min-choice-mass", "0", "--allow-no-signal"]
    assert main(["qualify", *small, *lenient]) == 0
    assert "qualifies on all 1 tasks" in capsys.readouterr().out
    assert loaded_once[0]["dtype"] == "float32" and loaded_once[0]["model"] is None


def test_the_command_needs_a_task(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["qualify"]) == 2
    assert "give at least one --task DIR" in capsys.readouterr().err
    assert main(["qualify", "--data", str(tmp_path / "none")]) == 2
    assert "is not a directory" in capsys.readouterr().err
