"""Labels that keep coming: a probe refitted from the decision log, look after look.

For each task, as a user would run it: a temperature profile is fitted on 40 labeled items
and served in process (``create_app``) with ``--decision-log``, ``--log-features`` and audit
rate 1; the calibration split is judged through ``POST /judge/batch`` and every decision
labeled. Then ``judge calibrate --from-log`` refits the profile at each look, on the first N
labeled decisions of the log (a log that grows), each look one step of the lineage that spends
one delta (``calibration.certificates.recertify``). Each look's profile is measured on the test split
(``calibration.evaluate_policy``), beside the profile ``judge calibrate --task`` fits on the
whole calibration split at the full delta: the price of certifying again and again.

Also measured: the bytes a decision's record takes in the log with and without its hidden
states, and the time to judge the split with and without them, side by side.

    python benchmarks/bench_log_features.py [--tasks sst2 ag_news] [--looks 100 200 300 400 500]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import cpu_flags, cpu_model

from calibration import (
    CalibrationProfile,
    FitSettings,
    PolicyEvaluation,
    Provenance,
    fit_profile,
    load_profile,
    save_profile,
)
from calibration.maps.probe import candidate_layers
from calibration.tasks import LabeledScores, Task, load_split, load_task, task_prompt
from judge import Judge
from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_calibration import DATA, cached_scores, evaluate_on, fit_and_evaluate  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SEED_ITEMS = 40  # labeled items behind the temperature profile served first
EVIDENCE = 200  # resamples behind the test metrics' intervals (evidence only)


def serve_and_label(
    judge: Judge, task: Task, directory: Path, *, log_features: bool
) -> tuple[Path, float]:
    """The calibration split judged through the service under a temperature profile, every
    decision labeled in the log; the log's path and the seconds the judging took."""
    from litestar.testing import TestClient

    from service import ServiceConfig, create_app
    from service.log.backends import open_log

    items, _ = load_split(task, "calibration")
    seed = judge.judge_batch(
        [{"prompt": task_prompt(task, i.text), "choices": task.choices} for i in items[:SEED_ITEMS]]
    )
    scores = LabeledScores(
        log_probabilities=np.array(
            [
                [dict(zip(j.choices, j.log_probs, strict=True))[c] for c in task.choices]
                for j in seed
            ]
        ),
        choice_mass=np.ones(len(seed)),  # no mass check: the seed profile only routes
        labels=np.array([task.choices.index(i.label) for i in items[:SEED_ITEMS]]),
    )
    provenance = Provenance(
        fingerprint=judge.fingerprint(),
        dataset=f"{task.name}/calibration[:{SEED_ITEMS}]",
        dataset_sha256="0" * 64,
    )
    settings = FitSettings(methods=["temperature"])
    profile = fit_profile(task.name, scores, task.choices, provenance, settings).profile
    profiles = directory / "profiles"
    profiles.mkdir(parents=True)
    save_profile(profile, profiles / f"{task.name}.json")
    log = directory / "decisions.db"
    config = ServiceConfig(
        profiles_dir=profiles, decision_log=str(log), audit_rate=1.0, log_features=log_features
    )
    labels: list[tuple[str, str]] = []
    with TestClient(app=create_app(judge, config=config), timeout=600) as client:
        while client.get("/ready").status_code != 200:
            time.sleep(0.1)
        start = time.perf_counter()
        for at in range(0, len(items), 50):
            chunk = items[at : at + 50]
            body = {
                "items": [
                    {
                        "prompt": task_prompt(task, i.text),
                        "choices": task.choices,
                        "profile": task.name,
                    }
                    for i in chunk
                ]
            }
            response = client.post("/judge/batch", json=body)
            response.raise_for_status()
            labels += [
                (r["judgment_id"], i.label)
                for r, i in zip(response.json()["results"], chunk, strict=True)
            ]
        seconds = time.perf_counter() - start
    with open_log(str(log)) as opened:
        opened.label_many(labels)
    return log, seconds


def record_bytes(log: Path) -> dict[str, float]:
    """Mean JSON bytes of a record, with its hidden states and without them."""
    import msgspec

    from service.log.backends import open_log

    with open_log(str(log)) as opened:
        records = opened.decisions()
    plain = [
        msgspec.structs.replace(r, features=None, label=None, labeled_at=None) for r in records
    ]
    kept = [msgspec.structs.replace(r, label=None, labeled_at=None) for r in records]
    return {
        "with_features": float(np.mean([len(msgspec.json.encode(r)) for r in kept])),
        "without": float(np.mean([len(msgspec.json.encode(r)) for r in plain])),
        "states_raw": float(np.mean([len(r.features.data) for r in records if r.features])),
    }


def looks(
    task: Task, log: Path, sizes: list[int], profiles: Path, test: LabeledScores, delta: float
) -> list[dict[str, Any]]:
    """``judge calibrate --from-log`` on the first N labeled decisions, for each N in turn (one
    lineage, its profiles in ``profiles``), each look's profile measured on the test split, with
    what the command said the next look would need when the gate stayed shut."""
    from service.cli.main import main
    from service.log.backends import open_log

    with open_log(str(log)) as opened:
        records = opened.decisions()
    rows: list[dict[str, Any]] = []
    for n in sizes:
        grown = profiles.parent / f"log-{profiles.name}-{n}.db"
        with open_log(str(grown)) as sub:
            sub.append(records[:n])
        argv = ["calibrate", "--from-log", str(grown), "--profile", task.name]
        argv += ["--profiles-dir", str(profiles), "--delta", str(delta)]
        said = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(said):
            code = main(argv)
        seconds = time.perf_counter() - start
        if code != 0:
            raise SystemExit(f"calibrate --from-log failed at look {len(rows) + 1}")
        profile = load_profile(profiles / f"{task.name}.json")
        row = row_of(profile, evaluate_on(profile, test, EVIDENCE), n, seconds)
        next_look = [x for x in said.getvalue().splitlines() if x.startswith("the next look:")]
        row["next_look"] = next_look[0].removeprefix("the next look: ") if next_look else None
        rows.append(row)
    return rows


def row_of(
    profile: CalibrationProfile, evaluation: PolicyEvaluation, n: int, seconds: float
) -> dict[str, Any]:
    """One table row: a profile fitted on ``n`` labels in ``seconds``, measured on test."""
    r = profile.recertification
    return {
        "labels": n,
        "look": None if r is None else r.look,
        "delta": profile.threshold.delta,
        "method": profile.calibration_map.method,
        "layers": list(profile.feature_layers),
        "threshold": profile.threshold.threshold,
        "test_accuracy": evaluation.after.accuracy.value,
        "test_coverage": evaluation.coverage,
        "test_precision": evaluation.precision,
        "fit_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--tasks", nargs="*", default=["sst2", "ag_news"])
    parser.add_argument("--looks", type=int, nargs="*", default=[100, 200, 300, 400, 500])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--target-precision", type=float, default=0.9)
    parser.add_argument("--delta", type=float, default=0.1)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "judge" / "logits")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_log_features.json")
    args = parser.parse_args()
    judge = Judge.load(dtype=args.dtype)
    layers = candidate_layers(judge.num_layers or 0)
    out: dict[str, Any] = {
        "cpu": cpu_model(),
        "flags": cpu_flags(),
        "model": judge.model_id,
        "dtype": judge.dtype,
        "target_precision": args.target_precision,
        "delta": args.delta,
        "tasks": {},
    }
    for name in args.tasks:
        task = load_task(args.data / name)
        calibration, digest = cached_scores(judge, task, "calibration", None, args.cache, layers)
        test, _ = cached_scores(judge, task, "test", None, args.cache, layers)
        start = time.perf_counter()
        once, evaluation = fit_and_evaluate(
            judge, task, args, calibration, digest, test, "auto", n_bootstrap=EVIDENCE
        )
        one_shot = row_of(once, evaluation, len(calibration.labels), time.perf_counter() - start)
        with tempfile.TemporaryDirectory() as tmp:
            _, bare_s = serve_and_label(judge, task, Path(tmp) / "bare", log_features=False)
            kept = Path(tmp) / "kept"
            log, kept_s = serve_and_label(judge, task, kept, log_features=True)
            sizes = record_bytes(log)
            # A second lineage from the same served profile: one look, at every label.
            shutil.copytree(kept / "profiles", kept / "once")
            rows = looks(task, log, args.looks, kept / "profiles", test, args.delta)
            single = looks(task, log, args.looks[-1:], kept / "once", test, args.delta)
        out["tasks"][name] = {
            "serve_s": {"without_features": bare_s, "with_features": kept_s},
            "record_bytes": sizes,
            "looks": rows,
            "one_look": single,
            "calibrate_task": one_shot,
        }
        print(
            f"\n{name}: judged {len(calibration.labels)} items through the service in "
            f"{bare_s:.1f} s without the states, {kept_s:.1f} s keeping them; a record "
            f"{sizes['without']:.0f} B, {sizes['with_features']:.0f} B with them"
        )
        print(
            "| labels | look | delta | method (layers) | threshold | test acc | coverage | precision |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in [*rows, *single, one_shot]:
            look = "calibrate --task" if r["look"] is None else r["look"]
            threshold = "none" if r["threshold"] is None else f"{r['threshold']:.2f}"
            precision = "-" if r["test_precision"] is None else f"{r['test_precision']:.3f}"
            print(
                f"| {r['labels']} | {look} | {r['delta']:.4f} | {r['method']} {r['layers']} | "
                f"{threshold} | {r['test_accuracy']:.3f} | {r['test_coverage']:.3f} | {precision} |"
            )
        for r in rows:
            if r["next_look"]:
                print(f"after look {r['look']} ({r['labels']} labels): {r['next_look']}")
    write_text(args.out, json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
