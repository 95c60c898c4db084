"""The command line's parser: help without the server's packages, and `judge serve`'s flags
made from ServiceConfig's settings (one declaration each).

The help checks run in a fresh interpreter where importing any of the `server` extra's
packages fails, as on the client's install (``pip install calibrated-judge``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from dataclasses import fields
from pathlib import Path
from typing import get_args

import pytest

from service.cli.main import parser
from service.command_line import SETTING_TYPES
from service.config import FlagKind, ServiceConfig, flags
from service.web import command as serve

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = [
    "ask",
    "decide",
    "label",
    "check",
    "replay",
    "calibrate",
    "evaluate",
    "estimate",
    "qualify",
    "serve",
    "mcp",
]
# The server extra's packages, as imported (tests/test_client_install.py blocks the same way).
SERVER_ONLY = (
    "torch",
    "transformers",
    "gguf",
    "accelerate",
    "scipy",
    "sklearn",
    "threadpoolctl",
    "matplotlib",
    "tqdm",
    "litestar",
    "uvicorn",
    "prometheus_client",
)
# `judge serve`'s flags that are not ServiceConfig's: the engine's, uvicorn's and Ray's.
NOT_SETTINGS = {
    "-h",
    "--help",
    "--model",
    "--dtype",
    "--device",
    "--batch-variant",
    "--generic-pass",
    "--choice-paths",
    "--prefix-cache-mb",
    "--host",
    "--port",
    "--shutdown-timeout",
    "--log-level",
    "--ray",
    "--replicas",
    "--min-replicas",
    "--max-replicas",
    "--target-ongoing-requests",
    "--replica-cpus",
    "--ray-address",
}


def test_help_needs_neither_torch_nor_the_server_s_packages() -> None:
    code = f"""
    import contextlib, io, json, sys

    for name in {SERVER_ONLY!r}:
        sys.modules[name] = None  # `import torch` raises ImportError

    from service.cli.main import main, parser

    [commands] = [a for a in parser()._actions if a.choices and a.dest == "command"]
    results = {{}}
    for argv in [["--help"], *([name, "--help"] for name in commands.choices)]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main(argv)
                code = "returned"
            except SystemExit as exc:
                code = exc.code
        results[" ".join(argv)] = {{"code": code, "out": out.getvalue()}}
    loaded = sorted(
        m for m, module in sys.modules.items()
        if m.split(".")[0] in {SERVER_ONLY!r} and module is not None
    )
    print(json.dumps({{"results": results, "loaded": loaded}}))
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    results = report["results"]
    assert list(results) == ["--help", *(f"{c} --help" for c in COMMANDS)]
    for argv, result in results.items():
        assert result["code"] == 0, (argv, result)
        command = argv.removesuffix("--help").strip()
        assert result["out"].startswith(f"usage: judge {command}".rstrip()), (argv, result)
    for command in COMMANDS:  # the overview names every command
        assert f"    {command}" in results["--help"]["out"]
    assert "--max-batch-tokens" in results["serve --help"]["out"]
    assert report["loaded"] == []  # nothing got past the block


def test_a_command_without_the_server_s_packages_fails_after_parsing() -> None:
    """A usage error is reported as one (exit 2, the usage); a valid command says what to
    install, and naming the command it was given."""
    code = f"""
    import sys

    for name in {SERVER_ONLY!r}:
        sys.modules[name] = None
    from service.cli.main import main

    try:
        main(["decide", "--max-orderings", "0", "--state", "-"])
    except SystemExit as exc:
        print("usage error", exc.code)
    print("status", main(["label", "--log", "decisions.db", "--input", "labels.jsonl"]))
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["usage error 2", "status 2"]
    assert "judge decide: error: argument --max-orderings" in done.stderr
    assert (
        "judge: error: `judge label` needs the server's dependencies (torch, transformers, "
        "scipy, sklearn, litestar, uvicorn not installed): pip install 'calibrated-judge[server]' "
        "(from a checkout: pip install '.[server]')"
    ) in done.stderr


def _serve_parser(command: str = "serve") -> argparse.ArgumentParser:
    [commands] = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    serve_parser: argparse.ArgumentParser = commands.choices[command]
    return serve_parser


def test_judge_mcp_takes_judge_serve_s_log_settings_as_they_are() -> None:
    """The decision log's settings (retention included), the audit rate, the opt-in and the
    choice mass: the same flags on both servers, with the same defaults, readings and help."""
    from service.mcp.command import SETTINGS

    def actions(command: str) -> dict[str, tuple[object, ...]]:
        return {
            a.option_strings[0]: (a.default, a.type, a.help, a.nargs)
            for a in _serve_parser(command)._actions
            if a.option_strings
        }

    served, mcp = actions("serve"), actions("mcp")
    shared = {flags()[name].name for name in SETTINGS}
    assert {"--log-max-age-days", "--log-max-rows", "--decision-log"} <= shared
    assert {flag: mcp[flag] for flag in shared} == {flag: served[flag] for flag in shared}


def test_every_setting_has_a_serve_flag_and_every_flag_sets_one() -> None:
    settings = {f.name for f in fields(ServiceConfig) if f.init}
    assert set(flags()) == settings
    declared = {flag.name for flag in flags().values()}
    given = {s for a in _serve_parser()._actions for s in a.option_strings}
    assert given - NOT_SETTINGS == declared
    assert not declared & NOT_SETTINGS
    # Every kind of value has its reading on the command line (a switch takes none).
    assert set(SETTING_TYPES) == set(get_args(FlagKind)) - {"switch"}


def test_serve_s_flags_default_to_the_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JUDGE_API_KEY", raising=False)
    args = parser().parse_args(["serve"])
    assert serve.service_config(args) == ServiceConfig()
    defaults = {f.name: f.default for f in fields(ServiceConfig)}
    for name, flag in flags().items():
        # These are read, then made settings; a cascade is off unless given, no default shown.
        if flag.kind not in ("key_file", "rates", "stages"):
            assert getattr(args, flag.dest) == defaults[name], flag.name
            assert type(getattr(args, flag.dest)) is type(defaults[name]), flag.name
        if flag.kind not in ("switch", "stages") and defaults[name] is not None:
            shown = next(a for a in _serve_parser()._actions if flag.name in a.option_strings)
            assert shown.help is not None and "(default: " in shown.help, flag.name


def test_serve_s_flags_set_the_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("JUDGE_API_KEY", raising=False)
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    argv = ["serve", "--profiles-dir", str(tmp_path), "--max-jobs", "5", "--admission-wait", "0.5"]
    argv += ["--api-key-file", str(key), "--log-requests", "--log-max-rows", "10"]
    argv += ["--audit-rate", "0.1", "--audit-rate", "spam=0.5", "--max-profile-bytes", "100"]
    argv += ["--cascade", "gemma=g.gguf", "--cascade", "big=http://10.0.0.2:8000"]
    config = serve.service_config(parser().parse_args(argv))
    assert list(config.cascade.items()) == [("gemma", "g.gguf"), ("big", "http://10.0.0.2:8000")]
    assert config.profiles_dir == tmp_path and config.max_jobs == 5
    assert config.admission_wait_s == 0.5 and config.api_key == "s3cret"
    assert config.log_requests is True and config.log_max_rows == 10
    assert config.audit_rate == 0.1 and config.audit_rates == {"spam": 0.5}
    assert config.max_profile_bytes == 100
    with pytest.raises(SystemExit):  # checked as the setting's kind: a count is >= 1
        parser().parse_args(["serve", "--max-jobs", "0"])
