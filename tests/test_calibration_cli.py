"""`judge calibrate` and `judge evaluate` on a small slice of a real dataset, real model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from calibration import load_profile, reliability
from calibration.gate import Gate
from judge import Judge
from service.cli.main import main

SMS = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "sms_spam"
needs_data = pytest.mark.skipif(
    not SMS.exists(), reason="the shared datasets are not beside this checkout"
)
DRAWN: dict[str, Any] = {}  # what `fitted`'s calibrate drew its reliability diagram of


@pytest.fixture
def session_model(monkeypatch: pytest.MonkeyPatch, judge: Judge) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def load(model: object = None, **options: Any) -> Judge:
        calls.append(options)
        return judge

    monkeypatch.setattr(Judge, "load", staticmethod(load))
    return calls


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory, judge: Judge) -> Path:
    """Profiles fitted once by `judge calibrate` on the first 48 calibration items."""
    profiles = tmp_path_factory.mktemp("profiles")
    drawn = reliability.reliability_diagram

    def diagram(before: Any, after: Any, path: Any, **options: Any) -> Path:
        DRAWN.update(before=len(before[1]), after=len(after[1]), **options)
        return drawn(before, after, path, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Judge, "load", staticmethod(lambda model=None, **options: judge))
        patch.setattr(reliability, "reliability_diagram", diagram)
        args = ["calibrate", "--task", str(SMS), "--limit", "48", "--profiles-dir", str(profiles)]
        assert main(args) == 0
    return profiles


@needs_data
def test_calibrate_writes_profile_report_and_diagram(
    fitted: Path, judge: Judge, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sorted(p.name for p in fitted.iterdir()) == [
        "sms_spam.json",
        "sms_spam.reliability.png",
        "sms_spam.report.md",
    ]
    profile = load_profile(fitted / "sms_spam.json")
    assert profile.n_examples == 48
    assert profile.choices == ["ham", "spam"]
    assert profile.fingerprint == judge.fingerprint()  # model, weights, dtype, template, shape
    assert profile.dataset == "sms_spam/calibration"
    assert (fitted / "sms_spam.reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The diagram draws the examples the map was not fitted on, before and after, and says so.
    held = profile.split.conformal + profile.split.certify
    assert DRAWN["before"] == DRAWN["after"] == held < 48
    assert DRAWN["title"] == f"sms_spam: the {held} examples the map was not fitted on"
    assert profile.metrics_after is not None and profile.metrics_after.n == held
    assert "# Calibration profile `sms_spam`" in (fitted / "sms_spam.report.md").read_text()


@needs_data
def test_calibrate_prints_the_fit(
    session_model: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["calibrate", "--task", str(SMS), "--limit", "24", "--profiles-dir", str(tmp_path)]
    assert main([*args, "--name", "tiny", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("profile tiny: method ")
    assert "accuracy" in out and "ECE" in out
    assert "**signal: " in out  # beats the label prior, or NO SIGNAL: said either way
    assert "wrote" in out and (tmp_path / "tiny.json").exists()
    assert session_model == [
        {
            "dtype": "float32",
            "device": "cpu",
            "response_prefix": '{"answer": "',
            "response_suffix": '"}',
            "choice_paths": "canonical",
        }
    ]


@needs_data
def test_evaluate_measures_the_served_policy(
    fitted: Path,
    session_model: list[dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    report, result = tmp_path / "eval.md", tmp_path / "eval.json"
    profile = str(fitted / "sms_spam.json")
    args = ["evaluate", "--task", str(SMS), "--limit", "32", "--profile", profile]
    assert main([*args, "--report", str(report), "--json", str(result)]) == 0
    out = capsys.readouterr().out
    assert "Held-out evaluation (32 items)" in out and "served policy" in out
    assert "Held-out evaluation" in report.read_text()
    evaluation = json.loads(result.read_text())
    assert evaluation["n"] == 32 and evaluation["profile"] == "sms_spam"
    # Whether the judge beats the label prior, as fields and in words.
    signal = evaluation["signal"]
    assert signal["n"] == 32 and isinstance(signal["beats_prior"], bool)
    assert signal["verdict"] in out and evaluation["signal_prior"] == "the profile's fit split"
    assert signal["prior"] == load_profile(profile).signal.prior  # type: ignore[union-attr]
    assert evaluation["threshold"] == load_profile(profile).threshold.threshold
    assert session_model[0]["dtype"] == "float32"  # the profile's dtype
    # Per class: precision, recall and coverage of the accepted items, and the confusion
    # matrices, printed and in the JSON.
    classes = evaluation["classes"]
    assert [c["choice"] for c in classes["classes"]] == ["ham", "spam"]
    assert sum(c["support"] for c in classes["classes"]) == 32
    assert sum(map(sum, classes["confusion"])) == 32
    assert sum(map(sum, classes["confusion_accepted"])) == evaluation["n_accepted"]
    assert "### Per class" in out and "Confusion matrix, the accepted items" in out

    # An override is evaluated as the service would serve it: every gate, no certification.
    assert main([*args, "--threshold", "1", "--json", str(result)]) == 0
    evaluation = json.loads(result.read_text())
    assert evaluation["threshold"] == 1.0 and evaluation["certified"] is False
    assert evaluation["n_accepted"] == 0 and evaluation["escalations"]["below_threshold"] == 32


@needs_data
def test_evaluate_refuses_a_profile_for_other_choices(
    fitted: Path,
    session_model: list[dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "task.json").write_text(
        '{"name": "other", "choices": ["yes", "no"], "instruction": "?"}'
    )
    (other / "test.jsonl").write_text(
        "".join(f'{{"text": "item {i}", "label": "yes"}}\n' for i in range(12))
    )
    code = main(["evaluate", "--task", str(other), "--profile", str(fitted / "sms_spam.json")])
    assert code == 2
    err = capsys.readouterr().err
    assert "judge: error (choices):" in err and "fitted for choices ['ham', 'spam']" in err


@needs_data
def test_too_few_examples_is_refused_before_loading(
    session_model: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["calibrate", "--task", str(SMS), "--limit", "10", "--profiles-dir", str(tmp_path)]
    assert main(args) == 2
    assert "needs at least 20 labeled examples" in capsys.readouterr().err
    assert session_model == [] and list(tmp_path.iterdir()) == []


def test_a_bad_task_directory_is_a_usage_error(
    session_model: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["calibrate", "--task", str(tmp_path)]) == 2
    assert "has no task.json" in capsys.readouterr().err
    (tmp_path / "task.json").write_text('{"name": "t", "choices": ["a", "b"], "instruction": "?"}')
    assert main(["calibrate", "--task", str(tmp_path)]) == 2
    assert "has no split 'calibration'" in capsys.readouterr().err
    assert session_model == []


@pytest.mark.parametrize("option", ["--target-precision", "--delta", "--alpha"])
def test_levels_must_be_strictly_between_0_and_1(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["calibrate", "--task", str(tmp_path), option, "1"])
    assert "strictly between 0 and 1" in capsys.readouterr().err


SST2 = SMS.parent / "sst2"


@pytest.fixture(scope="module")
def probe_profile(tmp_path_factory: pytest.TempPathFactory, judge: Judge) -> Path:
    """A probe fitted by `judge calibrate --method probe` on the first 120 sst2 items."""
    profiles = tmp_path_factory.mktemp("probe")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Judge, "load", staticmethod(lambda model=None, **options: judge))
        args = ["calibrate", "--task", str(SST2), "--limit", "120", "--method", "probe"]
        assert main([*args, "--profiles-dir", str(profiles)]) == 0
    return profiles / "sst2.json"


@needs_data
def test_calibrate_fits_a_probe_and_compares_it_with_temperature(
    probe_profile: Path, judge: Judge
) -> None:
    profile = load_profile(probe_profile)
    probe = profile.calibration_map
    # It reads the decision point's state, the mean over each item's text, or both.
    assert probe.method == "probe" and (profile.feature_layers or profile.span_layers)
    assert profile.fingerprint == judge.fingerprint()  # the shape the probe must be served on
    assert profile.split.fit == 60 and profile.split.certify == 48  # the probe's 5:1:4 split
    assert profile.baseline is not None and profile.baseline.calibration_map.method in (
        "none",
        "temperature",
        "bias_temperature",
    )
    report = probe_profile.with_suffix(".report.md").read_text()
    assert "**probe**" in report and "What the labels bought" in report


@needs_data
def test_ask_and_evaluate_decide_with_the_probe(
    probe_profile: Path,
    session_model: list[dict[str, Any]],
    judge: Judge,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from calibration.tasks import load_task, task_item_span, task_prompt

    profile = load_profile(probe_profile)
    task = load_task(SST2)
    item = "a gorgeous, witty and deeply moving film."
    prompt = task_prompt(task, item)
    # The item is marked, as calibrate marked each task item: a probe may read its mean.
    span = task_item_span(task, item)
    expected = Gate(profile).judge(judge, prompt, item_span=span)
    assert main(["ask", prompt, "--item", item, "--profile", str(probe_profile)]) == 0
    answer = json.loads(capsys.readouterr().out)
    # The prefix cache may be warm for one and cold for the other: float rounding apart.
    assert answer["probabilities"] == pytest.approx(expected.probabilities, abs=1e-6)
    assert answer["decision"] == expected.decision

    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"prompt": prompt, "item_span": span}) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["ask", "--input", str(lines), "--output", str(out), "--profile", str(probe_profile)]
    assert main(args) == 0
    row = json.loads(out.read_text())
    assert row["probabilities"] == pytest.approx(expected.probabilities, abs=1e-6)

    result = tmp_path / "eval.json"
    args = ["evaluate", "--task", str(SST2), "--limit", "24", "--profile", str(probe_profile)]
    assert main([*args, "--json", str(result)]) == 0
    printed = capsys.readouterr().out
    assert "(baseline)" in printed
    evaluation = json.loads(result.read_text())
    assert evaluation["method"] == "probe" and evaluation["baseline"]["n"] == 24


@needs_data
def test_a_probe_on_too_few_examples_is_refused_before_loading(
    session_model: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["calibrate", "--task", str(SST2), "--limit", "60", "--method", "probe"]
    assert main([*args, "--profiles-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "method probe needs at least 100 labeled examples" in err and "has 60" in err
    assert session_model == [] and list(tmp_path.iterdir()) == []


@needs_data
def test_calibrate_per_class_writes_a_threshold_per_class(
    session_model: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["calibrate", "--task", str(SMS), "--limit", "48", "--per-class"]
    assert main([*args, "--profiles-dir", str(tmp_path)]) == 0
    profile = load_profile(tmp_path / "sms_spam.json")
    assert profile.class_thresholds is not None and len(profile.class_thresholds) == 2
    assert all(
        t.delta == pytest.approx(profile.threshold.delta / 2) for t in profile.class_thresholds
    )
    # A class that certified nothing says about how many labels would.
    for t in profile.class_thresholds:
        assert t.threshold is not None or any(
            said in t.reason for said in ("labels needed: ", "no certify item was decided as it")
        )
    out = capsys.readouterr().out
    assert "served per class" in out and "  - ham:" in out and "  - spam:" in out
    assert "served per class" in (tmp_path / "sms_spam.report.md").read_text()
