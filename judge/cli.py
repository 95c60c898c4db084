"""Command line: ``judge ask "PROMPT" --choice A --choice B`` prints the judgment as JSON."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import msgspec

from judge.engine import DEFAULT_RESPONSE_PREFIX, DEFAULT_RESPONSE_SUFFIX, Judge
from judge.errors import JudgeError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="judge", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    ask = commands.add_parser("ask", help="judge one prompt and print the result as JSON")
    ask.add_argument("prompt", help="the question or item to judge")
    ask.add_argument("--choice", action="append", required=True, help="a choice; repeat for each")
    ask.add_argument("--system", default=None, help="system prompt (default: the model's own)")
    ask.add_argument(
        "--model",
        default=None,
        help="model id, directory or .gguf (default: SmolLM2-135M-Instruct)",
    )
    ask.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ask.add_argument("--device", default="cpu")
    ask.add_argument("--response-prefix", default=DEFAULT_RESPONSE_PREFIX)
    ask.add_argument("--response-suffix", default=DEFAULT_RESPONSE_SUFFIX)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        judge = Judge.load(
            args.model,
            dtype=args.dtype,
            device=args.device,
            response_prefix=args.response_prefix,
            response_suffix=args.response_suffix,
        )
        result = judge.judge(args.prompt, args.choice, system=args.system)
    except JudgeError as exc:
        print(f"judge: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(result), indent=2).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
