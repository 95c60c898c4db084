"""``judge decide``: typed questions about one state, answered in one run of the model.

    judge decide --state ticket.json \\
        --question 'billing={"type": "noul", "instructions": "Is this about billing?"}' \\
        --questions more.json --order invariant --profile billing=billing-v2

The state is a file (``-``: stdin), read as JSON if it parses and as text otherwise. Each
question is ``ID=JSON`` on the command line, or an entry of ``--questions FILE`` (a JSON
object, id -> question); a question is ``judge.answers``'s: ``{"type": "noul" | "choice" |
"score", "instructions": ..., "criteria": ..., "order": ...}``, or a pair, ``{"type": "pair",
"instructions": ..., "candidates": {name: text, name: text}}``. ``--profile ID=NAME`` gates
question ID with the profile NAME from ``--profiles-dir``.

Prints one JSON object, id -> answer (the answers of ``POST /v1/systemone``, ``service.systemone``). Everything the
command line can get wrong is checked before the model loads; an error is one line that
names the question and its field, with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from calibration import CalibrationProfile, Gate, Overrides, PolicyDefaults, ProfileError
from judge.answers import MAX_ORDERINGS, DecisionPlan, plan_decisions
from service.command_line import (
    UsageError,
    check_stage_names,
    load_engine,
    load_stages,
    model_arguments,
    positive_int,
    profiles_dir_argument,
    stage,
    to_json,
)
from service.decisions import QuestionDecision, judge_questions, question_overrides, with_order
from service.gate_context import NO_LOG, GateContext
from service.profiles import ProfileStore

if TYPE_CHECKING:
    from service.cascade.stages import LocalStage, QuestionItem, RemoteStage

__all__ = ["add_arguments", "read_state", "run"]


def run(args: argparse.Namespace) -> int:
    """Check the questions and profiles, load the model once, answer, print."""
    state = read_state(args.state)
    questions: dict[str, Any] = _questions(args)
    if args.order is not None:
        questions = with_order(questions, args.order)
    # No model yet: the questions, the profiles and their choices are checked first.
    plan = plan_decisions(state, questions, max_orderings=args.max_orderings)
    profiles = _profiles(args.profile or [], args.profiles_dir, questions)
    for asked in plan.asked:
        profile, _ = profiles.get(asked.id, (None, None))
        if profile is not None and sorted(profile.choices) != sorted(asked.choices):
            raise UsageError(
                f"profile {profile.name!r} was fitted for choices {profile.choices!r}, not "
                f"question {asked.id!r}'s {asked.choices!r}; the same choices are needed "
                "(in any order)",
                field=f"profiles.{asked.id}",
            )
    given: list[tuple[str, str]] = args.cascade or []
    check_stage_names(args.stage_name, given)
    first = next((profile for profile, _ in profiles.values()), None)
    engine = load_engine(args, first, dtype=args.dtype)
    gates = {
        qid: NO_LOG.open_profile(profile, question_overrides(qid, questions[qid]), etag=etag)
        for qid, (profile, etag) in profiles.items()
    }
    later = _later_stages(args, given, engine.dtype, state, plan, profiles, questions)
    judged = judge_questions(
        engine,
        state,
        questions,
        gates=gates,
        defaults=PolicyDefaults(),
        max_orderings=args.max_orderings,
    )
    answers = {}
    for qid, (answer, verdict) in judged.items():
        escalation = None
        if qid in later:  # what this model escalated goes to the later stages, in turn
            from service.cascade.escalation import escalated

            item, stages = later[qid]
            choices = list(answer.probabilities)
            escalation = escalated(args.stage_name, verdict, answer.judgment, choices, stages, item)
        answers[qid] = QuestionDecision(answer, verdict, escalation).wire()
    sys.stdout.write(to_json(answers, indent=2) + "\n")
    return 0


def _later_stages(
    args: argparse.Namespace,
    given: list[tuple[str, str]],
    dtype: str,
    state: object,
    plan: DecisionPlan,
    profiles: dict[str, tuple[CalibrationProfile, str]],
    questions: dict[str, Any],
) -> dict[str, tuple[QuestionItem, list[LocalStage | RemoteStage]]]:
    """Each question's later stages (``--cascade``), as ``judge serve`` and ``judge mcp``
    open them: stage NAME under the profile "P-NAME" from ``--profiles-dir`` where the
    question's is P, a local model loaded here (in the first's dtype), a URL asked over
    ``POST /v1/systemone``; every gate opened and checked before any item is judged."""
    if not given:
        return {}
    from service.cascade.stages import QuestionItem, asked_as, opened_stages

    cascade = load_stages(given, dtype)
    store = GateContext(store=ProfileStore(args.profiles_dir))
    later: dict[str, tuple[QuestionItem, list[LocalStage | RemoteStage]]] = {}
    for asked in plan.asked:
        overrides = question_overrides(asked.id, questions[asked.id])
        profile, _ = profiles.get(asked.id, (None, None))
        field = f"profiles.{asked.id}"

        def open_gate(
            mine: str | None, overrides: Overrides = overrides, field: str = field
        ) -> Gate:
            try:
                return store.open(mine, overrides)
            except ProfileError as exc:
                raise UsageError(f"{field}: {exc} (in {args.profiles_dir})", field=field) from None

        stages = opened_stages(
            cascade,
            None if profile is None else profile.name,
            overrides,
            open_gate,
            choices=asked.choices,
            field=field,
            api_key=os.environ.get("JUDGE_API_KEY") or None,
        )
        item = QuestionItem(state, asked.id, asked_as(asked.question, overrides))
        later[asked.id] = (item, stages)
    return later


def read_state(source: str) -> object:
    """The state in ``source`` (a path, or ``-`` for stdin): JSON if it parses, else text."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise UsageError(f"cannot read --state {source!r}: {reason}", field="state") from None
    if not text.strip():
        raise UsageError(f"--state {source!r} is empty; give the state to judge", field="state")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _questions(args: argparse.Namespace) -> dict[str, Any]:
    """The questions of ``--questions FILE`` and then of each ``--question ID=JSON``."""
    questions: dict[str, Any] = {}
    if args.questions is not None:
        path = args.questions
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise UsageError(
                f"cannot read --questions {path}: {reason}", field="questions"
            ) from None
        except json.JSONDecodeError as exc:
            raise UsageError(f"--questions {path} is not JSON: {exc}", field="questions") from None
        if not isinstance(data, dict):
            raise UsageError(
                f"--questions {path} must be a JSON object, id -> question; "
                f"got {type(data).__name__}",
                field="questions",
            )
        questions.update(data)
    for item in args.question or []:
        qid, text = _pair(item, "--question", "ID=JSON")
        if qid in questions:
            raise UsageError(
                f"question {qid!r} is asked twice; give each question its own id",
                field=f"questions.{qid}",
            )
        try:
            questions[qid] = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(
                f"--question {qid}: not JSON ({exc}); write it as "
                f'{qid}=\'{{"type": "noul", "instructions": "..."}}\'',
                field=f"questions.{qid}",
            ) from None
    if not questions:
        raise UsageError(
            "ask at least one question: --question ID=JSON or --questions FILE", field="questions"
        )
    return questions


def _profiles(
    pairs: list[str], directory: Path, questions: dict[str, Any]
) -> dict[str, tuple[CalibrationProfile, str]]:
    """Each ``--profile ID=NAME``'s profile and its ETag, by question id, from ``directory``."""
    store: ProfileStore | None = None
    profiles: dict[str, tuple[CalibrationProfile, str]] = {}
    for item in pairs:
        qid, name = _pair(item, "--profile", "ID=NAME")
        field = f"profiles.{qid}"
        if qid not in questions:
            raise UsageError(
                f"--profile {item}: no question {qid!r} is asked (the questions are "
                f"{', '.join(sorted(questions))})",
                field=field,
            )
        if qid in profiles:
            raise UsageError(f"--profile: question {qid!r} is given two profiles", field=field)
        store = store or ProfileStore(directory)
        try:
            profiles[qid] = store.get_tagged(name)
        except ProfileError as exc:
            raise UsageError(f"--profile {item}: {exc} (in {directory})", field=field) from None
    return profiles


def _pair(item: str, flag: str, form: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise UsageError(f"{flag} {item!r}: expected {form}")
    return key.strip(), value


def add_arguments(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``judge decide``'s arguments."""
    decide = commands.add_parser(
        "decide",
        help="answer typed questions (yes/no, one of options, a score, the better of a pair) "
        "about a state",
        description="Answer typed questions about one state in one run of the model and "
        "print one JSON object, id -> answer. A question is "
        '{"type": "noul" | "choice" | "score" | "pair", "instructions": ..., "criteria": ...}; '
        'a pair\'s "candidates": {name: text, name: text}.',
    )
    decide.add_argument(
        "--state",
        required=True,
        help="a file with the state ('-' for stdin): JSON if it parses, else text",
    )
    decide.add_argument(
        "--question",
        action="append",
        metavar="ID=JSON",
        help="a question and its id; repeat for each",
    )
    decide.add_argument(
        "--questions", type=Path, metavar="FILE", help="a JSON object of questions, id -> question"
    )
    decide.add_argument(
        "--order",
        choices=["given", "invariant"],
        help="for questions that set no order: invariant asks under several listings of the "
        "options and averages (default: each question's own, else given)",
    )
    decide.add_argument(
        "--max-orderings",
        type=positive_int,
        default=MAX_ORDERINGS,
        help=f"listings of a choice question's options under order invariant ({MAX_ORDERINGS})",
    )
    decide.add_argument(
        "--profile",
        action="append",
        metavar="ID=NAME",
        help="gate question ID with the profile NAME from --profiles-dir; repeat for each",
    )
    profiles_dir_argument(decide)
    decide.add_argument(
        "--cascade",
        type=stage,
        action="append",
        metavar="NAME=MODEL|URL",
        help="a later stage, in order: a question the stages before it escalate goes to it, "
        "under the profile P-NAME from --profiles-dir where the question's is P (a model "
        "loaded here, or another judge server's URL), as judge serve --cascade sends it",
    )
    decide.add_argument(
        "--stage-name", default="local", help="this command's model's name as the first stage"
    )
    model_arguments(decide, dtype_help="(default: the first profile's, else auto)")
    decide.set_defaults(run=run)
