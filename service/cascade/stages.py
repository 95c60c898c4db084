"""A cascade's later stages: a model in this process (``LocalStage``) or another judge server
(``RemoteStage``), each asked a judgment (``calibration.cascade.StageItem``: a prompt and its
choices) or a typed question about a state (``QuestionItem``) alike.

    stages = opened_stages({"big": LocalModel(engine), "far": "http://10.0.0.2:8000"},
                           "sms_spam", overrides, open_gate, choices=choices, field="profile")
    escalated("local", verdict, judgment, choices, stages, item)   # service.cascade.escalation

Stage NAME decides under the request's profile P as "P-NAME" (``calibration.tasks.fit_cascade``
names them so). A local stage judges through its own gate on its model's lock (one item at a
time), its decision settled through a ``GateContext`` (the server's: its log); a remote one
asks that server (``POST /judge``, or ``POST /v1/systemone`` for a typed question) under its
profile there, with the request's overrides. A stage is made per request and keeps what it
answered (``kept``), for the front to send back where its answer stands.

Nothing here retries: the cascade's deadline bounds a remote call (what is left of it is the
call's timeout), and a server that does not answer in time, or fails, is an escalation with a
reason code (``stage_timeout``, ``stage_failed``), never an error of the cascade. A judge
server does not report tokens, so a remote answer's token counts are None.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import httpx
import msgspec

from calibration import Gate, Overrides
from calibration.carry import carry
from calibration.cascade import StageAnswer, StageItem
from service.cascade.escalation import Kept
from service.client import JudgeClient, RetryPolicy
from service.decisions import judge_questions
from service.gate_context import GateContext
from service.schemas import JudgeResponse
from service.systemone import SystemOneAnswer, SystemOneQuestion

if TYPE_CHECKING:
    from judge import Engine
    from judge.answers import Question

__all__ = [
    "LocalModel",
    "LocalStage",
    "QuestionItem",
    "RemoteStage",
    "asked_as",
    "bounded",
    "is_remote",
    "opened_stages",
]

NO_RETRIES = RetryPolicy(max_retries=0)

# The overrides a remote stage sends with each item: the ones that bear on its own gate there
# (a request's other settings are the first stage's alone).
SENT = ("threshold", "uncertified_threshold", "min_choice_mass")


class QuestionItem(NamedTuple):
    """A typed question as each later stage is asked it: one question (``asked_as``) about a
    state, under its id."""

    state: Any
    qid: str
    question: SystemOneQuestion


@dataclass
class LocalModel:
    """A later stage's model, loaded once; its lock lets one item at a time through."""

    engine: Engine
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class LocalStage:
    """A model in this process behind its gate (``judge.Judge``, or any ``judge.Engine``).
    ``lock``: the model's (shared by every request's stage on it); ``context``: where its
    decisions are settled (a server's logs them; by default no log). A local pass cannot be
    cut short, so the cascade's deadline only says whether to start it."""

    name: str
    engine: Engine
    gate: Gate
    lock: threading.Lock = field(default_factory=threading.Lock)
    context: GateContext = field(default_factory=GateContext)
    kept: Kept | None = None  # what it last answered

    def answer(self, item: StageItem | QuestionItem, *, timeout_s: float | None) -> StageAnswer:
        model = self.engine.model_id
        if isinstance(item, QuestionItem):
            with self.lock:
                decided = judge_questions(
                    self.engine,
                    item.state,
                    {item.qid: item.question.question()},
                    gates={item.qid: self.gate},
                )
            answer, verdict = decided[item.qid]
            # Logged as a later stage of a judgment is: its hidden states, not its request
            # (the first stage's record replays the question).
            decision, record = self.context.answered(answer, verdict, self.gate, model=model)
            # Its prompt kept: the front sends it where the request asks for it.
            response = decision.response(return_prompt=True)
            self.kept = Kept(response, decision.wire(), record)
            return StageAnswer.of(verdict, answer.judgment, list(answer.probabilities))
        with self.lock:
            judgment, verdict = self.gate.judged(
                self.engine, item.prompt, item.choices, item_span=item.item_span
            )
        # What the log keeps of a first stage's decision it keeps of this one's (with
        # --log-features, the hidden states a refit of this stage's probe reads), but not its
        # request: the first stage's record replays the request.
        response, record = self.context.respond(
            judgment,  # type: ignore[arg-type]  # an engine's Judgment, not a bare score
            verdict,
            self.gate,
            model=model,
            choices=item.choices,
        )
        self.kept = Kept(response, None, record)
        return StageAnswer.of(verdict, judgment, item.choices)


@dataclass
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
    kept: Kept | None = None  # what it last answered

    @property
    def settings(self) -> dict[str, Any]:
        """What each request to the server sets: the profile and the ``SENT`` overrides."""
        return {"profile": self.profile} | {f: getattr(self.overrides, f) for f in SENT}

    def answer(self, item: StageItem | QuestionItem, *, timeout_s: float | None) -> StageAnswer:
        """The server's decision; TimeoutError when it does not answer in time."""
        # A client per call: httpx fixes a client's timeout when it is made, and each call
        # has what is left of its own deadline. A connection costs little beside a pass.
        with (
            bounded(self.url, self.timeout_s, timeout_s) as limit,
            JudgeClient(self.url, self.api_key, timeout=limit, retries=NO_RETRIES) as client,
        ):
            if isinstance(item, QuestionItem):
                # Asked under this stage's profile and overrides in place of the question's.
                asked = msgspec.structs.replace(item.question, **self.settings)
                answered = client.systemone(item.state, {item.qid: asked})
            else:
                r = client.judge(
                    item.prompt, item.choices, item_span=item.item_span, **self.settings
                )
        if isinstance(item, QuestionItem):
            if item.qid not in answered.answers:
                raise ValueError(f"{self.url} answered no question {item.qid!r}")
            wire = answered.answers[item.qid]
            stage_answer = _of_wire(wire, answered.model)
            response = JudgeResponse.of_answer(
                wire,
                choice=stage_answer.choice,
                model=answered.model,
                latency_ms=answered.latency_ms,
            )
            self.kept = Kept(response, wire)
            return stage_answer
        stage_answer = _of_response(r, item.choices)
        self.kept = Kept(r)
        return stage_answer


def is_remote(target: str) -> bool:
    """Whether a stage's target is another server (a URL) rather than a model to load."""
    return target.startswith(("http://", "https://"))


@contextmanager
def bounded(url: str, own_s: float, left_s: float | None) -> Iterator[float]:
    """A call's time limit: the stage's own, or what is left of the cascade's deadline where
    that is less; httpx's timeout within it becomes the TimeoutError a cascade reads as
    ``stage_timeout``."""
    limit = own_s if left_s is None else min(left_s, own_s)
    try:
        yield limit
    except httpx.TimeoutException as exc:
        raise TimeoutError(f"{url} did not answer within {limit:g} s") from exc


def _of_response(r: JudgeResponse, choices: Sequence[str]) -> StageAnswer:
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


def _of_wire(wire: SystemOneAnswer, model: str) -> StageAnswer:
    """A stage's answer from a question's wire answer: its decision on its probabilities, the
    most probable of them its choice."""
    probs = wire.probabilities
    best = max(probs, key=probs.__getitem__)
    return carry(wire, StageAnswer, choice=best, confidence=probs[best], model=model)


def opened_stages(
    cascade: Mapping[str, LocalModel | str],
    profile: str | None,
    overrides: Overrides,
    open_gate: Callable[[str | None], Gate],
    *,
    choices: Sequence[str],
    field: str,
    context: GateContext | None = None,
    api_key: str | None = None,
) -> list[LocalStage | RemoteStage]:
    """One request's stage for each of ``cascade``'s later stages (by name: a loaded model,
    or another judge server's URL) under its ``profile`` P (stage NAME's is "P-NAME") and
    ``overrides``, made before any model work: a remote one as that server is asked
    (``api_key``: a fleet's servers share theirs); a local one with its gate, opened by
    ``open_gate`` and checked against its model and ``choices`` (a mismatch names ``field``),
    its decisions settled through ``context`` (a server's: its log; None: no log). Every
    front's cascade, for a judgment and a typed question alike."""
    stages: list[LocalStage | RemoteStage] = []
    for name, target in cascade.items():
        mine = None if profile is None else f"{profile}-{name}"
        if isinstance(target, str):
            stages.append(RemoteStage(name, target, mine, overrides, api_key))
            continue
        gate = open_gate(mine)
        gate.check_engine(target.engine, choices=choices, field=field)
        stages.append(LocalStage(name, target.engine, gate, target.lock, context or GateContext()))
    return stages


def asked_as(question: Question, overrides: Overrides) -> SystemOneQuestion:
    """A question as a later stage is asked it: its wire form (``service.systemone``) with
    the bound on its listings' spread it was asked under."""
    wire = msgspec.convert(msgspec.to_builtins(question), SystemOneQuestion)
    return msgspec.structs.replace(wire, max_order_spread=overrides.max_order_spread)
