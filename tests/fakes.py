"""A stand-in engine for tests of mechanics (batching, errors, gating), per ``judge.Engine``.

Subclasses say what a query's judgment is (``judgment``); everything else an engine does is
here once. The real model stays the proof of behaviour; a fake only drives the machinery.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from judge import (
    DEFAULT_RESPONSE_PREFIX,
    DEFAULT_RESPONSE_SUFFIX,
    Configuration,
    JudgeError,
    Judgment,
    Query,
    TokenCount,
)


def as_query(item: Query | Mapping[str, Any]) -> Query:
    return item if isinstance(item, Query) else Query(**item)


def judgment_of(
    probabilities: Mapping[str, float], *, prompt: str = "", mass: float = 1.0
) -> Judgment:
    """A Judgment whose numbers are exactly ``probabilities``."""
    choice = max(probabilities, key=probabilities.__getitem__)
    return Judgment(
        choice=choice,
        confidence=probabilities[choice],
        probabilities=dict(probabilities),
        log_probabilities={c: math.log(p) for c, p in probabilities.items()},
        choice_mass=mass,
        prompt=prompt,
        prompt_tokens=1,
        cached_tokens=0,
        computed_tokens=1,
        forward_passes=1,
        latency_ms=1.0,
        model="fake",
    )


class FakeEngine:
    """Satisfies ``judge.Engine`` with no cast and no ``type: ignore``."""

    model_id = "fake"
    dtype = "float32"

    def judgment(self, query: Query) -> Judgment:
        """Uniform probabilities over the query's choices; override for others."""
        return judgment_of(dict.fromkeys(query.choices, 1 / len(query.choices)))

    def configuration(
        self,
        *,
        system: str | None = None,
        response_prefix: str | None = None,
        response_suffix: str | None = None,
    ) -> Configuration:
        return Configuration(
            model=self.model_id,
            model_sha256=None,
            dtype=self.dtype,
            response_prefix=response_prefix or DEFAULT_RESPONSE_PREFIX,
            response_suffix=response_suffix or DEFAULT_RESPONSE_SUFFIX,
            system=system,
        )

    def count_tokens(self, query: Query | Mapping[str, Any]) -> TokenCount:
        """One token per character of each field: enough to exercise a server's budget."""
        q = as_query(query)
        parts = {
            "prompt": len(q.prompt),
            "system": len(q.system or ""),
            "response_prefix": len(q.response_prefix or ""),
            "response_suffix": len(q.response_suffix or ""),
            "choices": max(len(c) for c in q.choices),
        }
        return TokenCount(total=sum(parts.values()), parts=parts)

    def judge(
        self,
        prompt: str,
        choices: Sequence[str],
        *,
        system: str | None = None,
        response_prefix: str | None = None,
        response_suffix: str | None = None,
        feature_layers: Sequence[int] = (),
    ) -> Judgment:
        query = Query(prompt=prompt, choices=list(choices), feature_layers=tuple(feature_layers))
        return self.judge_batch([query])[0]

    def judge_batch(self, queries: Sequence[Query | Mapping[str, Any]]) -> list[Judgment]:
        return [self.judgment(as_query(q)) for q in queries]

    def judge_each(
        self, queries: Sequence[Query | Mapping[str, Any]]
    ) -> list[Judgment | JudgeError]:
        return list(self.judge_batch(queries))

    def judge_shared(
        self, context: str, questions: Sequence[Query | Mapping[str, Any]]
    ) -> list[Judgment]:
        return self.judge_batch(questions)


# What calibration.fit_profile records of the engine, for profiles fitted on synthetic data.
CONFIG: dict[str, Any] = {
    "model": "m",
    "model_sha256": None,
    "dtype": "float32",
    "response_prefix": "",
    "response_suffix": "",
    "system": None,
}


class Scored(msgspec.Struct, frozen=True):
    """A judgment as the policy sees it: log-probabilities and the choice mass."""

    log_probabilities: dict[str, float]
    choice_mass: float = 1.0
