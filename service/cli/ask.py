"""``judge ask``: judge one prompt, or gate a JSONL file of them, and print the decisions.

One prompt prints one JSON object: the decision (accept or escalate, with reasons) and the
judgment behind it. With ``--input`` every line of a JSONL file (or stdin) is judged the same
way and answered by one JSON line, in input order; a line that cannot be judged gets its error
in its place, so the output lines up with the input and nothing is silently dropped.

The decision always comes from a ``calibration.Gate``, the same object every route of the HTTP
service decides through and whose policy ``judge evaluate`` measures; nothing here decides on
its own. Its wire form
is the HTTP service's (``JudgeResponse.of``), and an error's is too (``service.errors.error_of``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TextIO

import msgspec

from calibration import (
    CalibrationError,
    CalibrationProfile,
    Gate,
    NoCertificateError,
    Overrides,
    ProfileMismatchError,
    Verdict,
)
from judge import (
    DEFAULT_RESPONSE_PREFIX,
    DEFAULT_RESPONSE_SUFFIX,
    Engine,
    InvalidQueryError,
    JudgeError,
    Judgment,
    Query,
)
from judge.atomicio import replacing
from judge.judgments import check_item_span, item_span_of, validate_choices
from service.cli import ask_cascade
from service.cli.ask_cascade import LaterStages
from service.command_line import (
    UsageError,
    choice_value,
    load_engine,
    load_profile,
    model_arguments,
    non_negative,
    positive_int,
    probability,
    to_json,
)
from service.errors import BadFieldError, error_of
from service.gate_context import NO_LOG, item_prompt, scored
from service.schemas import JudgeResponse

__all__ = ["AskedLine", "Failure", "InputLineError", "LineError", "add_arguments", "run"]

Scalar = str | int | float | bool


class AskedLine(JudgeResponse, frozen=True, kw_only=True, omit_defaults=True, tag="judgment"):
    """What ``judge ask`` prints per prompt: the HTTP service's ``JudgeResponse`` (the verdict
    and the judgment behind it, field for field: one record, so a field added there is printed
    here too) and, in batch mode, the input line's id."""

    id: Scalar | msgspec.UnsetType = msgspec.UNSET  # batch mode only


class LineError(msgspec.Struct, frozen=True, kw_only=True):
    """A line's error: the service's error body (``error_of``), named by the error's class."""

    type: str  # the error's class name
    detail: str  # what is wrong and how to fix it
    field: str | None  # the input field at fault, where one is


class Failure(msgspec.Struct, frozen=True, kw_only=True):
    """What a batch line that could not be judged gets in its place."""

    id: Scalar
    line: int  # 1-based line number in the input
    error: LineError


class InputLineError(BadFieldError, ValueError):
    """A line of ``--input`` is not a JSON object with a prompt (and optional choices, id)."""

    def __init__(self, field: str | None, message: str) -> None:
        Exception.__init__(self, message)
        self.field = field  # type: ignore[assignment]  # None: the line as a whole


_FIELDS = ("prompt", "item", "choices", "id", "item_span")


class _Item(msgspec.Struct, frozen=True):
    id: Scalar
    line: int
    query: Query
    outside_template: bool = False  # a whole prompt that is not the profile's template


def _asked(gate: Gate, text: str, query: Query, *, item_alone: bool) -> tuple[Query, bool]:
    """``query`` planned on ``gate`` (``Gate.plan``: asking for what it reads, and whether
    its prompt lies outside the profile's template); with ``item_alone``, ``text`` is the
    item, put in the template the profile was fitted on first (``item_prompt``, every
    front's), else ``query`` holds the whole prompt."""
    if item_alone:
        asked = item_prompt(gate.profile, text)
        query = msgspec.structs.replace(query, prompt=asked.prompt, item_span=asked.item_span)
    return gate.plan(query)


def _answer(
    judgment: Judgment,
    verdict: Verdict,
    gate: Gate,
    item_id: Scalar | msgspec.UnsetType,
    query: Query,
    later: LaterStages | None,
) -> AskedLine:
    """The response ``POST /judge`` gives (the decision core's: the probabilities in the
    query's order, the request's), with the line's id; with a cascade, the cascade's
    (``ask_cascade``)."""
    if later is None:
        response, _ = NO_LOG.respond(
            judgment, verdict, gate, model=judgment.model, choices=query.choices
        )
    else:
        response = later.decide(query, judgment, verdict, gate)
    return AskedLine(
        **{f: getattr(response, f) for f in JudgeResponse.__struct_fields__}, id=item_id
    )


def run(args: argparse.Namespace) -> int:
    """Open the gate and load the engine once, check them against each other, then judge."""
    profile = load_profile(args.profile) if args.profile else None
    overrides = Overrides(
        threshold=args.threshold,
        uncertified_threshold=args.uncertified_threshold,
        min_choice_mass=args.min_choice_mass,
        max_std=args.max_std,
        values=dict(args.value) if args.value else None,
    )
    if overrides.values is not None or overrides.max_std is not None:
        scale = args.choice or (profile.choices if profile else None)
        if scale is None:
            raise UsageError("--value and --max-std score the choices: give them (--choice)")
        overrides = scored(overrides, scale, profile=None if profile is None else profile.name)
    try:
        gate = NO_LOG.open_profile(profile, overrides)
    except NoCertificateError:
        raise UsageError(
            f"--threshold {args.threshold:g} overrides a profile's certified threshold, and "
            "there is none; to accept on uncertified confidence anyway, with no guarantee, "
            "give --uncertified-threshold instead",
            field="--threshold",
        ) from None
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    later = ask_cascade.plan(args, gate.overrides)  # checked before any model loads
    engine = load_engine(
        args,
        profile,
        dtype=args.dtype,
        response_prefix=args.response_prefix,
        response_suffix=args.response_suffix,
    )
    # A profile fitted on a task has its system prompt in its template.
    if args.system is None and gate.template is not None:
        args.system = gate.template.system
    # Once, before any item: every item shares the model, dtype, template and system.
    gate.check_engine(engine, system=args.system, choices=args.choice)
    choices = args.choice or gate.choices
    if later is not None:
        later.load(args.dtype, choices)
    if args.input is None:
        if choices is None:
            raise UsageError("give the choices (--choice A --choice B) or a --profile")
        try:
            span = None if args.item is None else item_span_of(args.prompt, args.item)
        except InvalidQueryError as exc:
            raise UsageError(f"--{exc}") from None
        # With a profile fitted on a task, PROMPT is the item alone, unless --item marks it
        # inside a whole prompt.
        alone = gate.template is not None and args.item is None
        query = Query(prompt=args.prompt, choices=choices, system=args.system, item_span=span)
        query, outside = _asked(gate, args.prompt, query, item_alone=alone)
        judgment = engine.judge_batch([query])[0]
        verdict = gate.decide(judgment, outside_template=outside)
        answer = _answer(judgment, verdict, gate, msgspec.UNSET, query, later)
        sys.stdout.write(to_json(answer, indent=2) + "\n")
        return 0
    return _run_batch(args, engine, gate, profile, choices, later)


def _run_batch(
    args: argparse.Namespace,
    engine: Engine,
    gate: Gate,
    profile: CalibrationProfile | None,
    choices: list[str] | None,
    later: LaterStages | None,
) -> int:
    from tqdm import tqdm

    lines, total = _input_lines(args.input)
    counts: Counter[str] = Counter()
    failed: list[int] = []
    with (
        _output(args.output) as out,
        tqdm(total=total, unit="item", desc="judge ask", file=sys.stderr) as bar,
    ):
        for batch in _batches(lines, args.batch_size):
            parsed = [
                _parse(raw, n, choices, profile, system=args.system, gate=gate) for n, raw in batch
            ]
            for row in _answer_batch(engine, gate, parsed, later):
                if isinstance(row, Failure):
                    counts["error"] += 1
                    failed.append(row.line)
                else:
                    counts[row.decision] += 1
                    counts.update(f"reason:{code}" for code in row.reason_codes)
                    if row.cascade is not None:
                        counts[f"stage:{row.decided_by or 'person'}"] += 1
                out.write(to_json(row) + "\n")
            out.flush()
            bar.update(len(batch))
    print(_summary(counts, failed), file=sys.stderr)
    return 0


def _answer_batch(
    engine: Engine,
    gate: Gate,
    parsed: Sequence[_Item | Failure],
    later: LaterStages | None = None,
) -> list[AskedLine | Failure]:
    """Each parsed line's output row, in order; the valid ones judged in one call.

    ``judge_each`` gives an item the engine refuses (a prompt too long, say) its error in its
    place, so one bad item does not cost the rest of its batch.
    """
    items = [p for p in parsed if isinstance(p, _Item)]
    results = dict(
        zip((i.line for i in items), engine.judge_each([i.query for i in items]), strict=True)
    )
    judged = [(r, i) for i in items if isinstance(r := results[i.line], Judgment)]
    decisions = iter(
        gate.decide_many(
            [r for r, _ in judged], outside_templates=[i.outside_template for _, i in judged]
        )
    )
    rows: list[AskedLine | Failure] = []
    for p in parsed:
        if isinstance(p, Failure):
            rows.append(p)
            continue
        result = results[p.line]
        if isinstance(result, Judgment):
            rows.append(_answer(result, next(decisions), gate, p.id, p.query, later))
        else:
            rows.append(_failure(p.id, p.line, result))
    return rows


def _summary(counts: Counter[str], failed: Sequence[int]) -> str:
    n = counts["accept"] + counts["escalate"] + counts["error"]
    reasons = ", ".join(
        f"{key.removeprefix('reason:')} {count}"
        for key, count in sorted(counts.items())
        if key.startswith("reason:")
    )
    lines = [
        f"{_plural(n, 'item')}: {counts['accept']} accepted, {counts['escalate']} escalated"
        + (f" ({reasons})" if reasons else "")
        + f", {_plural(counts['error'], 'error')}"
    ]
    stages = [(k.removeprefix("stage:"), v) for k, v in counts.items() if k.startswith("stage:")]
    if stages:
        lines.append("decided by: " + ", ".join(f"{name} {n}" for name, n in stages))
    if failed:
        shown = ", ".join(map(str, failed[:20])) + (", ..." if len(failed) > 20 else "")
        lines.append(
            f"{_plural(len(failed), 'line')} could not be judged "
            f"({'line' if len(failed) == 1 else 'lines'} {shown}); each has its error in its "
            "place in the output"
        )
    return "\n".join(lines)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _input_lines(source: str) -> tuple[Iterator[tuple[int, bytes | str]], int | None]:
    """Numbered lines of ``source`` (a path, or ``-`` for stdin) and how many are not blank."""
    if source == "-":
        stream: Iterable[bytes | str] = getattr(sys.stdin, "buffer", sys.stdin)
        return enumerate(stream, start=1), None
    try:
        data = Path(source).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read --input {source!r}: {exc.strerror or exc}") from exc
    rows = data.splitlines()
    return enumerate(rows, start=1), sum(1 for r in rows if r.strip())


def _batches(
    lines: Iterator[tuple[int, bytes | str]], size: int
) -> Iterator[list[tuple[int, bytes | str]]]:
    """Non-blank lines in lists of ``size``; blank lines are skipped and get no output."""
    batch: list[tuple[int, bytes | str]] = []
    for n, raw in lines:
        if not raw.strip():
            continue
        batch.append((n, raw))
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


@contextlib.contextmanager
def _output(target: str | None) -> Iterator[TextIO]:
    """stdout for None or ``-``; else the file, which appears whole once every line is in."""
    if target in (None, "-"):
        yield sys.stdout
        return
    with replacing(target) as temp, temp.open("w", encoding="utf-8") as handle:
        yield handle


def _parse(
    raw: bytes | str,
    n: int,
    default_choices: list[str] | None,
    profile: CalibrationProfile | None,
    *,
    system: str | None,
    gate: Gate,
) -> _Item | Failure:
    """One input line as a query asking for what ``gate`` reads, or the Failure that says what
    is wrong with it. A line may mark its item's characters in the prompt (``item_span``)."""
    item_id: Scalar = n
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputLineError(None, f"line {n} is not JSON: {exc}") from None
        if not isinstance(row, dict):
            raise InputLineError(
                None, f"line {n} must be a JSON object with a prompt, got {type(row).__name__}"
            )
        given = row.get("id")
        if given is not None:
            if isinstance(given, dict | list):
                raise InputLineError("id", f"id must be a string or a number, got {given!r}")
            item_id = given
        unknown = sorted(set(row) - set(_FIELDS))
        if unknown:
            raise InputLineError(
                unknown[0],
                f"unknown field {unknown[0]!r}; a line has {', '.join(_FIELDS)}",
            )
        prompt, item = row.get("prompt"), row.get("item")
        if (prompt is None) == (item is None):
            raise InputLineError(
                "prompt", "give a prompt, or an item alone (for a profile fitted on a task)"
            )
        given_text = prompt if item is None else item
        name = "prompt" if item is None else "item"
        if not isinstance(given_text, str):
            raise InputLineError(name, f"{name} must be a string, got {given_text!r}")
        choices = row.get("choices")
        if choices is None:  # absent or null: the command line's (or the profile's)
            choices = default_choices
        if choices is None:
            raise InputLineError(
                "choices", "no choices: give the line a choices list, or pass --choice or --profile"
            )
        choices = validate_choices(choices)
        if profile is not None and set(choices) != set(profile.choices):
            raise ProfileMismatchError(
                "choices",
                f"profile {profile.name!r} was fitted for choices {profile.choices!r}, not "
                f"{choices!r}; give the profile's choices (any order) or drop the line's",
            )
        if item is not None and row.get("item_span") is not None:
            raise InputLineError("item_span", "an item alone marks its own span: drop item_span")
        span = None if item is not None else check_item_span(row.get("item_span"), given_text)
        query = Query(prompt=given_text, choices=choices, system=system, item_span=span)
        query, outside = _asked(gate, given_text, query, item_alone=item is not None)
        return _Item(item_id, n, query, outside)
    except UnicodeDecodeError as exc:
        return _failure(item_id, n, InputLineError(None, f"line {n} is not UTF-8 text: {exc}"))
    except (InputLineError, JudgeError, CalibrationError) as exc:
        return _failure(item_id, n, exc)


def _failure(item_id: Scalar, n: int, exc: Exception) -> Failure:
    """The line's error: the field the service would name; the error's whole message, always
    (the service hides an unexpected error's from its clients; here the reader is the owner)."""
    error = error_of(exc)
    return Failure(
        id=item_id,
        line=n,
        error=LineError(type=type(exc).__name__, detail=str(exc), field=error.field),
    )


def add_arguments(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``judge ask``'s arguments (main checks the combinations argparse cannot express)."""
    ask = commands.add_parser(
        "ask",
        help="judge a prompt (or a JSONL file of them) and print the decisions as JSON",
        description="Print the decision (accept or escalate, with reasons) and the judgment "
        "behind it. Give one PROMPT, or --input with one JSON object per line: "
        '{"prompt": "...", "choices": [...] (optional), "id": ... (optional), '
        '"item_span": [start, end] (optional)}.',
    )
    ask.add_argument("prompt", nargs="?", help="the question or item to judge")
    ask.add_argument(
        "--choice",
        action="append",
        help="a choice; repeat for each (default with --profile: the profile's choices)",
    )
    ask.add_argument("--profile", type=Path, help="a calibration profile JSON file")
    ask.add_argument(
        "--threshold",
        type=probability,
        help="accept at this calibrated confidence or above instead of the profile's "
        "certified threshold (refused where there is none); overriding drops the certification",
    )
    ask.add_argument(
        "--uncertified-threshold",
        type=probability,
        help="OPT-IN, NO GUARANTEE: where no certified threshold exists (no --profile, or one "
        "that certified none), accept at this confidence instead of escalating",
    )
    ask.add_argument(
        "--min-choice-mass",
        type=probability,
        help="escalate when the choices' share of the next-token distribution is below this "
        "(default: the profile's; 0 without a profile)",
    )
    ask.add_argument(
        "--value",
        type=choice_value,
        action="append",
        metavar="CHOICE=NUMBER",
        help="a score: each choice's number (repeat for each; default for numeral choices: the "
        "numerals), so that the answer carries the expected value and its standard deviation",
    )
    ask.add_argument(
        "--max-std",
        type=non_negative,
        help="a score: escalate when the standard deviation is above this (default: the profile's)",
    )
    ask.add_argument(
        "--item",
        help="the item's own text inside PROMPT (its first occurrence), for a profile whose "
        "probe reads the mean over the item; JSONL lines give item_span [start, end] instead",
    )
    ask.add_argument("--system", default=None, help="system prompt (default: the model's own)")
    ask.add_argument(
        "--input",
        help="judge every line of this JSONL file ('-' for stdin) instead of one PROMPT",
    )
    ask.add_argument("--output", help="with --input: write JSON lines here (default: stdout)")
    ask.add_argument(
        "--batch-size", type=positive_int, default=16, help="with --input: items per batch"
    )
    model_arguments(ask, dtype_help="(default: the profile's, else auto)")
    ask_cascade.add_arguments(ask)
    ask.add_argument(
        "--response-prefix",
        default=None,
        help=f"default: the profile's, else {DEFAULT_RESPONSE_PREFIX!r}",
    )
    ask.add_argument(
        "--response-suffix",
        default=None,
        help=f"default: the profile's, else {DEFAULT_RESPONSE_SUFFIX!r}",
    )
    ask.set_defaults(run=run)
