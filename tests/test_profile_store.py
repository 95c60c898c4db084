"""Profiles with versions: ETags, compare-and-swap across processes, and caches that notice.

The store is tested on both backends (a local directory, a shared one), with real processes
racing on one directory; the HTTP contract (ETag, If-Match, If-None-Match, 412) on the app.
"""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from fakes import FakeEngine
from litestar.testing import TestClient

from calibration import CalibrationProfile, FitSettings, LabeledScores, Provenance, fit_profile
from calibration.errors import ProfileNotFoundError
from service import ServiceConfig, create_app
from service.profiles import (
    LocalDirectory,
    PreconditionFailedError,
    Preconditions,
    ProfileStore,
    SharedDirectory,
    etag_of,
    parse_etags,
)

# The fake engine's own fingerprint, so the profile applies to it.
FAKE = FakeEngine().fingerprint()


def fake_profile(name: str = "sms", seed: int = 0) -> CalibrationProfile:
    """A real fitted profile (synthetic scores) whose fingerprint is FakeEngine's."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 3, size=(200, 2))
    y = (rng.random(200) > np.exp(z[:, 0] / 2) / np.exp(z / 2).sum(1)).astype(int)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return fit_profile(
        name,
        LabeledScores(logp, np.ones(len(y)), y),
        ["ham", "spam"],
        Provenance(fingerprint=FAKE, dataset="d", dataset_sha256="0"),
        FitSettings(n_bootstrap=10),
    ).profile


@pytest.fixture(scope="module")
def profile() -> CalibrationProfile:
    return fake_profile()


@pytest.fixture(params=[LocalDirectory, SharedDirectory])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    return request.param(tmp_path / "profiles")


def test_etag_is_the_hash_of_the_stored_bytes_and_changes_with_them(
    backend: Any, profile: CalibrationProfile
) -> None:
    store = ProfileStore(backend)
    tag = store.put(profile)
    assert tag == etag_of((backend.path / "sms.json").read_bytes())
    assert tag.startswith('"') and tag.endswith('"') and len(tag) == 66
    assert store.get_tagged("sms") == (profile, tag) and store.etag("sms") == tag
    # Another store on the same directory (another replica) computes the same ETag.
    assert ProfileStore(type(backend)(backend.path)).etag("sms") == tag
    changed = msgspec.structs.replace(profile, n_examples=profile.n_examples + 1)
    assert store.put(changed) != tag


def test_preconditions_compare_and_swap(backend: Any, profile: CalibrationProfile) -> None:
    store = ProfileStore(backend)
    with pytest.raises(PreconditionFailedError) as absent:
        store.put(profile, Preconditions(if_match=["*"]))  # nothing stored: If-Match cannot hold
    assert absent.value.field == "If-Match" and not (backend.path / "sms.json").exists()
    first = store.put(profile, Preconditions(if_none_match=["*"]))
    with pytest.raises(PreconditionFailedError) as exists:
        store.put(profile, Preconditions(if_none_match=["*"]))
    assert exists.value.field == "If-None-Match" and first in str(exists.value)
    changed = msgspec.structs.replace(profile, n_examples=profile.n_examples + 1)
    second = store.put(changed, Preconditions(if_match=[first]))
    with pytest.raises(PreconditionFailedError, match="does not match"):
        store.put(profile, Preconditions(if_match=[first]))  # stale: refused, nothing written
    assert store.get("sms") == changed
    with pytest.raises(PreconditionFailedError):  # weak tags never match for If-Match
        store.put(profile, Preconditions(if_match=[f"W/{second}"]))
    third = store.put(profile, Preconditions(if_match=['"other"', second]))  # any tag listed
    assert third != second
    with pytest.raises(PreconditionFailedError):
        store.delete("sms", Preconditions(if_match=[second]))
    with pytest.raises(PreconditionFailedError):  # a delete honours If-None-Match too
        store.delete("sms", Preconditions(if_none_match=["*"]))
    store.delete("sms", Preconditions(if_match=["*"]))
    with pytest.raises(ProfileNotFoundError):
        store.delete("sms", Preconditions(if_match=["*"]))  # 404 before any precondition
    with pytest.raises(ProfileNotFoundError):
        store.get("sms")


def test_every_version_is_kept_and_a_rollback_serves_one_again(
    backend: Any, profile: CalibrationProfile, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ProfileStore(backend)
    first = store.put(profile)
    changed = msgspec.structs.replace(profile, n_examples=profile.n_examples + 1)
    second = store.put(changed)
    kept = store.versions("sms")
    assert [v.etag for v in kept] == [second, first]  # newest first
    assert store.version_of("sms", first) == profile
    # A rollback stores the kept version again: its ETag is the one it had, and it is served.
    with pytest.raises(PreconditionFailedError):
        store.rollback("sms", first, Preconditions(if_match=[first]))  # not the current one
    assert store.rollback("sms", first, Preconditions(if_match=[second])) == first
    assert store.get_tagged("sms") == (profile, first)
    assert store.versions("sms")[0].etag == first
    with pytest.raises(ProfileNotFoundError, match="no version"):
        store.rollback("sms", '"' + "0" * 64 + '"')
    with pytest.raises(ProfileNotFoundError, match="no version"):
        store.version_of("sms", "../sms")  # not an ETag: nothing outside the history is read
    # A deleted profile's versions stay: it can be brought back.
    store.delete("sms")
    assert store.rollback("sms", second) == second and store.get("sms") == changed
    # The oldest beyond the bound are dropped.
    monkeypatch.setattr("service.profiles.KEPT_VERSIONS", 3)
    for n in range(5):
        store.put(msgspec.structs.replace(profile, n_examples=1000 + n))
    assert len(store.versions("sms")) == 3
    assert store.get("sms").n_examples == 1004
    assert "sms" in store.names() and store.names() == ["sms"]  # the history is not a profile


def test_a_version_written_by_other_means_is_listed_and_kept_when_replaced(
    backend: Any, profile: CalibrationProfile
) -> None:
    from calibration import save_profile

    save_profile(profile, backend.path / "sms.json")  # judge calibrate's way: not the store's
    store = ProfileStore(backend)
    first = store.etag("sms")
    assert [v.etag for v in store.versions("sms")] == [first]
    second = store.put(msgspec.structs.replace(profile, n_examples=profile.n_examples + 1))
    assert [v.etag for v in store.versions("sms")] == [second, first]
    assert store.rollback("sms", first) == first


def test_the_cache_notices_changes_made_by_another_store(
    backend: Any, profile: CalibrationProfile
) -> None:
    mine, other = ProfileStore(backend), ProfileStore(type(backend)(backend.path))
    mine.put(profile)
    assert mine.get("sms") == profile  # cached now
    changed = msgspec.structs.replace(profile, n_examples=profile.n_examples + 7)
    other.put(changed)
    assert mine.get("sms") == changed
    other.delete("sms")
    with pytest.raises(ProfileNotFoundError):
        mine.get("sms")
    assert mine.names() == []


def test_parse_etags() -> None:
    assert Preconditions.of({}) == Preconditions()
    headers = {"if-match": '"a", "b"', "if-none-match": "*"}
    assert Preconditions.of(headers) == Preconditions(['"a"', '"b"'], ["*"])
    assert parse_etags(None) is None and parse_etags(" ") is None
    assert parse_etags('"a", W/"b" ,"c"') == ['"a"', 'W/"b"', '"c"']
    assert parse_etags("*") == ["*"]


def _increment(args: tuple[str, str, int]) -> int:
    """Read-modify-write a counter ``rounds`` times, retrying on conflicts; count them."""
    kind, directory, rounds = args
    backend = (SharedDirectory if kind == "shared" else LocalDirectory)(Path(directory))
    conflicts = 0
    for _ in range(rounds):
        while True:
            stored = backend.read("counter")
            assert stored is not None
            value = json.loads(stored.data)["n"]
            try:
                backend.write(
                    "counter",
                    json.dumps({"n": value + 1}).encode(),
                    Preconditions(if_match=[stored.etag]),
                )
                break
            except PreconditionFailedError:
                conflicts += 1
    return conflicts


@pytest.mark.parametrize("kind", ["local", "shared"])
def test_concurrent_writers_in_processes_lose_no_update(tmp_path: Path, kind: str) -> None:
    backend = LocalDirectory(tmp_path)
    backend.write("counter", b'{"n": 0}')
    workers, rounds = 4, 25
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        conflicts = pool.map(_increment, [(kind, str(tmp_path), rounds)] * workers)
    stored = backend.read("counter")
    assert stored is not None and json.loads(stored.data) == {"n": workers * rounds}
    print(f"{kind}: {sum(conflicts)} conflicts retried over {workers * rounds} updates")
    assert not list(tmp_path.glob(".*.tmp"))  # no temporaries left behind


# --- the HTTP contract -----------------------------------------------------------------------


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient[Any]]:
    app = create_app(FakeEngine(), config=ServiceConfig(profiles_dir=tmp_path))
    with TestClient(app=app) as c:
        yield c


def test_profiles_over_http_carry_etags_and_honour_preconditions(
    client: TestClient[Any], profile: CalibrationProfile
) -> None:
    body = msgspec.to_builtins(profile)
    created = client.put("/profiles/sms", json=body, headers={"If-None-Match": "*"})
    assert created.status_code == 200
    tag = created.headers["etag"]
    got = client.get("/profiles/sms")
    assert got.headers["etag"] == tag and got.json() == body
    again = client.put("/profiles/sms", json=body, headers={"If-None-Match": "*"})
    assert again.status_code == 412 and again.json()["field"] == "If-None-Match"
    changed = {**body, "n_examples": body["n_examples"] + 3}
    ok = client.put("/profiles/sms", json=changed, headers={"If-Match": tag})
    assert ok.status_code == 200 and ok.headers["etag"] not in (tag, None)
    stale = client.put("/profiles/sms", json=body, headers={"If-Match": tag})
    assert stale.status_code == 412 and stale.json()["field"] == "If-Match"
    assert (
        client.get("/profiles/sms").json()["n_examples"] == changed["n_examples"]
    )  # the stale write did nothing
    assert client.delete("/profiles/sms", headers={"If-Match": tag}).status_code == 412
    gone = client.delete("/profiles/sms", headers={"If-None-Match": "*"})  # one is stored
    assert gone.status_code == 412 and gone.json()["field"] == "If-None-Match"
    assert (
        client.delete("/profiles/sms", headers={"If-Match": ok.headers["etag"]}).status_code == 204
    )
    assert client.delete("/profiles/sms", headers={"If-Match": "*"}).status_code == 404
    # Unconditional writes still work: the last one wins, and its ETag says which is stored.
    assert client.put("/profiles/sms", json=body).headers["etag"] == tag
    assert client.get("/profiles/sms").headers["x-judge-replica"]


def test_the_document_lists_the_preconditions_and_412(client: TestClient[Any]) -> None:
    paths = client.get("/schema/openapi.json").json()["paths"]
    put, delete = paths["/profiles/{name}"]["put"], paths["/profiles/{name}"]["delete"]
    assert {p["name"] for p in put["parameters"]} >= {"If-Match", "If-None-Match"}
    assert {p["name"] for p in delete["parameters"]} >= {"If-Match", "If-None-Match"}
    assert "412" in put["responses"] and "412" in delete["responses"]
    assert "ETag" in put["responses"]["200"]["headers"]
    assert "ETag" in paths["/profiles/{name}"]["get"]["responses"]["200"]["headers"]
