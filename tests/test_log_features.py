"""Labels that keep coming: hidden states kept in the decision log (``--log-features``), a probe
refitted from them (``judge calibrate --from-log``), each refit one look of a lineage that
spends one delta (``calibration.certificates.recertify``), and the labels ``judge check`` says the gate needs.

The end-to-end test runs on the real default model (the session's): served with
``--log-features`` under a temperature profile, 160 SMS messages judged and labelled, then a
probe refitted from the log, twice. The simulation of repeated looks is in
tests/test_gating_simulation.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from fakes import FINGERPRINT, judgment_of
from litestar.testing import TestClient
from server import wait_app_ready

from calibration import FitSettings, Gate, LabeledScores, Provenance, fit_profile
from calibration.certificates.recertify import Recertification, labels_to_certify, look_delta
from calibration.errors import RuleError
from calibration.fitting import labels_for_next_look
from calibration.maps.probe import candidate_layers
from calibration.tasks.files import load_split, load_task, task_prompt
from service import ServiceConfig, create_app
from service.cli.main import main
from service.log.backends import open_log
from service.log.logged_features import LoggedFeatures, log_layers
from service.log.record import LoggedDecision
from service.profiles import ProfileStore

SMS = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "sms_spam"
HANG_S = 1800.0  # a deadline that only ends a hang: a slow or shared machine must not meet it
needs_data = pytest.mark.skipif(not SMS.exists(), reason="the shared datasets are not here")


# --- the stored states ----------------------------------------------------------------------


def test_states_round_trip_through_the_log_in_float16(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    states = {n: rng.normal(0, 30, 8).tolist() for n in (10, 20, 30)}
    kept = LoggedFeatures.of(states, [10, 30])
    assert kept is not None and kept.dtype == "float16" and len(kept.data) == 2 * 8 * 2
    verdict = Gate(None).decide(
        msgspec.structs.replace(judgment_of({"a": 0.7, "b": 0.3}), judgment_id="j1")
    )
    with open_log(str(tmp_path / "log.db")) as log:
        log.append([LoggedDecision.of(verdict, model="m", features=kept)])
        back = log.get("j1")
    assert back is not None and back.features == kept
    expected = np.array([states[10], states[30]], dtype=np.float32)
    # float16 keeps 11 significant bits: at most 2^-11 off, relative to each number.
    assert np.allclose(back.features.array(), expected, rtol=2**-11, atol=0)
    assert LoggedFeatures.of(states, []) is None  # nothing asked, nothing kept


def test_a_state_beyond_float16_is_kept_in_float32() -> None:
    kept = LoggedFeatures.of({5: [1.0, 70_000.0, -2.5]}, [5])
    assert kept is not None and kept.dtype == "float32"
    assert kept.array().tolist() == [[1.0, 70_000.0, -2.5]]


def test_a_missing_layer_is_an_error_not_a_silent_gap() -> None:
    with pytest.raises(ValueError, match=r"layer\(s\) \[20\]"):
        LoggedFeatures.of({10: [1.0]}, [10, 20])
    with pytest.raises(ValueError, match="layer"):
        LoggedFeatures.of(None, [10])


def test_which_layers_the_log_keeps() -> None:
    assert log_layers((20,), 30, enabled=False) == ()
    assert log_layers((20,), 30, enabled=True) == (20,)  # a probe's own
    assert log_layers((), 30, enabled=True) == candidate_layers(30) == (10, 15, 20, 25, 30)
    assert log_layers((), None, enabled=True) == ()  # depth unknown: none


def test_a_gate_reads_the_logged_layers_without_reporting_them_as_the_probe_s() -> None:
    gate = Gate(None, log_layers=(15, 10))
    assert gate.feature_layers == (10, 15) and gate.log_layers == (15, 10)
    assert gate.policy.feature_layers == ()  # what a response names: no probe read them


# --- looks and labels -----------------------------------------------------------------------


def test_looks_spend_one_delta() -> None:
    assert math.isclose(sum(look_delta(0.1, k) for k in range(1, 200_000)), 0.1, rel_tol=1e-5)
    first = Recertification.after(None, 0.1, "log.db")
    second = Recertification.after(first, 0.1, "log.db")
    assert (first.look, second.look) == (1, 2)
    assert second.spent == look_delta(0.1, 2) < first.spent == look_delta(0.1, 1)
    with pytest.raises(ValueError, match="look"):
        look_delta(0.1, 0)


def test_a_profile_must_be_certified_at_its_look_s_share() -> None:
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 200)
    z = np.log(np.where(np.eye(2)[y] > 0, 0.8, 0.2))
    look = Recertification.after(None, 0.1, "log.db")
    scores = LabeledScores(z, np.ones(len(y)), y)
    source = Provenance(
        fingerprint=FINGERPRINT, dataset="s", dataset_sha256="0", recertification=look
    )
    fitted = fit_profile("p", scores, ["a", "b"], source, FitSettings(delta=look.spent)).profile
    assert fitted.recertification == look and fitted.threshold.delta == look.spent
    with pytest.raises(RuleError, match=r"recertification\.spent"):
        fit_profile("p", scores, ["a", "b"], source)  # at the full delta


def test_labels_to_certify() -> None:
    rng = np.random.default_rng(2)
    confidence = rng.uniform(0.5, 1.0, 400)
    correct = rng.random(400) < confidence  # calibrated: precision 0.96 above 0.92
    some = labels_to_certify(
        confidence, correct, target_precision=0.9, delta=0.06, certify_share=0.5
    )
    assert some.labels is not None and some.more == max(0, some.labels - 400)
    assert some.threshold is not None and some.precision is not None and some.precision > 0.9
    stricter = labels_to_certify(
        confidence, correct, target_precision=0.95, delta=0.06, certify_share=0.5
    )
    assert stricter.labels is not None and stricter.labels > some.labels
    # A smaller certify share needs more labels in all.
    fewer_certify = labels_to_certify(
        confidence, correct, target_precision=0.9, delta=0.06, certify_share=0.4
    )
    assert fewer_certify.labels is not None and fewer_certify.labels > some.labels
    # No signal: right half the time at every confidence. No number of labels opens the gate.
    none = labels_to_certify(
        confidence, rng.random(400) < 0.5, target_precision=0.9, delta=0.06, certify_share=0.5
    )
    assert none.labels is None and none.more is None and "will not open the gate" in none.reason
    # One wrong label says nothing of the next hundred: too few to tell, not "will not help".
    one = labels_to_certify([0.9], [False], target_precision=0.9, delta=0.06, certify_share=0.5)
    assert one.labels is None and "too few to tell" in one.reason
    assert "will not open the gate" not in one.reason


def test_labels_to_certify_answers_the_fewest_certify_items_at_every_threshold() -> None:
    """The thresholds' searches run together in one array call a step: each still ends on
    the fewest certify items whose expected accepted items certify, one fewer not."""
    from calibration.certificates.recertify import _certifies

    rng = np.random.default_rng(4)
    confidence = rng.uniform(0.5, 1.0, 600)
    correct = rng.random(600) < confidence
    asked: list[int] = []

    def labels_for(items: int) -> int:
        asked.append(items)
        return 2 * items

    common: dict[str, Any] = {"target_precision": 0.9, "delta": 0.01, "certify_share": 0.5}
    needed = labels_to_certify(confidence, correct, labels_for=labels_for, **common)
    assert needed.labels is not None and needed.labels == 2 * min(asked) and len(asked) > 3
    assert needed.acceptance is not None and needed.precision is not None
    items = needed.labels // 2

    def certifies(n: int) -> bool:
        assert needed.acceptance is not None and needed.precision is not None
        trials = np.array([round(n * needed.acceptance)], dtype=np.int64)
        return bool(_certifies(trials, np.array([needed.precision]), 0.9, 0.01)[0])

    assert certifies(items) and not certifies(items - 1)


def test_labels_to_certify_from_calibrated_confidence_reads_no_label() -> None:
    """With ``expected`` (a calibrated map's confidence in its answers) in place of the
    labels, the estimate is the labels' in expectation, and never reads a label."""
    rng = np.random.default_rng(3)
    confidence = rng.uniform(0.5, 1.0, 4000)
    correct = rng.random(4000) < confidence  # calibrated
    common: dict[str, Any] = {"target_precision": 0.9, "delta": 0.06, "certify_share": 0.5}
    read = labels_to_certify(confidence, correct, **common)
    believed = labels_to_certify(confidence, None, expected=confidence, **common)
    assert read.labels is not None and believed.labels is not None
    assert abs(believed.labels - read.labels) <= 0.25 * read.labels
    assert "calibrated confidence" in believed.reason
    # An overconfident map says so to its own estimate: where it believes itself right half
    # the time, no number of labels opens the gate.
    none = labels_to_certify(confidence, None, expected=np.full(4000, 0.5), **common)
    assert none.labels is None and "calibrated confidence shows" in none.reason
    with pytest.raises(ValueError, match="not both"):
        labels_to_certify(confidence, correct, expected=confidence, **common)
    with pytest.raises(ValueError, match="neither"):
        labels_to_certify(confidence, None, **common)


# --- the real model: serve, label, refit a probe from the log -------------------------------


@needs_data
def test_a_probe_is_refitted_from_the_log_of_a_served_model(
    judge: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    task = load_task(SMS)
    items, _ = load_split(task, "calibration", 184)
    first, served = items[:24], items[24:]
    # The profile served first: temperature, fitted on 24 items judged directly.
    scores = judge.judge_batch(
        [{"prompt": task_prompt(task, i.text), "choices": task.choices} for i in first]
    )
    z = np.array([j.log_probs for j in scores])
    y = np.array([task.choices.index(i.label) for i in first])
    profile = fit_profile(
        "sms",
        LabeledScores(z, np.ones(len(y)), y),
        task.choices,
        Provenance(
            fingerprint=judge.fingerprint(), dataset="sms_spam/calibration[:24]", dataset_sha256="0"
        ),
        FitSettings(methods=["temperature"]),
    ).profile
    profiles = tmp_path / "profiles"
    ProfileStore(profiles).put(profile)
    db = str(tmp_path / "decisions.db")
    # 160 items in one request: the default deadline (60 s) is a user's, and 160 judgments on
    # two shared cores beside a second busy process took longer (this test failed so); here
    # the deadline is a hang bound only.
    config = ServiceConfig(
        profiles_dir=profiles,
        decision_log=db,
        audit_rate=1.0,
        log_features=True,
        request_timeout_s=HANG_S,
    )
    with TestClient(app=create_app(judge, config=config)) as c:
        wait_app_ready(c)
        body = {
            "items": [
                {"prompt": task_prompt(task, i.text), "choices": task.choices, "profile": "sms"}
                for i in served
            ]
        }
        results = c.post("/judge/batch", json=body).json()["results"]
        assert all("judgment_id" in r for r in results), [r for r in results if "detail" in r][:1]
        assert all(r.get("feature_layers") is None for r in results)  # no probe read them
        labels = [
            {"judgment_id": r["judgment_id"], "label": i.label}
            for r, i in zip(results, served, strict=True)
        ]
    layers = candidate_layers(judge.fingerprint().num_layers)
    with open_log(db) as log:
        log.label_many([(x["judgment_id"], x["label"]) for x in labels])
        row = log.get(results[0]["judgment_id"])
    assert row is not None and row.features is not None
    assert row.features.layers == list(layers) and row.features.dtype == "float16"
    assert row.features.width == judge.fingerprint().hidden_size

    # The check estimates the labels a refit needs, from the labelled decisions of this version.
    main(["check", "--profile", "sms", "--log", db, "--profiles-dir", str(profiles)])
    needed = json.loads(capsys.readouterr().out)["labels"]
    assert needed is not None and needed["given"] == len(served)

    refit = ["calibrate", "--from-log", db, "--profile", "sms", "--profiles-dir", str(profiles)]
    assert main([*refit, "--method", "probe"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    probe = ProfileStore(profiles).get("sms")
    assert probe.calibration_map.method == "probe" and probe.n_examples == len(served)
    assert set(probe.feature_layers) <= set(layers)
    assert probe.recertification is not None and probe.recertification.look == 1
    assert probe.threshold.delta == look_delta(0.1, 1) and "look 1" in out
    # A second refit is the lineage's second look, at its smaller share of the delta.
    assert main([*refit, "--method", "probe"]) == 0, capsys.readouterr().err
    again = ProfileStore(profiles).get("sms")
    assert again.recertification is not None and again.recertification.look == 2
    assert again.threshold.delta == look_delta(0.1, 2)
    # Under "auto", too few decisions with states: the scalar maps fit all of them, and the
    # refit says why no probe was tried (it said nothing, and its profile blamed HTTP).
    from service.log.refit import _with_features, labelled_decisions

    with open_log(db) as log:
        few = labelled_decisions(log, profile)[:50]
    kept, states, _, why = _with_features(few, "auto", profile)
    assert states is None and len(kept) == 50
    assert why is not None and "50 labeled decisions kept the hidden states" in why


def test_a_refit_that_stays_shut_says_what_the_next_look_needs() -> None:
    """Read off the refit's own held-out items, at the next look's delta."""
    rng = np.random.default_rng(0)
    confidence = rng.uniform(0.5, 1.0, 150)
    first = rng.random(150) < 0.5
    y = np.where((rng.random(150) < confidence) == first, 0, 1)  # calibrated: right w.p. conf
    p = np.where(first, confidence, 1 - confidence)
    z = np.log(np.stack([p, 1 - p], axis=1))
    look = Recertification.after(None, 0.1, "log.db")
    profile = fit_profile(
        "p",
        LabeledScores(z, np.ones(len(y)), y),
        ["a", "b"],
        Provenance(fingerprint=FINGERPRINT, dataset="s", dataset_sha256="0", recertification=look),
        FitSettings(delta=look.spent, target_precision=0.95, methods=["temperature"]),
    ).profile
    assert profile.threshold.threshold is None  # 150 labels are too few for 0.95
    needed = labels_for_next_look(profile, z, y)
    assert needed.given == 150 and needed.labels is not None and needed.labels > 150
    assert needed.more == needed.labels - 150
    assert f"delta {look_delta(0.1, 2):.3g}" in needed.reason
