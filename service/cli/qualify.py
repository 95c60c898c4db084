"""``judge qualify [MODEL]``: a fixed suite to run before a model is trusted as a stage.

On each task (``--task DIR``, repeatable, or every task under ``--data DIR``) it judges the
first ``--limit`` test items three ways and ``--fit-limit`` calibration items once
(``calibration.tasks.qualify_on_task``), prints one row per task and the criteria each
missed, and exits 1 when any task misses one (0: the model qualifies; 2: a usage error).
The criteria are flags; their defaults and why are in ``calibration.qualify``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from calibration.qualify import Criteria, Qualification, TaskQualification
from calibration.tasks import Task, load_split, load_task
from judge.atomicio import write_text
from service.command_line import (
    UsageError,
    batch_size_argument,
    device_argument,
    dtype_argument,
    load_engine,
    positive_int,
    probability,
    to_json,
)

__all__ = ["add_arguments", "run", "table"]


# What each probability criterion measures, as its flag's help says it.
_CRITERIA_HELP = {
    "confidence": "the confidence at which accuracy is measured",
    "min_accuracy": "accuracy of the items at or above --confidence",
    "max_ece": "expected calibration error",
    "max_flip_rate": "decisions changed between two runs of the same items",
    "max_order_flips": "decisions changed with the allowed answers listed in reverse",
    "min_choice_mass": "mean full-vocabulary probability of the choices",
}


def add_arguments(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``judge qualify``'s arguments."""
    q = commands.add_parser(
        "qualify",
        help="measure a model on labeled tasks before trusting it; exit 1 if it misses",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    q.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model id, directory or .gguf (default: SmolLM2-135M-Instruct)",
    )
    q.add_argument("--task", type=Path, action="append", help="a task directory (repeatable)")
    q.add_argument("--data", type=Path, help="every task directory under this one")
    q.add_argument("--limit", type=positive_int, default=100, help="test items per task")
    q.add_argument(
        "--fit-limit",
        type=positive_int,
        default=100,
        help="calibration items per task (the temperature and prior of the signal verdict)",
    )
    dtype_argument(q)
    device_argument(q)
    batch_size_argument(q)
    q.add_argument("--response-prefix", help="the response prefix (default: the engine's)")
    q.add_argument("--json", type=Path, help="also write the qualification as JSON here")
    defaults = Criteria()
    # One flag per probability criterion, its default the Criteria's.
    for name, about in _CRITERIA_HELP.items():
        flag = "--" + name.replace("_", "-")
        value = getattr(defaults, name)
        q.add_argument(flag, type=probability, default=value, help=f"{about} (default: {value})")
    q.add_argument(
        "--allow-no-signal",
        action="store_true",
        help="do not require the calibrated judge to beat the label prior",
    )
    q.add_argument(
        "--calibrated",
        action="store_true",
        help="measure accuracy and ECE on temperature-scaled probabilities (the temperature "
        "fitted on the calibration items), as a profile would serve them",
    )
    q.set_defaults(run=run)


def tasks_of(args: argparse.Namespace) -> list[Task]:
    """--task and --data's tasks, in the order given (--data's sorted by name)."""
    folders = list(args.task or [])
    if args.data is not None:
        if not args.data.is_dir():
            raise UsageError(f"--data {args.data} is not a directory", field="data")
        folders += sorted(p.parent for p in args.data.glob("*/task.json"))
    if not folders:
        raise UsageError("give at least one --task DIR, or --data DIR", field="task")
    return [load_task(folder) for folder in folders]


def run(args: argparse.Namespace) -> int:
    from calibration.tasks import qualify_engine

    criteria = Criteria(
        confidence=args.confidence,
        min_accuracy=args.min_accuracy,
        max_ece=args.max_ece,
        max_flip_rate=args.max_flip_rate,
        max_order_flips=args.max_order_flips,
        min_choice_mass=args.min_choice_mass,
        require_signal=not args.allow_no_signal,
        calibrated=args.calibrated,
    )
    from tqdm import tqdm

    tasks = tasks_of(args)  # before the model loads: a bad task directory fails fast
    engine = load_engine(args, dtype=args.dtype, response_prefix=args.response_prefix)
    # Each task's test items are judged three times and its calibration items once.
    total = sum(3 * len(load_split(t, "test", args.limit)[0]) for t in tasks)
    total += sum(len(load_split(t, "calibration", args.fit_limit)[0]) for t in tasks)
    with tqdm(total=total, desc="qualify", unit="judgment", file=sys.stderr) as bar:
        result = qualify_engine(
            engine,
            tasks,
            criteria=criteria,
            limit=args.limit,
            fit_limit=args.fit_limit,
            batch_size=args.batch_size,
            progress=bar.update,
        )
    print(table(result))
    if args.json:
        write_text(args.json, to_json(result, indent=2) + "\n")
    sys.stdout.flush()
    return 0 if result.qualifies else 1


def _row(r: TaskQualification) -> str:
    at = "-" if r.accuracy_at_confidence is None else f"{r.accuracy_at_confidence:.3f}"
    return (
        f"| {r.task} | {r.n} | {r.choice_mass:.3f} | {r.accuracy:.3f} | "
        f"{r.confident_share:.2f} | {at} | {r.ece:.3f} | {r.flip_rate:.3f} "
        f"({r.max_rerun_change:.1e}) | {r.order_flips:.3f} | "
        f"{'yes' if r.beats_prior else 'NO'} | {'qualifies' if r.qualifies else 'MISSES'} |"
    )


def table(result: Qualification) -> str:
    """The qualification as a markdown table, the criteria, and each miss in words."""
    fp, c = result.fingerprint, result.criteria
    reading = "temperature-scaled" if c.calibrated else "the model's own"
    lines = [
        f"# judge qualify: {fp.model} ({fp.dtype}; {result.arithmetic}; response prefix "
        f"{fp.response_prefix!r})",
        "",
        f"| task | n | mass | accuracy | share >= {c.confidence:g} | accuracy there | ECE "
        "| flips (largest change) | order flips | signal | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
        *(_row(r) for r in result.tasks),
        "",
        f"Criteria: accuracy >= {c.min_accuracy:g} at confidence >= {c.confidence:g} and ECE "
        f"<= {c.max_ece:g} ({reading} probabilities), flips <= {c.max_flip_rate:g} between "
        f"two runs, order flips <= {c.max_order_flips:g}, mean choice mass >= "
        f"{c.min_choice_mass:g}"
        + (", a signal beyond the label prior." if c.require_signal else "."),
    ]
    for r in result.tasks:
        lines += [f"- {r.task}: {miss}" for miss in r.misses]
    missed = sum(not r.qualifies for r in result.tasks)
    lines.append(
        f"{fp.model} qualifies on all {len(result.tasks)} tasks."
        if result.qualifies
        else f"{fp.model} does NOT qualify: {missed} of {len(result.tasks)} tasks miss a criterion."
    )
    return "\n".join(lines)
