"""Request and response bodies of the HTTP API.

Constraints live in the types, so a malformed body is refused with a 400 that names the
field before any work is done; what only the engine can check (duplicate choices, a prompt
too long for the model) comes back as a 4xx from the engine's own errors.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from calibration.metrics import MetricReport
from calibration.profile import NAME_PATTERN
from calibration.routing import ThresholdResult
from judge.engine import MAX_CHOICES

__all__ = [
    "BatchRequest",
    "BatchResponse",
    "ErrorBody",
    "FitRequest",
    "JudgeRequest",
    "JudgeResponse",
    "LabeledExample",
    "ProfileName",
    "ProfileSummary",
    "SharedQuestion",
]

Choice = Annotated[str, Meta(min_length=1)]
Choices = Annotated[list[Choice], Meta(min_length=2, max_length=MAX_CHOICES)]
ProfileName = Annotated[str, Meta(pattern=f"^{NAME_PATTERN}$")]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
MAX_BATCH_ITEMS = 256


class JudgeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prompt: str
    choices: Choices
    system: str | None = None
    profile: ProfileName | None = None
    threshold: Probability | None = None  # overrides the profile's threshold
    min_choice_mass: Probability | None = None  # overrides the server's default
    response_prefix: str | None = None
    response_suffix: str | None = None
    return_prompt: bool = False


class JudgeResponse(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="type", tag="judgment"
):
    choice: str
    confidence: float
    probabilities: dict[str, float]  # calibrated when a profile applies
    raw_probabilities: dict[str, float]
    decision: Literal["accept", "escalate"]
    reason: str | None  # why it escalated
    threshold: float | None
    temperature: float | None
    choice_mass: float
    profile: str | None
    model: str
    latency_ms: float
    prediction_set: list[str] | None = None
    prompt: str | None = None


class BatchRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Either ``items`` (independent requests) or ``context`` with ``questions`` about it."""

    items: Annotated[list[JudgeRequest], Meta(max_length=MAX_BATCH_ITEMS)] | None = None
    context: str | None = None
    questions: Annotated[list[SharedQuestion], Meta(max_length=MAX_BATCH_ITEMS)] | None = None


class SharedQuestion(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A question about the batch's shared context; the prompt is context + question."""

    prompt: str
    choices: Choices
    profile: ProfileName | None = None
    threshold: Probability | None = None
    min_choice_mass: Probability | None = None
    return_prompt: bool = False


class BatchResponse(msgspec.Struct, frozen=True, kw_only=True):
    results: list[JudgeResponse | ErrorBody]


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="error"):
    """An item's error inside a batch, shaped like the top-level error bodies."""

    status_code: int
    detail: str
    field: str | None = None


class LabeledExample(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prompt: str
    label: Choice


class FitRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    choices: Choices
    examples: Annotated[list[LabeledExample], Meta(min_length=10, max_length=20_000)]
    system: str | None = None
    response_prefix: str | None = None
    response_suffix: str | None = None
    target_precision: Annotated[float, Meta(gt=0.0, lt=1.0)] = 0.9
    delta: Annotated[float, Meta(gt=0.0, lt=1.0)] = 0.1
    alpha: Annotated[float, Meta(gt=0.0, lt=1.0)] = 0.1


class ProfileSummary(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    model: str
    choices: list[str]
    method: str
    temperature: float
    threshold: ThresholdResult
    metrics_after: MetricReport
    n_examples: int
    created_at: str
