"""``judge mcp``: the MCP server (``service.mcp.server``) on stdin/stdout.

Register it with an MCP client as a stdio server whose command is ``judge mcp`` (with the
model and profile options it needs). The model loads once, before the first message is read;
stdout carries the protocol only, so everything else (the model's loading, logs) goes to
stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from calibration import PolicyDefaults
from judge import DEFAULT_PREFIX_CACHE_MB
from service.command_line import (
    DTYPES,
    UsageError,
    audit_rate,
    audit_rates,
    choice_paths_argument,
    megabytes,
    probability,
    stage,
)

if TYPE_CHECKING:
    from service.cascade.cascade_questions import LocalModel

__all__ = ["add_arguments", "run"]

INSTALL = "pip install 'judge[mcp]'"


def add_arguments(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``judge mcp``'s arguments: the model's, and where the profiles are."""
    mcp = commands.add_parser(
        "mcp",
        help=f"serve the judge to MCP clients over stdio ({INSTALL})",
        description="A Model Context Protocol server on stdin/stdout with the tools judge "
        "(one prompt), decide (typed questions about a state) and list_profiles. The model "
        "loads once, at start. Register it with a client as the command `judge mcp`.",
    )
    mcp.add_argument("--model", default=None, help="model id, directory or .gguf")
    choice_paths_argument(mcp)
    mcp.add_argument("--dtype", default="auto", choices=DTYPES)
    mcp.add_argument("--device", default="cpu")
    mcp.add_argument("--profiles-dir", type=Path, default=Path("profiles"))
    mcp.add_argument(
        "--prefix-cache-mb",
        type=megabytes,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="memory for cached prompt prefixes, reused across calls (0: off)",
    )
    mcp.add_argument(
        "--decision-log",
        default=None,
        metavar="FILE|postgresql://...",
        help="append every decision to this log before the tool answers (a SQLite file, or a "
        "PostgreSQL URL), as judge serve --decision-log does: labels, health and replay",
    )
    mcp.add_argument(
        "--log-requests",
        action="store_true",
        help="keep each call's prompt or state in the log, so that judge replay can re-run it",
    )
    mcp.add_argument(
        "--log-features",
        action="store_true",
        help="keep each decision's hidden states in the log (float16; a probe profile's "
        "layers, else the probe's candidate layers), so that judge calibrate --from-log can "
        "fit a probe",
    )
    mcp.add_argument(
        "--audit-rate",
        type=audit_rate,
        action="append",
        default=None,
        metavar="[PROFILE=]RATE",
        help="mark this share of decisions (of PROFILE's, or of all) audit: true, a uniform "
        "sample for people to label, as judge serve --audit-rate does; repeat for each profile",
    )
    mcp.add_argument(
        "--uncertified-threshold",
        type=probability,
        default=None,
        help="OPT-IN, NO GUARANTEE: where no certified threshold exists (no profile, or one "
        "that certified none), accept at this confidence instead of escalating",
    )
    mcp.add_argument(
        "--cascade",
        type=stage,
        action="append",
        default=None,
        metavar="NAME=MODEL|URL",
        help="a later stage of the cascade, in order: a judgment (the judge tool) or a "
        "question (decide) the stages before it escalate goes to it, under the profile P-NAME "
        "(a model loaded here, or another judge server's URL), as judge serve --cascade "
        "sends it",
    )
    mcp.add_argument(
        "--stage-name", default="local", help="this server's model's name as the first stage"
    )
    mcp.set_defaults(run=run)


def _stage_names(first: str, given: list[tuple[str, str]]) -> None:
    """Each stage's name its own, refused before any model loads."""
    names = [first, *(name for name, _ in given)]
    if len(set(names)) != len(names):
        raise UsageError(
            f"each stage needs a name of its own (--stage-name and --cascade), got {names}",
            field="--cascade",
        )


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("mcp") is None:
        raise UsageError(f"`judge mcp` needs the MCP SDK (mcp is not installed): {INSTALL}")
    from judge.engines import open_engine
    from service.mcp.server import create_server
    from service.profiles import ProfileStore

    given: list[tuple[str, str]] = args.cascade or []
    _stage_names(args.stage_name, given)
    # Opened first: a log that cannot be written stops the server before the model loads.
    decision_log = None
    if args.decision_log is not None:
        from service.log.decision_log import DecisionLogError, open_log

        try:
            decision_log = open_log(args.decision_log)
        except DecisionLogError as exc:
            raise UsageError(f"--decision-log: {exc}") from None
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the protocol's alone
        engine = open_engine(
            args.model,
            dtype=args.dtype,
            device=args.device,
            prefix_cache_mb=args.prefix_cache_mb,
            choice_paths=args.choice_paths,
        )
        cascade = _load_stages(given, engine.dtype)
    server = create_server(
        engine,
        ProfileStore(args.profiles_dir),
        defaults=PolicyDefaults(uncertified_threshold=args.uncertified_threshold),
        decision_log=decision_log,
        log_requests=args.log_requests,
        log_features=args.log_features,
        **audit_rates(args.audit_rate or []),
        cascade=cascade,
        stage_name=args.stage_name,
    )
    try:
        server.run("stdio")
    finally:
        if decision_log is not None:
            decision_log.close()
    return 0


def _load_stages(given: list[tuple[str, str]], dtype: str) -> dict[str, LocalModel | str]:
    """The later stages, in order: a URL as it is, a model loaded (in the first's dtype)."""
    from judge.engines import open_engine
    from service.cascade.cascade_questions import LocalModel
    from service.cascade.remote_stage import is_remote

    return {
        name: target if is_remote(target) else LocalModel(open_engine(target, dtype=dtype))  # type: ignore[arg-type]
        for name, target in given
    }
