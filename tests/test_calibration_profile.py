"""Profiles: fitting on log-probabilities, round-trip, atomic writes, validation, mismatches."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from fakes import Scored

from calibration.errors import (
    FitError,
    ProfileError,
    ProfileMismatchError,
    ProfileNotFoundError,
    RuleError,
)
from calibration.fit_data import LabeledScores, Provenance
from calibration.fitting import (
    TrainedHead,
    evaluate_policy,
    fit_profile,
    held_out_examples,
    split_examples,
)
from calibration.maps.scaling import BiasTemperature, Temperature
from calibration.metrics import Interval
from calibration.profile import (
    CalibrationProfile,
    DataSplit,
    decode_profile,
    load_profile,
    save_profile,
)
from judge.fingerprint import Fingerprint, sha256_text

CHOICES = ["ham", "spam", "unsure"]
FINGERPRINT = Fingerprint(
    model="m",
    model_sha256="abc",
    dtype="float32",
    response_prefix='{"answer": "',
    response_suffix='"}',
    system_sha256=None,
)


def engine(system: str | None = None, **changes: Any) -> Fingerprint:
    """The fingerprint of an engine like the profile's, with ``changes`` (and ``system``)."""
    return msgspec.structs.replace(FINGERPRINT, system_sha256=sha256_text(system), **changes)


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
        LabeledScores(z, np.ones(len(y)), y),
        CHOICES,
        Provenance(fingerprint=FINGERPRINT, dataset="synthetic", dataset_sha256="d" * 64),
    ).profile


def test_fit_recovers_the_temperature_and_improves_held_out(profile: CalibrationProfile) -> None:
    assert profile.metrics_after is not None and profile.metrics_before is not None
    # Over-confident, with no offset between choices: temperature scaling is the fix.
    assert isinstance(profile.calibration_map, Temperature)
    assert profile.calibration_map.temperature == pytest.approx(2.0, abs=0.4)
    assert profile.metrics_after.nll.value < profile.metrics_before.nll.value
    z, y = synthetic(1000, seed=2)
    evaluation = evaluate_policy(profile, z, y)
    assert evaluation.after.nll.value < evaluation.before.nll.value
    assert evaluation.after.ece.value < evaluation.before.ece.value
    # Coverage given one conformal split of 120 items is Beta(109, 12)-distributed (mean 0.90,
    # 1st percentile 0.83); the guarantee is on average over splits (test_calibration_conformal).
    assert evaluation.conformal_coverage is not None and evaluation.conformal_coverage >= 0.8


def test_each_step_has_its_own_examples(profile: CalibrationProfile) -> None:
    split = profile.split
    assert split.fit + split.conformal + split.certify == profile.n_examples == 600
    assert (split.fit, split.conformal, split.certify) == (180, 120, 300)
    # The threshold is certified on the certify split only, and the "after" metrics are
    # measured on the examples the map was not fitted on.
    assert profile.threshold.n == split.certify
    assert profile.metrics_after is not None and profile.metrics_before is not None
    assert profile.metrics_after.n == split.conformal + split.certify
    assert profile.metrics_before.n == profile.n_examples
    assert profile.threshold.procedure == "fixed_sequence"


def test_scores_from_another_classifier_can_take_the_probes_split() -> None:
    """``probe_split=True``: the 5:1:4 split without a probe, so scores of a classifier
    trained on the probe split's fit items only are certified on items it never saw."""
    z, y = synthetic(600, seed=1)
    scores = LabeledScores(z, np.ones(600), y)
    source = Provenance(fingerprint=FINGERPRINT, dataset="synthetic", dataset_sha256="d" * 64)
    probe_split = fit_profile("other", scores, CHOICES, source, probe_split=True).profile
    split = probe_split.split
    assert (split.fit, split.conformal, split.certify) == (300, 60, 240)
    assert probe_split.threshold.n == 240 and probe_split.calibration_map.method != "probe"
    fit_idx, _, _ = split_examples(y, split.seed, probe=True)
    assert set(held_out_examples(y, split)) == set(range(600)) - set(fit_idx)
    # A head trained with adapters is trained on the probe split: another split is refused
    # before any fitting (what is passed as the head and adapter is never read).
    head: Any = TrainedHead(fit=None, adapter=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="trained on the probe split"):
        fit_profile("adapted", scores, CHOICES, source, probe_split=False, trained=head)


def test_the_held_out_examples_are_recomputed_from_the_labels_and_the_split(
    profile: CalibrationProfile,
) -> None:
    """The examples the map was not fitted on, for a report drawn after the fit: exactly
    the conformal and certify splits, 3:2:5 here; 5:1:4 is recognised by its counts; other
    labels than the fit's are refused."""
    _, y = synthetic(600, seed=1)
    held = held_out_examples(y, profile.split)
    assert held.shape[0] == profile.split.conformal + profile.split.certify == 420
    fit_idx, conformal_idx, certify_idx = split_examples(y, profile.split.seed)
    assert set(held) == set(conformal_idx) | set(certify_idx) and not set(held) & set(fit_idx)
    probe_split = DataSplit(fit=300, conformal=60, certify=240, seed=profile.split.seed)
    fit_idx, _, _ = split_examples(y, profile.split.seed, probe=True)
    assert set(held_out_examples(y, probe_split)) == set(range(600)) - set(fit_idx)
    with pytest.raises(ValueError, match="not the labels it was fitted on"):
        held_out_examples(y[:500], profile.split)


def test_too_few_or_too_uniform_examples_are_refused() -> None:
    source = Provenance(fingerprint=FINGERPRINT, dataset="d", dataset_sha256="0")
    z, y = synthetic(19, seed=3)
    with pytest.raises(FitError, match="at least 20 labeled examples, got 19"):
        fit_profile("p", LabeledScores(z, np.ones(19), y), CHOICES, source)
    z, _ = synthetic(40, seed=4)
    with pytest.raises(FitError, match="all 40 examples have label 'spam'; need at least two"):
        fit_profile("p", LabeledScores(z, np.ones(40), np.ones(40, int)), CHOICES, source)
    # Ten examples of one class: the one-class problem is named, not just the count (it used
    # to be a profile with T = 0.01 and precision 1.0).
    z, _ = synthetic(10, seed=5)
    with pytest.raises(FitError, match="all 10 examples have label 'ham'; need at least two"):
        fit_profile("p", LabeledScores(z, np.ones(10), np.zeros(10, int)), CHOICES, source)
    with pytest.raises(ValueError, match="3 columns but there are 2 choices"):
        fit_profile("p", LabeledScores(z, np.ones(10), np.arange(10) % 2), CHOICES[:2], source)


def test_the_fit_returns_each_item_as_the_map_judges_a_new_one() -> None:
    """A scalar map is fitted on few parameters: every item's out-of-sample probabilities are
    its map's, fit split included, and they are what the profile serves."""
    z, y = synthetic(300, seed=6)
    source = Provenance(fingerprint=FINGERPRINT, dataset="d", dataset_sha256="0")
    fitted = fit_profile("p", LabeledScores(z, np.ones(300), y), CHOICES, source)
    assert fitted.out_of_sample.shape == (300, len(CHOICES))
    np.testing.assert_allclose(fitted.out_of_sample.sum(axis=1), 1.0)
    np.testing.assert_allclose(
        fitted.out_of_sample, fitted.profile.calibration_map.apply(z), rtol=1e-12
    )


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
        save_profile(msgspec.structs.replace(profile, note="changed"), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"format_version": 99}, "format_version is 99"),
        ({"calibration_map": {"method": "temperature", "temperature": -1.0}}, "temperature"),
        ({"calibration_map": {"method": "temperature", "temperature": 1e-300}}, "temperature"),
        (
            {"calibration_map": {"method": "bias_temperature", "temperature": 1, "bias": [0, 1]}},
            "bias has 2 entries for 3 choices",
        ),
        ({"calibration_map": {"method": "magic"}}, "magic"),
        ({"choices": ["a", "a"]}, "at least 2 distinct"),
        ({"name": "../evil"}, "at `\\$.name`"),
        ({"min_choice_mass": 1.5}, "<= 1.0 - at `\\$.min_choice_mass`"),
        ({"n_examples": -1}, ">= 1 - at `\\$.n_examples`"),
        # Issue 10 item 5: what PUT /profiles used to store and then serve.
        (
            {
                "calibration_map": {
                    "method": "bias_temperature",
                    "temperature": 1,
                    "bias": [1e308, -1e308, 0],
                }
            },
            r"<= 1000.0 - at `\$.calibration_map.bias\[0\]`",
        ),
        (
            {
                "calibration_map": {
                    "method": "bias_temperature",
                    "temperature": 1,
                    "bias": [1001, 0, 0],
                }
            },
            r"<= 1000.0 - at `\$.calibration_map.bias\[0\]`",
        ),
        (
            {"split": {"fit": -1, "conformal": 0, "certify": 0, "seed": 0}},
            ">= 0 - at `\\$.split.fit`",
        ),
        (
            {"split": {"fit": 500, "conformal": 100, "certify": 300, "seed": 0}},
            "exceed n_examples 600",
        ),
        ({"cv_nll": {"none": -1.0}}, r"cv_nll\['none'\] must be a finite number >= 0"),
        ({"values": {"ham": 0, "spam": 1}}, r"missing \['unsure'\]"),
        ({"max_std": 0.5}, "max_std needs values"),
        ({"max_std": -1}, ">= 0.0 - at `\\$.max_std`"),
        ({"metrics_after": None}, "metrics_after is missing"),
        ({"conformal_quantile": None}, "conformal_quantile is missing"),
    ],
)
def test_invalid_profiles_are_refused(
    profile: CalibrationProfile, change: dict[str, object], words: str
) -> None:
    data = msgspec.json.decode(msgspec.json.encode(profile))
    data.update(change)
    with pytest.raises(ProfileError, match=words):
        decode_profile(msgspec.json.encode(data))


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        (("threshold", "threshold"), -5.0, ">= 0.0 - at `\\$.threshold.threshold`"),
        (("threshold", "coverage"), 1.5, "<= 1.0 - at `\\$.threshold.coverage`"),
        (("threshold", "n_accepted"), -1, ">= 0 - at `\\$.threshold.n_accepted`"),
        (("threshold", "feasible"), "flip", "threshold.feasible must be true exactly"),
        (("metrics_after", "n"), 0, ">= 1 - at `\\$.metrics_after.n`"),
        (("metrics_after", "n"), 10_000, "metrics_after.n 10000 exceeds n_examples"),
        (("signal", "auroc"), 1.5, "<= 1.0 - at `\\$.signal.auroc`"),
    ],
)
def test_nested_nonsense_is_refused(
    profile: CalibrationProfile, path: tuple[str, str], value: object, words: str
) -> None:
    data = msgspec.json.decode(msgspec.json.encode(profile))
    data[path[0]][path[1]] = not data[path[0]][path[1]] if value == "flip" else value
    with pytest.raises(ProfileError, match=words):
        decode_profile(msgspec.json.encode(data))


def test_non_finite_numbers_are_refused_in_python_too(profile: CalibrationProfile) -> None:
    # A profile built in Python is not checked against the types' constraints (msgspec
    # checks them when decoding), but its rules still run: a RuleError, not a ValueError.
    with pytest.raises(RuleError, match="must be finite"):
        Interval(value=float("nan"), low=0.0, high=1.0)
    with pytest.raises(RuleError, match="temperature must be in"):
        Temperature(temperature=float("inf"))
    with pytest.raises(RuleError, match="bias must be"):
        BiasTemperature(temperature=1.0, bias=[float("nan"), 0.0])
    with pytest.raises(RuleError, match="cv_nll"):
        msgspec.structs.replace(profile, cv_nll={"none": float("inf")})


def test_profiles_without_the_new_fields_still_load(profile: CalibrationProfile) -> None:
    data = msgspec.json.decode(msgspec.json.encode(profile))
    for field in ("values", "max_std", "label_free", "signal"):
        del data[field]
    old = decode_profile(msgspec.json.encode(data))
    assert old.signal is None and old.values is None and old.label_free is None
    assert old.threshold == profile.threshold


def test_a_fitted_profile_says_whether_it_beats_the_prior(profile: CalibrationProfile) -> None:
    signal = profile.signal
    assert signal is not None
    assert signal.n == profile.split.conformal + profile.split.certify
    # The synthetic judge has real signal (labels follow softmax(z / 2)).
    assert signal.beats_prior and "beats the label prior" in signal.verdict
    assert signal.nll_gain.low > 0 and signal.auroc is not None and signal.auroc > 0.6
    assert not signal.temperature_at_bound


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
        ({"dtype": "bfloat16"}, "dtype"),
        ({"response_prefix": "Answer: "}, "response_prefix"),
        ({"response_suffix": ""}, "response_suffix"),
        ({"system": "Be brief."}, "system"),
        ({"choice_paths": "grammar"}, "choice_paths"),
    ],
)
def test_mismatch_is_an_error(
    profile: CalibrationProfile, change: dict[str, object], field: str
) -> None:
    with pytest.raises(ProfileMismatchError) as info:
        profile.check(engine(**change))  # type: ignore[arg-type]
    assert info.value.field == field
    assert "spam-v1" in str(info.value)


def test_mismatch_messages_name_the_field_and_both_values(profile: CalibrationProfile) -> None:
    with pytest.raises(ProfileMismatchError, match="fitted with dtype 'float32', not 'bfloat16'"):
        profile.check(engine(dtype="bfloat16"))
    # The system prompt is stored as a hash and never shown back.
    with pytest.raises(ProfileMismatchError, match="not a different system prompt") as info:
        profile.check(engine(system="Be brief."))
    assert "Be brief." not in str(info.value)
    with pytest.raises(ProfileMismatchError, match=r"choices \['ham', 'spam', 'unsure'\]") as info:
        profile.check(engine(), choices=["ham", "spam"])
    assert info.value.field == "choices"
    # The first field that differs is named, in the fingerprint's order.
    with pytest.raises(ProfileMismatchError) as info:
        profile.check(engine(dtype="bfloat16", response_suffix="x"))
    assert info.value.field == "dtype"
    # The hidden-state shape counts only for a probe; this profile is a scalar map.
    profile.check(engine(num_layers=30, hidden_size=576))


def test_a_profile_from_before_choice_paths_holds_for_canonical_paths(
    profile: CalibrationProfile,
) -> None:
    data = msgspec.json.decode(msgspec.json.encode(profile))
    del data["fingerprint"]["choice_paths"]
    old = decode_profile(msgspec.json.encode(data))
    assert old.fingerprint.choice_paths == "canonical"
    old.check(engine())
    with pytest.raises(ProfileMismatchError, match="choice_paths 'canonical', not 'grammar'"):
        old.check(engine(choice_paths="grammar"))


def test_the_fingerprint_is_stored_as_one_value(profile: CalibrationProfile) -> None:
    assert profile.fingerprint == FINGERPRINT
    data = msgspec.json.decode(msgspec.json.encode(profile))
    assert data["format_version"] == 3
    assert data["fingerprint"] == msgspec.to_builtins(FINGERPRINT)
    assert not {"model", "dtype", "system_sha256"} & data.keys()


def test_a_profile_in_the_flat_format_2_layout_still_loads(
    profile: CalibrationProfile, tmp_path: Path
) -> None:
    data = msgspec.json.decode(msgspec.json.encode(profile))
    rest = {k: v for k, v in data.items() if k != "fingerprint"}
    flat = {**rest, **data["fingerprint"], "format_version": 2}
    (tmp_path / "old.json").write_bytes(msgspec.json.encode(flat))
    old = load_profile(tmp_path / "old.json")
    assert old == profile and old.format_version == 3
    # Written back, it is in the current layout.
    save_profile(old, tmp_path / "new.json")
    assert msgspec.json.decode((tmp_path / "new.json").read_bytes()) == data
    # A format-2 file that lacks a fingerprint field is refused, naming it.
    del flat["dtype"]
    with pytest.raises(ProfileError, match="dtype"):
        decode_profile(msgspec.json.encode(flat))


def test_matching_configuration_passes_in_any_choice_order(profile: CalibrationProfile) -> None:
    profile.check(engine(), choices=CHOICES[::-1])
    logits = {"unsure": -3.0, "ham": -0.2, "spam": -1.9}
    calibrated = profile.calibrate(Scored(logits))
    assert list(calibrated) == ["unsure", "ham", "spam"]
    assert sum(calibrated.values()) == pytest.approx(1.0)
    reordered = profile.calibrate(Scored({c: logits[c] for c in CHOICES}))
    assert all(calibrated[c] == pytest.approx(reordered[c]) for c in CHOICES)
    # The profile's map is a temperature (test above), which never changes the top choice,
    # and the probabilities are softmax(log-probabilities / T), computed here by hand.
    t = profile.calibration_map.temperature
    scaled = {c: np.exp(v / t) for c, v in logits.items()}
    assert calibrated == pytest.approx({c: v / sum(scaled.values()) for c, v in scaled.items()})
    assert max(calibrated, key=calibrated.__getitem__) == "ham"


def test_a_format_2_body_with_a_nested_fingerprint_is_left_for_the_version_check() -> None:
    """make fuzz: a body saying format 2 with a format-3 fingerprint object was rebuilt as if
    flat, and refused as ``fingerprint.model: missing`` rather than by its version."""
    from calibration.profile import current_format

    nested = msgspec.json.encode({"format_version": 2, "fingerprint": {"model": "m"}, "x": 1})
    assert current_format(nested) == nested
    flat = msgspec.json.decode(current_format(msgspec.json.encode({"format_version": 2})))
    assert flat["format_version"] == 3 and flat["fingerprint"] == {}
