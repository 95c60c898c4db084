"""A stand-in engine for tests of mechanics (batching, errors, gating), per ``judge.Engine``.

Subclasses say what a query's judgment is (``judgment``); everything else an engine does is
here once. The real model stays the proof of behaviour; a fake only drives the machinery.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, Unpack

import msgspec
import numpy as np

from calibration import CalibrationProfile, FitSettings, LabeledScores, Provenance, fit_profile
from judge import (
    DEFAULT_RESPONSE_PREFIX,
    DEFAULT_RESPONSE_SUFFIX,
    Fingerprint,
    JudgeError,
    Judgment,
    Prepared,
    Query,
    TokenCount,
)
from judge.engine import shared_query, validate_choices
from judge.fingerprint import sha256_text
from judge.identity import new_judgment_id, tokens_sha256
from judge.judgments import QueryOptions, check_item_span
from judge.packing import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_BATCH_TOKENS
from judge.trie import build_trie


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
        choices=list(probabilities),
        probs=list(probabilities.values()),
        log_probs=[math.log(p) for p in probabilities.values()],
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
    batch_invariant = True  # its numbers depend on nothing but the item
    model_sha256 = hashlib.sha256(b"fake weights").hexdigest()
    max_batch_size = DEFAULT_MAX_BATCH_SIZE
    max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS

    def judgment(self, query: Query) -> Judgment:
        """Uniform probabilities over the query's choices; override for others."""
        uniform = dict.fromkeys(query.choices, 1 / len(query.choices))
        return judgment_of(uniform, prompt=query.prompt)

    def fingerprint(
        self,
        *,
        system: str | None = None,
        response_prefix: str | None = None,
        response_suffix: str | None = None,
    ) -> Fingerprint:
        return Fingerprint(
            model=self.model_id,
            model_sha256=None,
            dtype=self.dtype,
            response_prefix=response_prefix or DEFAULT_RESPONSE_PREFIX,
            response_suffix=response_suffix or DEFAULT_RESPONSE_SUFFIX,
            system_sha256=sha256_text(system),
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
        self, prompt: str, choices: Sequence[str], **options: Unpack[QueryOptions]
    ) -> Judgment:
        # Unchecked here: ``prepare`` checks the query and names what is wrong with it.
        query = Query(prompt=prompt, choices=choices, **options)  # type: ignore[arg-type]
        return self.judge_batch([query])[0]

    def prepare(self, query: Query | Mapping[str, Any]) -> Prepared:
        """A real trie over made-up token ids: a start token, then one per character.

        ``Prepared.prompt`` is the query's own prompt (the fake renders nothing), so that
        ``run`` hands ``judgment`` the prompt it was asked.
        """
        q = as_query(query)
        choices = validate_choices(q.choices)
        head = [0, *map(ord, (q.system or "") + q.prompt + (q.response_prefix or ""))]
        suffix = DEFAULT_RESPONSE_SUFFIX if q.response_suffix is None else q.response_suffix
        paths = [[*head, *map(ord, c + suffix)] for c in choices]
        trie = build_trie(paths, head, choices)
        tokens = tokens_sha256(head, paths)
        spans = tuple(q.span_layers)
        item = check_item_span(q.item_span, q.prompt)
        layers = tuple(q.feature_layers)
        return Prepared(
            choices, q.prompt, len(head), trie, tokens, trie.packed_length, layers, spans, item
        )

    def run(self, prepared: Sequence[Prepared]) -> list[Judgment]:
        return [
            self.identified(
                self.judgment(
                    Query(
                        prompt=p.prompt,
                        choices=p.choices,
                        feature_layers=p.feature_layers,
                        span_layers=p.span_layers,
                        item_span=p.item_span,
                    )
                ),
                p,
            )
            for p in prepared
        ]

    def identified(self, judgment: Judgment, prepared: Prepared) -> Judgment:
        """``judgment`` stamped as the engine stamps one: a fresh id, its tokens, the weights."""
        return msgspec.structs.replace(
            judgment,
            judgment_id=new_judgment_id(),
            tokens_sha256=prepared.tokens_sha256,
            model_sha256=self.model_sha256,
        )

    def run_shared(self, prepared: Sequence[Prepared]) -> list[Judgment]:
        return self.run(prepared)

    def judge_batch(self, queries: Sequence[Query | Mapping[str, Any]]) -> list[Judgment]:
        checked = [as_query(q) for q in queries]
        # Refuses what the real engine would, before any judgment.
        prepared = [self.prepare(q) for q in checked]
        return [
            self.identified(self.judgment(q), p) for q, p in zip(checked, prepared, strict=True)
        ]

    def judge_each(
        self, queries: Sequence[Query | Mapping[str, Any]]
    ) -> list[Judgment | JudgeError]:
        results: list[Judgment | JudgeError] = []
        for q in queries:
            try:
                results += self.judge_batch([q])
            except JudgeError as exc:
                results.append(exc)
        return results

    def judge_shared(
        self, context: str, questions: Sequence[Query | Mapping[str, Any]]
    ) -> list[Judgment]:
        return self.judge_batch([shared_query(context, as_query(q)) for q in questions])


# The engine calibration.fit_profile records, for profiles fitted on synthetic data.
FINGERPRINT = Fingerprint(
    model="m",
    model_sha256=None,
    dtype="float32",
    response_prefix="",
    response_suffix="",
    system_sha256=None,
)


class Scored:
    """A judgment as the policy sees it: its choices, their log-probabilities, the choice mass."""

    def __init__(self, log_probabilities: Mapping[str, float], choice_mass: float = 1.0) -> None:
        self.choices = list(log_probabilities)
        self.log_probs = list(log_probabilities.values())
        self.choice_mass = choice_mass


def clear_profile(
    name: str, choices: Sequence[str], fingerprint: Fingerprint, *, seed: int = 5
) -> CalibrationProfile:
    """A temperature profile for ``fingerprint``'s model, fitted on 600 synthetic scores with
    a clear signal (the first choice's label pulls its score up), so that it certifies a
    threshold: for tests of routing and gating, not of fitting."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 600)
    margin = rng.normal(np.where(y == 0, 2.5, -2.5), 1.5)
    z = np.stack([margin / 2, -margin / 2], axis=1)
    z = z - np.logaddexp(z[:, :1], z[:, 1:])
    return fit_profile(
        name,
        LabeledScores(z, np.ones(len(y)), y),
        list(choices),
        Provenance(fingerprint=fingerprint, dataset="synthetic", dataset_sha256="0" * 64),
        FitSettings(methods=["temperature"]),
    ).profile
