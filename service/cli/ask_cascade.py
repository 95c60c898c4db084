"""``judge ask --cascade NAME=MODEL|URL ...``: what the first model escalates goes to the next.

The command's own model is the first stage (``--stage-name``, default "local"), batched and
decided as without a cascade. Each item it escalates goes to the later stages in turn, as
``judge serve --cascade`` sends it (``service.cascade.escalation.escalated``): a model loaded
here (a .gguf, directory or hub id, or a packaged name such as gemma3-270m), decided by its
own gate, or another judge server (``service.cascade.stages``). A later stage judges the prompt
with its own chat template (not ``--system``) and the command's ``--threshold`` and
``--min-choice-mass``; ``--stage-profile NAME=FILE`` gives a local stage its profile (for a
remote one, ``NAME=PROFILE``: the profile's name in that server's store). A stage that fails
is an escalation with a reason code in the row's ``cascade``, never an error of the line.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from calibration import CalibrationProfile, Gate, Overrides, Verdict
from service import command_line as common
from service.gate_context import NO_LOG
from service.schemas import JudgeResponse

if TYPE_CHECKING:
    from judge import Judgment, Query
    from service.cascade.stages import LocalModel, LocalStage, RemoteStage

# The cascade's machinery (service.cascade, shared with the servers) is imported where a cascade
# is asked for, so that `judge ask --help` needs none of the server's packages.

__all__ = ["LaterStages", "add_arguments", "plan"]


@dataclass(frozen=True)
class _Given:
    """A later stage as the flags name it (``--cascade``, ``--stage-profile``)."""

    name: str
    target: str
    profile: CalibrationProfile | None  # a local stage's
    remote_profile: str | None  # a remote stage's, by name in its server's store


@dataclass(frozen=True)
class LaterStages:
    """The later stages, checked before any model loads; ``load`` loads the local ones."""

    first: str
    stages: list[_Given]
    overrides: Overrides
    models: dict[str, tuple[LocalModel, Gate]]

    def load(self, dtype: str | None, choices: Sequence[str] | None) -> None:
        """Load each local stage's model and open its gate, checked against the model and
        ``choices`` (None: the profile's, else any), before any item is judged."""
        from judge.engines import open_engine
        from judge.server_engine import is_server_model
        from service.cascade.stages import LocalModel, is_remote

        for stage in self.stages:
            if is_remote(stage.target):
                continue
            engine = open_engine(
                stage.target,
                dtype=None
                if is_server_model(stage.target)
                else common.profile_dtype(dtype, stage.profile),
            )
            gate = NO_LOG.open_profile(stage.profile, self.overrides)
            gate.check_engine(engine, choices=choices, field=f"--stage-profile {stage.name}")
            self.models[stage.name] = (LocalModel(engine), gate)

    def opened(self) -> list[LocalStage | RemoteStage]:
        """One item's later stages (each keeps what it answered)."""
        from service.cascade.stages import LocalStage, RemoteStage, is_remote

        stages: list[LocalStage | RemoteStage] = []
        for given in self.stages:
            if is_remote(given.target):
                key = os.environ.get("JUDGE_API_KEY") or None
                stages.append(
                    RemoteStage(given.name, given.target, given.remote_profile, self.overrides, key)
                )
            else:
                model, gate = self.models[given.name]
                stages.append(LocalStage(given.name, model.engine, gate, model.lock))
        return stages

    def decide(
        self, query: Query, judgment: Judgment, verdict: Verdict, gate: Gate
    ) -> JudgeResponse:
        """The cascade's response to an item the first stage judged: its own where it
        accepted, else the later stages' (``escalated``)."""
        from calibration.cascade import StageItem
        from service.cascade.escalation import escalated

        item = StageItem(query.prompt, list(query.choices), query.item_span)
        response, _ = NO_LOG.respond(
            judgment, verdict, gate, model=judgment.model, choices=item.choices
        )
        escalation = escalated(self.first, verdict, judgment, item.choices, self.opened(), item)
        return escalation.staged(response)


def plan(args: argparse.Namespace, overrides: Overrides) -> LaterStages | None:
    """The later stages ``--cascade`` names, their profiles read; None without a cascade.
    Refused before any model loads: a stage without a name of its own, a profile for a stage
    not in the cascade."""
    given: list[tuple[str, str]] = args.cascade or []
    if not given:
        if args.stage_profile:
            raise common.UsageError("--stage-profile needs --cascade", field="--stage-profile")
        return None
    common.check_stage_names(args.stage_name, given)
    profiles = dict(args.stage_profile or [])
    unknown = sorted(set(profiles) - {name for name, _ in given})
    if unknown:
        raise common.UsageError(
            f"--stage-profile names {unknown[0]!r}, which is not a --cascade stage",
            field="--stage-profile",
        )
    from service.cascade.stages import is_remote

    stages = []
    for name, target in given:
        value = profiles.get(name)
        remote = is_remote(target)
        stages.append(
            _Given(
                name=name,
                target=target,
                profile=None if remote or value is None else common.load_profile(value),
                remote_profile=value if remote else None,
            )
        )
    return LaterStages(args.stage_name, stages, overrides, {})


def _named(text: str) -> tuple[str, str]:
    """An argparse type for ``--stage-profile``: ``NAME=FILE`` or ``NAME=PROFILE``."""
    name, sep, value = text.partition("=")
    if not (sep and name and value):
        raise argparse.ArgumentTypeError(f"give NAME=FILE or NAME=PROFILE, got {text!r}")
    return name, value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The cascade's flags on ``judge ask``."""
    parser.add_argument(
        "--cascade",
        type=common.stage,
        action="append",
        metavar="NAME=MODEL|URL",
        help="a later stage, in order: what the stages before it escalate goes to it; a model "
        "(a .gguf, directory, hub id or packaged name) or another judge server's URL",
    )
    parser.add_argument(
        "--stage-name", default="local", help="this command's model's name as the first stage"
    )
    parser.add_argument(
        "--stage-profile",
        type=_named,
        action="append",
        metavar="NAME=FILE|PROFILE",
        help="a later stage's profile: a JSON file for a model, a profile's name in the "
        "server's store for a URL",
    )
