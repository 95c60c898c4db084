"""Command line.

judge ask "PROMPT" --choice A --choice B     print one judgment as JSON
judge calibrate --task DIR                   fit a calibration profile on a labeled task
judge evaluate --task DIR --profile FILE     measure a profile on a held-out split
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import msgspec
import numpy as np

from judge.engine import DEFAULT_RESPONSE_PREFIX, DEFAULT_RESPONSE_SUFFIX, Judge
from judge.errors import JudgeError
from judge.loading import DType
from judge.tasks import Task, judge_items, load_split, load_task

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="judge", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    ask = commands.add_parser("ask", help="judge one prompt and print the result as JSON")
    ask.add_argument("prompt", help="the question or item to judge")
    ask.add_argument("--choice", action="append", required=True, help="a choice; repeat for each")
    ask.add_argument("--system", default=None, help="system prompt (default: the model's own)")
    ask.add_argument(
        "--model",
        default=None,
        help="model id, directory or .gguf (default: SmolLM2-135M-Instruct)",
    )
    ask.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ask.add_argument("--device", default="cpu")
    ask.add_argument("--response-prefix", default=DEFAULT_RESPONSE_PREFIX)
    ask.add_argument("--response-suffix", default=DEFAULT_RESPONSE_SUFFIX)

    fit = commands.add_parser(
        "calibrate", help="fit a calibration profile on a task's labeled data"
    )
    _task_arguments(fit, split="calibration")
    fit.add_argument("--name", help="profile name (default: the task's name)")
    fit.add_argument("--profiles-dir", type=Path, default=Path("profiles"))
    fit.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    fit.add_argument("--target-precision", type=float, default=0.9)
    fit.add_argument("--delta", type=float, default=0.1, help="allowed failure probability")
    fit.add_argument("--alpha", type=float, default=0.1, help="conformal miscoverage level")

    ev = commands.add_parser("evaluate", help="measure a calibration profile on a held-out split")
    _task_arguments(ev, split="test")
    ev.add_argument("--profile", type=Path, required=True, help="a profile JSON file")
    ev.add_argument("--report", type=Path, help="also write a markdown report here")
    ev.add_argument("--json", type=Path, help="also write the evaluation as JSON here")

    serve = commands.add_parser("serve", help="run the HTTP service (POST /judge)")
    serve.add_argument("--model", default=None, help="model id, directory or .gguf")
    serve.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    serve.add_argument("--device", default="cpu")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--profiles-dir", type=Path, default=Path("profiles"))
    serve.add_argument("--max-batch-size", type=int, default=16, help="judgments per forward pass")
    serve.add_argument("--max-wait-ms", type=float, default=5.0, help="wait for a batch to fill")
    serve.add_argument("--max-queue", type=int, default=256, help="queued jobs before 503")
    serve.add_argument("--request-timeout", type=float, default=60.0, help="seconds")
    serve.add_argument("--max-body-bytes", type=int, default=1_000_000)
    serve.add_argument("--default-threshold", type=float, default=0.9)
    serve.add_argument("--min-choice-mass", type=float, default=0.0)
    serve.add_argument(
        "--api-key",
        default=os.environ.get("JUDGE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
        "(default: $JUDGE_API_KEY; none: no auth)",
    )
    serve.add_argument("--log-level", default="info")
    return parser


def _task_arguments(parser: argparse.ArgumentParser, *, split: str) -> None:
    parser.add_argument("--task", type=Path, required=True, help="task directory with task.json")
    parser.add_argument("--split", default=split, help=f"which <split>.jsonl (default: {split})")
    parser.add_argument("--limit", type=int, help="use only the first N items")
    parser.add_argument("--model", default=None, help="model id, directory or .gguf")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=8)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from calibration.errors import CalibrationError

    try:
        if args.command == "ask":
            return _ask(args)
        if args.command == "calibrate":
            return _calibrate(args)
        if args.command == "serve":
            return _serve(args)
        return _evaluate(args)
    except (JudgeError, CalibrationError) as exc:
        print(f"judge: error: {exc}", file=sys.stderr)
        return 2


def _ask(args: argparse.Namespace) -> int:
    judge = Judge.load(
        args.model,
        dtype=args.dtype,
        device=args.device,
        response_prefix=args.response_prefix,
        response_suffix=args.response_suffix,
    )
    result = judge.judge(args.prompt, args.choice, system=args.system)
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(result), indent=2).decode() + "\n")
    return 0


def _judge_split(
    args: argparse.Namespace, dtype: DType
) -> tuple[Judge, Task, np.ndarray, np.ndarray, str]:
    from tqdm import tqdm

    task = load_task(args.task)
    items, digest = load_split(task, args.split, args.limit)
    judge = Judge.load(args.model, dtype=dtype, device=args.device)
    with tqdm(
        total=len(items), desc=f"{task.name}/{args.split}", unit="item", file=sys.stderr
    ) as bar:
        logits, labels = judge_items(
            judge, task, items, batch_size=args.batch_size, progress=bar.update
        )
    return judge, task, logits, labels, digest


def _calibrate(args: argparse.Namespace) -> int:
    from calibration.fitting import fit_profile
    from calibration.profile import save_profile
    from calibration.reliability import reliability_diagram
    from calibration.report import metrics_table, profile_markdown
    from calibration.scaling import apply_calibration, softmax

    judge, task, logits, labels, digest = _judge_split(args, args.dtype)
    name = args.name or task.name
    profile = fit_profile(
        name,
        logits,
        labels,
        task.choices,
        dtype=judge.dtype,
        **judge.configuration(),
        dataset=f"{task.name}/{args.split}",
        dataset_sha256=digest,
        target_precision=args.target_precision,
        delta=args.delta,
        alpha=args.alpha,
    )
    out = args.profiles_dir
    save_profile(profile, out / f"{name}.json")
    _write_text(out / f"{name}.report.md", profile_markdown(profile))
    calibrated = apply_calibration(logits, profile.method, profile.temperature, profile.bias)
    reliability_diagram(
        (softmax(logits), labels), (calibrated, labels), out / f"{name}.reliability.png", title=name
    )
    print(f"profile {name}: method {profile.method}, temperature {profile.temperature:.4f}")
    print(profile.note)
    print(metrics_table(profile.metrics_before, profile.metrics_after))
    t = profile.threshold
    print(f"threshold: {t.threshold:.3f}, coverage {t.coverage:.3f}" if t.feasible else t.reason)
    print(f"wrote {out / name}.json, .report.md, .reliability.png")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from calibration.fitting import evaluate_profile
    from calibration.profile import load_profile
    from calibration.report import evaluation_markdown, profile_markdown

    profile = load_profile(args.profile)
    judge, task, logits, labels, _ = _judge_split(args, cast(DType, profile.dtype))
    profile.check(**judge.configuration(), choices=task.choices)
    order = [task.choices.index(c) for c in profile.choices]
    evaluation = evaluate_profile(
        profile, logits[:, order], np.array([order.index(y) for y in labels])
    )
    print(evaluation_markdown(evaluation))
    if args.report:
        _write_text(args.report, profile_markdown(profile, evaluation))
    if args.json:
        _write_text(
            args.json, msgspec.json.format(msgspec.json.encode(evaluation), indent=2).decode()
        )
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from service import ServiceConfig, create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = ServiceConfig(
        profiles_dir=args.profiles_dir,
        max_batch_size=args.max_batch_size,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
        api_key=args.api_key or None,
        max_body_bytes=args.max_body_bytes,
        default_threshold=args.default_threshold,
        min_choice_mass=args.min_choice_mass,
    )
    app = create_app(
        loader=lambda: Judge.load(args.model, dtype=args.dtype, device=args.device), config=config
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _write_text(path: Path, text: str) -> None:
    """Write atomically: a temporary file beside ``path``, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
