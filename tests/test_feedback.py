"""The decision log over HTTP and on the command line: every decision kept, labels taken,
audit sampling, each profile's health (precision against its certificate, drift, the model),
``judge check``'s exit codes, ``judge replay`` and ``judge calibrate --from-log``.

A fake engine judges "p=<number>" prompts: P(yes) is that number, so a test chooses the
traffic's confidences and labels exactly. ``judge replay`` and the
model check run on the real default model (the session's, through ``loaded_once``).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
from fakes import FakeEngine, judgment_of
from litestar.testing import TestClient
from postgres import postgres_database, postgres_url  # noqa: F401
from server import wait_app_ready as wait_ready

from calibration import CalibrationProfile, FitSettings, LabeledScores, Provenance, fit_profile
from calibration.limits import allot
from judge import Fingerprint, Judgment, Query
from service import ServiceConfig, create_app
from service.cli.main import main
from service.client import AsyncJudgeClient, ClientError
from service.log.backends import open_log
from service.log.decision_log import DecisionLogError
from service.profiles import ProfileStore

CHOICES = ["yes", "no"]
JSON = {"content-type": "application/json"}


class ScoreEngine(FakeEngine):
    """P(yes) is the number after "p=" in the prompt (else 0.5); the weights are this
    class's."""

    def fingerprint(
        self,
        *,
        system: str | None = None,
        response_prefix: str | None = None,
        response_suffix: str | None = None,
    ) -> Fingerprint:
        made = super().fingerprint(
            system=system, response_prefix=response_prefix, response_suffix=response_suffix
        )
        return msgspec.structs.replace(made, model_sha256=self.model_sha256)

    def judgment(self, query: Query) -> Judgment:
        _, marked, number = query.prompt.rpartition("p=")
        p = float(number) if marked else 0.5  # the warm-up's prompt has no number
        probabilities = {"yes": p, "no": 1 - p}
        return judgment_of({c: probabilities[c] for c in query.choices}, prompt=query.prompt)


def stream(rng: np.random.Generator, n: int, prior: float = 0.5) -> tuple[list[float], list[str]]:
    """``n`` items: the label ("yes" with probability ``prior``) and the model's P(yes), a
    noisy logistic of it, calibrated enough that high confidence is mostly right."""
    y = rng.random(n) < prior
    margin = np.where(y, 2.0, -2.0) + rng.normal(0, 1.5, n)
    p = 1 / (1 + np.exp(-margin))
    return [round(float(v), 6) for v in np.clip(p, 1e-4, 1 - 1e-4)], [
        "yes" if v else "no" for v in y
    ]


@pytest.fixture(scope="module")
def profile() -> CalibrationProfile:
    p, labels = stream(np.random.default_rng(0), 800)
    z = np.log(np.array([[v, 1 - v] for v in p]))
    y = np.array([CHOICES.index(label) for label in labels])
    fitted = fit_profile(
        "gate",
        LabeledScores(z, np.ones(len(y)), y),
        CHOICES,
        Provenance(
            fingerprint=ScoreEngine().fingerprint(), dataset="synthetic", dataset_sha256="0" * 64
        ),
        FitSettings(methods=["temperature"], target_precision=0.95),
    ).profile
    assert fitted.threshold.threshold is not None and fitted.reference is not None
    return fitted


@contextmanager
def served(
    tmp_path: Path, profile: CalibrationProfile, **options: Any
) -> Iterator[TestClient[Any]]:
    """A server on the fake with ``profile`` stored and a SQLite log, once it is ready."""
    ProfileStore(tmp_path / "profiles").put(profile)
    config = ServiceConfig(
        profiles_dir=tmp_path / "profiles",
        decision_log=str(tmp_path / "decisions.db"),
        **options,
    )
    with TestClient(app=create_app(ScoreEngine(), config=config)) as c:
        wait_ready(c)
        yield c


@pytest.fixture
def client(tmp_path: Path, profile: CalibrationProfile) -> Iterator[TestClient[Any]]:
    with served(tmp_path, profile, audit_rate=0.3, log_requests=True) as c:
        yield c


def judge_all(c: TestClient[Any], p: list[float], profile: str | None = "gate") -> list[Any]:
    """Judge one item per number, in batches; the responses in order."""
    out: list[Any] = []
    for start in range(0, len(p), 200):
        items = [
            {"prompt": f"item {start + i} p={v}", "choices": CHOICES, "profile": profile}
            for i, v in enumerate(p[start : start + 200])
        ]
        r = c.post("/judge/batch", json={"items": items})
        assert r.status_code == 200, r.text
        out += r.json()["results"]
    return out


def label_audited(c: TestClient[Any], responses: list[Any], labels: list[str]) -> int:
    pairs = [
        {"judgment_id": r["judgment_id"], "label": label}
        for r, label in zip(responses, labels, strict=True)
        if r.get("audit")
    ]
    r = c.post("/labels", json={"labels": pairs})
    assert r.status_code == 200, r.text
    assert {x["status"] for x in r.json()["results"]} == {"labeled"}
    return len(pairs)


# --- the log keeps every decision -------------------------------------------------------------


def test_every_decision_is_logged_with_what_made_it(
    client: TestClient[Any], tmp_path: Path
) -> None:
    r = client.post("/judge", json={"prompt": "one p=0.97", "choices": CHOICES, "profile": "gate"})
    assert r.status_code == 200
    body = r.json()
    shared = client.post(
        "/judge/batch",
        json={"context": "ctx", "questions": [{"prompt": "q p=0.2", "choices": ["no", "yes"]}]},
    ).json()["results"][0]
    with open_log(str(tmp_path / "decisions.db")) as log:
        assert log.count() == 2
        kept = log.get(body["judgment_id"])
        other = log.get(shared["judgment_id"])
    assert kept is not None and other is not None
    for field in ("judgment_id", "tokens_sha256", "model_sha256", "policy_sha256", "profile_etag"):
        assert getattr(kept, field) == body[field], field
    assert (kept.decision, kept.choice, kept.certified) == (
        body["decision"],
        body["choice"],
        body["certified"],
    )
    assert kept.confidence == body["confidence"] and kept.probabilities == body["probabilities"]
    assert kept.log_probs == pytest.approx([math.log(0.97), math.log(0.03)])
    assert kept.audit == body.get("audit", False)
    assert kept.request is not None and kept.request["query"]["prompt"] == "one p=0.97"
    # A shared question is logged as the query it was: the context and the question.
    assert other.request is not None and other.request["query"]["prompt"].startswith("ctx")
    assert other.choices == ["no", "yes"] and other.profile is None
    # GET /judgments/{id} answers the logged record.
    got = client.get(f"/judgments/{body['judgment_id']}").json()
    assert got["judgment_id"] == body["judgment_id"] and got["label"] is None


def test_prompts_are_kept_only_when_asked(tmp_path: Path, profile: CalibrationProfile) -> None:
    with served(tmp_path, profile) as c:
        body = c.post("/judge", json={"prompt": "secret p=0.5", "choices": CHOICES}).json()
    with open_log(str(tmp_path / "decisions.db")) as log:
        kept = log.get(body["judgment_id"])
    assert kept is not None and kept.request is None
    assert "secret" not in (tmp_path / "decisions.db").read_bytes().decode("latin-1")


def test_audit_marks_a_uniform_share_of_all_decisions(
    tmp_path: Path, profile: CalibrationProfile
) -> None:
    p, _ = stream(np.random.default_rng(1), 1200)
    with served(tmp_path, profile, audit_rates={"gate": 0.25}) as c:
        responses = judge_all(c, p)
        unprofiled = judge_all(c, p[:100], profile=None)
    audited = np.array([bool(r.get("audit")) for r in responses])
    accepted = np.array([r["decision"] == "accept" for r in responses])
    # 0.25 of 1200 is 300, sd 15: within 4 sd. Accepted and escalated alike.
    assert abs(audited.sum() - 300) < 60
    assert abs(audited[accepted].mean() - 0.25) < 0.08
    assert abs(audited[~accepted].mean() - 0.25) < 0.08
    assert not any(r.get("audit") for r in unprofiled)  # the server's own rate is 0
    with open_log(str(tmp_path / "decisions.db")) as log:
        assert len(log.decisions(audit=True)) == audited.sum()


def test_no_log_means_no_feedback_endpoints(tmp_path: Path) -> None:
    app = create_app(ScoreEngine(), config=ServiceConfig(profiles_dir=tmp_path))
    with TestClient(app=app) as c:
        wait_ready(c)
        r = c.post("/judgments/x/label", json={"label": "yes"})
        assert r.status_code == 404 and "--decision-log" in r.json()["detail"]
        assert c.get("/profiles/gate/health").status_code == 404


def test_a_log_that_cannot_be_written_stops_the_server_at_start(tmp_path: Path) -> None:
    missing = tmp_path / "no such directory" / "log.db"
    with pytest.raises(DecisionLogError, match="no such directory"):
        create_app(ScoreEngine(), config=ServiceConfig(decision_log=str(missing)))
    code = main(["serve", "--decision-log", str(missing), "--profiles-dir", str(tmp_path)])
    assert code == 2


def test_a_write_failure_is_a_503_not_a_silent_loss(client: TestClient[Any]) -> None:
    log = _service(client).decision_log
    assert log is not None

    def fail(records: Any) -> None:
        raise DecisionLogError("disk full (simulated)")

    original = log.append
    log.append = fail
    try:
        r = client.post("/judge", json={"prompt": "x p=0.9", "choices": CHOICES})
    finally:
        log.append = original
    assert r.status_code == 503 and "decision log" in r.json()["detail"]
    metrics = client.get("/metrics").text
    assert "judge_decision_log_errors_total 1.0" in metrics


def test_a_label_the_log_cannot_store_is_a_503_not_a_500(client: TestClient[Any]) -> None:
    """A full disk under the log (bench_soak's fault) failed every label with a bare 500, as
    if the server had a bug, and the labeller could not tell that a retry would do: a label
    the log cannot store, or a read it cannot make, is a 503 that says the log failed."""
    judged = client.post("/judge", json={"prompt": "x p=0.9", "choices": CHOICES}).json()
    log = _service(client).decision_log
    assert log is not None

    def full(*args: Any, **kwargs: Any) -> None:
        # What SQLite says when the file may not grow (RLIMIT_FSIZE; ENOSPC: "disk is full").
        raise DecisionLogError("decision log x: cannot label decision 'y': disk I/O error")

    jid = judged["judgment_id"]
    calls = {
        "label": lambda: client.post(f"/judgments/{jid}/label", json={"label": "no"}),
        "labels": lambda: client.post("/labels", json={"labels": [{"judgment_id": jid, "label": "no"}]}),
        "get": lambda: client.get(f"/judgments/{jid}"),
    }  # fmt: skip
    for method, call in zip(("label", "label_many", "get"), calls.values(), strict=True):
        original = getattr(log, method)
        setattr(log, method, full)
        try:
            r = call()
        finally:
            setattr(log, method, original)
        assert r.status_code == 503, (method, r.status_code, r.text)
        assert "disk I/O error" in r.json()["detail"] and r.headers["retry-after"] == "1"
    # Nothing was stored meanwhile; once the log can be written, the same label is.
    assert client.get(f"/judgments/{jid}").json()["label"] is None
    stored = client.post(f"/judgments/{jid}/label", json={"label": "no"}).json()
    assert stored["status"] == "labeled"
    # The two labels refused are counted as a refused decision is; the read is not a write.
    metrics = client.get("/metrics").text
    assert "judge_decision_log_errors_total 2.0" in metrics


def _service(client: TestClient[Any]) -> Any:
    """The app's Service: the dependency the routes are given."""
    provide = client.app.dependencies["service"]
    return provide.dependency()


# --- feedback ----------------------------------------------------------------------------------


def test_labels_are_stored_and_refused_clearly(client: TestClient[Any]) -> None:
    body = client.post("/judge", json={"prompt": "a p=0.9", "choices": CHOICES}).json()
    url = f"/judgments/{body['judgment_id']}/label"
    first = client.post(url, json={"label": "no"})
    assert first.status_code == 200 and first.json()["status"] == "labeled"
    again = client.post(url, json={"label": "no"})
    assert again.status_code == 200 and again.json()["status"] == "unchanged"
    other = client.post(url, json={"label": "yes"})
    assert other.status_code == 409 and other.json()["field"] == "label"
    assert "no" in other.json()["detail"] and "replace" in other.json()["detail"]
    replaced = client.post(url, json={"label": "yes", "replace": True})
    assert replaced.json() == {
        "judgment_id": body["judgment_id"],
        "label": "yes",
        "status": "relabeled",
        "previous": "no",
    }
    assert client.get(f"/judgments/{body['judgment_id']}").json()["label"] == "yes"
    bad = client.post(url, json={"label": "maybe"})
    assert bad.status_code == 422 and bad.json()["field"] == "label"
    unknown = client.post("/judgments/0190-none/label", json={"label": "yes"})
    assert unknown.status_code == 404 and unknown.json()["field"] == "judgment_id"
    malformed = client.post(url, json={"label": "yes", "extra": 1})
    assert malformed.status_code == 400 and malformed.json()["field"] == "extra"
    empty = client.post(url, json={"label": ""})
    assert empty.status_code == 400 and empty.json()["field"] == "label"


def test_a_batch_of_labels_answers_each_in_its_place(client: TestClient[Any]) -> None:
    a, b = judge_all(client, [0.9, 0.1], profile=None)
    r = client.post(
        "/labels",
        json={
            "labels": [
                {"judgment_id": a["judgment_id"], "label": "yes"},
                {"judgment_id": "unknown", "label": "yes"},
                {"judgment_id": b["judgment_id"], "label": "perhaps"},
                {"judgment_id": b["judgment_id"], "label": "no"},
            ]
        },
    )
    assert r.status_code == 200
    results = r.json()["results"]
    assert [x["status"] for x in results] == ["labeled", "error", "error", "labeled"]
    assert [x.get("status_code") for x in results] == [None, 404, 422, None]
    assert client.post("/labels", json={"labels": []}).status_code == 400


def test_judge_label_reads_a_jsonl_file(
    client: TestClient[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = judge_all(client, [0.9, 0.1], profile=None)
    lines = tmp_path / "labels.jsonl"
    lines.write_text(
        json.dumps({"judgment_id": a["judgment_id"], "label": "yes"})
        + "\n"
        + json.dumps({"judgment_id": b["judgment_id"], "label": "nope"})
        + "\n"
    )
    log = str(tmp_path / "decisions.db")
    assert main(["label", "--log", log, "--input", str(lines)]) == 1  # one refused
    out = json.loads(capsys.readouterr().out)
    assert out["counts"] == {"labeled": 1, "error": 1}
    assert out["errors"][0]["error"] == "not_a_choice"
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"judgment_id": b["judgment_id"], "label": "no"}) + "\n{oops\n")
    assert main(["label", "--log", log, "--input", str(broken)]) == 2
    assert "line 2" in capsys.readouterr().err
    with open_log(log) as opened:
        stored = opened.get(b["judgment_id"])
    assert stored is not None and stored.label is None  # nothing of the broken file was stored


# --- health: precision, drift, the model ----------------------------------------------------


def test_a_stationary_stream_is_healthy(
    tmp_path: Path, profile: CalibrationProfile, capsys: pytest.CaptureFixture[str]
) -> None:
    p, labels = stream(np.random.default_rng(2), 1500)
    with served(tmp_path, profile, audit_rate=0.3) as c:
        responses = judge_all(c, p)
        labeled = label_audited(c, responses, labels)
        health = c.get("/profiles/gate/health").json()
        metrics = c.get("/metrics").text
    assert health["healthy"] and health["alarms"] == [], health
    assert health["n_decisions"] == 1500 and health["n_audited_labeled"] == labeled
    assert health["precision"]["n"] > 50 and not health["precision"]["contradicts"]
    assert not health["drift"]["drifted"] and health["model"]["matches"]
    shares = dict(zip(health["shares"]["choices"], health["shares"]["estimate"], strict=True))
    assert abs(shares["yes"] - 0.5) < 0.1
    assert 'judge_profile_healthy{profile="gate"} 1.0' in metrics
    # The alarm is the sequential one, and says so on every front.
    assert "anytime-valid" in health["precision"]["method"]
    bet = health["precision"]["max_capital"]
    assert 1.0 <= bet < 20 and f'judge_profile_precision_bet{{profile="gate"}} {bet}' in metrics
    log = str(tmp_path / "decisions.db")
    profile_file = str(tmp_path / "profiles" / "gate.json")
    assert main(["check", "--profile", profile_file, "--log", log]) == 0
    assert json.loads(capsys.readouterr().out)["healthy"] is True


def test_a_prior_shift_is_caught_by_the_drift_test(
    tmp_path: Path, profile: CalibrationProfile, capsys: pytest.CaptureFixture[str]
) -> None:
    p, _ = stream(np.random.default_rng(3), 1000, prior=0.85)
    with served(tmp_path, profile) as c:
        judge_all(c, p)
        health = c.get("/profiles/gate/health").json()
    assert "drift" in health["alarms"] and health["drift"]["choice_p"] < 0.005
    log = str(tmp_path / "decisions.db")
    profiles = str(tmp_path / "profiles")
    code = main(["check", "--profile", "gate", "--profiles-dir", profiles, "--log", log])
    assert code == 1 and "ALARM: drift" in capsys.readouterr().err


def test_labels_that_contradict_the_certificate_raise_the_alarm(
    tmp_path: Path, profile: CalibrationProfile
) -> None:
    rng = np.random.default_rng(4)
    p, labels = stream(rng, 1000)
    # The same inputs, but the world changed: a third of the labels flipped. Label-free drift
    # cannot see it; the audited labels can.
    flipped = [("no" if x == "yes" else "yes") if rng.random() < 0.35 else x for x in labels]
    with served(tmp_path, profile, audit_rate=0.5) as c:
        responses = judge_all(c, p)
        label_audited(c, responses, flipped)
        health = c.get("/profiles/gate/health").json()
    assert health["alarms"] == ["precision"], health
    check = health["precision"]
    assert check["contradicts"] and check["upper"] < check["target"] == 0.95


def test_check_fails_on_another_model(
    tmp_path: Path,
    profile: CalibrationProfile,
    capsys: pytest.CaptureFixture[str],
    loaded_once: list[dict[str, object]],
) -> None:
    p, _ = stream(np.random.default_rng(5), 200)
    with served(tmp_path, profile) as c:
        judge_all(c, p)
    log = str(tmp_path / "decisions.db")
    profile_file = str(tmp_path / "profiles" / "gate.json")
    assert main(["check", "--profile", profile_file, "--log", log]) == 0
    capsys.readouterr()
    # The embedded model is loaded, and its weights are not the ones the profile was fitted on.
    assert main(["check", "--profile", profile_file, "--log", log, "--check-model"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["alarms"] == ["model"] and not out["model"]["matches"]
    assert len(loaded_once) == 1


def test_calibrate_from_log_refits_on_the_audit_sample(
    tmp_path: Path, profile: CalibrationProfile, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(6)
    p, labels = stream(rng, 1500, prior=0.7)
    with served(tmp_path, profile, audit_rate=0.4) as c:
        responses = judge_all(c, p)
        n = label_audited(c, responses, labels)
    code = main(
        [
            *("calibrate", "--from-log", str(tmp_path / "decisions.db"), "--profile", "gate"),
            *("--profiles-dir", str(tmp_path / "profiles"), "--name", "gate2"),
            *("--method", "temperature", "--target-precision", "0.95"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    refit = ProfileStore(tmp_path / "profiles").get("gate2")
    assert refit.n_examples == n and refit.fingerprint == profile.fingerprint
    assert refit.dataset.startswith("decision log") and refit.reference is not None
    # Its reference is the live traffic's: the shifted prior shows in its choice counts.
    counts = refit.reference.choice_counts
    assert counts[0] / sum(counts) > 0.55


def test_labels_outside_the_audit_sample_fit_and_never_certify(
    tmp_path: Path, profile: CalibrationProfile, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(8)
    p, labels = stream(rng, 800)
    with served(tmp_path, profile, audit_rate=0.4) as c:
        responses = judge_all(c, p)
        n = label_audited(c, responses, labels)
        # A person labels 120 others too (the least certain, say: a teach stream's picks).
        others = [(r, y) for r, y in zip(responses, labels, strict=True) if not r.get("audit")]
        others.sort(key=lambda pair: abs(pair[0]["probabilities"]["yes"] - 0.5))
        pairs = [{"judgment_id": r["judgment_id"], "label": y} for r, y in others[:120]]
        assert c.post("/labels", json={"labels": pairs}).status_code == 200
    argv = ["calibrate", "--from-log", str(tmp_path / "decisions.db"), "--profile", "gate"]
    argv += ["--profiles-dir", str(tmp_path / "profiles"), "--method", "temperature"]
    assert main([*argv, "--name", "refit"]) == 0, capsys.readouterr().err
    assert "120 labeled decisions outside the audit sample fit the map only" in (
        capsys.readouterr().out
    )
    refit = ProfileStore(tmp_path / "profiles").get("refit")
    assert refit.n_examples == n + 120 and refit.split.taught == 120
    # Only the audited decisions set the quantile and certify. The fit split takes its share
    # (3 of 10) of all the labels, the 120 taught ones first, so the audited decisions fit only
    # where those fall short; the rest set the quantile and certify (2:5): calibration.limits.allot.
    fitting, conformal, certify = allot(120, n, probe=False)
    assert fitting == max(0, round((n + 120) * 3 / 10) - 120)
    assert (refit.split.conformal, refit.split.certify) == (conformal, certify)
    assert refit.split.fit == fitting + 120 and refit.split.allotment == "by_role"
    assert refit.metrics_after is not None and refit.metrics_after.n == n - fitting
    assert refit.dataset.endswith("and 120 others labeled (fit only)")


# --- replay, on the real model ------------------------------------------------------------------


def test_replay_reproduces_a_logged_decision_exactly(
    judge: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    loaded_once: list[dict[str, object]],
) -> None:
    config = ServiceConfig(
        profiles_dir=tmp_path / "profiles",
        decision_log=str(tmp_path / "decisions.db"),
        log_requests=True,
    )
    prompt = "Is this SMS spam? WINNER!! Claim your free prize now, text WIN to 80082."
    with TestClient(app=create_app(judge, config=config)) as c:
        wait_ready(c)
        items = [{"prompt": prompt, "choices": ["spam", "ham"]}] + [
            {"prompt": f"Is {n} a prime number?", "choices": ["yes", "no"]} for n in range(5)
        ]
        first = c.post("/judge/batch", json={"items": items}).json()["results"][0]
    log = str(tmp_path / "decisions.db")
    assert main(["replay", first["judgment_id"], "--log", log]) == 0
    out = json.loads(capsys.readouterr().out)
    # Judged alone today, in a batch of six then: batch-invariant arithmetic gives the same
    # bits, so nothing changed, the tokens and weights included.
    assert out["changed"] == [], out
    assert out["now"]["probabilities"] == first["probabilities"]
    assert out["now"]["model_sha256"] == first["model_sha256"] == judge.model_sha256
    # A decision logged without its request cannot be replayed, and says why.
    bare_config = ServiceConfig(profiles_dir=tmp_path / "profiles", decision_log=log)
    with TestClient(app=create_app(judge, config=bare_config)) as c:
        wait_ready(c)
        bare = c.post("/judge", json={"prompt": prompt, "choices": ["spam", "ham"]}).json()
    assert main(["replay", bare["judgment_id"], "--log", log]) == 2
    assert "--log-requests" in capsys.readouterr().err


def test_the_client_labels_and_reads_health(tmp_path: Path, profile: CalibrationProfile) -> None:
    p, labels = stream(np.random.default_rng(7), 300)
    with served(tmp_path, profile, audit_rate=0.5) as c:
        responses = judge_all(c, p)
    audited = [
        (r["judgment_id"], y) for r, y in zip(responses, labels, strict=True) if r.get("audit")
    ]
    # Labels and health need no model: a second app on the same log and profiles answers them.
    config = ServiceConfig(
        profiles_dir=tmp_path / "profiles", decision_log=str(tmp_path / "decisions.db")
    )
    app: Any = create_app(ScoreEngine(), config=config)  # httpx types ASGI apps more loosely
    transport = httpx.ASGITransport(app=app)

    async def calls() -> None:
        async with AsyncJudgeClient("http://judge.test", transport=transport) as client:
            first = await client.label(*audited[0])
            assert first.status == "labeled"
            with pytest.raises(ClientError) as refused:
                await client.label(audited[0][0], "no" if audited[0][1] == "yes" else "yes")
            assert refused.value.status_code == 409
            batch = await client.labels(audited[1:])
            assert {r.status for r in batch.results} == {"labeled"}
            kept = await client.judgment(audited[0][0])
            assert kept.label == audited[0][1] and kept.audit
            health = await client.profile_health("gate")
            assert health.n_audited_labeled == len(audited) and health.healthy
            history = await client.profile_health_history("gate")
            assert history.points[-1].n_decisions == 300 and history.points[-1].alarms == []
            assert history.points[-1].shares is not None
            versions = await client.profile_versions("gate")
            assert [v.etag for v in versions.versions if v.current] == [health.profile_etag]
            queue = await client.label_queue("gate")
            assert queue.pending_audit == 0  # every audited decision is labelled

    asyncio.run(calls())


# --- two replicas, one PostgreSQL log ---------------------------------------------------------


def test_two_replicas_share_one_postgresql_log(
    tmp_path: Path,
    profile: CalibrationProfile,
    postgres_database: str,  # noqa: F811
) -> None:
    """Two servers (each its own Service, connection and batcher) write one log at once; a
    decision made on one is labeled through the other, and either reports the health of all."""
    ProfileStore(tmp_path / "profiles").put(profile)
    config = ServiceConfig(
        profiles_dir=tmp_path / "profiles", decision_log=postgres_database, audit_rate=0.5
    )
    p, labels = stream(np.random.default_rng(8), 400)
    halves = [(p[:200], labels[:200]), (p[200:], labels[200:])]
    responses: list[list[Any]] = [[], []]
    with (
        TestClient(app=create_app(ScoreEngine(), config=config)) as a,
        TestClient(app=create_app(ScoreEngine(), config=config)) as b,
    ):
        wait_ready(a)
        wait_ready(b)
        replicas = [a, b]

        def serve(i: int) -> None:
            responses[i] = judge_all(replicas[i], halves[i][0])

        threads = [threading.Thread(target=serve, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Each replica labels the other's audited decisions.
        label_audited(a, responses[1], halves[1][1])
        label_audited(b, responses[0], halves[0][1])
        health = [c.get("/profiles/gate/health").json() for c in replicas]
    audited = sum(1 for half in responses for r in half if r.get("audit"))
    assert health[0]["n_decisions"] == health[1]["n_decisions"] == 400
    assert health[0]["n_audited_labeled"] == health[1]["n_audited_labeled"] == audited
    with open_log(postgres_database) as log:
        assert log.count() == 400
        ids = {r["judgment_id"] for half in responses for r in half}
        assert {d.judgment_id for d in log.decisions()} == ids
