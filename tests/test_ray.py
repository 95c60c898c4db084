"""Scale-out on Ray Serve: 2 replicas of 1 CPU each behind one endpoint, on a local cluster.

The mechanics (spread, shared profiles, a killed replica) run on a fake engine whose passes
take a set time, so requests are really in flight; one test deploys the real default model and
compares it with the single-process service. Numbers are printed (run with -s).
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from fakes import FakeEngine, judgment_of
from server import free_port
from test_profile_store import fake_profile
from test_reliability import live

from judge import Judgment, Prepared, Query
from service import ServiceConfig
from service.cli.main import main
from service.web.ray_serve import INSTALL_HINT, Scaling, application

try:
    import ray
    from ray import serve
except ImportError:  # the cluster tests skip, saying how to install it
    ray = serve = None  # type: ignore[assignment]

TESTS = str(Path(__file__).parent)
CHOICES = ["ham", "spam"]
REPLICA = "x-judge-replica"


class HashEngine(FakeEngine):
    """Probabilities that depend on the prompt (the same in every process); passes take time."""

    delay = 0.02

    def judgment(self, query: Query) -> Judgment:
        weights = {
            c: 1 + int(hashlib.sha256(f"{query.prompt}|{c}".encode()).hexdigest(), 16) % 97
            for c in query.choices
        }
        total = sum(weights.values())
        return judgment_of({c: w / total for c, w in weights.items()}, prompt=query.prompt)

    def run(self, prepared: Sequence[Prepared]) -> list[Judgment]:
        time.sleep(self.delay)
        return super().run(prepared)


def hash_engine() -> HashEngine:
    """The loader each replica runs (importable there: the cluster's PYTHONPATH has tests/)."""
    return HashEngine()


def real_engine() -> Any:
    from judge import Judge

    return Judge.load(dtype="float32")


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster of 2 CPUs with Serve's proxy on a free port; its base URL."""
    if ray is None:
        pytest.skip(INSTALL_HINT)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, old) if p)  # for the workers
    port = free_port()
    # Ray runs its workers at niceness 15 by default, so beside another busy process (a second
    # CI job on 2 cores) the replicas starve: test_ray took 13.4 min there, against 2 alone.
    # The replicas here are the tests' own work, at the tests' priority.
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _system_config={"worker_niceness": 0},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def fake_url(cluster: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    profiles = tmp_path_factory.mktemp("shared-profiles")
    config = ServiceConfig(profiles_dir=profiles, max_wait_ms=2.0)
    serve.run(application(hash_engine, config, Scaling(replicas=2)), name="judge")
    return cluster


def ask(client: httpx.Client, url: str, i: int, **extra: Any) -> httpx.Response:
    body = {"prompt": f"message {i}: is it spam?", "choices": CHOICES, **extra}
    return client.post(f"{url}/judge", json=body, timeout=60)


# Generous bounds, each for one thing: a loaded machine makes these slow, not wrong. Each is
# a watchdog (the test moves on as soon as what it waits for happens): only a hang reaches it.
STARTUP_S = 600.0  # both replicas answering after the deployment
RECOVERY_S = 600.0  # Serve replacing a killed replica, from the kill
SETTLE_S = 300.0  # the recovered pair answering a few more requests


def poll_until(condition: Callable[[], bool], within_s: float, what: str) -> float:
    """Check ``condition`` every 50 ms until it holds; the time it took. Fails after ``within_s``."""
    started = time.monotonic()
    deadline = started + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within_s:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.slow
def test_requests_spread_over_both_replicas_and_match_one_process(
    fake_url: str, tmp_path: Path
) -> None:
    with httpx.Client() as client, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: ask(client, fake_url, i), range(64)))
    assert all(r.status_code == 200 for r in answers)
    per_replica = collections.Counter(r.headers[REPLICA] for r in answers)
    print(f"\nrequests per replica: {dict(per_replica)}")
    assert len(per_replica) == 2 and min(per_replica.values()) >= 8
    with live(HashEngine(), tmp_path) as one, httpx.Client() as client:
        for i, r in enumerate(answers):
            alone = ask(client, one, i).json()
            for c in CHOICES:
                assert math.isclose(
                    r.json()["probabilities"][c], alone["probabilities"][c], abs_tol=1e-4
                )
            assert r.json()["decision"] == alone["decision"]


def until_both(
    url: str, check: Callable[[httpx.Response], bool], within_s: float = STARTUP_S
) -> collections.Counter[str]:
    """Send requests until both replicas have answered ``check``-passing responses.

    Eight at a time: the router spreads concurrent requests by queue length, while requests
    sent one by one find every replica idle and may all go to the same one (seen: 200 of 200).
    """
    seen: collections.Counter[str] = collections.Counter()
    deadline = time.monotonic() + within_s
    with httpx.Client() as client, ThreadPoolExecutor(8) as pool:
        for start in itertools.count(0, 8):
            batch = range(start, start + 8)
            for r in pool.map(lambda i: ask(client, url, i, profile="shared"), batch):
                if check(r):
                    seen[r.headers[REPLICA]] += 1
            if len(seen) == 2:
                return seen
            if time.monotonic() > deadline:
                break
    raise AssertionError(f"within {within_s:.0f} s only {dict(seen)} answered as expected")


@pytest.mark.slow
def test_a_profile_put_through_one_replica_is_used_by_both(fake_url: str) -> None:
    profile = fake_profile("shared")
    body = msgspec.json.encode(profile)
    headers = {"content-type": "application/json", "If-None-Match": "*"}
    stored = httpx.put(f"{fake_url}/profiles/shared", content=body, headers=headers)
    assert stored.status_code == 200, stored.text
    writer, tag = stored.headers[REPLICA], stored.headers["etag"]
    applied = until_both(
        fake_url,
        lambda r: (
            r.status_code == 200
            and r.json()["profile"] == "shared"
            and r.json()["temperature"] == profile.calibration_map.temperature
        ),
    )
    print(f"\nprofile stored by {writer}; applied by {dict(applied)}")
    # Both replicas see one version: a stale If-Match is refused whichever replica answers.
    for _ in range(6):
        r = httpx.put(
            f"{fake_url}/profiles/shared", content=body, headers={**headers, "If-Match": '"stale"'}
        )
        assert r.status_code == 412 and r.json()["field"] == "If-Match"
        got = httpx.get(f"{fake_url}/profiles/shared")
        assert got.headers["etag"] == tag
    gone = httpx.delete(f"{fake_url}/profiles/shared", headers={"If-Match": tag})
    assert gone.status_code == 204
    until_both(fake_url, lambda r: r.status_code == 404 and r.json()["field"] == "profile")


@pytest.mark.slow
def test_killing_a_replica_loses_only_what_was_in_flight_on_it(fake_url: str) -> None:
    workers = 4
    results: list[tuple[float, int, str | None]] = []  # (time, status, replica)
    lock = threading.Lock()
    stop = threading.Event()

    def stream(worker: int) -> None:
        with httpx.Client() as client:
            for i in range(100_000):  # bounded by the stop event, set within the deadlines
                if stop.is_set():
                    return
                try:
                    r = ask(client, fake_url, worker * 100_000 + i)
                    status, replica = r.status_code, r.headers.get(REPLICA)
                except httpx.TransportError:
                    status, replica = 0, None
                with lock:
                    results.append((time.monotonic(), status, replica))

    def answered_since(t: float) -> collections.Counter[str]:
        """Answers per replica, counting the 200s sent after ``t``."""
        with lock:
            return collections.Counter(
                r[2] for r in results if r[0] > t and r[1] == 200 and r[2] is not None
            )

    threads = [threading.Thread(target=stream, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    try:
        # Start-up and recovery each get their own deadline: a slow start must not eat into
        # the time a replacement replica has to come up.
        poll_until(lambda: len(answered_since(0.0)) == 2, STARTUP_S, "both replicas answering")
        victim = sorted(answered_since(0.0))[0]
        killed_at = time.monotonic()
        os.kill(int(victim.rsplit(":", 1)[1]), signal.SIGKILL)

        def pair_answered(since: float, each: int) -> bool:
            """The survivor and a new replica have each answered ``each`` times since then."""
            seen = answered_since(since)
            seen.pop(victim, None)
            return len(seen) == 2 and min(seen.values()) >= each

        recovery = poll_until(
            lambda: pair_answered(killed_at, 1), RECOVERY_S, f"a replica to replace {victim}"
        )
        recovered_at = time.monotonic()  # then a little more traffic on the recovered pair
        poll_until(lambda: pair_answered(recovered_at, 3), SETTLE_S, "the recovered pair")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    failed = [r for r in results if r[1] != 200]
    after = collections.Counter(r[2] for r in results if r[0] > killed_at and r[1] == 200)
    print(
        f"\n{len(results)} requests, {len(failed)} failed ({collections.Counter(r[1] for r in failed)}); "
        f"recovery {recovery:.1f} s; answers after the kill: {dict(after)}"
    )
    # Each client has one request at a time, so at most `workers` were in flight on the victim.
    assert len(failed) <= workers
    assert all(r[0] >= killed_at for r in failed)


@pytest.mark.slow
def test_the_real_model_on_two_replicas_equals_one_process(
    cluster: str, judge: Any, tmp_path: Path
) -> None:
    config = ServiceConfig(profiles_dir=tmp_path / "profiles")
    started = time.monotonic()
    serve.run(application(real_engine, config, Scaling(replicas=2)), name="judge")
    print(f"\nreal model: 2 replicas ready in {time.monotonic() - started:.1f} s")
    prompts = [f"Is this SMS spam? message {i}: WINNER!! claim {i} now" for i in range(16)]
    with httpx.Client() as client, ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(
                lambda p: client.post(
                    f"{cluster}/judge", json={"prompt": p, "choices": CHOICES}, timeout=120
                ),
                prompts,
            )
        )
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    replicas = collections.Counter(r.headers[REPLICA] for r in answers)
    print(f"real model: requests per replica {dict(replicas)}")
    assert len(replicas) == 2
    with live(judge, tmp_path) as one, httpx.Client() as client:
        worst = 0.0
        for p, r in zip(prompts, answers, strict=True):
            alone = client.post(
                f"{one}/judge", json={"prompt": p, "choices": CHOICES}, timeout=120
            ).json()
            for c in CHOICES:
                worst = max(
                    worst, abs(r.json()["raw_probabilities"][c] - alone["raw_probabilities"][c])
                )
    print(f"real model: largest difference from one process {worst:.2e}")
    assert worst <= 1e-4


def test_scaling_flags_are_checked_before_anything_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["serve", "--ray", "--replicas", "2", "--max-replicas", "3"]) == 2
    assert "give either --replicas, or --min-replicas/--max-replicas" in capsys.readouterr().err
    assert main(["serve", "--ray", "--min-replicas", "3", "--max-replicas", "2"]) == 2
    assert "--max-replicas (2) must be at least --min-replicas (3)" in capsys.readouterr().err
    assert main(["serve", "--ray", "--target-ongoing-requests", "4"]) == 2
    assert "--target-ongoing-requests needs" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: import fails
    assert main(["serve", "--ray", "--replicas", "2"]) == 2
    assert "pip install 'calibrated-judge[ray]'" in capsys.readouterr().err


def test_deployment_options_follow_the_scaling() -> None:
    config = ServiceConfig(max_queue=7)
    fixed = Scaling(replicas=3, replica_cpus=0.5).deployment_options(config)
    assert fixed["num_replicas"] == 3 and fixed["ray_actor_options"] == {"num_cpus": 0.5}
    assert fixed["max_ongoing_requests"] == 7 and "autoscaling_config" not in fixed
    auto = Scaling(
        replicas=None, min_replicas=0, max_replicas=4, target_ongoing_requests=8
    ).deployment_options(config)
    assert auto["autoscaling_config"] == {
        "min_replicas": 0,
        "max_replicas": 4,
        "initial_replicas": 1,
        "target_ongoing_requests": 8,
    }
    assert "num_replicas" not in auto
