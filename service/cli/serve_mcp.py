"""``judge mcp``: the MCP server (``service.mcp_server``) on stdin/stdout.

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

from service.cli.common import UsageError

__all__ = ["run"]

INSTALL = "pip install 'judge[mcp]'"


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("mcp") is None:
        raise UsageError(f"`judge mcp` needs the MCP SDK (mcp is not installed): {INSTALL}")
    from judge import Judge
    from service.mcp_server import create_server
    from service.profiles import ProfileStore

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the protocol's alone
        engine = Judge.load(
            args.model, dtype=args.dtype, device=args.device, prefix_cache_mb=args.prefix_cache_mb
        )
    create_server(engine, ProfileStore(args.profiles_dir)).run("stdio")
    return 0
