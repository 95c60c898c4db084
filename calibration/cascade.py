"""A cascade at serving time: stages tried in order, cheapest first, each deciding through its
own gate; what the last escalates goes to a person.

    cascade = Cascade([
        LocalStage("smollm2", small, Gate(profiles[0])),   # service.cascade.stages
        RemoteStage("gemma3", "http://10.0.0.2:8000", profile="sms_spam-gemma3"),
    ])
    verdict = cascade.judge("Is this spam? ...", ["spam", "ham"])
    verdict.decided_by      # "smollm2", "gemma3", or None: a person decides

The profiles come from ``calibration.tasks.fit_cascade``, which certifies the stages'
thresholds together as one rule, so that everything the cascade accepts meets the target
precision with probability 1 - delta (the argument is in ``calibration.certificates.cascade_certify``).

A stage that fails (raises, or is down) or cannot start before the deadline is an escalation
with a reason code (``stage_failed``, ``stage_timeout``) in its ``StageResult``, never an
error of the cascade: the next stage, or a person, takes the item. A failing local stage is a
bug to see, so the error's words are kept too. The guarantee is unchanged by a failed stage: it
accepts nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal, NamedTuple, Protocol, TypeVar

import msgspec

from calibration.policy import Verdict

__all__ = [
    "Cascade",
    "CascadeVerdict",
    "Stage",
    "StageAnswer",
    "StageFailure",
    "StageItem",
    "StageResult",
    "run_stages",
]

StageFailure = Literal["stage_failed", "stage_timeout"]


class StageAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """What a stage answers, local or remote alike: its decision and what it cost."""

    decision: Literal["accept", "escalate"]
    choice: str  # the most probable choice after the stage's calibration
    confidence: float
    probabilities: dict[str, float]  # calibrated, in the cascade's choice order
    raw_probabilities: dict[str, float]  # the stage's model's own
    reason_codes: list[str]  # why it escalated; empty when accepted
    threshold: float | None
    certified: bool
    profile: str | None
    model: str
    judgment_id: str | None
    prompt_tokens: int | None = None  # None where the stage does not say (a remote one)
    computed_tokens: int | None = None

    @classmethod
    def of(cls, verdict: Verdict, judgment: object, choices: Sequence[str]) -> StageAnswer:
        """A local stage's answer: ``verdict`` on ``judgment`` (an engine's ``Judgment``)."""
        return verdict.carried(
            cls,
            choices,
            model=str(getattr(judgment, "model", "")),
            prompt_tokens=getattr(judgment, "prompt_tokens", None),
            computed_tokens=getattr(judgment, "computed_tokens", None),
        )


class StageResult(msgspec.Struct, frozen=True, kw_only=True):
    """One stage's part in a cascade's verdict."""

    stage: str
    answer: StageAnswer | None  # None when the stage failed or was not reached in time
    failure: StageFailure | None = None
    error: str | None = None  # the failure in words
    latency_ms: float = 0.0  # the stage's wall time, failures included


class CascadeVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """The cascade's decision: the first stage that accepted, or escalation to a person."""

    decision: Literal["accept", "escalate"]
    decided_by: str | None  # the stage whose gate accepted; None: escalated past the last
    choice: str | None  # the accepted choice; None when escalated
    confidence: float | None  # its calibrated probability at that stage
    stages: list[StageResult]  # every stage tried, in order; none after the deciding one

    @property
    def accepted(self) -> bool:
        return self.decision == "accept"


class StageItem(NamedTuple):
    """What each stage is asked: the prompt (each stage renders it in its own chat template),
    the choices in the cascade's order, and where the item stands in the prompt."""

    prompt: str
    choices: Sequence[str]
    item_span: tuple[int, int] | None = None


# What a cascade's stages are asked: a prompt and its choices (``StageItem``), or a typed
# question about a state (``service.cascade.stages.QuestionItem``): the stepping is the same.
Item = TypeVar("Item", contravariant=True)
Asked = TypeVar("Asked")


class Stage(Protocol[Item]):
    """A judge the cascade can hand an item to: a model in this process behind its gate, or
    another server (``service.cascade.stages``: ``LocalStage``, ``RemoteStage``;
    ``service.cascade.system_one_stage``: any System One server)."""

    @property
    def name(self) -> str: ...

    def answer(self, item: Item, *, timeout_s: float | None) -> StageAnswer:
        """Judge and decide; raise when the stage cannot (the cascade escalates)."""
        ...


class Cascade:
    """Stages tried in order; see the module docstring."""

    def __init__(self, stages: Sequence[Stage[StageItem]]) -> None:
        if not stages:
            raise ValueError("a cascade needs at least one stage")
        names = [stage.name for stage in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must differ, got {names}")
        self.stages = list(stages)

    def judge(
        self,
        prompt: str,
        choices: Sequence[str],
        *,
        item_span: tuple[int, int] | None = None,
        deadline_s: float | None = None,
    ) -> CascadeVerdict:
        """Hand the item to each stage in turn until one accepts; ``deadline_s``: seconds from
        now after which no stage starts (a remote stage gets what is left as its timeout)."""
        return run_stages(self.stages, StageItem(prompt, choices, item_span), deadline_s=deadline_s)


def run_stages(
    stages: Sequence[Stage[Asked]], item: Asked, *, deadline_s: float | None = None
) -> CascadeVerdict:
    """``Cascade.judge`` for any item its stages take (a prompt and its choices, a typed
    question about a state): each stage in turn until one accepts."""
    start = time.monotonic()
    results: list[StageResult] = []
    for stage in stages:
        left = None if deadline_s is None else deadline_s - (time.monotonic() - start)
        if left is not None and left <= 0:
            results.append(
                StageResult(
                    stage=stage.name,
                    answer=None,
                    failure="stage_timeout",
                    error=f"the deadline of {deadline_s:g} s passed before this stage",
                )
            )
            continue
        began = time.monotonic()
        try:
            answer = stage.answer(item, timeout_s=left)
        except TimeoutError as exc:
            results.append(_failed(stage.name, "stage_timeout", exc, began))
            continue
        except Exception as exc:
            results.append(_failed(stage.name, "stage_failed", exc, began))
            continue
        results.append(
            StageResult(
                stage=stage.name,
                answer=answer,
                latency_ms=(time.monotonic() - began) * 1000,
            )
        )
        if answer.decision == "accept":
            return CascadeVerdict(
                decision="accept",
                decided_by=stage.name,
                choice=answer.choice,
                confidence=answer.confidence,
                stages=results,
            )
    return CascadeVerdict(
        decision="escalate", decided_by=None, choice=None, confidence=None, stages=results
    )


def _failed(name: str, failure: StageFailure, exc: BaseException, began: float) -> StageResult:
    return StageResult(
        stage=name,
        answer=None,
        failure=failure,
        error=f"{type(exc).__name__}: {exc}",
        latency_ms=(time.monotonic() - began) * 1000,
    )
