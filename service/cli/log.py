"""The commands that read the decision log (``service.decision_log``), for people and for cron.

judge label --log L --input labels.jsonl     store true labels, {"judgment_id", "label"} a line
judge check --profile P --log L              exit 1 when the profile's health check fails
judge replay ID --log L                      re-run a logged decision on today's model, profile
judge calibrate --from-log L --profile P     refit P on its audited, labeled decisions

``check`` is ``service.health.assess``, the same as ``GET /profiles/{name}/health``: it exits
0 when healthy, 1 when the audit labels contradict the certificate, the drift test fires or
the model no longer matches, and 2 on a usage error. ``calibrate --from-log`` fits from the
logged log-probabilities of the audit sample only: the uniform share of traffic, so its
certificate rests on items exchangeable with the traffic (labels given to escalated items
alone would certify the wrong population).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from service.cli.common import UsageError, to_json

if TYPE_CHECKING:
    from calibration import CalibrationProfile
    from service.decision_log import DecisionLog, LoggedDecision
    from service.profiles import ProfileStore

__all__ = ["run_check", "run_from_log", "run_label", "run_replay"]


class _LabelLine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    judgment_id: str
    label: str


def _open(target: str) -> DecisionLog:
    from service.decision_log import DecisionLogError, open_log

    try:
        return open_log(target)
    except DecisionLogError as exc:
        raise UsageError(f"--log: {exc}") from None


def _stored(profile: str, profiles_dir: Path) -> tuple[CalibrationProfile, str, ProfileStore]:
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
    """Store the labels of a JSONL file; every line is checked before any is stored."""
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
    from service.decision_log import LabelFailure

    with _open(args.log) as log:
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


def run_check(args: argparse.Namespace) -> int:
    """The profile's health from the log: exit 0 healthy, 1 when any check fires."""
    import time

    from service.health import profile_health

    profile, etag, _ = _stored(args.profile, args.profiles_dir)
    current = None
    if args.model is not None or args.check_model:
        from service.cli.common import load_engine

        current = load_engine(args, profile).model_sha256
    since = None if args.since_days is None else time.time() - args.since_days * 86400
    with _open(args.log) as log:
        health = profile_health(
            log,
            profile,
            etag,
            window=args.window,
            alpha_drift=args.alpha_drift,
            alpha_precision=args.alpha_precision,
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
    return 0 if health.healthy else 1


def run_replay(args: argparse.Namespace) -> int:
    """Re-run a logged decision on the model and profile of today; print then, now, changes."""
    from calibration import make_policy
    from judge import Query
    from service.cli.common import load_engine

    with _open(args.log) as log:
        record = log.get(args.judgment_id)
    if record is None:
        raise UsageError(f"no decision {args.judgment_id!r} in the log {args.log}")
    if record.request is None:
        raise UsageError(
            f"decision {args.judgment_id} was logged without its request (the server was not "
            "started with --log-requests), so there is nothing to re-run"
        )
    request: dict[str, Any] = record.request
    query = msgspec.convert(request["query"], type=Query)
    profile = etag = None
    if request.get("profile") is not None:
        profile, etag, _ = _stored(request["profile"], args.profiles_dir)
    engine = load_engine(args, profile)
    if profile is not None:
        profile.check(
            engine.fingerprint(
                system=query.system,
                response_prefix=query.response_prefix,
                response_suffix=query.response_suffix,
            ),
            choices=query.choices,
        )
    policy = make_policy(
        profile,
        threshold=request.get("threshold"),
        min_choice_mass=request.get("min_choice_mass"),
        max_std=request.get("max_std"),
        values=request.get("values"),
        profile_etag=etag,
    )
    if policy.feature_layers:
        query = msgspec.structs.replace(query, feature_layers=policy.feature_layers)
    judgment = engine.judge_batch([query])[0]
    decision = policy.decide(judgment)
    then = _view(record)
    now = {
        "decision": decision.decision,
        "choice": decision.choice,
        "confidence": decision.confidence,
        "probabilities": decision.probabilities,
        "log_probs": dict(zip(judgment.choices, judgment.log_probs, strict=True)),
        "reason_codes": list(decision.reason_codes),
        "tokens_sha256": judgment.tokens_sha256,
        "model_sha256": judgment.model_sha256,
        "policy_sha256": decision.policy_sha256,
        "profile_etag": decision.profile_etag,
    }
    changed = [key for key in now if now[key] != then[key]]
    print(
        to_json(
            {"judgment_id": record.judgment_id, "then": then, "now": now, "changed": changed},
            indent=2,
        )
    )
    return 0


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
    """``judge calibrate --from-log``: a new version of a profile, fitted on the logged
    log-probabilities of its audited, labeled decisions (every version's, same weights)."""
    from calibration import MIN_EXAMPLES, fit_profile
    from calibration.profile import NAME_PATTERN

    if args.profile is None:
        raise UsageError("calibrate --from-log: name the profile to refit with --profile")
    methods = args.methods or ([args.method] if args.method else "auto")
    if "probe" in methods:
        raise UsageError(
            "calibrate --from-log: a probe reads hidden states, which the log does not keep; "
            "refit it with judge calibrate --task, or choose --method temperature"
        )
    profile, _, store = _stored(args.profile, args.profiles_dir)
    name = args.name or profile.name
    import re

    if not re.fullmatch(NAME_PATTERN, name):
        raise UsageError(f"profile name {name!r} must match {NAME_PATTERN}")
    with _open(args.from_log) as log:
        records = log.decisions(profile=profile.name, audit=True, labeled=True)
    weights = profile.fingerprint.model_sha256
    other = {r.model_sha256 for r in records} - {weights}
    if weights is not None and other:
        raise UsageError(
            f"the audited decisions of {profile.name!r} were made with other weights too "
            f"({', '.join(sorted(s[:12] for s in other))}) than the profile's ({weights[:12]}): "
            "their log-probabilities are not comparable; refit with judge calibrate --task"
        )
    if len(records) < MIN_EXAMPLES:
        raise UsageError(
            f"the log holds {len(records)} audited, labeled decisions of {profile.name!r}; a "
            f"profile needs at least {MIN_EXAMPLES} (raise --audit-rate, or label more)"
        )
    index = {c: j for j, c in enumerate(profile.choices)}
    z = np.array(
        [
            [dict(zip(r.choices, r.log_probs, strict=True))[c] for c in profile.choices]
            for r in records
        ]
    )
    y = np.array([index[r.label] for r in records if r.label is not None])
    digest = hashlib.sha256(
        msgspec.json.encode([[r.judgment_id, r.label] for r in records])
    ).hexdigest()
    refit = fit_profile(
        name,
        z,
        y,
        profile.choices,
        fingerprint=profile.fingerprint,
        choice_mass=np.array([r.choice_mass for r in records]),
        dataset=f"decision log {args.from_log}: {len(records)} audited decisions of {profile.name}",
        dataset_sha256=digest,
        target_precision=args.target_precision,
        delta=args.delta,
        alpha=args.alpha,
        values=profile.values,
        max_std=args.max_std if args.max_std is not None else profile.max_std,
        methods=methods,
    )
    etag = store.put(refit)
    t = refit.threshold
    print(f"profile {name}: {refit.note}")
    print(
        f"threshold: {t.threshold:.3f}, coverage {t.coverage:.3f} (on the certify split)"
        if t.threshold is not None
        else f"no certified threshold: {t.reason}"
    )
    print(f"wrote {store.directory / name}.json (ETag {etag})")
    return 0
