"""``judge estimate``: each choice's share of a dataset, and the judge's accuracy on it, from a
few labels and the judge's probabilities on every item (PPI++, ``calibration.monitoring.estimates``).

Two sources:

* ``--judged F [--labels L]``: ``judge ask --input ITEMS --output F``'s lines (an ``id`` and
  the ``probabilities``), and the labels of some of them, ``{"id": ..., "label": ...}`` a
  line (or a ``label`` field on the judged lines themselves). The labelled items must be a
  uniform sample of the file; the estimate warns where they do not look like one.
* ``--log LOG --profile P``: P's logged decisions, the audited ones with a label as the
  labelled sample (a uniform sample by construction), every other one as unlabelled. Labels
  outside the audit sample (a teach stream's picks) are left out, and the output says so.

Prints a table (``--json``: the ``DatasetEstimate`` as JSON): PPI++ beside the labels alone
and the judge alone, and about how many labels would halve each interval.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from service.command_line import UsageError, open_probability, profiles_dir_argument, to_json

__all__ = ["add_arguments", "run_estimate"]


def add_arguments(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``judge estimate``'s arguments."""
    estimate = commands.add_parser(
        "estimate",
        help="each choice's share of a dataset and the judge's accuracy, from a few labels "
        "(prediction-powered inference, PPI++)",
        description="The judge's probabilities on every item and the labels of a uniform "
        "sample of them give each choice's share and the judge's accuracy with intervals "
        "that are never wider than the labels' own and narrower the better the judge "
        "predicts (Angelopoulos, Duchi & Zrnic 2023). From judge ask's output and a labels "
        "file, or from a profile's decision log (its audited labels).",
    )
    source = estimate.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--judged",
        type=Path,
        help="judge ask --input ... --output's JSONL: an id and probabilities a line",
    )
    source.add_argument("--log", help="a decision log: a SQLite file or a postgresql:// URL")
    estimate.add_argument(
        "--labels",
        type=Path,
        help='with --judged: {"id": ..., "label": ...} a line, for a uniform sample of its ids',
    )
    estimate.add_argument(
        "--profile", help="with --log: the profile whose decisions to read (a file or a name)"
    )
    profiles_dir_argument(estimate)
    estimate.add_argument(
        "--alpha",
        type=open_probability,
        default=0.05,
        help="error level: the shares' intervals hold together with probability 1 - alpha",
    )
    estimate.add_argument("--json", action="store_true", help="print the estimate as JSON")
    estimate.set_defaults(run=run_estimate)


def run_estimate(args: argparse.Namespace) -> int:
    """Read the source, estimate, print; exit 0 (2 on bad input)."""
    from calibration.monitoring.estimates import dataset_estimate

    if args.judged is not None:
        if args.profile is not None:
            raise UsageError("--profile goes with --log", field="--profile")
        choices, p_u, p_l, y, notes = _from_judged(args.judged, args.labels)
    else:
        if args.labels is not None:
            raise UsageError(
                "--labels goes with --judged; a log keeps its labels", field="--labels"
            )
        if args.profile is None:
            raise UsageError(
                "--log needs --profile: whose decisions to estimate over", field="--profile"
            )
        choices, p_u, p_l, y, notes = _from_log(args.log, args.profile, args.profiles_dir)
    if p_l.shape[0] < 2 or p_u.shape[0] < 2:
        raise UsageError(
            f"{p_l.shape[0]} labelled and {p_u.shape[0]} unlabelled items: an estimate needs "
            "at least 2 of each"
        )
    estimate = dataset_estimate(choices, p_u, p_l, y, alpha=args.alpha)
    if args.json:
        print(to_json({"estimate": estimate, "notes": notes}, indent=2))
        return 0
    print(_table(estimate))
    for line in [*notes, *estimate.warnings]:
        print(f"note: {line}")
    return 0


def _table(estimate: Any) -> str:
    level = f"{1 - estimate.alpha:g}"
    lines = [
        f"{estimate.n_labeled} labelled, {estimate.n_unlabeled} unlabelled items; intervals at "
        f"{level}, the shares' together",
        "",
        "| | PPI++ | labels alone | judge alone | labels to halve |",
        "|---|---|---|---|---|",
    ]

    def row(name: str, ppi: Any, labels: Any, model: float) -> str:
        halve = "-" if ppi.labels_to_halve is None else str(ppi.labels_to_halve)
        return (
            f"| {name} | {ppi.estimate:.3f} [{ppi.lower:.3f}, {ppi.upper:.3f}] | "
            f"{labels.estimate:.3f} [{labels.lower:.3f}, {labels.upper:.3f}] | {model:.3f} | "
            f"{halve} |"
        )

    for share in estimate.shares:
        lines.append(row(f"share {share.choice}", share.ppi, share.labels_only, share.model_only))
    lines.append(
        row(
            "accuracy",
            estimate.accuracy,
            estimate.accuracy_labels_only,
            estimate.accuracy_model_only,
        )
    )
    return "\n".join(lines)


Source = tuple[list[str], np.ndarray, np.ndarray, np.ndarray, list[str]]


def _jsonl(path: Path, what: str) -> list[tuple[int, dict[str, Any]]]:
    try:
        text = path.read_text("utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror}", field=what) from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{what} line {n} is not JSON: {exc}", field=what) from None
        if not isinstance(row, dict):
            raise UsageError(f"{what} line {n} must be a JSON object", field=what)
        rows.append((n, row))
    return rows


def _from_judged(judged: Path, labels_file: Path | None) -> Source:
    """Every judged line's probabilities; the labelled ones by --labels' ids or their own
    ``label`` field. Lines that failed (an ``error``) are left out, and said."""
    rows = _jsonl(judged, "--judged")
    labels: dict[str, str] = {}
    if labels_file is not None:
        for n, row in _jsonl(labels_file, "--labels"):
            if "id" not in row or not isinstance(row.get("label"), str):
                raise UsageError(
                    f'--labels line {n}: expected {{"id": ..., "label": "..."}}', field="--labels"
                )
            labels[str(row["id"])] = row["label"]
    choices: list[str] | None = None
    probabilities, given, failed = [], [], 0
    for n, row in rows:
        p = row.get("probabilities")
        if p is None and "error" in row:
            failed += 1
            continue
        if not isinstance(p, dict) or not p:
            raise UsageError(f"--judged line {n}: no probabilities object", field="--judged")
        if choices is None:
            choices = list(p)
        if sorted(p) != sorted(choices):
            raise UsageError(
                f"--judged line {n}: choices {sorted(p)}, where line 1 has {sorted(choices)}; "
                "estimate over one set of choices",
                field="--judged",
            )
        probabilities.append([float(p[c]) for c in choices])
        label = labels.get(str(row.get("id"))) if labels else row.get("label")
        if label is not None and label not in choices:
            raise UsageError(f"label {label!r} of --judged line {n} is not one of {choices}")
        given.append(label)
    if choices is None:
        raise UsageError(f"--judged {judged} holds no judged line", field="--judged")
    known = {str(row.get("id")) for _, row in rows}
    unmatched = sorted(set(labels) - known)
    notes = [f"{failed} judged lines with an error left out"] if failed else []
    if unmatched:
        notes.append(
            f"{len(unmatched)} labels name no judged id (first: {unmatched[0]!r}), left out"
        )
    p = np.asarray(probabilities, dtype=np.float64)
    has = np.array([label is not None for label in given])
    y = np.array([choices.index(label) for label in given if label is not None], dtype=np.int64)
    return choices, p[~has], p[has], y, notes


def _from_log(target: str, name: str, profiles_dir: Path) -> Source:
    from service.cli.log import open_decision_log, stored_profile

    profile, _, _ = stored_profile(name, profiles_dir)
    choices = list(profile.choices)
    with open_decision_log(target) as log:
        records = log.decisions(profile=profile.name)
    if not records:
        raise UsageError(f"the log holds no decision of {profile.name!r}", field="--profile")

    def row(r: Any) -> list[float]:
        return [float(r.probabilities.get(c, 0.0)) for c in choices]

    labelled = [r for r in records if r.audit and r.label is not None]
    unlabelled = [r for r in records if r.label is None]
    left_out = sum(1 for r in records if not r.audit and r.label is not None)
    notes = []
    if left_out:
        notes.append(
            f"{left_out} labelled decisions outside the audit sample left out: chosen, not "
            "drawn, they would bias the estimate"
        )
    # An audited decision not labelled yet is unlabelled traffic like any other.
    y = np.array([choices.index(r.label) for r in labelled if r.label is not None], dtype=np.int64)
    p_l = np.array([row(r) for r in labelled]).reshape(-1, len(choices))
    p_u = np.array([row(r) for r in unlabelled]).reshape(-1, len(choices))
    return choices, p_u, p_l, y, notes
