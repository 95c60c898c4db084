"""The real service (app, front door, batcher, profile store, uvicorn) in a process of its own,
around a fake engine instead of the model: for tests of the HTTP machinery that need many
requests, such as the contract test's schema fuzzing. The model stays the proof of behaviour.

    python tests/fake_server.py --port PORT --profiles-dir DIR [--max-request-tokens N]

The API key is $JUDGE_API_KEY, as for ``judge serve``; SIGTERM stops it as it stops that.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import uvicorn
from fakes import FakeEngine, judgment_of

from judge import Judgment, Query
from service import ServiceConfig, create_app


class VariedEngine(FakeEngine):
    """Probabilities that vary from query to query, fixed for each (a hash of its prompt and
    choices), and a choice mass below 1: fitted profiles, thresholds and decisions then come
    out as varied as a model's would, where uniform ones would all be alike."""

    def judgment(self, query: Query) -> Judgment:
        key = "\x00".join([query.prompt, *query.choices]).encode()
        digest = hashlib.sha256(key).digest()
        weights = [1 + digest[i % len(digest)] for i in range(len(query.choices))]
        total = sum(weights)
        probabilities = {c: w / total for c, w in zip(query.choices, weights, strict=True)}
        return judgment_of(probabilities, prompt=query.prompt, mass=0.5 + digest[-1] / 512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--profiles-dir", type=Path, required=True)
    parser.add_argument("--max-request-tokens", type=int, default=4096)
    args = parser.parse_args()
    config = ServiceConfig(
        profiles_dir=args.profiles_dir,
        max_request_tokens=args.max_request_tokens,
        api_key=os.environ.get("JUDGE_API_KEY") or None,
    )
    app = create_app(VariedEngine(), config=config)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
