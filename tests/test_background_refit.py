"""Refit without a person (issue 57): labels arriving at the server refit the profile from the
log in the background; the refit is served only when it certifies at least as much; every
version is kept and a rollback is one request."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from litestar.testing import TestClient
from test_feedback import CHOICES, ScoreEngine, judge_all, served, stream

from calibration import CalibrationProfile, FitSettings, LabeledScores, Provenance, fit_profile
from service import ServiceConfig
from service.profiles import ProfileStore
from service.web.background_refit import refit_due


def profile_on(n: int, seed: int) -> CalibrationProfile:
    """Profile "gate" fitted on ``n`` labelled items of the synthetic stream."""
    p, labels = stream(np.random.default_rng(seed), n)
    return fit_profile(
        "gate",
        LabeledScores(
            np.log(np.array([[v, 1 - v] for v in p])),
            np.ones(n),
            np.array([CHOICES.index(label) for label in labels]),
        ),
        CHOICES,
        Provenance(
            fingerprint=ScoreEngine().fingerprint(), dataset="synthetic", dataset_sha256="0" * 64
        ),
        FitSettings(methods=["temperature"], target_precision=0.95),
    ).profile


def label_audited(c: TestClient[Any], responses: list[Any], labels: list[str]) -> None:
    pairs = [
        {"judgment_id": r["judgment_id"], "label": y}
        for r, y in zip(responses, labels, strict=True)
        if r.get("audit")
    ]
    assert c.post("/labels", json={"labels": pairs}).status_code == 200


def refits(c: TestClient[Any], count: int) -> dict[str, Any]:
    """GET /profiles/gate/versions once ``count`` background refits have finished."""
    deadline = time.monotonic() + 120
    while True:
        body = c.get("/profiles/gate/versions").json()
        if len(body["refits"]) >= count or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def test_a_better_refit_is_served_and_a_rollback_undoes_it(tmp_path: Path) -> None:
    weak = profile_on(60, seed=1)  # few labels: it certifies little
    p, labels = stream(np.random.default_rng(2), 900)
    with served(tmp_path, weak, audit_rate=0.5, refit_every=100) as c:
        before = c.get("/profiles/gate").headers["etag"]
        responses = judge_all(c, p)
        assert {r["profile_etag"] for r in responses} == {before}
        assert refits(c, 0)["refits"] == []  # nothing refits before labels come
        label_audited(c, responses, labels)
        body = refits(c, 1)
        (refit,) = body["refits"]
        assert refit["served"], refit
        assert refit["from_etag"] == before and refit["coverage_after"] >= refit["coverage_before"]
        after = c.get("/profiles/gate").headers["etag"]
        assert after == refit["etag"] != before
        assert [v["etag"] for v in body["versions"]] == [after, before]
        assert [v["current"] for v in body["versions"]] == [True, False]
        stored = ProfileStore(tmp_path / "profiles").get("gate")
        assert stored.recertification is not None and stored.recertification.look == 1
        # A request decided after the refit names the new version.
        now = c.post("/judge", json={"prompt": "x p=0.9", "choices": CHOICES, "profile": "gate"})
        assert now.json()["profile_etag"] == after
        # A rollback is one request; If-Match guards it like a PUT.
        stale = c.post(
            "/profiles/gate/rollback", json={"etag": before}, headers={"If-Match": before}
        )
        assert stale.status_code == 412
        back = c.post("/profiles/gate/rollback", json={"etag": before}, headers={"If-Match": after})
        assert back.status_code == 200 and back.headers["etag"] == before
        again = c.post("/judge", json={"prompt": "x p=0.9", "choices": CHOICES, "profile": "gate"})
        assert again.json()["profile_etag"] == before
        for bad, field in (({"etag": "nope"}, "etag"), ({"tag": before}, "tag")):
            refused = c.post("/profiles/gate/rollback", json=bad)
            assert refused.status_code == 400 and field in refused.text, refused.text
        unknown = c.post("/profiles/gate/rollback", json={"etag": '"' + "0" * 64 + '"'})
        assert unknown.status_code == 404
        assert c.get("/profiles/nothing/versions").status_code == 404
        # Deleted, nothing is served under the name; its versions are kept and named.
        assert c.delete("/profiles/gate").status_code == 204
        gone = c.get("/profiles/gate/versions")
        assert gone.status_code == 404 and "deleted" in gone.json()["detail"]
        assert before in gone.json()["detail"]  # the newest kept: the rollback's
        revived = c.post("/profiles/gate/rollback", json={"etag": after})
        assert revived.status_code == 200 and revived.headers["etag"] == after


def test_a_worse_refit_is_kept_and_not_served(tmp_path: Path) -> None:
    strong = profile_on(3000, seed=3)
    assert strong.threshold.threshold is not None
    p, labels = stream(np.random.default_rng(4), 600)
    rng = np.random.default_rng(5)
    noisy = [y if rng.random() > 0.35 else ("no" if y == "yes" else "yes") for y in labels]
    with served(tmp_path, strong, audit_rate=0.5, refit_every=100) as c:
        before = c.get("/profiles/gate").headers["etag"]
        responses = judge_all(c, p)
        label_audited(c, responses, noisy)  # labels far worse than the profile's own
        body = refits(c, 1)
        (refit,) = body["refits"]
        assert not refit["served"] and refit["reason"].startswith("not served"), refit
        assert c.get("/profiles/gate").headers["etag"] == before
        # Kept all the same, for a person to look at (and roll forward to, if they choose).
        assert refit["etag"] in [v["etag"] for v in body["versions"]]
        assert [v["current"] for v in body["versions"] if v["etag"] == before] == [True]


def test_a_refit_that_certifies_nothing_replaces_only_a_profile_that_certifies_nothing(
    tmp_path: Path,
) -> None:
    blind = msgspec.structs.replace(
        profile_on(200, seed=6),
        threshold=msgspec.structs.replace(
            profile_on(200, seed=6).threshold, threshold=None, feasible=False, coverage=0.0
        ),
    )
    p, labels = stream(np.random.default_rng(7), 120)
    rng = np.random.default_rng(8)
    coin = [str(rng.choice(CHOICES)) for _ in labels]  # labels no map can certify on
    with served(tmp_path, blind, audit_rate=1.0, refit_every=50) as c:
        before = c.get("/profiles/gate").headers["etag"]
        label_audited(c, judge_all(c, p), coin)
        (refit,) = refits(c, 1)["refits"]
        assert refit["coverage_after"] == 0.0 and refit["served"], refit
        assert c.get("/profiles/gate").headers["etag"] == refit["etag"] != before


def test_refit_every_needs_a_log() -> None:
    with pytest.raises(ValueError, match="decision_log"):
        ServiceConfig(refit_every=10)
    with pytest.raises(ValueError, match="refit_every"):
        ServiceConfig(refit_every=0, decision_log="x.db")


def test_refits_come_further_apart_as_the_labels_grow() -> None:
    """A refit reads every labelled decision: past four times ``--refit-every``, the next one
    waits for a quarter more labels than the last read, so refits take a bounded share of the
    machine (issue 69: at 3,000 labels a refit every 40 ran a few seconds a time)."""
    assert refit_due(40, 0, 40) and not refit_due(39, 0, 40)
    assert refit_due(200, 160, 40)  # 40 new: a quarter of 160 is less
    assert not refit_due(2039, 2000, 40) and not refit_due(2499, 2000, 40)
    assert refit_due(2500, 2000, 40)  # a quarter of 2,000
    at, refits = 0, 0
    for labelled in range(1, 10_001):
        if refit_due(labelled, at, 40):
            at, refits = labelled, refits + 1
    assert 20 <= refits <= 30  # every 40 labels would be 250
