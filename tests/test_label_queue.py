"""The labelling queue over the decision log (issue 57): audit and teach streams kept apart,
each label stored as given, and ``judge label --queue`` driven from a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from calibration import CalibrationProfile, FitSettings, LabeledScores, Provenance, fit_profile
from judge import Fingerprint
from judge.identity import new_judgment_id
from service.log.backends import open_log
from service.log.labelling_queue import LabellingQueue
from service.log.record import LoggedDecision
from service.profiles import ProfileStore

ROOT = Path(__file__).resolve().parent.parent
CHOICES = ["yes", "no"]


# The engine of the decisions ``decision`` logs: its weights hashed, as a served model's.
WEIGHTS = Fingerprint(
    model="fake",
    model_sha256="a" * 64,
    dtype="float32",
    response_prefix='{"answer": "',
    response_suffix='"}',
    system_sha256=None,
)


@pytest.fixture(scope="module")
def profile() -> CalibrationProfile:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400)
    margin = np.where(y == 0, 2.0, -2.0) + rng.normal(0, 1.5, 400)
    p = np.clip(1 / (1 + np.exp(-margin)), 1e-4, 1 - 1e-4)
    return fit_profile(
        "gate",
        LabeledScores(np.log(np.stack([p, 1 - p], axis=1)), np.ones(len(y)), y),
        CHOICES,
        Provenance(fingerprint=WEIGHTS, dataset="synthetic", dataset_sha256="0" * 64),
        FitSettings(methods=["temperature"]),
    ).profile


def decision(
    etag: str, p_yes: float, *, audit: bool, item: str | None, at: float
) -> LoggedDecision:
    """A logged decision of profile "gate" on ``item`` (its request kept; None: not kept)."""
    prompt = f"Context first.\n{item}" if item is not None else ""
    span = [len("Context first.\n"), len(prompt)]
    choice = "yes" if p_yes >= 0.5 else "no"
    return LoggedDecision(
        judgment_id=new_judgment_id(),
        created_at=at,
        model="fake",
        model_sha256="a" * 64,
        tokens_sha256="c" * 64,
        policy_sha256="d" * 64,
        profile="gate",
        profile_etag=etag,
        choices=CHOICES,
        log_probs=[float(np.log(p_yes)), float(np.log(1 - p_yes))],
        choice_mass=1.0,
        probabilities={"yes": p_yes, "no": 1 - p_yes},
        choice=choice,
        confidence=max(p_yes, 1 - p_yes),
        decision="accept" if max(p_yes, 1 - p_yes) >= 0.9 else "escalate",
        reason_codes=[],
        threshold=0.9,
        certified=True,
        audit=audit,
        request=None
        if item is None
        else {"query": {"prompt": prompt, "choices": CHOICES, "item_span": span}},
    )


def logged(tmp_path: Path, profile: CalibrationProfile) -> tuple[str, Path, dict[str, str]]:
    """A log with three audit decisions, four others and one without its request; the
    profile stored. Returns the log, the profiles directory and each item's judgment id."""
    profiles = tmp_path / "profiles"
    etag = ProfileStore(profiles).put(profile)
    now = time.time() - 60
    rows = [
        ("audit one", 0.95, True),
        ("audit two", 0.60, True),
        ("audit three", 0.10, True),
        ("sure", 0.99, False),
        ("coin toss", 0.51, False),
        ("fairly sure", 0.80, False),
        ("unsure", 0.40, False),
    ]
    records = [
        decision(etag, p, audit=audit, item=text, at=now + i)
        for i, (text, p, audit) in enumerate(rows)
    ]
    records.append(decision(etag, 0.5, audit=False, item=None, at=now + 10))
    log = str(tmp_path / "decisions.db")
    with closing(open_log(log)) as opened:
        opened.append(records)
    return (
        log,
        profiles,
        {r.request["query"]["prompt"].split("\n")[1]: r.judgment_id for r in records if r.request},
    )


def test_the_streams_are_kept_apart_and_each_in_its_order(
    tmp_path: Path, profile: CalibrationProfile
) -> None:
    log_target, profiles, ids = logged(tmp_path, profile)
    stored, etag = ProfileStore(profiles).get_tagged("gate")
    with closing(open_log(log_target)) as log:
        queue = LabellingQueue(log, stored, etag)
        assert queue.unreadable == 1  # no request logged: nothing to show a person
        assert (queue.pending("audit"), queue.pending("teach")) == (3, 4)
        seen: list[tuple[str, str]] = []
        while (item := queue.next()) is not None:
            seen.append((item.stream, item.item))
            queue.skip(item)
        # Audit oldest first (a uniform sample: no order chosen by the model); the others
        # least certain first; the two in turn.
        assert seen == [
            ("audit", "audit one"),
            ("teach", "coin toss"),
            ("audit", "audit two"),
            ("teach", "unsure"),
            ("audit", "audit three"),
            ("teach", "fairly sure"),
            ("teach", "sure"),
        ]
        assert queue.skipped == {"audit": 3, "teach": 4}

        queue = LabellingQueue(log, stored, etag, streams=("teach",))
        item = queue.next()
        assert item is not None and item.item == "coin toss" and item.prompt.startswith("Context")
        with pytest.raises(ValueError, match="label must be one of"):
            queue.label(item, "maybe")
        assert queue.label(item, "no").status == "labeled"
        labelled = log.get(ids["coin toss"])
        assert labelled is not None and labelled.label == "no"
        assert queue.next() is not None and queue.pending("teach") == 3
        # A new queue leaves what is labelled out.
        assert LabellingQueue(log, stored, etag).pending("teach") == 3
        # One that orders only the next few (the HTTP queue's) has the same next few.
        whole, few = LabellingQueue(log, stored, etag), LabellingQueue(log, stored, etag, ahead=1)
        assert few.pending("teach") == whole.pending("teach") == 3
        assert few.upcoming("teach", 1) == whole.upcoming("teach", 1)
        health = queue.health()
        assert health.n_audited == 3 and health.n_audited_labeled == 0


def _read_until(fd: int, marker: str, seen: list[str], timeout: float = 60.0) -> str:
    """What the terminal printed until ``marker`` appears (all of it kept in ``seen``)."""
    deadline = time.monotonic() + timeout
    while marker not in "".join(seen):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {marker!r} in {''.join(seen)!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen.append(chunk.decode("utf-8", errors="replace"))
    return "".join(seen)


def test_judge_label_queue_from_a_terminal(tmp_path: Path, profile: CalibrationProfile) -> None:
    log_target, profiles, ids = logged(tmp_path, profile)
    master, slave = pty.openpty()
    env: dict[str, Any] = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "service.cli", "label", "--queue", "--log", log_target]
    child = subprocess.Popen(
        [*argv, "--profile", "gate", "--profiles-dir", str(profiles)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        cwd=tmp_path,
    )
    os.close(slave)
    seen: list[str] = []
    try:
        _read_until(master, "1 yes · 2 no · s skip · q quit", seen)
        assert "audit one" in "".join(seen)
        os.write(master, b"1")  # audit one: yes, at once, no Enter
        _read_until(master, "labelled yes (labeled, audit)", seen)
        _read_until(master, "coin toss", seen)
        os.write(master, b"s")  # the coin toss: skipped
        _read_until(master, "audit two", seen)
        os.write(master, b"7")  # no such choice: asked again
        _read_until(master, "no such key '7'", seen)
        os.write(master, b"2")  # audit two: no
        _read_until(master, "labelled no (labeled, audit)", seen)
        os.write(master, b"q")
        out = _read_until(master, "labelled 2 (audit 2, teach 0)", seen)
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
        os.close(master)
    assert "audit: 2 of 3 labelled" in out  # the certificate's state after each label
    with closing(open_log(log_target)) as log:
        labels = {text: (log.get(i) or pytest.fail(text)).label for text, i in ids.items()}
    assert labels == {
        "audit one": "yes",
        "audit two": "no",
        "audit three": None,
        "sure": None,
        "coin toss": None,
        "fairly sure": None,
        "unsure": None,
    }


def test_queue_needs_a_profile(tmp_path: Path, profile: CalibrationProfile) -> None:
    from service.cli.main import main

    log_target, _, _ = logged(tmp_path, profile)
    assert main(["label", "--queue", "--log", log_target]) == 2


def test_the_queue_over_http(tmp_path: Path) -> None:
    from test_background_refit import profile_on
    from test_feedback import judge_all, served, stream

    p, _ = stream(np.random.default_rng(9), 60)
    with served(tmp_path, profile_on(200, seed=9), audit_rate=0.3, log_requests=True) as c:
        responses = judge_all(c, p)
        audited = [r["judgment_id"] for r in responses if r.get("audit")]
        body = c.get("/profiles/gate/queue").json()
        assert body["profile"] == "gate" and body["etag"] == c.get("/profiles/gate").headers["etag"]
        assert [e["judgment_id"] for e in body["audit"]] == audited[:20]  # oldest first
        assert body["pending_audit"] == len(audited)
        assert body["pending_teach"] == len(responses) - len(audited)
        margins = [abs(e["probabilities"]["yes"] - e["probabilities"]["no"]) for e in body["teach"]]
        assert margins == sorted(margins)  # least certain first (no features logged)
        first = body["audit"][0]
        assert first["item"] == first["prompt"] and first["choices"] == CHOICES
        labelled = c.post(f"/judgments/{first['judgment_id']}/label", json={"label": "yes"})
        assert labelled.status_code == 200
        after = c.get("/profiles/gate/queue").json()
        assert after["pending_audit"] == len(audited) - 1 and after["n_audited_labeled"] == 1
        assert after["audit"][0]["judgment_id"] == audited[1]
        assert c.get("/profiles/nothing/queue").status_code == 404
    from litestar.testing import TestClient
    from server import wait_app_ready
    from test_feedback import ScoreEngine

    from service import ServiceConfig, create_app

    ProfileStore(tmp_path / "plain").put(profile_on(200, seed=9))
    config = ServiceConfig(profiles_dir=tmp_path / "plain")  # no decision log
    with TestClient(app=create_app(ScoreEngine(), config=config)) as c:
        wait_app_ready(c)
        nolog = c.get("/profiles/gate/queue")
        assert nolog.status_code == 404 and "--decision-log" in nolog.json()["detail"]
