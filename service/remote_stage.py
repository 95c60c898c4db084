"""A cascade stage on another ``judge serve``: ``POST /judge`` there, under its own profile.

    Cascade([LocalStage("smollm2", judge, gate), RemoteStage("big", "http://10.0.0.2:8000",
             profile="sms_spam-big")])

The remote server judges and decides with its profile; its answer is the stage's
(``calibration.cascade.StageAnswer``). Nothing here retries: the cascade's deadline bounds the
call (what is left of it is the request's timeout), and a server that does not answer in
time, or fails, is an escalation with a reason code (``stage_timeout``, ``stage_failed``),
never an error of the cascade. The remote server does not report tokens, so the answer's
token counts are None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from calibration.cascade import StageAnswer
from service.client import JudgeClient, RetryPolicy
from service.schemas import JudgeResponse

__all__ = ["RemoteStage", "answer_of"]

NO_RETRIES = RetryPolicy(max_retries=0)


@dataclass(frozen=True)
class RemoteStage:
    """Another judge server as a stage: its ``url``, the ``profile`` it decides with there
    (None: its raw probabilities under its own defaults), a request's ``threshold`` and
    ``min_choice_mass`` overrides, and an API key where it needs one. ``timeout_s`` bounds a
    call when the cascade has no deadline."""

    name: str
    url: str
    profile: str | None = None
    threshold: float | None = None
    min_choice_mass: float | None = None
    api_key: str | None = None
    timeout_s: float = 60.0

    def call(
        self,
        prompt: str,
        choices: Sequence[str],
        *,
        item_span: tuple[int, int] | None,
        timeout_s: float | None,
    ) -> JudgeResponse:
        """The remote server's response; TimeoutError when it does not answer in time."""
        limit = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        # A client per call: httpx fixes a client's timeout when it is made, and each call
        # has what is left of its own deadline. A connection costs little beside a pass.
        try:
            with JudgeClient(self.url, self.api_key, timeout=limit, retries=NO_RETRIES) as client:
                return client.judge(
                    prompt,
                    choices,
                    profile=self.profile,
                    threshold=self.threshold,
                    min_choice_mass=self.min_choice_mass,
                    item_span=item_span,
                )
        except httpx.TimeoutException as exc:
            raise TimeoutError(f"{self.url} did not answer within {limit:g} s") from exc

    def answer(
        self,
        prompt: str,
        choices: Sequence[str],
        *,
        item_span: tuple[int, int] | None,
        timeout_s: float | None,
    ) -> StageAnswer:
        r = self.call(prompt, choices, item_span=item_span, timeout_s=timeout_s)
        return answer_of(r, choices)


def answer_of(r: JudgeResponse, choices: Sequence[str]) -> StageAnswer:
    """A stage's answer from a judge server's response (``choices``: the cascade's order)."""
    return StageAnswer(
        decision=r.decision,
        choice=r.choice,
        confidence=r.confidence,
        probabilities={c: r.probabilities[c] for c in choices},
        raw_probabilities={c: r.raw_probabilities[c] for c in choices},
        reason_codes=list(r.reason_codes),
        threshold=r.threshold,
        certified=r.certified,
        profile=r.profile,
        model=r.model,
        judgment_id=r.judgment_id,
    )
