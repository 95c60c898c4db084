"""Command line.

judge ask "PROMPT" --choice A --choice B      judge one prompt; print the decision as JSON
judge ask --input items.jsonl --profile FILE  gate a JSONL file of prompts, one JSON line each
judge calibrate --task DIR                    fit a calibration profile on a labeled task
judge calibrate --task DIR --unlabeled batch  fit a label-free prior correction (no labels)
judge evaluate --task DIR --profile FILE      measure the served policy on a held-out split
judge qualify [MODEL] --data DIR              measure a model before trusting it (exit 1: misses)
judge serve                                   run the HTTP service
judge decide --state FILE --question ID=JSON  typed questions about a state; print the answers
judge mcp                                     a Model Context Protocol server over stdio
judge label --queue --items F --task DIR     label a file's items one key at a time, to a certificate
judge label --log L --input labels.jsonl      store the true labels of logged decisions
judge estimate --log L --profile P            each choice's share and the judge's accuracy (PPI++)
judge check --profile P --log L               a profile's health from the log (exit 1: alarm)
judge replay ID --log L                       re-run a logged decision on today's model
judge calibrate --from-log L --profile P      refit a profile on its audited decisions

Every command needs the server's dependencies (the engine, the fitters, the decision log's
readers): without them (the client's install, ``pip install calibrated-judge``) it stops with one line
that says to install them.
``judge --help`` and ``judge COMMAND --help`` need none of them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence

from calibration import CalibrationError
from calibration.tasks import TaskError
from judge import JudgeError
from service.command_line import UsageError
from service.install import install_hint
from service.log.decision_log import DecisionLogError

__all__ = ["COMMAND_MODULES", "SERVER_MODULES", "main", "parser"]

# What the commands import that the client's install lacks: the `server` extra's.
SERVER_MODULES = ("torch", "transformers", "scipy", "sklearn", "litestar", "uvicorn")

# The modules that declare the commands, in the order `judge --help` lists them. Each has
# ``add_arguments(commands)``: it adds its commands, their arguments and the function that
# runs each (``set_defaults(run=...)``). None imports torch until a command runs.
COMMAND_MODULES = (
    "service.cli.ask",  # ask
    "service.cli.decide",  # decide
    "service.cli.log",  # label, check, replay
    "service.cli.calibrate",  # calibrate (and calibrate --from-log), evaluate
    "service.cli.estimate",  # estimate
    "service.cli.qualify",  # qualify
    "service.web.command",  # serve: the HTTP front
    "service.mcp.command",  # mcp: the MCP front
)


def parser() -> argparse.ArgumentParser:
    """The ``judge`` argument parser, with one subcommand per command."""
    root = argparse.ArgumentParser(
        prog="judge", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = root.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        importlib.import_module(module).add_arguments(commands)
    return root


def _check_ask(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Argument combinations argparse cannot express; each is a usage error (exit 2)."""
    if (args.prompt is None) == (args.input is None):
        parser.error("ask: give one PROMPT or --input FILE (not both)")
    if args.output is not None and args.input is None:
        parser.error("ask: --output goes with --input")
    if args.choice is not None and len(args.choice) < 2 and args.profile is None:
        parser.error("ask: give at least two choices (--choice A --choice B)")
    if args.choice is None and args.profile is None and args.input is None:
        parser.error("ask: give the choices (--choice A --choice B) or a --profile")


# command -> its checks of the parsed arguments, before anything is loaded
_CHECKS: dict[str, Callable[[argparse.ArgumentParser, argparse.Namespace], None]] = {
    "ask": _check_ask
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit status (2: usage, profile or input error)."""
    root = parser()
    args = root.parse_args(argv)
    check = _CHECKS.get(args.command)
    if check is not None:
        check(root, args)
    missing = [name for name in SERVER_MODULES if not _installed(name)]
    if missing:  # after parsing: --help, and a usage error, need none of them
        print(
            f"judge: error: `judge {args.command}` needs the server's dependencies "
            f"({', '.join(missing)} not installed): {install_hint('server')}",
            file=sys.stderr,
        )
        return 2
    try:
        status: int = args.run(args)
        return status
    except (JudgeError, CalibrationError, TaskError, UsageError, DecisionLogError) as exc:
        field = getattr(exc, "field", None)
        where = f" ({field})" if isinstance(field, str) else ""
        print(f"judge: error{where}: {exc}", file=sys.stderr)
        return 2


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
        return False


if __name__ == "__main__":
    sys.exit(main())
