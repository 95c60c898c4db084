"""Any System One server as a cascade stage (``POST {url}/v1/systemone``): a hosted decision
model behind such a server is a stage without new code.

    Cascade([LocalStage("smollm2", judge, gate), SystemOneStage("hosted", "https://gateway.example/api")])

The server is asked the item as one choice question (the prompt as the state, the choices as
the options) and answers probabilities; the stage decides on them by its own gate (this side's:
its threshold and minimum mass, or a profile fitted on that server's answers). As for every
remote stage (``service.cascade.stages``), nothing retries: the cascade's deadline bounds the
call, and a server that does not answer in time, or fails, is an escalation with a reason code.
A System One server's ``usage.input_tokens`` is the answer's computed tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from calibration import Gate
from calibration.cascade import StageAnswer, StageItem
from service.cascade.stages import bounded

__all__ = ["SystemOneStage"]


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
    certify. A server that gives no choice mass (only judge's does) passes the mass check.
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
            bounded(self.url, self.timeout_s, timeout_s) as limit,
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
