"""Command line.

judge ask "PROMPT" --choice A --choice B      judge one prompt; print the decision as JSON
judge ask --input items.jsonl --profile FILE  gate a JSONL file of prompts, one JSON line each
judge calibrate --task DIR                    fit a calibration profile on a labeled task
judge calibrate --task DIR --unlabeled batch  fit a label-free prior correction (no labels)
judge evaluate --task DIR --profile FILE      measure the served policy on a held-out split
judge serve                                   run the HTTP service
judge decide --state FILE --question ID=JSON  typed questions about a state; print the answers
judge mcp                                     a Model Context Protocol server over stdio
judge label --log L --input labels.jsonl      store the true labels of logged decisions
judge check --profile P --log L               a profile's health from the log (exit 1: alarm)
judge replay ID --log L                       re-run a logged decision on today's model
judge calibrate --from-log L --profile P      refit a profile on its audited decisions

Every command runs the model, so each needs the server's dependencies: without them (the
client's install, ``pip install judge``) it stops with one line that says to install them.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from calibration import CalibrationError
from calibration.probe import MIN_PROBE_EXAMPLES
from calibration.tasks import TaskError
from judge import (
    DEFAULT_PREFIX_CACHE_MB,
    DEFAULT_RESPONSE_PREFIX,
    DEFAULT_RESPONSE_SUFFIX,
    JudgeError,
)
from judge.packing import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_BATCH_TOKENS
from service.decision_log import DecisionLogError

__all__ = ["SERVER_MODULES", "main", "parser"]

# What the commands import that the client's install lacks: the `server` extra's.
SERVER_MODULES = ("torch", "transformers", "scipy", "sklearn", "litestar", "uvicorn")


def parser() -> argparse.ArgumentParser:
    """The ``judge`` argument parser, with one subcommand per command."""
    from service.cli.common import (  # here: it loads the engine's modules (torch)
        DTYPES,
        audit_rate,
        megabytes,
        open_probability,
        positive_int,
        positive_number,
        probability,
        seconds,
    )

    root = argparse.ArgumentParser(
        prog="judge", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = root.add_subparsers(dest="command", required=True)

    ask = commands.add_parser(
        "ask",
        help="judge a prompt (or a JSONL file of them) and print the decisions as JSON",
        description="Print the decision (accept or escalate, with reasons) and the judgment "
        "behind it. Give one PROMPT, or --input with one JSON object per line: "
        '{"prompt": "...", "choices": [...] (optional), "id": ... (optional)}.',
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
        help="accept at this calibrated confidence or above (default: the profile's certified "
        "threshold; 0.9 without a profile); overriding drops the certification",
    )
    ask.add_argument(
        "--min-choice-mass",
        type=probability,
        help="escalate when the choices' share of the next-token distribution is below this "
        "(default: the profile's; 0 without a profile)",
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
    _model_arguments(ask, dtype_help="(default: the profile's, else auto)")
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

    _decide_arguments(commands)
    _log_arguments(commands)

    fit = commands.add_parser(
        "calibrate", help="fit a calibration profile on a task's labeled data"
    )
    _task_arguments(fit, split="calibration", required=False)
    fit.add_argument(
        "--from-log",
        metavar="LOG",
        help="instead of --task: refit --profile on the audited, labeled decisions of this "
        "decision log (a SQLite file or a postgresql:// URL), from their logged scores",
    )
    fit.add_argument(
        "--profile", help="with --from-log: the profile to refit (a name in --profiles-dir)"
    )
    fit.add_argument("--name", help="profile name (default: the task's name)")
    fit.add_argument("--profiles-dir", type=Path, default=Path("profiles"))
    fit.add_argument(
        "--target-precision",
        type=open_probability,
        default=0.9,
        help="precision to certify on accepted items",
    )
    fit.add_argument(
        "--delta", type=open_probability, default=0.1, help="allowed failure probability"
    )
    fit.add_argument(
        "--alpha", type=open_probability, default=0.1, help="conformal miscoverage level"
    )

    def std_bound(text: str) -> float:
        value = float(text)
        if not (value >= 0 and value != float("inf")):
            raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
        return value

    fit.add_argument(
        "--max-std",
        type=std_bound,
        help="score tasks: escalate when the calibrated std of the value exceeds this",
    )
    fit.add_argument(
        "--method",
        choices=["auto", "temperature", "bias_temperature", "probe"],
        help="the calibration map: auto (default) chooses between temperature, "
        "bias_temperature and probe (a learned head on the model's hidden state) by "
        f"cross-validated NLL; the probe is tried from {MIN_PROBE_EXAMPLES} labeled examples",
    )
    fit.add_argument(
        "--methods",
        nargs="+",
        choices=["temperature", "batch_temperature", "bias_temperature", "probe"],
        help="instead of --method: the labeled candidates chosen between by cross-validated NLL",
    )
    fit.add_argument(
        "--unlabeled",
        nargs="?",
        const="batch",
        choices=["contextual", "batch"],
        help="fit a label-free prior correction instead: contextual (content-free inputs in "
        "the task's prompt) or batch (default: the split's texts, labels ignored, or --input)",
    )
    fit.add_argument(
        "--input",
        type=Path,
        help='with --unlabeled batch: a JSONL file of unlabeled prompts, {"prompt": ...} a line',
    )

    ev = commands.add_parser(
        "evaluate", help="measure the served policy of a profile on a held-out split"
    )
    _task_arguments(ev, split="test", dtype=False)
    ev.add_argument("--profile", type=Path, required=True, help="a profile JSON file")
    ev.add_argument("--threshold", type=probability, help="evaluate with this threshold instead")
    ev.add_argument(
        "--min-choice-mass", type=probability, help="evaluate with this minimum choice mass"
    )
    ev.add_argument(
        "--max-std", type=std_bound, help="evaluate with this bound on a score's std instead"
    )
    ev.add_argument("--report", type=Path, help="also write a markdown report here")
    ev.add_argument("--json", type=Path, help="also write the evaluation as JSON here")

    # No abbreviations: `--api-key KEY` must not pass for `--api-key-file KEY`.
    serve = commands.add_parser(
        "serve", help="run the HTTP service (POST /judge)", allow_abbrev=False
    )
    serve.add_argument("--model", default=None, help="model id, directory or .gguf")
    serve.add_argument("--dtype", default="auto", choices=DTYPES)
    serve.add_argument("--device", default="cpu")
    serve.add_argument(
        "--batch-variant",
        action="store_true",
        help="faster arithmetic, without the guarantee that a judgment's probabilities do "
        "not depend on its batch or the prefix cache (in bfloat16 they move by up to 0.02)",
    )
    serve.add_argument(
        "--generic-pass",
        action="store_true",
        help="run the model's own decoder instead of the lean pass that Llama-family models "
        "take (slower; as exact; for comparison)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--profiles-dir", type=Path, default=Path("profiles"))
    # The engine's own defaults (judge.packing): the server packs to the numbers it passes on.
    serve.add_argument(
        "--max-batch-size",
        type=positive_int,
        default=DEFAULT_MAX_BATCH_SIZE,
        help=f"judgments per forward pass (default: {DEFAULT_MAX_BATCH_SIZE})",
    )
    serve.add_argument(
        "--max-batch-tokens",
        type=positive_int,
        default=DEFAULT_MAX_BATCH_TOKENS,
        help="tokens per forward pass, so no pass holds the model for long "
        f"(default: {DEFAULT_MAX_BATCH_TOKENS})",
    )
    serve.add_argument(
        "--max-request-tokens",
        type=positive_int,
        default=4096,
        help="tokens one judgment (a request, a batch item, a shared question with its "
        "context) may feed the model; larger ones get a 413 before any work (default: 4096, "
        "about 3-4 s on 2 CPU cores)",
    )
    serve.add_argument(
        "--max-questions",
        type=positive_int,
        default=64,
        help="questions one POST /v1/systemone may ask; more get a 413 (default: 64)",
    )
    serve.add_argument("--max-wait-ms", type=seconds, default=5.0, help="wait for a batch to fill")
    serve.add_argument(
        "--max-queue",
        type=positive_int,
        default=64,
        help="requests needing the model admitted at once; the rest wait at the door (64)",
    )
    serve.add_argument(
        "--admission-wait",
        type=seconds,
        default=2.0,
        help="seconds a request waits at the door for a slot before its 503 (default: 2)",
    )
    serve.add_argument(
        "--request-timeout",
        type=seconds,
        default=60.0,
        help="seconds a judgment request may take; clients may ask for less with the "
        "X-Request-Timeout header (default: 60)",
    )
    serve.add_argument(
        "--fit-timeout", type=seconds, default=1800.0, help="the same for a fit (default: 1800)"
    )
    serve.add_argument(
        "--read-timeout",
        type=seconds,
        default=30.0,
        help="seconds a client may take to send its body, else 408 (default: 30)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=20.0,
        help="on SIGTERM or Ctrl-C, seconds to finish requests in flight before cancelling "
        "them (default: 20, within the usual 30 s grace period)",
    )
    serve.add_argument("--max-body-bytes", type=positive_int, default=1_000_000)
    serve.add_argument("--default-threshold", type=probability, default=0.9)
    serve.add_argument("--min-choice-mass", type=probability, default=0.0)
    serve.add_argument(
        "--prefix-cache-mb",
        type=megabytes,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="memory for cached prompt prefixes, reused across requests (0: off)",
    )
    serve.add_argument(
        "--api-key-file",
        type=Path,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health, KEY being "
        "this file's first line (default: $JUDGE_API_KEY; neither: no auth). A key is not "
        "taken on the command line, where any user can read it in `ps`.",
    )
    serve.add_argument("--log-level", default="info")
    logged = serve.add_argument_group(
        "the decision log (feedback, audit, health)",
        "Every decision appended to a database before its response is sent; labels taken at "
        "POST /judgments/{id}/label and POST /labels; each profile's health at "
        "GET /profiles/{name}/health and /metrics.",
    )
    logged.add_argument(
        "--decision-log",
        metavar="TARGET",
        help="a SQLite file (created if missing) or a postgresql:// URL (pip install "
        "'judge[postgres]'), shared by every replica",
    )
    logged.add_argument(
        "--log-requests",
        action="store_true",
        help="keep each decision's request (its prompt text) too, for judge replay",
    )
    logged.add_argument(
        "--log-max-age-days",
        type=positive_number,
        default=90.0,
        help="delete logged decisions older than this (default: 90)",
    )
    logged.add_argument(
        "--log-max-rows",
        type=positive_int,
        default=1_000_000,
        help="keep at most this many logged decisions, the newest (default: 1,000,000)",
    )
    logged.add_argument(
        "--audit-rate",
        action="append",
        metavar="[PROFILE=]RATE",
        type=audit_rate,
        help="mark this share of decisions (of PROFILE's, or of all) audit: true, a uniform "
        "sample for people to label; repeat for each profile (default: 0)",
    )
    scale = serve.add_argument_group(
        "scaling out on Ray Serve (pip install -e '.[ray]')",
        "Replicas of the service behind one endpoint, each with its own model; profiles are "
        "shared through --profiles-dir, which every replica must reach.",
    )
    scale.add_argument("--ray", action="store_true", help="serve with Ray Serve replicas")
    scale.add_argument(
        "--replicas", type=positive_int, help="a fixed number of replicas (default: 1)"
    )
    scale.add_argument(
        "--min-replicas", type=int, help="autoscale: at least this many replicas (0 allowed)"
    )
    scale.add_argument("--max-replicas", type=positive_int, help="autoscale: at most this many")
    scale.add_argument(
        "--target-ongoing-requests",
        type=float,
        help="autoscale: requests in flight per replica that Ray aims for",
    )
    scale.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs reserved per replica (default: 1)"
    )
    scale.add_argument(
        "--ray-address",
        help="join this Ray cluster (e.g. ray://head:10001 or auto); default: start a local one",
    )
    mcp = commands.add_parser(
        "mcp",
        help="serve the judge to MCP clients over stdio (pip install 'judge[mcp]')",
        description="A Model Context Protocol server on stdin/stdout with the tools judge "
        "(one prompt), decide (typed questions about a state) and list_profiles. The model "
        "loads once, at start. Register it with a client as the command `judge mcp`.",
    )
    mcp.add_argument("--model", default=None, help="model id, directory or .gguf")
    mcp.add_argument("--dtype", default="auto", choices=DTYPES)
    mcp.add_argument("--device", default="cpu")
    mcp.add_argument("--profiles-dir", type=Path, default=Path("profiles"))
    mcp.add_argument(
        "--prefix-cache-mb",
        type=megabytes,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="memory for cached prompt prefixes, reused across calls (0: off)",
    )
    return root


def _decide_arguments(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from judge.decisions import MAX_ORDERINGS
    from service.cli.common import positive_int

    decide = commands.add_parser(
        "decide",
        help="answer typed questions (yes/no, one of options, a score) about a state",
        description="Answer typed questions about one state in one run of the model and "
        "print one JSON object, id -> answer. A question is "
        '{"type": "noul" | "choice" | "score", "instructions": ..., "criteria": ...}.',
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
    decide.add_argument("--profiles-dir", type=Path, default=Path("profiles"))
    _model_arguments(decide, dtype_help="(default: the first profile's, else auto)")


def _log_arguments(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from service.cli.common import open_probability, positive_int, positive_number

    log_help = "the decision log: a SQLite file or a postgresql:// URL"
    label = commands.add_parser(
        "label",
        help="store the true labels of logged decisions from a JSONL file",
        description='Each line: {"judgment_id": "...", "label": "..."}. Every line is read '
        "before any is stored; exit 1 if any label was refused (unknown id, not a choice, "
        "another label already and no --replace).",
    )
    label.add_argument("--log", required=True, help=log_help)
    label.add_argument("--input", required=True, help="the JSONL file ('-' for stdin)")
    label.add_argument(
        "--replace", action="store_true", help="change labels given before (else refused)"
    )
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
    check.add_argument("--profiles-dir", type=Path, default=Path("profiles"))
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
        help="false-alarm rate of the precision check while the certificate holds (0.05)",
    )
    check.add_argument(
        "--since-days", type=positive_number, help="read only the last N days of the log"
    )
    _model_arguments(check, dtype_help="(default: the profile's)")
    check.set_defaults(model=None)
    check.add_argument(
        "--check-model",
        action="store_true",
        help="also load the model (--model, default the embedded one) and compare its weights",
    )
    replay = commands.add_parser(
        "replay",
        help="re-run a logged decision on today's model and profile and show what changed",
    )
    replay.add_argument("judgment_id")
    replay.add_argument("--log", required=True, help=log_help)
    replay.add_argument("--profiles-dir", type=Path, default=Path("profiles"))
    _model_arguments(replay, dtype_help="(default: the profile's, else auto)")


def _model_arguments(parser: argparse.ArgumentParser, *, dtype_help: str = "") -> None:
    from service.cli.common import DTYPES

    parser.add_argument(
        "--model",
        default=None,
        help="model id, directory or .gguf (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--dtype", default=None, choices=DTYPES, help=dtype_help or None)
    parser.add_argument("--device", default="cpu")


def _task_arguments(
    parser: argparse.ArgumentParser, *, split: str, dtype: bool = True, required: bool = True
) -> None:
    from service.cli.common import DTYPES, positive_int

    parser.add_argument(
        "--task", type=Path, required=required, help="task directory with task.json"
    )
    parser.add_argument("--split", default=split, help=f"which <split>.jsonl (default: {split})")
    parser.add_argument("--limit", type=positive_int, help="use only the first N items")
    parser.add_argument("--model", default=None, help="model id, directory or .gguf")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    if dtype:
        parser.add_argument("--dtype", default="auto", choices=DTYPES)


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


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit status (2: usage, profile or input error)."""
    missing = [name for name in SERVER_MODULES if not _installed(name)]
    if missing:  # before the parser, which loads the engine's modules
        words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
        command = " ".join(["judge", *words[:1]])
        print(
            f"judge: error: `{command}` needs the server's dependencies "
            f"({', '.join(missing)} not installed): pip install 'judge[server]'",
            file=sys.stderr,
        )
        return 2
    from service.cli.common import UsageError

    root = parser()
    args = root.parse_args(argv)
    try:
        if args.command == "ask":
            _check_ask(root, args)
            from service.cli import ask

            return ask.run(args)
        if args.command == "calibrate":
            if (args.task is None) == (args.from_log is None):
                root.error("calibrate: give --task DIR or --from-log LOG (not both)")
            if args.from_log is not None:
                from service.cli import log

                return log.run_from_log(args)
            from service.cli import calibrate

            return calibrate.run_calibrate(args)
        if args.command in ("label", "check", "replay"):
            from service.cli import log

            run = {"label": log.run_label, "check": log.run_check, "replay": log.run_replay}
            return run[args.command](args)
        if args.command == "evaluate":
            from service.cli import calibrate

            return calibrate.run_evaluate(args)
        if args.command == "decide":
            from service.cli import decide

            return decide.run(args)
        if args.command == "mcp":
            from service.cli import serve_mcp

            return serve_mcp.run(args)
        from service.cli import serve

        return serve.run(args)
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
