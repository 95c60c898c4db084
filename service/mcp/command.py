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

from judge import DEFAULT_PREFIX_CACHE_MB
from service.command_line import (
    UsageError,
    add_settings,
    check_stage_names,
    choice_paths_argument,
    device_argument,
    dtype_argument,
    load_stages,
    megabytes,
    profiles_dir_argument,
    settings_of,
    stage,
)
from service.config import ServiceConfig
from service.install import install_hint

__all__ = ["add_arguments", "run"]

# The server's settings judge mcp takes (service.config.ServiceConfig), with judge serve's flags.
SETTINGS = (
    "decision_log",
    "log_requests",
    "log_features",
    "log_max_age_days",
    "log_max_rows",
    "audit_rate",
    "audit_rates",
    "uncertified_threshold",
    "min_choice_mass",
)
INSTALL = install_hint("mcp")


def add_arguments(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``judge mcp``'s arguments: the model's, and where the profiles are."""
    mcp = commands.add_parser(
        "mcp",
        help="serve the judge to MCP clients over stdio (the mcp extra)",
        description="A Model Context Protocol server on stdin/stdout with the tools judge "
        "(one prompt), decide (typed questions about a state) and list_profiles. The model "
        "loads once, at start. Register it with a client as the command `judge mcp`.",
    )
    mcp.add_argument("--model", default=None, help="model id, directory or .gguf")
    choice_paths_argument(mcp)
    dtype_argument(mcp)
    device_argument(mcp)
    profiles_dir_argument(mcp)
    mcp.add_argument(
        "--prefix-cache-mb",
        type=megabytes,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="memory for cached prompt prefixes, reused across calls (0: off)",
    )
    # The settings it shares with judge serve, with judge serve's flags, defaults and checks:
    # the decision log (retention included), the audit rate, the opt-in and the choice mass.
    add_settings(
        {
            None: mcp,
            "log": mcp.add_argument_group(
                "the decision log (feedback, audit, health)",
                "Every decision appended before the tool answers, as judge serve appends its own.",
            ),
        },
        SETTINGS,
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


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("mcp") is None:
        raise UsageError(f"`judge mcp` needs the MCP SDK (mcp is not installed): {INSTALL}")
    from judge.engines import open_engine
    from service.mcp.server import create_server
    from service.profiles import ProfileStore

    given: list[tuple[str, str]] = args.cascade or []
    check_stage_names(args.stage_name, given)
    settings = settings_of(args, SETTINGS)
    try:  # checked as judge serve checks them
        config = ServiceConfig(**settings)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    # Opened first: a log that cannot be written stops the server before the model loads.
    decision_log = None
    if config.decision_log is not None:
        from service.log.backends import open_log
        from service.log.decision_log import DecisionLogError, Retention

        retention = Retention(max_age_days=config.log_max_age_days, max_rows=config.log_max_rows)
        try:
            decision_log = open_log(config.decision_log, retention=retention)
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
        cascade = load_stages(given, engine.dtype)
    server = create_server(
        engine,
        ProfileStore(args.profiles_dir),
        defaults=config.policy_defaults,
        decision_log=decision_log,
        log_requests=config.log_requests,
        log_features=config.log_features,
        audit_rate=config.audit_rate,
        audit_rates=config.audit_rates,
        cascade=cascade,
        stage_name=args.stage_name,
    )
    try:
        server.run("stdio")
    finally:
        if decision_log is not None:
            decision_log.close()
    return 0
