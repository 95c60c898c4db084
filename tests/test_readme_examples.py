"""The documentation's gating examples run as written, on the real default model."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from calibration import FitSettings, LabeledScores, Provenance, fit_profile, save_profile
from calibration.tasks import load_task, task_item_span, task_prompt, task_template
from judge import Judge
from service.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = "\n".join(page.read_text() for page in sorted((ROOT / "docs").glob("*.md")))
SMS = ROOT.parent / "shared" / "data" / "sms_spam"


def block(heading: str, language: str, index: int = 0) -> str:
    """The index-th ``language`` code block after ``heading``."""
    section = DOCS[DOCS.index(heading) :]
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)[index]


@pytest.fixture
def session_model(monkeypatch: pytest.MonkeyPatch, judge: Judge) -> None:
    def load(model: object = None, **options: Any) -> Judge:
        return judge

    monkeypatch.setattr(Judge, "load", staticmethod(load))


@pytest.mark.skipif(not SMS.exists(), reason="the shared datasets are not beside this checkout")
@pytest.mark.parametrize("method", ["temperature", "probe"])
def test_pipeline_example(
    session_model: None,
    judge: Judge,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    method: str,
) -> None:
    # A profile for this judge, fitted on synthetic log-probabilities (and, for a probe, hidden
    # states of the judge's width at layer 20): the example is about the pipeline's shape, and
    # `judge calibrate` has its own tests.
    rng = np.random.default_rng(0)
    n = 120
    z = rng.normal(0, 2, size=(n, 2))
    features = rng.normal(0, 1, size=(n, 1, judge.hidden_size or 1))
    signal = features[:, 0, 0] if method == "probe" else z[:, 1] - z[:, 0]
    labels = (signal + rng.normal(0, 0.5, n) > 0).astype(int)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    profile = fit_profile(
        "sms_spam",
        LabeledScores(logp, np.ones(len(labels)), labels, features=features, feature_layers=(20,)),
        ["ham", "spam"],
        Provenance(fingerprint=judge.fingerprint(), dataset="t", dataset_sha256="0"),
        FitSettings(n_bootstrap=20, methods=[method]),
    ).profile
    assert (profile.calibration_map.method == "probe") == (method == "probe")
    # As judge calibrate --task writes it: with the task's prompt, so the example sends items.
    profile = msgspec.structs.replace(profile, template=task_template(load_task(SMS)))
    save_profile(profile, tmp_path / "profiles" / "sms_spam.json")
    monkeypatch.chdir(tmp_path)
    code = block("## Gating in a pipeline", "python").replace("../shared/data/sms_spam", str(SMS))
    namespace: dict[str, Any] = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/calibration.md", "exec"), namespace)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert all(re.match(r"(ham|spam): |to a person \(", line) for line in lines)
    gate = namespace["gate"]
    assert gate.feature_layers == profile.feature_layers
    task = load_task(SMS)
    # The item alone is judged in the task's prompt, its span marked: as a whole prompt would be.
    one_by_one = [
        gate.judge(namespace["j"], task_prompt(task, t), item_span=task_item_span(task, t))
        for t in namespace["inbox"]
    ]
    assert not any(v.outside_template for v in one_by_one)
    assert [d.decision for d in namespace["verdicts"]] == [d.decision for d in one_by_one]
    for batched, alone in zip(namespace["verdicts"], one_by_one, strict=True):
        assert batched.confidence == pytest.approx(alone.confidence, abs=1e-4)


def test_batch_gating_example(
    session_model: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    section = "## Gating a file"
    command = block(section, "sh").split()
    items, shown = block(section, "json", 0), block(section, "json", 1)
    (tmp_path / "items.jsonl").write_text(items)
    assert command[:4] == ["judge", "ask", "--input", "items.jsonl"]
    code = main([*command[1:3], str(tmp_path / "items.jsonl"), *command[4:]])
    assert code == 0
    captured = capsys.readouterr()
    got = [json.loads(line) for line in captured.out.splitlines()]
    expected = [json.loads(line) for line in shown.splitlines()]
    assert len(got) == len(expected) == 3
    for g, e in zip(got, expected, strict=True):
        assert set(g) == set(e) and g["id"] == e["id"]
        if "error" in e:
            assert g == e
            continue
        # The page's numbers are rounded from a run in bfloat16 and this model is float32,
        # which moves probabilities by about 0.01; the decision and the choice hold.
        assert (g["decision"], g["choice"], g["reason_codes"]) == (
            e["decision"],
            e["choice"],
            e["reason_codes"],
        )
        assert g["confidence"] == pytest.approx(e["confidence"], abs=0.03)
    assert "3 items: 1 accepted, 1 escalated (below_threshold 1), 1 error" in captured.err
