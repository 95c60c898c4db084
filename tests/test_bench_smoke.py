"""The benchmark scripts: the generation-output classifier, and the --quick runs of the engine's
(the service's and the labels' are in tests/test_bench_smoke_service.py: two files, so that
`make bench-smoke`'s two workers each take one)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from quick_runs import BENCHMARKS, DATA, HANG_S, ROOT, run_quick


def _load(name: str) -> ModuleType:
    """Import a benchmark script as a module (benchmarks/ is not a package)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # where the scripts find benchlib, as when run
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench_quality = _load("bench_quality")
classify_output = bench_quality.classify_output
CHOICES = ["spam", "ham"]


@pytest.mark.parametrize(
    "text",
    [
        '{"answer": "spam"}',
        '  \n{"answer": "spam"}\n',
        '{\n  "answer": "spam"\n}',
        '{"answer": "spam", "confidence": "high"}',  # other keys are allowed
    ],
)
def test_success(text: str) -> None:
    assert classify_output(text, CHOICES) == ("spam", None)


def test_success_with_braces_and_quotes_inside_the_choice() -> None:
    choices = ['{a} "b"', "c"]
    assert classify_output('{"answer": "{a} \\"b\\""}', choices) == ('{a} "b"', None)


FAILURE_CASES: list[tuple[str, str]] = [
    ('```json\n{"answer": "spam"}\n```', "markdown_wrap"),
    ('```\n{"answer": "spam"}', "markdown_wrap"),
    ('Sure! Here is my answer: {"answer": "spam"}', "prose_preamble"),
    ('This message is clearly spam.\n{"answer": "spam"', "prose_preamble"),
    (
        '{"type": "object", "properties": {"answer": {"enum": ["spam", "ham"]}}}',
        "schema_mirroring",
    ),
    ('{"$schema": "http://json-schema.org/draft-07/schema#"}', "schema_mirroring"),
    ('{"answer": "spam", "required": ["answer"]} ok', "schema_mirroring"),
    ('{"answer": "spam"}\n{"answer": "ham"}', "multiple_objects"),
    ('{"answer": "spam"} {"answer": "h', "multiple_objects"),  # the second cut off
    ('{"answer": "spam"} because it promises a prize', "trailing_text"),
    ('{"answer": "spam"}\n```', "trailing_text"),
    ('{"answer": "Spam"} trailing', "trailing_text"),  # before the enum check
    ('{"answer": "spam"', "parse_error"),  # cut off
    ("The message is spam.", "parse_error"),  # no JSON at all
    ("Certainly, this one is an obvious case of spam", "parse_error"),  # prose, no brace
    ('Answer: {"answer": "spam"}', "parse_error"),  # under 20 characters of preamble
    ('"spam"', "parse_error"),  # valid JSON, but not an object
    ('["spam"]', "parse_error"),
    ("", "parse_error"),
    ("{'answer': 'spam'}", "parse_error"),  # single quotes
    ('{"answer": "Spam"}', "enum_violation"),
    ('{"answer": " spam"}', "enum_violation"),
    ('{"answer": "<choice>"}', "enum_violation"),
    ('{"answer": 1}', "enum_violation"),
    ('{"answer": "a}{b"}', "enum_violation"),  # braces inside a string open no object
    ('{"label": "spam"}', "missing_field"),
    ("{}", "missing_field"),
]


@pytest.mark.parametrize(("text", "failure"), FAILURE_CASES)
def test_failure(text: str, failure: str) -> None:
    assert failure in bench_quality.FAILURE_TYPES
    assert classify_output(text, CHOICES) == (None, failure)


def test_every_failure_type_is_tested() -> None:
    # A failure type the classifier can report but no case above produces is untested.
    untested = set(bench_quality.FAILURE_TYPES) - {failure for _, failure in FAILURE_CASES}
    assert not untested, f"no test_failure case for {sorted(untested)}"
    assert len(set(bench_quality.FAILURE_TYPES)) == len(bench_quality.FAILURE_TYPES)


# What the careful pipeline recovers from an output, and the violation left where it cannot.
RECOVER_CASES: list[tuple[str, str | None, str | None]] = [
    ('{"answer": "spam"}', "spam", None),
    ('```json\n{"answer": "spam"}\n```', "spam", None),  # fences stripped
    ('Sure! Here is my answer: {"answer": "ham"} Hope it helps.', "ham", None),
    ('{"answer": " spam "}', "spam", None),  # surrounding whitespace stripped
    ('{"answer": "spam"}\n{"answer": "ham"}', "spam", None),  # the first object
    ('{"type": "object"} then {"answer": "ham"}', None, "missing_field"),  # the first object
    ('{"answer": "spam"', None, "no_json_object"),  # cut off
    ("The message is spam.", None, "no_json_object"),
    ('{"answer": "Spam"}', None, "enum_violation"),  # case is not normalised
    ('{"answer": 1}', None, "enum_violation"),
    ('{"label": "spam"}', None, "missing_field"),
]


@pytest.mark.parametrize(("text", "answer", "violation"), RECOVER_CASES)
def test_recover(text: str, answer: str | None, violation: str | None) -> None:
    got, why, error = bench_quality.recover(text, CHOICES)
    assert (got, why) == (answer, violation)
    assert (error == "") == (violation is None)
    assert violation is None or violation in bench_quality.VIOLATIONS


def test_the_enum_error_names_the_choices_and_the_answer() -> None:
    _, _, error = bench_quality.recover('{"answer": "Spam"}', CHOICES)
    assert error == '"answer" must be one of ["spam", "ham"], got "Spam"'


def test_the_constrained_grammar_is_one_literal_per_choice() -> None:
    grammar = bench_quality.constrained_grammar(["a", 'q"t'])
    assert grammar == r'start: "{\"answer\": \"a\"}" | "{\"answer\": \"q\\\"t\"}"'


@pytest.mark.bench
@pytest.mark.slow
def test_bench_latency_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_latency.json"
    run_quick("bench_latency.py", "--out", str(out))
    result = json.loads(out.read_text())
    assert set(result) == {"machine", "quick", "config", "rows", "skipped", "elapsed_s"}
    assert result["quick"] is True
    assert [r["choices"] for r in result["rows"]] == [2, 4]
    for row in result["rows"]:
        assert set(row["contenders"]) == {
            "judge",
            "judge_generic",
            "bare",
            "generate",
            "per_choice",
            "constrained",
        }


@pytest.mark.bench
def test_bench_tails_quick(tmp_path: Path) -> None:
    out = tmp_path / "tails.json"
    run_quick("bench_tails.py", "--out", str(out))
    result = json.loads(out.read_text())
    # Both blockings judge alike, bit for bit, and a warm call computes the item only.
    assert result["same_bits"] is True and 0 < result["warm_computed_tokens"] < 100
    assert set(result["median_ms"]) == {"tails", "whole blocks"}


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.skipif(not DATA.exists(), reason="the shared datasets are not beside this checkout")
def test_bench_quality_quick(tmp_path: Path) -> None:
    run_quick("bench_quality.py", "--out-dir", str(tmp_path))
    result = json.loads((tmp_path / "bench_quality.json").read_text())
    assert set(result) == {
        "machine",
        "quick",
        "config",
        "success",
        "failure_types",
        "violations",
        "tasks",
        "elapsed_s",
    }
    assert result["quick"] is True and len(result["tasks"]) == 2
    for task in result["tasks"]:
        assert set(task) == {
            "task",
            "choices",
            "splits",
            "judge_canonical",
            "judge_grammar",
            "careful",
            "constrained",
        }
        careful = task["careful"]
        # Retrying never loses a recovered answer, and every item took 1 to 4 attempts.
        assert careful["strict_first"] <= careful["recovered_first"] <= careful["with_retries"]
        assert 1.0 <= careful["attempts_per_item"] <= 4.0
        for name in ("judge_canonical", "judge_grammar", "careful", "constrained"):
            row = task[name]["calibrated"] if name.startswith("judge") else task[name]
            low, high = row["accuracy_interval"]
            assert low <= row["accuracy"] <= high
    lines = (tmp_path / "quality_failures_sample.jsonl").read_text().splitlines()
    for line in lines:
        sample = json.loads(line)
        assert {"task", "id", "failure", "violation", "output"} <= set(sample)
        assert sample["failure"] in result["failure_types"]


@pytest.mark.bench
@pytest.mark.slow
def test_bench_engine_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_engine.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_engine.py"), "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result) == {"machine", "quick", "reps", "rows", "batch"}
    # The machine as every CPU benchmark names it: its flags and the kernels torch ran.
    assert isinstance(result["machine"]["cpu_flags"], list) and result["machine"]["kernels"]
    assert {(r["kind"], r["choices"]) for r in result["rows"]} == {
        (k, n) for k in ("distinct", "shared") for n in (2, 16)
    }
    assert all(r["ratio_to_bare"] > 0 and r["ratio_to_floor"] > 0 for r in result["rows"])


@pytest.mark.bench
@pytest.mark.slow
def test_bench_breakdown_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_breakdown.json"
    run_quick("bench_breakdown.py", "--out", str(out), "--lengths", "40,90")
    result = json.loads(out.read_text())
    parts = result["breakdown"]
    assert set(parts) == {"judgment (lean, invariant)", "bare pass"}
    for part in parts.values():
        assert part["profiled_ms"] > 0 and part["families_ms"]["matrix products"] > 0
        assert part["top_ops"] and part["unaccounted_ms"] >= 0
    # The length sweep: each prompt about as long as asked, judged beside the bare pass.
    lengths = result["lengths"]
    assert all(abs(r["tokens"] - want) <= 5 for r, want in zip(lengths, (40, 90), strict=True))
    assert all(r["judgment_ms"] > 0 and r["bare_ms"] > 0 and r["x"] > 0 for r in lengths)


@pytest.mark.bench
@pytest.mark.slow
def test_bench_pass_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_pass.json"
    run_quick("bench_pass.py", "--out", str(out))
    result = json.loads(out.read_text())
    arms = {r["arm"] for r in result["rows"]}
    paths = ("lean", "generic")
    assert arms == {f"{p}, {a}" for p in paths for a in ("invariant", "variant")} | {"bare pass"}
    assert result["peak"]["gflops"] > 0 and result["read_gb_s"] > 0
    # The roofline: each pass's floor and its bound, the goals met or not.
    assert result["one_token_floor_ms"] > 0 and result["judgment_floor_ms"] > 0
    assert {result["one_token_bound"], result["judgment_bound"]} <= {"arith", "memory"}
    # The default pass's products alone, one row each: what of a 1-token pass is its kernels.
    products = result["one_token_products"]
    assert products["ms"] > 0 and products["x_floor"] > 0 and products["read_gb_s"] > 0
    assert set(result["goals"]) == {"one_token_x_floor", "judgment_share_of_peak"}
    for row in result["rows"]:
        assert row["judgment_ms"] > 0 and row["judgment_x_floor"] > 0
        assert 0 < row["share_of_peak"] <= 1
        if row["arm"] != "bare pass":
            assert row["one_token_x_floor"] > 0


@pytest.mark.bench
@pytest.mark.slow
def test_bench_packing_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_packing.json"
    run_quick("bench_packing.py", "--out", str(out))
    result = json.loads(out.read_text())
    libraries = set(result["arithmetic"])
    assert libraries and libraries <= {"MKL", "oneDNN"}
    # Each judge really ran on its own library's packed weights, not on one shared lean pass.
    for library, words in result["arithmetic"].items():
        assert f"products ({library})" in words
    assert set(result["layer_ms"]) == libraries | {"F.linear"}
    assert set(result["judgment_ms"]) == {f"judge ({lib})" for lib in libraries} | {"bare pass"}
    assert all(ms > 0 for ms in (*result["layer_ms"].values(), *result["judgment_ms"].values()))
    assert isinstance(result["bitwise_same_judgment"], bool)


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.skipif(not DATA.exists(), reason="the shared datasets are not beside this checkout")
def test_bench_span_features_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_span_features.json"
    cmd = [sys.executable, str(BENCHMARKS / "bench_span_features.py"), "--quick"]
    cmd += ["--out", str(out), "--cache", str(tmp_path / "cache")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-4000:]
    arms = json.loads(out.read_text())["tasks"]["sms_spam"]["arms"]
    assert set(arms) == {
        "decision point",
        "item mean",
        "prompt mean",
        "point + item mean",
        "point + prompt mean",
        "auto (item means)",
        "auto (prompt means)",
    }
    assert all(0 <= a["test_accuracy"] <= 1 for a in arms.values())
    assert arms["auto (item means)"]["reads"] in ("point", "mean", "point+mean")


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.skipif(not DATA.exists(), reason="the shared datasets are not beside this checkout")
def test_bench_span_cost_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_span_cost.json"
    run_quick("bench_span_cost.py", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert {(r["cache"], r["reads"]) for r in rows if r["reads"] == "plain"} == {
        ("off", "plain"),
        ("on", "plain"),
    }
    assert len(rows) == 12 and all(r["ms_per_item"] > 0 for r in rows)


def test_bench_gating_quick(tmp_path: Path) -> None:
    out = tmp_path / "gating.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_gating.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["procedure"] for r in rows] == ["fixed_sequence", "bonferroni"]
    assert all(0 <= r["failure_rate"] <= r["certified"] <= 1 for r in rows)
    assert "| 500 | fixed_sequence |" in done.stdout


@pytest.mark.bench
@pytest.mark.skipif(not DATA.exists(), reason="the shared datasets are not beside this checkout")
def test_bench_prefix_cache_quick(tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_prefix_cache.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["head_tokens"] > 500 and [r["choices"] for r in result["rows"]] == [2, 5]
    for row in result["rows"]:
        # A warm call computes the item, not the head (the times are for the benchmark).
        assert row["median"]["computed_warm"] < row["median"]["computed_off"] / 5
        assert row["bytes"] > 0


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.skipif(not DATA.exists(), reason="the shared datasets are not beside this checkout")
def test_bench_pairwise_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_pairwise.json"
    run_quick("bench_pairwise.py", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["quick"] is True and result["config"]["limit"] == 12
    assert [t["task"] for t in result["tasks"]] == ["sst2", "commonsense_qa"]
    for task in result["tasks"]:
        assert task["n"] == task["n_calibration"] == 12
        rows = task["rows"]
        assert [(r["orders"], r["bound"]) for r in rows] == [
            ("one", None),
            ("both", None),
            ("both", 0.1),
            ("both", 0.2),
        ]
        one, both = rows[0], rows[1]
        assert len(one["first_place_wins"]) == 1 and len(both["first_place_wins"]) == 2
        # The given order is read alike in both contenders' runs.
        assert both["first_place_wins"][0] == one["first_place_wins"][0]
        assert one["consistent"] is None and 0 <= both["consistent"] <= 1
        # Both orders share the state and the instructions: fewer than twice the tokens.
        assert 1 < both["tokens_ratio"] < 2
        for r in rows:
            assert 0 <= r["accuracy"] <= 1 and r["ms_per_item"] > 0
            for name in ("raw", "calibrated"):
                if r[f"coverage_{name}"] == 0:
                    assert r[f"precision_{name}"] is None
        # A bound only ever removes acceptances.
        for r in rows[2:]:
            assert r["coverage_raw"] <= both["coverage_raw"]
            assert r["coverage_calibrated"] <= both["coverage_calibrated"]


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.skipif(not DATA.exists(), reason="the shared datasets are not beside this checkout")
def test_bench_order_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_order.json"
    run_quick("bench_order.py", "--out", str(out))
    result = json.loads(out.read_text())
    assert set(result) == {"machine", "quick", "config", "rows", "elapsed_s"}
    assert result["quick"] is True and result["config"]["n"] == 10
    assert result["machine"]["dtype"] and result["machine"]["cpu"]
    rows = {(r["naming"], r["order"]): r for r in result["rows"]}
    assert set(rows) == {(n, o) for n in ("letters", "texts") for o in ("given", "invariant")}
    for (_, order), row in rows.items():
        assert row["orderings"] == (1 if order == "given" else 5)
        assert 0 <= row["accuracy"] <= 1 and 0 <= row["ece"] <= 1
        assert row["ms_per_item"] > 0 and row["tokens_per_item"] > 0
        if order == "given":
            assert row["spread_mean"] == row["spread_p90"] == 0
            assert row["tokens_ratio"] == row["ms_ratio"] == 1
        else:
            # Five listings share the question's state: more than 1x, less than 5x the tokens.
            assert 1 < row["tokens_ratio"] < 5 and row["spread_mean"] > 0


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.skipif(not DATA.exists(), reason="the shared datasets are not beside this checkout")
def test_bench_invariance_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_invariance.json"
    run_quick("bench_invariance.py", "--out", str(out))
    result = json.loads(out.read_text())
    assert set(result) == {"machine", "items", "quick", "dtypes"}
    entry = result["dtypes"]["float32"]
    hows = {f"batch of {n}" for n in (2, 4)} | {"cold cache", "warm cache", "shared context"}
    for mode in ("invariant", "variant"):
        assert set(entry["reproducibility"][mode]) == hows
    for row in entry["reproducibility"]["invariant"].values():
        assert row["max_diff"] <= 1e-6 and row["flips"] == 0
    assert all(row["ratio"] > 0 for row in entry["cost"].values())


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.skipif(not DATA.exists(), reason="the shared datasets are not beside this checkout")
def test_bench_choice_paths_quick(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "bench_choice_paths.py"),
            "--quick",
            "--out",
            str(tmp_path),
            "--cache",
            str(tmp_path / "cache"),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "summary.json").read_text())
    (modes,) = result["tasks"].values()
    assert set(modes) == {"canonical", "grammar"}
    for r in modes.values():
        assert r["n"] == [40, 40] and 0.0 <= r["coverage"] <= 1.0
        assert r["seeds_certified"] <= r["seeds"] == 2
        assert r["ms_per_item"] is not None  # a fresh cache: both modes were timed
    # The modes read different paths, so their raw probabilities differ on sms_spam.
    assert modes["canonical"]["accuracy_raw"] != modes["grammar"]["accuracy_raw"]
    assert (tmp_path / "summary.md").read_text().count("| sms_spam |") == 2


@pytest.mark.bench
@pytest.mark.slow
def test_bench_grammar_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench_grammar.json"
    run_quick("bench_grammar.py", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["quick"] is True and result["tasks"]
    for task in result["tasks"]:
        assert 0.0 <= task["tv_mean"] <= task["tv_max"] <= 1.0
        assert task["positions"] >= task["nodes"] >= 1
        # The one-pass grammar mode is the reference's distribution.
        assert task["one_pass_error_max"] < 1e-4
        assert task["tokens_added_grammar"] >= 0
        for item in task["items"]:
            assert sum(item["canonical"]) == pytest.approx(1.0, abs=1e-6)
