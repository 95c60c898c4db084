"""The gate: one policy object decides, with precedence, every gate and its reasons."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from fakes import FINGERPRINT, Scored, judgment_of

from calibration import (
    FitSettings,
    LabeledScores,
    NoCertificateError,
    PolicyDefaults,
    ProfileMismatchError,
    Provenance,
    Verdict,
    evaluate_policy,
    fit_profile,
    make_policy,
)
from calibration.certificates.certify import ThresholdResult
from calibration.gate import Gate, Overrides
from calibration.maps.scaling import Temperature
from calibration.profile import CalibrationProfile
from judge import Judgment

CHOICES = ["ham", "spam"]


def scored(p_spam: float, mass: float = 1.0, order: tuple[str, str] = ("ham", "spam")) -> Scored:
    logp = {"ham": math.log(1 - p_spam), "spam": math.log(p_spam)}
    return Scored({c: logp[c] for c in order}, mass)


@pytest.fixture(scope="module")
def profile() -> CalibrationProfile:
    rng = np.random.default_rng(0)
    z = rng.normal(0, 3, size=(400, 2))
    p = np.exp(z / 2) / np.exp(z / 2).sum(1, keepdims=True)
    y = (rng.random(400) > p[:, 0]).astype(int)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return fit_profile(
        "sms",
        LabeledScores(logp, np.ones(len(y)), y),
        CHOICES,
        Provenance(fingerprint=FINGERPRINT, dataset="d", dataset_sha256="0"),
        FitSettings(n_bootstrap=20),
    ).profile


def with_threshold(profile: CalibrationProfile, t: float | None) -> CalibrationProfile:
    result = msgspec.structs.replace(
        profile.threshold, threshold=t, feasible=t is not None, reason="test"
    )
    return msgspec.structs.replace(profile, threshold=result)


def test_without_a_profile_nothing_is_accepted() -> None:
    # No accept without a certificate: confidence 0.999 on raw probabilities still escalates.
    d = make_policy(None).decide(scored(0.999))
    assert d.decision == "escalate" and d.reason_codes == ["uncalibrated"]
    assert d.threshold is None and not d.certified
    assert "no calibration profile" in d.reasons[0] and "uncertified_threshold" in d.reasons[0]
    assert PolicyDefaults().uncertified_threshold is None


def test_a_threshold_without_a_certificate_is_refused() -> None:
    # A request's threshold overrides a certified one; with none to override it would be raw
    # confidence under a quiet name, so it is refused, naming the field and the opt-in.
    with pytest.raises(NoCertificateError, match="uncertified_threshold") as caught:
        make_policy(None, threshold=0.9)
    assert caught.value.field == "threshold"


def test_the_uncertified_threshold_is_an_opt_in_that_says_so() -> None:
    policy = make_policy(
        None, defaults=PolicyDefaults(uncertified_threshold=0.8, min_choice_mass=0.1)
    )
    assert policy.threshold_source == "uncertified_default"
    d = policy.decide(scored(0.85))
    assert d.accepted and d.decision == "accept" and d.reasons == [] and d.reason_codes == []
    assert d.choice == "spam" and d.confidence == pytest.approx(0.85)
    assert d.probabilities == pytest.approx({"ham": 0.15, "spam": 0.85})
    assert d.threshold == 0.8 and d.min_choice_mass == 0.1
    assert d.prediction_set is None and d.profile is None and not d.certified
    low = policy.decide(scored(0.7))
    assert not low.accepted and low.reason_codes == ["below_threshold"]
    assert low.reasons == ["confidence 0.7000 is below the threshold 0.8000"]
    # The request's opt-in wins over the server's.
    both = make_policy(None, uncertified_threshold=0.95, min_choice_mass=0.5)
    assert both.threshold_source == "uncertified_request"
    decided = both.decide(scored(0.9, mass=0.2))
    assert decided.reason_codes == ["below_threshold", "low_choice_mass"]
    assert decided.threshold == 0.95 and decided.min_choice_mass == 0.5


def test_the_profile_is_between_request_and_default(profile: CalibrationProfile) -> None:
    certified = with_threshold(profile, 0.7)
    defaults = PolicyDefaults(uncertified_threshold=0.99, min_choice_mass=0.3)
    policy = make_policy(certified, uncertified_threshold=0.5, defaults=defaults)
    # A certificate wins over every uncertified threshold, the request's and the server's.
    assert policy.threshold == 0.7 and policy.threshold_source == "profile"
    assert policy.min_choice_mass == certified.min_choice_mass == 0.0  # not the default's 0.3
    assert policy.certified
    overridden = make_policy(certified, threshold=0.8, defaults=defaults)
    assert overridden.threshold == 0.8 and overridden.threshold_source == "request"
    assert not overridden.certified
    assert not make_policy(certified, min_choice_mass=0.2).certified


def test_a_profile_without_a_certified_threshold_escalates_everything(
    profile: CalibrationProfile,
) -> None:
    none = with_threshold(profile, None)
    d = Gate(none).decide(scored(0.999))
    assert not d.accepted and d.threshold is None and not d.certified
    assert d.reason_codes[0] == "no_certified_threshold"
    assert d.reasons[0] == "profile 'sms' certifies no threshold: test"
    # A threshold cannot override a certificate that is not there; the opt-in can accept,
    # and the decision says it is uncertified.
    with pytest.raises(NoCertificateError):
        Gate(none, overrides=Overrides(threshold=0.5))
    own = Gate(none, overrides=Overrides(uncertified_threshold=0.5)).decide(scored(0.999))
    assert own.accepted and own.reason_codes == [] and not own.certified


def test_profile_decisions_calibrate_and_use_the_conformal_set(
    profile: CalibrationProfile,
) -> None:
    p = with_threshold(profile, 0.5)
    judgment = scored(0.9, order=("spam", "ham"))
    d = Gate(p).decide(judgment)
    assert list(d.probabilities) == CHOICES  # the profile's order, whatever the judgment's
    expected = profile.calibration_map.apply(np.log([0.1, 0.9]))
    assert d.probabilities["spam"] == pytest.approx(expected[1])
    assert d.prediction_set is not None and d.choice in d.prediction_set
    # A set of two choices escalates even above the threshold.
    wide = msgspec.structs.replace(p, conformal_quantile=1.0)
    w = Gate(wide).decide(judgment)
    assert w.prediction_set == CHOICES and w.reason_codes == ["ambiguous_set"]
    assert "holds 2 choices (ham, spam), not one" in w.reasons[0]


def test_decide_many_equals_deciding_one_by_one(profile: CalibrationProfile) -> None:
    p = with_threshold(profile, 0.6)
    rng = np.random.default_rng(1)
    judgments = [
        scored(float(q), mass=float(m), order=("ham", "spam") if i % 2 else ("spam", "ham"))
        for i, (q, m) in enumerate(
            zip(rng.uniform(0.01, 0.99, 50), rng.uniform(0, 1, 50), strict=True)
        )
    ]
    gate = Gate(p, overrides=Overrides(min_choice_mass=0.3))
    many = gate.decide_many(judgments)
    assert many == [gate.decide(j) for j in judgments]
    assert {d.decision for d in many} == {"accept", "escalate"}
    # Without a profile, judgments with different choices are decided in one call too.
    mixed = [scored(0.95), Scored({"a": math.log(0.5), "b": math.log(0.3), "c": math.log(0.2)})]
    out = make_policy(None, uncertified_threshold=0.9).decide_many(mixed)
    assert out[0].accepted and out[1].choice == "a" and not out[1].accepted


def test_wrong_choices_are_refused(profile: CalibrationProfile) -> None:
    bad = Scored({"ham": -0.1, "eggs": -2.0})
    with pytest.raises(ProfileMismatchError) as info:
        Gate(profile).decide(bad)
    assert info.value.field == "choices"


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"uncertified_threshold": 1.5}, "uncertified_threshold"),
        ({"min_choice_mass": -0.1}, "min_choice_mass"),
    ],
)
def test_overrides_and_defaults_are_validated(kwargs: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be in"):
        make_policy(
            None,
            uncertified_threshold=kwargs.get("uncertified_threshold"),
            min_choice_mass=kwargs.get("min_choice_mass"),
        )
    with pytest.raises(ValueError, match=f"{name} must be in"):
        PolicyDefaults(**kwargs)
    with pytest.raises(ValueError, match=f"{name} must be a number"):
        make_policy(None, **{name: "0.5"})  # type: ignore[arg-type]


def test_decisions_are_plain_data(profile: CalibrationProfile) -> None:
    d = Gate(profile).decide(scored(0.9))
    assert msgspec.json.decode(msgspec.json.encode(d), type=Verdict) == d
    assert b"accepted" not in msgspec.json.encode(d)  # a property, derived from decision


def test_evaluate_policy_counts_what_decide_decides(profile: CalibrationProfile) -> None:
    p = with_threshold(profile, 0.7)
    rng = np.random.default_rng(2)
    z = rng.normal(0, 3, size=(300, 2))
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    y = rng.integers(0, 2, 300)
    mass = rng.uniform(0, 1, 300)
    e = evaluate_policy(p, logp, y, mass, min_choice_mass=0.2)
    decisions = Gate(p, overrides=Overrides(min_choice_mass=0.2)).decide_many(
        [Scored(dict(zip(CHOICES, row, strict=True)), m) for row, m in zip(logp, mass, strict=True)]
    )
    accepted = [d for d in decisions if d.accepted]
    assert e.n_accepted == len(accepted) and e.coverage == pytest.approx(len(accepted) / 300)
    hits = sum(
        CHOICES.index(d.choice) == t for d, t in zip(decisions, y, strict=True) if d.accepted
    )
    assert e.precision == pytest.approx(hits / len(accepted))
    assert e.precision_interval is not None
    assert e.precision_interval[0] <= hits / len(accepted) <= e.precision_interval[1]
    for code in ("below_threshold", "low_choice_mass", "ambiguous_set"):
        assert e.escalations.get(code, 0) == sum(code in d.reason_codes for d in decisions)
    assert not e.certified and e.threshold == 0.7 and e.min_choice_mass == 0.2


def test_a_temperature_map_changes_confidence_not_the_choice() -> None:
    hot = Temperature(temperature=4.0)
    policy = msgspec.structs.replace(
        make_policy(None, uncertified_threshold=0.0), calibration_map=hot
    )
    d = policy.decide(scored(0.95))
    assert d.choice == "spam" and 0.5 < d.confidence < 0.95


def test_threshold_results_stay_in_range_on_upload(profile: CalibrationProfile) -> None:
    data = msgspec.json.decode(msgspec.json.encode(profile))
    data["threshold"]["threshold"] = -5.0
    from calibration import ProfileError, decode_profile

    with pytest.raises(ProfileError, match=r">= 0.0 - at `\$.threshold.threshold`"):
        decode_profile(msgspec.json.encode(data))
    assert isinstance(profile.threshold, ThresholdResult)


def test_an_order_spread_over_the_bound_escalates(profile: CalibrationProfile) -> None:
    policy = make_policy(None, uncertified_threshold=0.6, max_order_spread=0.2)
    assert policy.decide(scored(0.9)).accepted  # no spread given: the gate passes
    calm = policy.decide(scored(0.9), order_spread=0.2)  # at the bound: still accepted
    assert calm.accepted and calm.order_spread == 0.2 and calm.max_order_spread == 0.2
    moved = policy.decide(scored(0.9), order_spread=0.35)
    assert moved.decision == "escalate" and moved.reason_codes == ["order_sensitive"]
    assert "0.3500" in moved.reasons[0] and "0.2000" in moved.reasons[0]
    # With other reasons, in the documented order: the threshold's first.
    low = policy.decide(scored(0.45), order_spread=0.9)
    assert low.reason_codes == ["below_threshold", "order_sensitive"]
    # Without a bound, a spread is recorded and decides nothing.
    free = make_policy(None, uncertified_threshold=0.5).decide(scored(0.9), order_spread=0.9)
    assert free.accepted and free.order_spread == 0.9 and free.max_order_spread is None
    # The bound is the caller's: a profile's certified rule stays certified under it.
    certified = make_policy(profile)
    bounded = make_policy(profile, max_order_spread=0.1)
    assert bounded.certified == certified.certified
    judgments = [scored(p) for p in (0.02, 0.5, 0.98)]
    spreads = [0.0, 0.05, 0.3]
    many = bounded.decide_many(judgments, order_spreads=spreads)
    one_by_one = [
        bounded.decide(j, order_spread=s) for j, s in zip(judgments, spreads, strict=True)
    ]
    assert many == one_by_one
    assert "order_sensitive" in many[2].reason_codes
    assert many[2].reason_codes[:-1] == certified.decide(judgments[2]).reason_codes
    gates = bounded.checks(CHOICES, [[math.log(0.02), math.log(0.98)]] * 3, order_spread=spreads)
    assert gates.order_sensitive.tolist() == [False, False, True] and not gates.accepted[2]
    with pytest.raises(ValueError, match="order spreads"):
        bounded.decide_many(judgments, order_spreads=[0.1])
    with pytest.raises(ValueError, match="max_order_spread"):
        make_policy(None, max_order_spread=1.5)


def test_order_sensitive_is_a_reason_code() -> None:
    from calibration import REASON_CODES

    assert "order_sensitive" in REASON_CODES


def per_class(
    profile: CalibrationProfile, ham: float | None, spam: float | None
) -> CalibrationProfile:
    """``profile`` certified per class: ham's decisions at ``ham``, spam's at ``spam``."""
    results = [
        msgspec.structs.replace(
            profile.threshold,
            threshold=t,
            feasible=t is not None,
            reason="ok"
            if t is not None
            else f"class {c!r} (3 certify items decided as it): too few",
        )
        for c, t in zip(CHOICES, (ham, spam), strict=True)
    ]
    return msgspec.structs.replace(profile, class_thresholds=results)


def test_a_profile_certified_per_class_holds_each_class_to_its_own_threshold(
    profile: CalibrationProfile,
) -> None:
    gate = Gate(per_class(with_threshold(profile, 0.5), 0.6, 0.95))
    assert gate.policy.certified and gate.policy.threshold is None
    # Both decisions at confidence 0.8 (the map is the profile's, so compare calibrated ones).
    ham, spam = gate.decide_many([scored(0.0001), scored(0.9999)])
    assert ham.choice == "ham" and spam.choice == "spam"
    assert ham.threshold == 0.6 and spam.threshold == 0.95  # each decision's own
    middling = gate.policy.checks(CHOICES, np.log([[0.2, 0.8], [0.8, 0.2]]))
    assert list(middling.thresholds) == [{0: 0.6, 1: 0.95}[int(b)] for b in middling.best]
    # A class that certified nothing escalates its decisions, saying which class.
    none = Gate(per_class(with_threshold(profile, 0.5), 0.6, None))
    d = none.decide(scored(0.9999))
    assert d.decision == "escalate" and d.reason_codes[0] == "no_certified_threshold"
    assert "class 'spam'" in d.reasons[0] and d.threshold is None
    assert none.decide(scored(0.0001)).threshold == 0.6


def test_overriding_a_per_class_rule_holds_every_class_to_one_uncertified_threshold(
    profile: CalibrationProfile,
) -> None:
    gate = Gate(
        per_class(with_threshold(profile, 0.5), 0.6, 0.95), overrides=Overrides(threshold=0.7)
    )
    assert gate.policy.class_thresholds is None and gate.policy.threshold == 0.7
    assert not gate.policy.certified
    # A profile whose classes all certified nothing has no certificate at all.
    empty = per_class(with_threshold(profile, 0.5), None, None)
    with pytest.raises(NoCertificateError):
        Gate(empty, overrides=Overrides(threshold=0.7))
    assert Gate(empty, overrides=Overrides(uncertified_threshold=0.7)).policy.threshold == 0.7


def test_a_profile_s_class_thresholds_match_its_choices(profile: CalibrationProfile) -> None:
    good = per_class(profile, 0.6, None)
    data = msgspec.to_builtins(good)
    data["class_thresholds"] = data["class_thresholds"][:1]
    with pytest.raises(Exception, match="class_thresholds has 1 entries for 2 choices"):
        msgspec.convert(data, CalibrationProfile)


def test_fit_profile_certifies_per_class_when_asked(profile: CalibrationProfile) -> None:
    rng = np.random.default_rng(4)
    z = rng.normal(0, 4, size=(600, 2))
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)  # a calibrated, sharp judge
    y = (rng.random(600) > p[:, 0]).astype(int)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    fitted = fit_profile(
        "sms",
        LabeledScores(logp, np.ones(len(y)), y),
        CHOICES,
        Provenance(fingerprint=FINGERPRINT, dataset="d", dataset_sha256="0"),
        FitSettings(n_bootstrap=20, per_class=True),
    ).profile
    assert fitted.class_thresholds is not None and len(fitted.class_thresholds) == 2
    for result in fitted.class_thresholds:
        assert result.delta == pytest.approx(fitted.threshold.delta / 2)  # Bonferroni
        assert result.threshold is not None, result.reason
    assert Gate(fitted).policy.class_thresholds == [t.threshold for t in fitted.class_thresholds]


def test_labels_for_the_next_look_open_every_class_s_threshold(
    profile: CalibrationProfile,
) -> None:
    from calibration.fitting import labels_for_next_look

    rng = np.random.default_rng(0)  # the fixture's examples
    z = rng.normal(0, 3, size=(400, 2))
    p = np.exp(z / 2) / np.exp(z / 2).sum(1, keepdims=True)
    y = (rng.random(400) > p[:, 0]).astype(int)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    pooled = with_threshold(profile, None)
    # The estimate reads every gate but the threshold: a class's own threshold (or its lack
    # of one) is opened too, so a per-class profile asks what the pooled one does.
    split = per_class(pooled, 0.99, None)
    assert labels_for_next_look(split, logp, y) == labels_for_next_look(pooled, logp, y)


def test_an_unread_share_that_could_change_the_decision_escalates() -> None:
    """A served model read from its top next tokens (``Judgment.unknown_mass``): the decision
    must hold with the unread share given to the runner-up, or spread over the others."""
    policy = make_policy(None, defaults=PolicyDefaults(uncertified_threshold=0.8))

    def judged(p_spam: float, unknown: float) -> Judgment:
        made = judgment_of({"ham": 1 - p_spam, "spam": p_spam})
        return msgspec.structs.replace(made, unknown_mass=unknown)

    assert policy.decide(judged(0.95, 0.0)).decision == "accept"
    assert policy.decide(judged(0.95, 0.1)).decision == "accept"  # 0.95 * 0.9 = 0.855 holds
    moved = policy.decide(judged(0.95, 0.2))  # 0.95 * 0.8 = 0.76: below the threshold
    assert moved.decision == "escalate" and moved.reason_codes == ["partial_logprobs"]
    assert moved.reasons == [
        "up to 0.2000 of the choices' probability was not read (the server's top next tokens "
        "left some out), and at that bound it escalates (below_threshold)"
    ]
    assert moved.confidence == pytest.approx(0.95)  # what was read, reported as read
    # Already escalating for its own reasons: the unread share adds nothing.
    low = policy.decide(judged(0.7, 0.5))
    assert low.reason_codes == ["below_threshold"]
