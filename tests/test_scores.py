"""Scores: expected value and std of a judgment over numeric choices, raw and calibrated."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
import pytest
from fakes import FINGERPRINT, Scored, judgment_of
from hypothesis import given, settings
from hypothesis import strategies as st

from calibration import (
    REASON_CODES,
    FitSettings,
    LabeledScores,
    PolicyDefaults,
    Provenance,
    decode_profile,
    fit_profile,
    make_policy,
)
from calibration import (
    ValuesError as CalibrationValuesError,
)
from calibration.gate import Gate
from calibration.profile import CalibrationProfile
from judge import InvalidQueryError, Judge, Score, ValuesError, default_values, score_of

GRADES = [str(i) for i in range(6)]


def scored(probs: dict[str, float]) -> Scored:
    return Scored({c: math.log(p) for c, p in probs.items()})


# --- the engine layer ------------------------------------------------------------------------


def test_numerals_are_their_own_values() -> None:
    assert default_values(["0", "10", "-1", "2.5", " 3 "]) == {
        "0": 0.0,
        "10": 10.0,
        "-1": -1.0,
        "2.5": 2.5,
        " 3 ": 3.0,
    }
    for bad in (["one", "2"], ["1e3", "2"], ["inf", "1"], ["nan", "1"], ["1", ""]):
        with pytest.raises(ValuesError, match="values"):
            default_values(bad)


def test_score_is_the_probability_weighted_mean_and_spread() -> None:
    probs = {"1": 0.2, "3": 0.5, "5": 0.3}
    s = judgment_of(probs).score()
    assert isinstance(s, Score)
    assert s.expected_value == pytest.approx(0.2 * 1 + 0.5 * 3 + 0.3 * 5)
    var = sum(p * (float(c) - s.expected_value) ** 2 for c, p in probs.items())
    assert s.std == pytest.approx(math.sqrt(var))
    assert (s.most_likely_choice, s.most_likely_value) == ("3", 3.0)
    assert s.distribution == probs
    # Explicit values for words.
    words = judgment_of({"bad": 0.25, "ok": 0.25, "good": 0.5}).score(
        {"bad": 0, "ok": 1, "good": 2}
    )
    assert words.expected_value == pytest.approx(1.25)


@pytest.mark.parametrize(
    ("probs", "values", "words"),
    [
        ({"yes": 0.5, "no": 0.5}, None, "'yes' is not a numeral"),
        ({"a": 0.5, "b": 0.5}, {"a": 1.0}, r"values is missing \['b'\]"),
        ({"a": 0.5, "b": 0.5}, {"a": 1.0, "b": 2.0, "c": 3.0}, r"names \['c'\]"),
        ({"a": 0.5, "b": 0.5}, {"a": 1.0, "b": float("nan")}, "finite"),
        ({"a": 0.5, "b": 0.5}, {"a": 1.0, "b": float("inf")}, "finite"),
        ({"a": 0.5, "b": 0.5}, {"a": 1.0, "b": "2"}, "must be a number"),
        ({"a": 0.5, "b": 0.5}, {"a": True, "b": 2}, "must be a number"),
        ({"a": 0.5, "b": 0.5}, [1, 2], "must map each choice"),
    ],
)
def test_bad_values_name_the_field(probs: dict[str, float], values: object, words: str) -> None:
    with pytest.raises(ValuesError, match=words) as info:
        score_of(probs, values)  # type: ignore[arg-type]
    assert info.value.field == "values"
    # The service maps InvalidQueryError to 400 and honours an error's own field.
    assert isinstance(info.value, InvalidQueryError) and isinstance(info.value, ValueError)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.01, 1.0), min_size=2, max_size=8),
    st.lists(st.floats(-100, 100), min_size=8, max_size=8),
)
def test_score_agrees_with_numpy(weights: list[float], raw: list[float]) -> None:
    p = np.array(weights) / sum(weights)
    v = np.array(raw[: len(weights)])
    choices = [f"c{i}" for i in range(len(weights))]
    s = score_of(dict(zip(choices, p.tolist(), strict=True)), dict(zip(choices, v, strict=True)))
    mean = float(np.average(v, weights=p))
    assert s.expected_value == pytest.approx(mean, abs=1e-9)
    assert s.std == pytest.approx(float(np.sqrt(np.average((v - mean) ** 2, weights=p))), abs=1e-6)
    assert min(v) - 1e-9 <= s.expected_value <= max(v) + 1e-9


# --- the policy: calibrated scores and the high_std gate --------------------------------------


def test_decisions_on_numerals_carry_the_calibrated_score() -> None:
    d = make_policy(None).decide(scored({"1": 0.1, "2": 0.6, "3": 0.3}))
    assert d.expected_value == pytest.approx(2.2)
    assert d.std == pytest.approx(math.sqrt(0.1 * 1.44 + 0.6 * 0.04 + 0.3 * 0.64))
    # Not a score: no expected value, and no error.
    d = make_policy(None).decide(scored({"yes": 0.4, "no": 0.6}))
    assert d.expected_value is None and d.std is None


def test_high_std_escalates_with_its_own_reason_code() -> None:
    assert "high_std" in REASON_CODES
    torn = scored({"1": 0.5, "5": 0.5})  # std 2
    sure = scored({"1": 0.02, "5": 0.98})  # std 0.56
    policy = make_policy(None, uncertified_threshold=0.5, max_std=1.0)
    d = policy.decide(torn)
    assert not d.accepted and "high_std" in d.reason_codes and d.max_std == 1.0
    assert any("standard deviation 2.0000 is above the maximum 1.0000" in r for r in d.reasons)
    assert policy.decide(sure).accepted
    # No bound, no gate.
    assert "high_std" not in make_policy(None, uncertified_threshold=0.5).decide(torn).reason_codes


def test_values_and_max_std_precedence_request_over_profile_over_default(
    score_profile: CalibrationProfile,
) -> None:
    defaults = PolicyDefaults(max_std=9.0)
    assert make_policy(None, defaults=defaults).max_std == 9.0
    assert make_policy(None, max_std=0.1, defaults=defaults).max_std == 0.1
    from_profile = make_policy(score_profile, defaults=defaults)
    assert (from_profile.max_std, from_profile.max_std_source) == (1.2, "profile")
    assert from_profile.certified == (score_profile.threshold.threshold is not None)
    overridden = make_policy(score_profile, max_std=0.3, defaults=defaults)
    assert (overridden.max_std, overridden.max_std_source, overridden.certified) == (
        0.3,
        "request",
        False,
    )
    doubled = {c: 2 * v for c, v in (score_profile.values or {}).items()}
    d = make_policy(score_profile, values=doubled).decide(scored(dict.fromkeys(GRADES, 1 / 6)))
    assert d.expected_value == pytest.approx(5.0)  # mean of 0, 2, ..., 10


def test_one_values_error_for_raw_and_calibrated_scores() -> None:
    # One set of rules (judge.scores) and one class, whichever layer checks the values.
    assert CalibrationValuesError is ValuesError
    grades = scored({"1": 0.5, "2": 0.5})
    bad_values: list[dict[str, Any]] = [
        {"1": 1.0, "3": 2.0},
        {"1": 1.0, "2": float("nan")},
        {"1": "x", "2": 2.0},
    ]
    for bad in bad_values:
        with pytest.raises(ValuesError) as raw:
            score_of({"1": 0.5, "2": 0.5}, bad)
        with pytest.raises(ValuesError) as calibrated:
            make_policy(None, values=bad).decide(grades)
        assert str(calibrated.value) == str(raw.value)
        assert calibrated.value.field == raw.value.field == "values"


def test_max_std_without_values_is_an_error_naming_values() -> None:
    with pytest.raises(CalibrationValuesError, match="give values") as info:
        make_policy(None, max_std=1.0).decide(scored({"yes": 0.5, "no": 0.5}))
    assert info.value.field == "values"
    # A server default bound applies to scores only, silently elsewhere.
    defaults = PolicyDefaults(max_std=1.0)
    assert make_policy(None, defaults=defaults).decide(scored({"yes": 0.5, "no": 0.5}))
    with pytest.raises(CalibrationValuesError, match="max_std") as info:
        make_policy(None, max_std=-1.0)
    assert info.value.field == "max_std"
    with pytest.raises(CalibrationValuesError, match=r"missing \['3'\]"):
        make_policy(None, values={"1": 1, "2": 2}).decide(scored({"1": 0.2, "2": 0.3, "3": 0.5}))


@pytest.fixture(scope="module")
def score_profile() -> CalibrationProfile:
    """A 0-5 grader, over-confident by a factor 2, with a std bound of 1.2."""
    rng = np.random.default_rng(0)
    n = 600
    truth = rng.uniform(0, 5, size=n)
    z = -((np.arange(6)[None, :] - truth[:, None]) ** 2)  # peaked at the true grade
    p = np.exp(z / 2) / np.exp(z / 2).sum(1, keepdims=True)
    y = np.array([rng.choice(6, p=row) for row in p])
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return fit_profile(
        "grades",
        LabeledScores(logp, np.ones(len(y)), y),
        GRADES,
        Provenance(fingerprint=FINGERPRINT, dataset="d", dataset_sha256="0"),
        FitSettings(n_bootstrap=20, values={c: float(c) for c in GRADES}, max_std=1.2),
    ).profile


def test_a_score_profile_round_trips_and_certifies_the_gate_it_serves(
    score_profile: CalibrationProfile,
) -> None:
    assert score_profile.values == {c: float(c) for c in GRADES}
    assert decode_profile(msgspec.json.encode(score_profile)) == score_profile
    d = Gate(score_profile).decide(scored(dict.fromkeys(GRADES, 1 / 6)))
    assert d.expected_value == pytest.approx(2.5)
    assert "high_std" in d.reason_codes  # uniform over 0..5: std 1.71 > 1.2


# --- the real model ------------------------------------------------------------------------


def test_ten_is_scored_exactly_on_the_real_model(judge: Judge) -> None:
    """'10' is two tokens; its probability comes from the trie, not from the token '1'."""
    choices = [str(i) for i in range(11)]
    j = judge.judge(
        "On a scale from 0 to 10, how good is a perfect, flawless answer? Answer 10 if perfect.",
        choices=choices,
    )
    ids = judge.tokenizer("10", add_special_tokens=False).input_ids
    assert len(ids) == 2  # "1", "0": the first token is also the whole of the choice "1"
    assert sum(j.probabilities.values()) == pytest.approx(1.0, abs=1e-5)
    # A reader of first-token logprobs would give "1" all of the mass of "10"; the trie splits
    # it by what follows the "1" (the suffix's quote, or "0").
    assert j.choice == "10" and j.probabilities["10"] > 0.5 > j.probabilities["1"]
    s = j.score()
    assert s.expected_value == pytest.approx(
        sum(p * float(c) for c, p in j.probabilities.items()), abs=1e-9
    )
    assert s.most_likely_choice == j.choice
    assert s.distribution == j.probabilities
