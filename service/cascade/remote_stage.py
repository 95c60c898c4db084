"""Cascade stages on other servers: another ``judge serve`` (``POST /judge`` there, under its
own profile), or any server that speaks the System One wire format (``POST /v1/systemone``).

    Cascade([LocalStage("smollm2", judge, gate), RemoteStage("big", "http://10.0.0.2:8000",
             profile="sms_spam-big"), SystemOneStage("hosted", "https://gateway.example/api")])

A judge server judges and decides with its profile; its answer is the stage's
(``calibration.cascade.StageAnswer``). A System One server is asked the item as one choice
question (the prompt as the state, the choices as the options) and answers probabilities; the
stage decides on them by its own gate (this side's: its threshold and minimum mass, or a
profile fitted on that server's answers), so any hosted decision model behind such a server is
a stage without new code. Nothing here retries: the cascade's deadline bounds the
call (what is left of it is the request's timeout), and a server that does not answer in
time, or fails, is an escalation with a reason code (``stage_timeout``, ``stage_failed``),
never an error of the cascade. A judge server does not report tokens, so the answer's token
counts are None; a System One server's ``usage.input_tokens`` is the answer's computed tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from calibration import Gate, Overrides
from calibration.carry import carry
from calibration.cascade import StageAnswer, StageItem
from service.client import JudgeClient, RetryPolicy
from service.schemas import JudgeResponse
from service.systemone import SystemOneQuestion, SystemOneResponse

__all__ = ["RemoteStage", "SystemOneStage", "answer_of", "is_remote"]

NO_RETRIES = RetryPolicy(max_retries=0)


# The overrides a stage sends with each item: the ones that bear on its own gate there (a
# request's other settings are the first stage's alone).
SENT = ("threshold", "uncertified_threshold", "min_choice_mass")


@dataclass(frozen=True)
class RemoteStage:
    """Another judge server as a stage: its ``url``, the ``profile`` it decides with there
    (None: its raw probabilities under its own defaults), the ``overrides`` sent with each item
    (their ``SENT`` fields), and an API key where it needs one. ``timeout_s`` bounds a call
    when the cascade has no deadline."""

    name: str
    url: str
    profile: str | None = None
    overrides: Overrides = field(default_factory=Overrides)
    api_key: str | None = None
    timeout_s: float = 60.0

    @classmethod
    def under(
        cls, name: str, url: str, profile: str | None, overrides: Overrides, api_key: str | None
    ) -> RemoteStage:
        """The stage as a cascade asks it: under ``profile`` in that server's store, with the
        request's ``overrides`` (``settings`` sends their ``SENT`` fields)."""
        return cls(name, url, profile=profile, overrides=overrides, api_key=api_key)

    @property
    def settings(self) -> dict[str, Any]:
        """What each request to the server sets: the profile and the ``SENT`` overrides."""
        return {"profile": self.profile} | {f: getattr(self.overrides, f) for f in SENT}

    def call(self, item: StageItem, *, timeout_s: float | None) -> JudgeResponse:
        """The remote server's response; TimeoutError when it does not answer in time."""
        # A client per call: httpx fixes a client's timeout when it is made, and each call
        # has what is left of its own deadline. A connection costs little beside a pass.
        with (
            _bounded(self.url, self.timeout_s, timeout_s) as limit,
            JudgeClient(self.url, self.api_key, timeout=limit, retries=NO_RETRIES) as client,
        ):
            return client.judge(
                item.prompt, item.choices, item_span=item.item_span, **self.settings
            )

    def answer(self, item: StageItem, *, timeout_s: float | None) -> StageAnswer:
        return answer_of(self.call(item, timeout_s=timeout_s), item.choices)

    def ask(
        self, state: Any, qid: str, question: SystemOneQuestion, *, timeout_s: float | None
    ) -> SystemOneResponse:
        """The remote server's answer to a typed question about ``state``
        (``POST /v1/systemone``), asked under this stage's profile and overrides in place of
        the question's own; TimeoutError when it does not answer in time."""
        asked = msgspec.structs.replace(question, **self.settings)
        with (
            _bounded(self.url, self.timeout_s, timeout_s) as limit,
            JudgeClient(self.url, self.api_key, timeout=limit, retries=NO_RETRIES) as client,
        ):
            return client.systemone(state, {qid: asked})


def is_remote(target: str) -> bool:
    """Whether a stage's target is another server (a URL) rather than a model to load."""
    return target.startswith(("http://", "https://"))


@contextmanager
def _bounded(url: str, own_s: float, left_s: float | None) -> Iterator[float]:
    """A call's time limit: the stage's own, or what is left of the cascade's deadline where
    that is less; httpx's timeout within it becomes the TimeoutError a cascade reads as
    ``stage_timeout``."""
    limit = own_s if left_s is None else min(left_s, own_s)
    try:
        yield limit
    except httpx.TimeoutException as exc:
        raise TimeoutError(f"{url} did not answer within {limit:g} s") from exc


def answer_of(r: JudgeResponse, choices: Sequence[str]) -> StageAnswer:
    """A stage's answer from a judge server's response (``choices``: the cascade's order)."""
    return carry(
        r,
        StageAnswer,
        probabilities={c: r.probabilities[c] for c in choices},
        raw_probabilities={c: r.raw_probabilities[c] for c in choices},
        # What a remote server computed is its own; these stay None (not said).
        prompt_tokens=None,
        computed_tokens=None,
    )


class _SystemOneChoice(msgspec.Struct, frozen=True, kw_only=True):
    """What a System One server answers to a choice question (the core; judge's extension
    fields are read where present)."""

    choice: str
    confidence: float
    probabilities: dict[str, float] | None = None
    choice_mass: float | None = None  # judge's extension


class _Answered(msgspec.Struct, frozen=True, kw_only=True):
    """A System One server's answer as a judgment a gate decides on (``ScoredJudgment``)."""

    choices: list[str]
    log_probs: list[float]
    choice_mass: float
    model: str
    computed_tokens: int | None


@dataclass(frozen=True)
class SystemOneStage:
    """Any System One server as a stage: ``url`` is its root (``POST {url}/v1/systemone``).

    The item is one choice question: ``state`` the prompt, ``criteria`` the choices (no
    descriptions), ``instructions`` as given. The server's probabilities (else its choice at
    its confidence, the rest shared evenly) are decided by ``gate``: this side's rule, since
    the server's own decision, where it gives one, was made under a rule this cascade did not
    certify. A server that gives no choice mass (only judge's does) passes the mass gate.
    ``model`` names the server's model where it serves several; ``api_key`` goes as a bearer
    token; ``timeout_s`` bounds a call when the cascade has no deadline. ``transport`` is
    httpx's (tests use a mock).
    """

    name: str
    url: str
    gate: Gate = field(default_factory=Gate)
    instructions: str = "Which option fits?"
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 60.0
    transport: httpx.BaseTransport | None = None

    def answer(self, item: StageItem, *, timeout_s: float | None) -> StageAnswer:
        question = {"type": "choice", "instructions": self.instructions}
        choices = item.choices
        body: dict[str, Any] = {
            "state": item.prompt,
            "questions": {"item": {**question, "criteria": dict.fromkeys(choices)}},
        }
        if self.model is not None:
            body["model"] = self.model
        headers = {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}
        with (
            _bounded(self.url, self.timeout_s, timeout_s) as limit,
            httpx.Client(timeout=limit, transport=self.transport) as http,
        ):
            r = http.post(f"{self.url.rstrip('/')}/v1/systemone", json=body, headers=headers)
        if r.status_code != 200:
            raise RuntimeError(f"{self.url} answered {r.status_code}: {r.text[:300]}")
        reply = msgspec.json.decode(r.content)
        answer = msgspec.convert(reply["answers"]["item"], _SystemOneChoice)
        judgment = _Answered(
            choices=list(choices),
            log_probs=[math.log(max(p, 1e-300)) for p in _probabilities(answer, choices)],
            choice_mass=1.0 if answer.choice_mass is None else answer.choice_mass,
            model=str(reply.get("model", "")),
            computed_tokens=(reply.get("usage") or {}).get("input_tokens"),
        )
        return StageAnswer.of(self.gate.decide(judgment), judgment, choices)


def _probabilities(answer: _SystemOneChoice, choices: Sequence[str]) -> list[float]:
    """The answer's probability of each choice: its own where it gives them, else its choice at
    its confidence and the rest shared evenly (all a bare System One answer says)."""
    if answer.probabilities is not None:
        missing = [c for c in choices if c not in answer.probabilities]
        if missing:
            raise ValueError(f"the answer has no probability for {missing[0]!r}")
        return [answer.probabilities[c] for c in choices]
    if answer.choice not in choices:
        raise ValueError(f"the answer {answer.choice!r} is not one of the choices")
    rest = (1.0 - answer.confidence) / (len(choices) - 1)
    return [answer.confidence if c == answer.choice else rest for c in choices]
