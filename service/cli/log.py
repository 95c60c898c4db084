"""The commands that read the decision log (``service.log.decision_log``), for people and for cron.

judge label --log L --input labels.jsonl     store true labels, {"judgment_id", "label"} a line
judge check --profile P --log L              exit 1 when the profile's health check fails
judge replay ID --log L                      re-run a logged decision on today's model, profile
judge calibrate --from-log L --profile P     refit P on its audited, labeled decisions

``check`` is ``service.log.health.assess``, the same as ``GET /profiles/{name}/health``: it exits
0 when healthy, 1 when the audit labels contradict the certificate, the drift test fires or
the model no longer matches, and 2 on a usage error. ``calibrate --from-log`` fits from the
logged log-probabilities (and, kept with ``--log-features``, hidden states: a probe) of the
audit sample only: the uniform share of traffic, so its certificate rests on items
exchangeable with the traffic (labels given to escalated items alone would certify the wrong
population). Each such refit is one look of the profile's lineage, certified at its share of
the delta (``calibration.certificates.recertify``).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from service.command_line import (
    UsageError,
    batch_size_argument,
    fit_settings,
    model_arguments,
    open_probability,
    positive_int,
    positive_number,
    profiles_dir_argument,
    to_json,
)

if TYPE_CHECKING:
    from calibration import CalibrationProfile, Gate, Overrides, PolicyDefaults, Verdict
    from judge import Engine, Judgment
    from service.log.decision_log import DecisionLog
    from service.log.record import LoggedDecision
    from service.profiles import ProfileStore

__all__ = [
    "add_arguments",
    "open_decision_log",
    "run_check",
    "run_from_log",
    "run_label",
    "run_replay",
    "stored_profile",
]


class _LabelLine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    judgment_id: str
    label: str


def open_decision_log(target: str) -> DecisionLog:
    from service.log.backends import open_log
    from service.log.decision_log import DecisionLogError

    try:
        return open_log(target)
    except DecisionLogError as exc:
        raise UsageError(f"--log: {exc}") from None


def stored_profile(
    profile: str, profiles_dir: Path
) -> tuple[CalibrationProfile, str, ProfileStore]:
    """The profile ``profile`` names, a file or a name in ``profiles_dir``, and its ETag (the
    version the server's decisions carry)."""
    from service.profiles import ProfileStore

    path = Path(profile)
    if path.suffix == ".json" or path.is_file():
        store, name = ProfileStore(path.parent), path.stem
    else:
        store, name = ProfileStore(profiles_dir), profile
    found, etag = store.get_tagged(name)
    return found, etag, store


def run_label(args: argparse.Namespace) -> int:
    """Store the labels of a JSONL file; every line is checked before any is stored. With
    --queue, label from the terminal (``service.cli.label_queue``)."""
    if args.queue and args.items is not None:
        return _label_items(args)
    if args.items is not None or args.task is not None:
        raise UsageError("--items and --task go with --queue: label a file's items one at a time")
    if args.log is None:
        raise UsageError("--log is required: the decision log whose decisions to label")
    if args.queue:
        from service.cli.label_queue import run_queue

        if args.profile is None:
            raise UsageError("--queue needs --profile: the profile whose decisions to label")
        profile, etag, _ = stored_profile(args.profile, args.profiles_dir)
        with open_decision_log(args.log) as log:
            return run_queue(log, profile, etag, args.stream)
    lines: list[_LabelLine] = []
    source = sys.stdin if args.input == "-" else None
    try:
        text = source.read() if source is not None else Path(args.input).read_text("utf-8")
    except OSError as exc:
        raise UsageError(f"--input: cannot read {args.input}: {exc.strerror}") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            lines.append(msgspec.json.decode(line, type=_LabelLine))
        except msgspec.DecodeError as exc:
            raise UsageError(
                f"--input line {number}: {exc} (each line is "
                '{"judgment_id": "...", "label": "..."}); nothing was stored'
            ) from None
    if not lines:
        raise UsageError(f"--input: {args.input} holds no labels")
    from service.log.decision_log import LabelFailure

    with open_decision_log(args.log) as log:
        outcomes = log.label_many(
            [(line.judgment_id, line.label) for line in lines], replace=args.replace
        )
    counts: dict[str, int] = {}
    failures = []
    for outcome in outcomes:
        status = "error" if isinstance(outcome, LabelFailure) else outcome.status
        counts[status] = counts.get(status, 0) + 1
        if isinstance(outcome, LabelFailure):
            failures.append(outcome)
    print(to_json({"counts": counts, "errors": failures}, indent=2))
    return 1 if failures else 0


def _label_items(args: argparse.Namespace) -> int:
    """``--queue --items``: a new task's first labels, from a file of its unlabelled items,
    written into the task's directory for ``judge calibrate``; every few labels the profile
    ``judge calibrate`` would fit on them is fitted in the background, and written where it
    certifies (``service.cli.label_queue``)."""
    from calibration import FitSettings
    from calibration.maps.probe import candidate_layers
    from calibration.profile import NAME_PATTERN
    from calibration.tasks import ItemQueue, TaskError, judge_pool, load_pool, load_task
    from service.cli.label_queue import run_item_queue
    from service.command_line import load_engine

    if args.task is None:
        raise UsageError("--items needs --task: the task directory whose choices to label with")
    if args.log is not None or args.profile is not None:
        raise UsageError("--items labels a file, not a log: drop --log and --profile")
    try:
        task = load_task(args.task)
        pool, items_sha256 = load_pool(args.items)
    except TaskError as exc:
        raise UsageError(str(exc), field="--items") from None
    split = args.split
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", split) or split in ("calibration", "test"):
        raise UsageError(
            f"--split {split!r} must be a plain file name, not calibration or test (the "
            "task's own labelled splits)",
            field="--split",
        )
    if not 0 < args.audit_share <= 1:
        raise UsageError(f"--audit-share must be in (0, 1], got {args.audit_share}")
    name = args.name or task.name
    if not re.fullmatch(NAME_PATTERN, name):
        raise UsageError(
            f"profile name {name!r} must match {NAME_PATTERN} (pass --name to choose one)",
            field="--name",
        )
    engine = load_engine(args, dtype=args.dtype)
    num_layers = engine.fingerprint().num_layers
    # The layers judge calibrate reads (a probe's candidates), so that the fits here are its.
    layers = candidate_layers(num_layers) if num_layers else ()
    scores = judge_pool(
        engine,
        task,
        [text for _, text in pool],
        items_sha256,
        layers=layers,
        batch_size=args.batch_size,
        say=_say,
    )
    try:
        queue = ItemQueue(
            task,
            pool,
            scores,
            split,
            seed=args.seed,
            audit_share=args.audit_share,
            streams=["audit", "teach"] if args.stream == "both" else [args.stream],
        )
    except TaskError as exc:
        raise UsageError(str(exc), field="--split") from None
    settings = FitSettings(
        target_precision=args.target_precision, delta=args.delta, values=task.values
    )
    named = "" if name == task.name else f" --name {name}"
    command = f"judge calibrate --task {task.path} --split {split}{named}"
    return run_item_queue(
        queue,
        command,
        fingerprint=engine.fingerprint(),
        settings=settings,
        name=name,
        profiles_dir=args.profiles_dir,
        every=args.refit_every,
    )


def _say(line: str) -> None:
    """A line for the person at the terminal that is not the queue's own output."""
    sys.stderr.write(line + "\n")


def run_check(args: argparse.Namespace) -> int:
    """The profile's health from the log: exit 0 healthy, 1 when any check fires."""
    import time

    from service.log.health import profile_health

    profile, etag, _ = stored_profile(args.profile, args.profiles_dir)
    current = None
    if args.model is not None or args.check_model:
        from service.command_line import load_engine

        current = load_engine(args, profile).model_sha256
    since = None if args.since_days is None else time.time() - args.since_days * 86400
    with open_decision_log(args.log) as log:
        health = profile_health(
            log,
            profile,
            etag,
            window=args.window,
            alpha_drift=args.alpha_drift,
            alpha_precision=args.alpha_precision,
            alpha_prior=args.alpha_prior,
            current_model_sha256=current,
            since=since,
        )
    print(to_json(health, indent=2))
    verdict = "healthy" if health.healthy else "ALARM: " + ", ".join(health.alarms)
    print(
        f"judge check: profile {profile.name} ({health.n_decisions} decisions, "
        f"{health.n_audited_labeled} audited and labeled): {verdict}",
        file=sys.stderr,
    )
    if health.labels is not None:
        print(f"labels for the gate: {health.labels.reason}", file=sys.stderr)
    return 0 if health.healthy else 1


def run_replay(args: argparse.Namespace) -> int:
    """Re-run a logged decision on the model and profile of today; print then, now, changes.

    The gate is reopened as the decision's was: the logged request's overrides and the
    server's defaults in force then (``Gate.settings``), over today's version of the profile.
    A judgment (``POST /judge``, a batch item, a shared question) is judged again; a System One
    answer's question is asked again about its state, under all its listings.
    """
    from service.command_line import load_engine
    from service.gate_context import GateContext

    with open_decision_log(args.log) as log:
        record = log.get(args.judgment_id)
    if record is None:
        raise UsageError(f"no decision {args.judgment_id!r} in the log {args.log}")
    if record.request is None:
        raise UsageError(
            f"decision {args.judgment_id} was logged without its request (the server was not "
            "started with --log-requests), so there is nothing to re-run"
        )
    request: dict[str, Any] = record.request
    overrides, defaults = _logged_settings(request)
    profile = etag = None
    if request.get("profile") is not None:
        profile, etag, _ = stored_profile(request["profile"], args.profiles_dir)
    # Reopened through the decision core, under the defaults the server had then.
    context = GateContext(defaults=defaults or PolicyDefaults())
    gate = context.open_profile(profile, overrides, etag=etag)
    engine = load_engine(args, profile)
    if "question" in request:
        judgment, verdict = _replay_question(engine, gate, request)
    else:
        judgment, verdict = _replay_query(engine, gate, request)
    then = _view(record)
    now = {
        "decision": verdict.decision,
        "choice": verdict.choice,
        "confidence": verdict.confidence,
        "probabilities": verdict.probabilities,
        "log_probs": dict(zip(verdict.choices, verdict.raw_log_probs, strict=True)),
        "reason_codes": list(verdict.reason_codes),
        "tokens_sha256": judgment.tokens_sha256,
        "model_sha256": judgment.model_sha256,
        "policy_sha256": verdict.policy_sha256,
        "profile_etag": verdict.profile_etag,
    }
    changed = [key for key in now if now[key] != then[key]]
    print(
        to_json(
            {"judgment_id": record.judgment_id, "then": then, "now": now, "changed": changed},
            indent=2,
        )
    )
    return 0


def _logged_settings(request: dict[str, Any]) -> tuple[Overrides, PolicyDefaults | None]:
    """The overrides and server defaults a logged request was decided under. A record from
    before the gate kept its overrides at the top level and no defaults (then: the built-in
    defaults, which is what such a replay always assumed)."""
    from calibration import Gate, Overrides

    if "overrides" in request:
        return Gate.settings_of(request)
    return msgspec.convert(
        {k: request.get(k) for k in Overrides.__struct_fields__}, Overrides
    ), None


def _replay_query(engine: Engine, gate: Gate, request: dict[str, Any]) -> tuple[Judgment, Verdict]:
    """A logged judgment's query, judged again and decided by ``gate``."""
    from judge import Query

    query = msgspec.convert(request["query"], type=Query)
    gate.check_engine(
        engine,
        system=query.system,
        response_prefix=query.response_prefix,
        response_suffix=query.response_suffix,
        choices=query.choices,
    )
    judgment = engine.judge_batch([gate.asks(query)])[0]
    return judgment, gate.decide(judgment)


def _replay_question(
    engine: Engine, gate: Gate, request: dict[str, Any]
) -> tuple[Judgment, Verdict]:
    """A logged System One answer's question, asked again about its state (every listing,
    the state computed once) and decided by ``gate`` with its order spread."""
    from service.decisions import judge_questions
    from service.systemone import SystemOneQuestion

    ((qid, raw),) = request["question"].items()
    question = msgspec.convert(raw, type=SystemOneQuestion).question()
    ((answer, verdict),) = judge_questions(
        engine, request["state"], {qid: question}, gates={qid: gate}
    ).values()
    return answer.judgment, verdict


def _view(record: LoggedDecision) -> dict[str, Any]:
    """The logged decision in the shape ``run_replay`` prints for now."""
    return {
        "decision": record.decision,
        "choice": record.choice,
        "confidence": record.confidence,
        "probabilities": record.probabilities,
        "log_probs": dict(zip(record.choices, record.log_probs, strict=True)),
        "reason_codes": list(record.reason_codes),
        "tokens_sha256": record.tokens_sha256,
        "model_sha256": record.model_sha256,
        "policy_sha256": record.policy_sha256,
        "profile_etag": record.profile_etag,
    }


def run_from_log(args: argparse.Namespace) -> int:
    """``judge calibrate --from-log``: a new version of a profile from its decision log's
    labels (``service.log.refit``: the audited ones certify, the others only fit), stored
    under --name. Each run is one look of the profile's lineage and certifies at its share of
    ``--delta``."""
    from calibration.fitting import labels_for_next_look
    from calibration.profile import NAME_PATTERN
    from service.log.backends import mask_target
    from service.log.refit import RefitError, refit_from_log

    if args.profile is None:
        raise UsageError("calibrate --from-log: name the profile to refit with --profile")
    profile, _, store = stored_profile(args.profile, args.profiles_dir)
    max_std = args.max_std if args.max_std is not None else profile.max_std
    settings = fit_settings(args, values=profile.values, max_std=max_std)
    name = args.name or profile.name
    import re

    if not re.fullmatch(NAME_PATTERN, name):
        raise UsageError(f"profile name {name!r} must match {NAME_PATTERN}")
    with open_decision_log(args.from_log) as log:
        try:
            fitted = refit_from_log(
                log, profile, settings, name=name, log_name=mask_target(args.from_log)
            )
        except RefitError as exc:
            raise UsageError(str(exc)) from None
    for note in fitted.notes:
        print(note)
    refit, recertification = fitted.profile, fitted.recertification
    etag = store.put(refit)
    t = refit.threshold
    print(f"profile {name}: {refit.note}")
    print(
        f"look {recertification.look} of the lineage of {profile.name!r}: certified at delta "
        f"{recertification.spent:.4g}, its share of {settings.delta:g}"
    )
    if t.threshold is not None:
        print(f"threshold: {t.threshold:.3f}, coverage {t.coverage:.3f} (on the certify split)")
    else:
        print(f"no certified threshold: {t.reason}")
        scores = fitted.scores
        needed = labels_for_next_look(
            refit,
            scores.log_probabilities,
            scores.labels,
            scores.choice_mass,
            scores.features,
            scores.feature_layers,
            span_features=scores.span_features,
            fit_only=fitted.fit_only,
        )
        print(f"the next look: {needed.reason}")
    print(f"wrote {store.directory / name}.json (ETag {etag})")
    return 0


def add_arguments(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``judge label``, ``judge check`` and ``judge replay``'s arguments (``calibrate
    --from-log``'s are ``judge calibrate``'s, in service.cli.calibrate)."""
    log_help = "the decision log: a SQLite file or a postgresql:// URL"
    label = commands.add_parser(
        "label",
        help="store the true labels of logged decisions: from a JSONL file, or one key at a "
        "time (--queue)",
        description='--input: each line {"judgment_id": "...", "label": "..."}. Every line is '
        "read before any is stored; exit 1 if any label was refused (unknown id, not a "
        "choice, another label already and no --replace). --queue: the profile's unlabelled "
        "decisions one at a time, audit ones (a uniform sample: they certify) and the least "
        "certain others (they teach a refit) in turn; a digit labels, s skips, q quits.",
    )
    label.add_argument("--log", help=log_help + " (not with --items)")
    source = label.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="the JSONL file ('-' for stdin)")
    source.add_argument(
        "--queue", action="store_true", help="label from the terminal, one key per decision"
    )
    label.add_argument(
        "--replace", action="store_true", help="change labels given before (else refused)"
    )
    queue = label.add_argument_group("--queue")
    queue.add_argument("--profile", help="a profile file, or a name in --profiles-dir")
    profiles_dir_argument(queue)
    queue.add_argument(
        "--stream",
        choices=["both", "audit", "teach"],
        default="both",
        help="which decisions: audit (they certify), teach (they fit), or both in turn",
    )
    items = label.add_argument_group(
        "--queue --items (a new task's first labels, before any decision is logged)"
    )
    items.add_argument(
        "--items",
        type=Path,
        help='a JSONL file of the task\'s unlabelled items, {"text": ..., "id": ...} a line',
    )
    items.add_argument("--task", type=Path, help="the task directory (task.json) they belong to")
    items.add_argument(
        "--split",
        default="labelled",
        help="the labels go to <task>/<split>.jsonl, for judge calibrate --task T --split "
        "SPLIT (default labelled); labelled items are left out when the queue is run again",
    )
    items.add_argument(
        "--audit-share",
        type=float,
        default=0.5,
        help="the share of the items drawn (at random, before any label) for the audit stream",
    )
    items.add_argument("--seed", type=int, default=0, help="the streams' random draw")
    items.add_argument(
        "--refit-every",
        type=positive_int,
        default=10,
        help="fit the profile judge calibrate would fit on the labels so far, in the "
        "background, every N labels (default 10): whether it certifies, and about how many "
        "more audit labels would; a profile that certifies is written to --profiles-dir",
    )
    items.add_argument("--name", help="the profile's name (default: the task's)")
    items.add_argument(
        "--target-precision",
        type=open_probability,
        default=0.9,
        help="the precision its certificate is for (default 0.9), as judge calibrate's",
    )
    items.add_argument(
        "--delta",
        type=open_probability,
        default=0.1,
        help="the certificate's allowed failure probability (default 0.1), as judge calibrate's",
    )
    model_arguments(items)
    batch_size_argument(items)
    label.set_defaults(run=run_label)
    check = commands.add_parser(
        "check",
        help="a profile's health from the decision log; exit 1 on an alarm (for cron or CI)",
        description="Audited precision against the certificate, drift of live traffic from "
        "the calibration data, and the weights, for the profile's current version. Prints "
        "the health as JSON; exits 0 when healthy, 1 when a check fires.",
    )
    check.add_argument(
        "--profile", required=True, help="a profile file, or a name in --profiles-dir"
    )
    check.add_argument("--log", required=True, help=log_help)
    profiles_dir_argument(check)
    check.add_argument(
        "--window", type=positive_int, default=1000, help="newest decisions the drift test reads"
    )
    check.add_argument(
        "--alpha-drift",
        type=open_probability,
        default=0.01,
        help="false-alarm rate of the drift test, per check (default: 0.01)",
    )
    check.add_argument(
        "--alpha-precision",
        type=open_probability,
        default=0.05,
        help="false-alarm rate of the precision check while the certificate holds, over all "
        "checks however often run (0.05)",
    )
    check.add_argument(
        "--alpha-prior",
        type=open_probability,
        default=0.01,
        help="false-alarm rate of the answers' mix check while nothing shifts, over all "
        "checks (0.01)",
    )
    check.add_argument(
        "--since-days", type=positive_number, help="read only the last N days of the log"
    )
    model_arguments(check, dtype_help="(default: the profile's)")
    check.add_argument(
        "--check-model",
        action="store_true",
        help="also load the model (--model, default the embedded one) and compare its weights",
    )
    check.set_defaults(run=run_check)
    replay = commands.add_parser(
        "replay",
        help="re-run a logged decision on today's model and profile and show what changed",
    )
    replay.add_argument("judgment_id", help="the id of a logged decision (its judgment_id)")
    replay.add_argument("--log", required=True, help=log_help)
    profiles_dir_argument(replay)
    model_arguments(replay, dtype_help="(default: the profile's, else auto)")
    replay.set_defaults(run=run_replay)
