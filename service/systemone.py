"""The System One wire format (``POST /v1/systemone``): typed questions about one state.

What the ``systemone-client`` package (0.1.0) sends and reads, plus judge's own fields:

    request   {"state": <any JSON>, "questions": {id: question}, "model"?: str}
    question  {"type": "noul" | "choice" | "score", "instructions", "criteria"?,
               judge's: "order", "profile", "threshold", "uncertified_threshold",
               "min_choice_mass", "max_order_spread"}
              judge's extension, {"type": "pair", "instructions", "candidates": {name: text}
               (two), "criteria"?, ...}: which candidate is the better, both orders by default
    response  {"model", "answers": {id: answer}, "usage": {"input_tokens", "output_tokens"},
               "latency_ms"}
    answer    noul:   {"type": "noul", "noul"}                        P(yes)
              choice: {"type": "choice", "choice", "confidence", "probabilities"}
              score:  {"type": "score", "score", "confidence", "probabilities", "legend"}
              pair:   {"type": "pair", "winner", "confidence", "probabilities"}
              judge's, on every answer: the Policy's decision (decision, reasons,
              reason_codes, certified, threshold, choice_mass, prediction_set, profile),
              raw_probabilities, orderings and order_spread.

A question is ``judge.answers``'s (its prompt, choices and listings are rendered there); the
fields beyond the System One core choose its gate, as on ``POST /judge``: ``profile`` names a
calibration profile fitted for the question's choices (yes/no; the option names; "0".."n-1"
for a score), ``threshold`` overrides the profile's certified threshold, ``min_choice_mass`` the
profile's or the server's, and without a certificate an answer escalates unless the question
opts in with ``uncertified_threshold`` (``calibration.policy``),
and ``max_order_spread`` escalates an answer whose listings (``order="invariant"``) disagreed
by more than that (reason code ``order_sensitive``; for a pair, whose two orders are bounded
by default, ``position_inconsistent``: ``calibration.policy``). Probabilities are the calibrated ones
when a profile applies (``raw_probabilities``: the model's own, the mean over listings); a
score's are keyed by level index, "0".."n-1".

``model``: this server serves one model; a request that names another is refused (422,
``model``) rather than answered by a model it did not ask for.

``usage.input_tokens`` is the tokens the passes computed (the state once, where it fits in one
pass, then each question's own); ``output_tokens`` is 0: nothing is generated.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

from calibration.carry import carry
from calibration.cascade import StageResult
from calibration.policy import ReasonCode
from judge.questions import (
    MAX_LEVELS,
    MAX_OPTIONS,
    ChoiceQuestion,
    NoulQuestion,
    PairQuestion,
    ScoreQuestion,
)
from service.bodies import BodyError, decode_body, integral, located
from service.schemas import Candidates, Criterion, ProfileName

if TYPE_CHECKING:
    from calibration.policy import Verdict
    from judge.answers import Answer
    from judge.questions import Question

__all__ = [
    "SystemOneAnswer",
    "SystemOneChoice",
    "SystemOneChoiceAnswer",
    "SystemOneNoul",
    "SystemOneNoulAnswer",
    "SystemOnePair",
    "SystemOnePairAnswer",
    "SystemOneQuestion",
    "SystemOneRequest",
    "SystemOneResponse",
    "SystemOneScore",
    "SystemOneScoreAnswer",
    "Usage",
    "decode_request",
    "wire_answer",
]

Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
Order = Literal["given", "invariant"]
# An option's name: what the model answers with, so it holds at least one visible character.
OptionName = Annotated[str, Meta(min_length=1, pattern=r"\S")]
QuestionId = Annotated[str, Meta(min_length=1)]


class _Asked(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """What every question carries besides its criteria: the System One core and judge's.

    Encoded without the fields left at their defaults: what a System One server reads.
    """

    instructions: Annotated[str, Meta(min_length=1, pattern=r"\S")]  # not blank
    order: Order = "given"  # "invariant": asked under several listings, the mean answers
    profile: ProfileName | None = None  # fitted for this question's choices
    threshold: Probability | None = None  # overrides the profile's certified one (none: 422)
    uncertified_threshold: Probability | None = None  # the opt-in: accept with no certificate
    min_choice_mass: Probability | None = None  # overrides the profile's, else the server's
    max_order_spread: Probability | None = None  # escalate when the listings disagree more


class SystemOneNoul(_Asked, frozen=True, kw_only=True, tag="noul", tag_field="type"):
    """Yes or no; the answer is P(yes)."""

    criteria: Criterion = None

    def question(self) -> Question:
        return NoulQuestion(
            instructions=self.instructions, criteria=self.criteria, order=self.order
        )


class SystemOneChoice(_Asked, frozen=True, kw_only=True, tag="choice", tag_field="type"):
    """One of 2-255 named options, each with an optional description."""

    criteria: Annotated[dict[OptionName, Criterion], Meta(min_length=2, max_length=MAX_OPTIONS)]

    def question(self) -> Question:
        return ChoiceQuestion(
            instructions=self.instructions, criteria=self.criteria, order=self.order
        )


class SystemOneScore(_Asked, frozen=True, kw_only=True, tag="score", tag_field="type"):
    """A level on an ordered scale of 2-10 levels; the answer is the expected level index."""

    criteria: Annotated[list[Criterion], Meta(min_length=2, max_length=MAX_LEVELS)]

    def question(self) -> Question:
        return ScoreQuestion(
            instructions=self.instructions, criteria=self.criteria, order=self.order
        )


class SystemOnePair(_Asked, frozen=True, kw_only=True, tag="pair", tag_field="type"):
    """judge's extension: which of two named candidates is the better by the instructions and
    criteria; the answer names it. Both orders by default (``judge.answers``, "Pairs")."""

    candidates: Candidates
    criteria: Criterion = None
    order: Order = "invariant"

    def question(self) -> Question:
        return PairQuestion(
            instructions=self.instructions,
            candidates=self.candidates,
            criteria=self.criteria,
            order=self.order,
        )


SystemOneQuestion = SystemOneNoul | SystemOneChoice | SystemOneScore | SystemOnePair


class SystemOneRequest(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """Questions about one state; the server's ``max_questions`` bounds how many."""

    state: Annotated[
        Any,
        Meta(description="what the questions are about: a string as it is, other JSON indented"),
    ]
    questions: Annotated[
        dict[QuestionId, SystemOneQuestion],
        Meta(min_length=1, description="each question by its id: noul, choice, score or pair"),
    ]
    model: Annotated[
        str | None, Meta(description="if given, the served model's id (another: 422)")
    ] = None


class _Answered(msgspec.Struct, frozen=True, kw_only=True):
    """judge's fields on every answer: its gate's verdict and the listings."""

    probabilities: dict[str, float]  # calibrated when a profile applies; the question's order
    raw_probabilities: dict[str, float]  # the model's own: the mean over the listings
    decision: Literal["accept", "escalate"]
    reasons: list[str]
    reason_codes: list[ReasonCode]
    certified: bool
    threshold: float | None
    choice_mass: float
    prediction_set: list[str] | None
    profile: str | None
    orderings: int  # listings of the options judged (1 unless order="invariant")
    order_spread: float  # largest difference across listings in one choice's probability
    max_order_spread: float | None
    # What pins the decision, as on a judgment (``JudgeResponse``): the id a label is given
    # to (POST /judgments/{judgment_id}/label; the first listing's judgment), the sha256 of
    # the tokens fed (one listing: its tokens' hash; several: the hash of the listings'
    # hashes in listing order, ``judge.identity.listings_sha256``), of the weights and of the
    # policy, the profile's ETag, and whether it is in the audit sample.
    judgment_id: str | None = None
    tokens_sha256: str | None = None
    model_sha256: str | None = None
    policy_sha256: str | None = None
    profile_etag: str | None = None
    audit: bool = False
    # The profile's calibration map, as on a judgment: its method, a scalar map's temperature,
    # a probe's layers (None without a profile).
    calibration_method: str | None = None
    temperature: float | None = None
    feature_layers: list[int] | None = None
    # Under a profile fitted on a task: a typed question is asked in its own prompt, never
    # the task's, so the certificate was measured on other prompts (as on a judgment).
    outside_template: bool = False
    # With a cascade (``judge serve --cascade``), as on a judgment: the stage whose gate
    # accepted (None: escalated past the last, to a person) and each stage tried, in order.
    # The fields above are then the deciding stage's answer, else the last that answered.
    decided_by: str | None = None
    cascade: list[StageResult] | None = None


class SystemOneNoulAnswer(_Answered, frozen=True, kw_only=True, tag="noul", tag_field="type"):
    noul: float  # P(yes)


class SystemOneChoiceAnswer(_Answered, frozen=True, kw_only=True, tag="choice", tag_field="type"):
    choice: str
    confidence: float  # the probability of ``choice``


class SystemOneScoreAnswer(_Answered, frozen=True, kw_only=True, tag="score", tag_field="type"):
    score: float  # sum over levels of index * probability (0..n-1)
    confidence: float  # the probability of the most likely level
    legend: dict[str, str]  # level index -> its description


class SystemOnePairAnswer(_Answered, frozen=True, kw_only=True, tag="pair", tag_field="type"):
    winner: str  # the name of the candidate more probably the better
    confidence: float  # its probability


SystemOneAnswer = (
    SystemOneNoulAnswer | SystemOneChoiceAnswer | SystemOneScoreAnswer | SystemOnePairAnswer
)


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int  # tokens the passes computed
    output_tokens: int = 0  # nothing is generated


class SystemOneResponse(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    answers: dict[str, SystemOneAnswer]
    usage: Usage
    latency_ms: float


# msgspec names a map's values ``questions[...]`` and a bad key "at `key` in `$.path`".
_KEY_AT = re.compile(r" - at `key` in `\$\.?([^`]*)`$")


def decode_request(body: bytes, content_type: str | None) -> SystemOneRequest:
    """The request, or a BodyError whose field names the question by its id.

    ``service.bodies.decode_body`` decodes it; msgspec names a question only as
    ``questions[...]``, so a refusal there is found again question by question, to name it
    ``questions.<id>.<field>``.
    """
    try:
        return decode_body(body, content_type, SystemOneRequest)
    except BodyError as exc:
        message = str(exc)
        if exc.status != 400 or "questions" not in message:
            raise
        if exc.field == "questions" and message.startswith("questions: a key:"):
            raise BodyError(
                "questions", "questions: a question id must be a non-empty string"
            ) from None
        raise (_question_error(body) or exc) from None


def _question_error(body: bytes) -> BodyError | None:
    """The first question of ``body`` that does not decode, as a BodyError naming it."""
    try:
        raw = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    questions = raw.get("questions") if isinstance(raw, dict) else None
    if not isinstance(questions, dict):
        return None
    for qid, question in questions.items():
        try:
            msgspec.convert(integral(question), SystemOneQuestion, strict=True)
        except msgspec.ValidationError as exc:
            message = str(exc)
            key = _KEY_AT.search(message)
            if key:  # a bad key inside the question: an option's name
                field, text = key.group(1), f"an option's name: {message[: key.start()]}"
            else:
                field, text = located(message)
                text = text.split(": ", 1)[1]
            field = f"questions.{qid}" + (f".{field}" if field and field != "body" else "")
            return BodyError(field, f"{field}: {text}")
        except RecursionError:
            return None
    return None


def wire_answer(answer: Answer, verdict: Verdict) -> SystemOneAnswer:
    """The wire form of a question's ``answer`` as ``verdict`` (its gate's) decides it.

    The System One fields are computed from the verdict's probabilities (calibrated when a
    profile applies; the answer's own otherwise), in the question's order of choices.
    """
    from judge.answers import ChoiceAnswer, NoulAnswer, PairAnswer

    order = list(answer.probabilities)
    calibrated = verdict.probabilities
    probs = {c: calibrated[c] for c in order}
    # Every field of _Answered is the verdict's of the same name, but these (the verdict's
    # choice, confidence and probabilities are in the profile's order, and a noul has none).
    answered: dict[str, Any] = {
        "probabilities": probs,
        "raw_probabilities": dict(answer.probabilities),
        "orderings": answer.orderings,
        "order_spread": answer.order_spread,
    }
    best = max(order, key=probs.__getitem__)
    if isinstance(answer, NoulAnswer):
        return carry(verdict, SystemOneNoulAnswer, noul=probs["yes"], **answered)
    if isinstance(answer, PairAnswer):
        return carry(verdict, SystemOnePairAnswer, winner=best, confidence=probs[best], **answered)
    if isinstance(answer, ChoiceAnswer):
        return carry(
            verdict, SystemOneChoiceAnswer, choice=best, confidence=probs[best], **answered
        )
    return carry(
        verdict,
        SystemOneScoreAnswer,
        score=sum(int(c) * p for c, p in probs.items()),
        confidence=probs[best],
        legend=dict(answer.legend),
        **answered,
    )
