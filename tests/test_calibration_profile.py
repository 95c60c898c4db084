"""Profiles: fitting on logits, round-trip, atomic writes, validation and mismatch errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from calibration.errors import ProfileError, ProfileMismatchError, ProfileNotFoundError
from calibration.fitting import evaluate_profile, fit_profile
from calibration.profile import CalibrationProfile, decode_profile, load_profile, save_profile

CHOICES = ["ham", "spam", "unsure"]
CONFIG: dict[str, Any] = {
    "model": "m",
    "model_sha256": "abc",
    "response_prefix": '{"answer": "',
    "response_suffix": '"}',
    "system": None,
}


def synthetic(n: int, seed: int, temperature: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    """Over-confident log-probabilities: labels follow softmax(z / temperature)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 3, size=(n, len(CHOICES)))
    p = np.exp(z / temperature)
    p /= p.sum(1, keepdims=True)
    y = np.array([rng.choice(len(CHOICES), p=row) for row in p])
    return z - np.log(np.exp(z).sum(1, keepdims=True)), y


@pytest.fixture(scope="module")
def profile() -> CalibrationProfile:
    z, y = synthetic(600, seed=1)
    return fit_profile(
        "spam-v1",
        z,
        y,
        CHOICES,
        dtype="float32",
        dataset="synthetic",
        dataset_sha256="d" * 64,
        **CONFIG,
    )


def test_fit_recovers_the_temperature_and_improves_held_out(profile: CalibrationProfile) -> None:
    assert profile.method in ("temperature", "bias_temperature")
    assert profile.temperature == pytest.approx(2.0, abs=0.3)
    assert profile.metrics_after.nll.value < profile.metrics_before.nll.value
    z, y = synthetic(1000, seed=2)
    evaluation = evaluate_profile(profile, z, y)
    assert evaluation.after.nll.value < evaluation.before.nll.value
    assert evaluation.after.ece.value < evaluation.before.ece.value
    assert evaluation.conformal_coverage >= 1 - profile.conformal_alpha - 0.03


def test_round_trip(tmp_path: Path, profile: CalibrationProfile) -> None:
    path = save_profile(profile, tmp_path / "p.json")
    assert load_profile(path) == profile
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def test_failed_write_keeps_the_old_file(
    tmp_path: Path, profile: CalibrationProfile, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_profile(profile, tmp_path / "p.json")
    before = path.read_bytes()

    def crash(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        save_profile(msgspec.structs.replace(profile, temperature=9.0), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"format_version": 99}, "format_version is 99"),
        ({"temperature": -1.0}, "temperature must be a positive number"),
        ({"bias": [0.0]}, "bias must be 3 finite numbers"),
        ({"choices": ["a", "a"]}, "at least 2 distinct"),
        ({"name": "../evil"}, "name '../evil' must match"),
        ({"method": "magic"}, "method 'magic'"),
    ],
)
def test_invalid_profiles_are_refused(
    profile: CalibrationProfile, change: dict[str, object], words: str
) -> None:
    data = msgspec.json.decode(msgspec.json.encode(profile))
    data.update(change)
    with pytest.raises(ProfileError, match=words):
        decode_profile(msgspec.json.encode(data))


def test_unreadable_profiles(tmp_path: Path) -> None:
    with pytest.raises(ProfileNotFoundError):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ProfileError, match="not a valid calibration profile"):
        load_profile(tmp_path / "bad.json")
    (tmp_path / "extra.json").write_text('{"surprise": 1}')
    with pytest.raises(ProfileError, match="surprise"):
        load_profile(tmp_path / "extra.json")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model": "other"}, "model"),
        ({"model_sha256": "def"}, "model_sha256"),
        ({"response_prefix": "Answer: "}, "response_prefix"),
        ({"response_suffix": ""}, "response_suffix"),
        ({"system": "Be brief."}, "system"),
        ({"choices": ["ham", "spam"]}, "choices"),
    ],
)
def test_mismatch_is_an_error(
    profile: CalibrationProfile, change: dict[str, object], field: str
) -> None:
    given: dict[str, Any] = {**CONFIG, "choices": CHOICES, **change}
    with pytest.raises(ProfileMismatchError) as info:
        profile.check(**given)
    assert info.value.field == field
    assert "spam-v1" in str(info.value)


def test_matching_configuration_passes_in_any_choice_order(profile: CalibrationProfile) -> None:
    profile.check(**CONFIG, choices=CHOICES[::-1])
    logits = {"unsure": -3.0, "ham": -0.2, "spam": -1.9}
    calibrated = profile.calibrate(logits)
    assert list(calibrated) == ["unsure", "ham", "spam"]
    assert sum(calibrated.values()) == pytest.approx(1.0)
    reordered = profile.calibrate({c: logits[c] for c in CHOICES})
    assert all(calibrated[c] == pytest.approx(reordered[c]) for c in CHOICES)
    assert (
        max(calibrated, key=calibrated.__getitem__) == "ham" or profile.method == "bias_temperature"
    )
