"""Request and response bodies of the HTTP API.

Constraints live in the types, so a malformed body is refused with a 400 that names the
field before any work is done, and the OpenAPI document (``service.web.openapi``) shows every one
of them; what only the engine can check (choices whose token paths are ambiguous, a prompt too
long for the model) comes back as a 4xx from the engine's own errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

import msgspec
from msgspec import Meta

from calibration.carry import carry
from calibration.cascade import StageResult
from calibration.certificates.certify import ThresholdResult
from calibration.certificates.recertify import LabelsNeeded
from calibration.certificates.signal import SignalReport
from calibration.limits import MIN_EXAMPLES
from calibration.maps.label_free import LabelFree
from calibration.metrics import MetricReport
from calibration.policy import ReasonCode
from calibration.profile import NAME_PATTERN
from judge.limits import MAX_CHOICES

if TYPE_CHECKING:
    from calibration.policy import Verdict
    from judge import Judgment, Query

__all__ = [
    "BatchItem",
    "BatchRequest",
    "BatchResponse",
    "CalibrationMapSummary",
    "ErrorBody",
    "ErrorResponse",
    "FitMethod",
    "FitRequest",
    "ItemRequest",
    "ItemsBatch",
    "JudgeRequest",
    "JudgeResponse",
    "LabelItem",
    "LabelQueue",
    "LabelRequest",
    "LabelResult",
    "LabeledExample",
    "LabelsRequest",
    "LabelsResponse",
    "PairRequest",
    "ProfileName",
    "ProfileSummary",
    "ProfileVersion",
    "ProfileVersions",
    "QueueEntry",
    "ReadyResponse",
    "RefitRecord",
    "RollbackRequest",
    "SharedBatch",
    "SharedQuestion",
    "StatusResponse",
]

Choice = Annotated[str, Meta(min_length=1)]
# Unique: the engine refuses duplicates, and the schema says so (msgspec cannot check it).
Choices = Annotated[
    list[Choice],
    Meta(min_length=2, max_length=MAX_CHOICES, extra_json_schema={"uniqueItems": True}),
]
ProfileName = Annotated[str, Meta(pattern=f"^{NAME_PATTERN}$")]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
MAX_BATCH_ITEMS = 256
# A pair's candidates (``judge.questions.PairQuestion``): two names, each with its text; names
# and texts hold at least one visible character.
NonBlank = Annotated[str, Meta(min_length=1, pattern=r"\S")]
Candidates = Annotated[dict[NonBlank, NonBlank], Meta(min_length=2, max_length=2)]
# A criterion: free text, or an object whose values describe it ({"what": ...}), or nothing.
Criterion = str | dict[str, Any] | None


# What several request bodies share: each described once.
ChoicesField = Annotated[
    Choices,
    Meta(
        description="the answers allowed, two or more, distinct; the probabilities follow this order"
    ),
]
SystemField = Annotated[
    str | None, Meta(description="a system message before the prompt (default: the server's)")
]
PrefixField = Annotated[
    str | None,
    Meta(
        description="the text the answer starts with, so that the next token decides "
        '(default: {"answer": ")'
    ),
]
SuffixField = Annotated[
    str | None,
    Meta(description='the text that closes the answer after a choice (default: "})'),
]
ProfileField = Annotated[
    ProfileName | None,
    Meta(
        description="the calibration profile to decide through, by its name (GET /profiles); without one "
        "the decision escalates unless uncertified_threshold opts in"
    ),
]
ThresholdField = Annotated[
    Probability | None,
    Meta(
        description="accept at this confidence instead of the profile's certified threshold; the decision "
        "is then not certified (a profile that certified none: 422)"
    ),
]
UncertifiedField = Annotated[
    Probability | None,
    Meta(
        description="the opt-in: accept at this confidence where no certified threshold applies; the "
        "decision says certified: false"
    ),
]
MassField = Annotated[
    Probability | None,
    Meta(
        description="escalate (low_choice_mass) when the choices hold less of the model's probability; "
        "overrides the profile's and the server's"
    ),
]
ReturnPromptField = Annotated[bool, Meta(description="answer with the prompt as the model read it")]
ValuesField = Annotated[
    dict[str, float] | None,
    Meta(
        description="a score: a number per choice, so that the answer carries the expected value and its "
        "standard deviation (default for numeral choices: the numerals)"
    ),
]
MaxStdField = Annotated[
    Annotated[float, Meta(ge=0.0)] | None,
    Meta(
        description="a score: escalate (high_std) when the standard deviation is above this; overrides the "
        "profile's"
    ),
]
SpanField = Annotated[
    tuple[Annotated[int, Meta(ge=0)], Annotated[int, Meta(ge=1)]] | None,
    Meta(
        description="the [start, end) characters of the prompt that hold the item, for a probe that reads "
        "the mean hidden state over it: a profile fitted on marked items needs it, one fitted "
        "on whole prompts refuses it"
    ),
]


class JudgeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /judge``: one prompt between fixed choices."""

    prompt: Annotated[str, Meta(description="the whole prompt, the user's message the model reads")]
    choices: ChoicesField
    system: SystemField = None
    profile: ProfileField = None
    threshold: ThresholdField = None
    uncertified_threshold: UncertifiedField = None
    min_choice_mass: MassField = None
    response_prefix: PrefixField = None
    response_suffix: SuffixField = None
    return_prompt: ReturnPromptField = False
    values: ValuesField = None
    max_std: MaxStdField = None
    item_span: SpanField = None

    def query(self) -> Query:
        """The engine's query for this request."""
        from judge import Query  # here: the client decodes these types without the engine

        return Query(
            prompt=self.prompt,
            choices=list(self.choices),
            system=self.system,
            response_prefix=self.response_prefix,
            response_suffix=self.response_suffix,
            item_span=self.item_span,
        )


class PairRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /judge`` for a pair: which of two named candidates is the better, by the
    instructions and criteria, about ``state`` (``judge.answers``, "Pairs"; the System One
    ``pair`` question with its state). Told apart from a JudgeRequest by its keys
    (``service.bodies``). Judged in both orders by default; the response's ``choice`` is the
    winner's name, and the gate bounds how far the two orders disagreed
    (``max_order_spread``, reason code ``position_inconsistent``)."""

    state: Annotated[
        Any,
        Meta(
            description="what both candidates are judged against: a string as it is, other JSON indented"
        ),
    ]
    instructions: Annotated[
        NonBlank, Meta(description="what makes one candidate better than the other")
    ]
    candidates: Annotated[
        Candidates, Meta(description="two names, each with its text; the answer is a name")
    ]
    criteria: Annotated[
        Criterion,
        Meta(description="what to weigh: free text, an object of named criteria, or none"),
    ] = None
    order: Annotated[
        Literal["given", "invariant"],
        Meta(
            description="invariant: judged in both orders and averaged; given: once, in the order given"
        ),
    ] = "invariant"
    profile: ProfileField = None  # fitted for the two names
    threshold: ThresholdField = None
    uncertified_threshold: UncertifiedField = None
    min_choice_mass: MassField = None
    max_order_spread: Annotated[
        Probability | None,
        Meta(
            description="escalate (position_inconsistent) when the two orders disagree on a candidate's "
            "probability by more (default for a pair: 0.2)"
        ),
    ] = None
    return_prompt: ReturnPromptField = False  # the first order's prompt


class ItemRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /judge`` with the item alone, for a profile fitted on a task (one that carries
    its prompt template, ``calibration.template``): the item is put in the very prompt the
    profile was fitted on, its characters marked, and judged between the profile's choices
    (in its order). Told apart from a JudgeRequest by its key ``item``."""

    item: Annotated[
        str, Meta(description="the item alone, put in the prompt the profile was fitted on")
    ]
    profile: ProfileField = None  # needed: a 422 names it when missing
    threshold: ThresholdField = None
    uncertified_threshold: UncertifiedField = None
    min_choice_mass: MassField = None
    return_prompt: ReturnPromptField = False
    values: ValuesField = None
    max_std: MaxStdField = None

    def judge_request(
        self, prompt: str, item_span: tuple[int, int] | None, choices: list[str], system: str | None
    ) -> JudgeRequest:
        """The whole request it stands for: ``prompt``, rendered from the profile's template
        around the item, with the item's span, and the profile's ``choices``."""
        # Its gate's fields (profile, thresholds, return_prompt) are this request's own.
        return carry(
            self, JudgeRequest, prompt=prompt, choices=choices, system=system, item_span=item_span
        )


# POST /judge: one of the three, by the keys it has (service.bodies)
JudgeBody = JudgeRequest | PairRequest | ItemRequest


class JudgeResponse(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="type", tag="judgment"
):
    """One judgment and the policy's decision on it (``calibration.Verdict``, flattened)."""

    choice: str  # the most probable choice, after calibration
    confidence: float  # its probability, calibrated when a profile applies
    probabilities: dict[str, float]  # calibrated when a profile applies; the request's order
    raw_probabilities: dict[str, float]  # the model's own, in the request's order
    decision: Literal["accept", "escalate"]
    reasons: list[str]  # why it escalated, one line each; empty when accepted
    # One per reason, for programs: below_threshold, no_certified_threshold, low_choice_mass,
    # ambiguous_set, high_std, order_sensitive, position_inconsistent, partial_logprobs
    # (calibration.Verdict.reason_codes).
    reason_codes: list[ReasonCode]
    threshold: float | None  # the threshold in force; None when the profile has none
    certified: bool  # the threshold is the profile's certified one, with no override
    # The profile's fitted temperature; None without a profile, and for a probe, whose
    # probabilities come from a learned head rather than a rescaling (see calibration_method).
    temperature: float | None
    choice_mass: float
    prediction_set: list[str] | None  # the profile's conformal set; None without a profile
    profile: str | None
    model: str
    latency_ms: float
    # What pins this decision (calibration.Verdict): a fresh UUID version 7 for the judgment,
    # the sha256 of the token ids it fed (judge.identity.tokens_sha256), of the weights
    # (Judge.model_sha256) and of the policy in force (calibration.Policy.sha256).
    judgment_id: str
    tokens_sha256: str
    model_sha256: str
    policy_sha256: str
    # The profile's version: the ETag GET /profiles/{name} answers; None without a profile.
    profile_etag: str | None
    # In the audit sample (the server's --audit-rate): a person should label this decision
    # (POST /judgments/{judgment_id}/label), whatever it was. Omitted when false.
    audit: bool = False
    # The sha256 of the low-rank adapter the judgment ran under (a profile fitted with
    # --method adapter carries one); omitted when none.
    adapter_sha256: str | None = None
    prompt: str | None = None  # only with return_prompt
    # A score's (with values, numeral choices under max_std, or a profile with values):
    # sum of p * value and its standard deviation, over the calibrated probabilities.
    expected_value: float | None = None
    std: float | None = None
    max_std: float | None = None  # the bound in force
    # The profile's calibration map (calibration.maps.map_types): "temperature", "bias_temperature",
    # "probe", ...; None without a profile. A probe also names the hidden-state layers it read
    # (the features themselves never leave the server).
    calibration_method: str | None = None
    feature_layers: list[int] | None = None
    # With a cascade (``judge serve --cascade``): the stage whose gate accepted (None:
    # escalated past the last, to a person), and each stage tried, in order, with its answer
    # or its failure (``stage_failed``, ``stage_timeout``), its time and tokens. The fields
    # above are then the deciding stage's judgment, else the last that answered. Omitted
    # without a cascade.
    decided_by: str | None = None
    cascade: list[StageResult] | None = None
    # A pair (PairRequest): the orders judged (2, or 1 with order "given"), how far they
    # disagreed on a candidate's probability, and the bound in force. Omitted otherwise.
    orderings: int | None = None
    order_spread: float | None = None
    max_order_spread: float | None = None
    # A full prompt sent to a profile that carries its template, and not that template around
    # its item (calibration.template): the certificate was measured on other prompts.
    outside_template: bool = False

    @classmethod
    def of(
        cls,
        judgment: Judgment,
        verdict: Verdict,
        *,
        choices: Sequence[str] | None = None,
        return_prompt: bool = False,
        orderings: int | None = None,
    ) -> Self:
        """The wire form of ``verdict`` on ``judgment``: the one place it is built.

        Every decided field is the verdict's, the calibration map's method, temperature and
        probe layers included; ``judgment`` gives what only the judging knows (model, latency,
        prompt). ``choices`` orders the probabilities (the request's order; default: the
        verdict's, which is the profile's); ``orderings``: a pair's orders judged (its spread
        and the bound are the verdict's).
        """
        return verdict.carried(
            cls,
            verdict.choices if choices is None else choices,
            model=judgment.model,
            latency_ms=judgment.latency_ms,
            judgment_id=verdict.judgment_id or judgment.judgment_id,
            tokens_sha256=verdict.tokens_sha256 or judgment.tokens_sha256,
            model_sha256=verdict.model_sha256 or judgment.model_sha256,
            policy_sha256=verdict.policy_sha256 or "",
            prompt=judgment.prompt if return_prompt else None,
            orderings=orderings,
        )

    @classmethod
    def of_answer(
        cls, answer: msgspec.Struct, *, choice: str, model: str, latency_ms: float
    ) -> Self:
        """A typed answer's wire form another judge server gave (``service.systemone``: a
        pair a cascade's remote stage decided) in a judgment's shape: every field it shares
        is the answer's, ``choice`` its winner; what that server did not say is empty."""
        fields = ("judgment_id", "tokens_sha256", "model_sha256", "policy_sha256")
        said = {f: getattr(answer, f, None) or "" for f in fields}
        return carry(
            answer,
            cls,
            choice=choice,
            confidence=answer.probabilities[choice],  # type: ignore[attr-defined]
            model=model,
            latency_ms=latency_ms,
            **said,
        )


# A batch is one of two shapes, told apart by the key it has (``service.bodies``): ``items``,
# or ``context`` with ``questions``. The other shape's keys may be sent as null (older clients
# sent every key), and nothing else: so each type carries them, typed None, and the schema
# says so; a body with both or neither shape's keys is a 400 that names ``items``.


# One of a batch's items: a whole request, or an item alone for a profile fitted on a task;
# told apart by the keys it has, as POST /judge's bodies are (``service.bodies.decode_each``).
BatchItem = JudgeRequest | ItemRequest


class ItemsBatch(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """Independent requests, each judged (or refused) on its own.

    msgspec tells the members of a union of Structs apart by a tag only, and a batch item has
    none: so ``items`` are read raw here and each is decoded as a ``BatchItem`` by its keys
    (``service.bodies.decode_each``), before any work; the schema says what each may be
    (``service.web.openapi``)."""

    items: Annotated[
        Annotated[list[msgspec.Raw], Meta(max_length=MAX_BATCH_ITEMS)],
        Meta(
            description="each a whole request or an item alone, as POST /judge takes them; each is answered "
            "or refused in its place"
        ),
    ]
    context: Annotated[None, Meta(description="the other shape's key: absent, or null")] = None
    questions: Annotated[None, Meta(description="the other shape's key: absent, or null")] = None


class SharedBatch(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """Questions about one ``context``, which the engine encodes once for all of them."""

    context: Annotated[
        str, Meta(description="the text every question is about, computed once for all of them")
    ]
    questions: Annotated[
        Annotated[list[SharedQuestion], Meta(max_length=MAX_BATCH_ITEMS)],
        Meta(description="each question's prompt follows the context"),
    ]
    items: Annotated[None, Meta(description="the other shape's key: absent, or null")] = None


BatchRequest = ItemsBatch | SharedBatch


class SharedQuestion(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A question about the batch's shared context; the prompt is context + question."""

    prompt: Annotated[str, Meta(description="the question, read after the shared context")]
    choices: ChoicesField
    profile: ProfileField = None
    threshold: ThresholdField = None
    uncertified_threshold: UncertifiedField = None
    min_choice_mass: MassField = None
    return_prompt: ReturnPromptField = False

    def query(self) -> Query:
        """The engine's query for this question alone; the engine's own template applies."""
        from judge import Query  # here: the client decodes these types without the engine

        return Query(prompt=self.prompt, choices=list(self.choices))


class BatchResponse(msgspec.Struct, frozen=True, kw_only=True):
    results: list[JudgeResponse | ErrorBody]


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="error"):
    """An item's error inside a batch, shaped like the top-level error bodies."""

    status_code: int
    detail: str
    field: str | None = None


# --- feedback: the true label of a logged decision (service.log.decision_log) ---------------------

MAX_LABELS = 10_000  # labels one POST /judgments/labels may carry
JudgmentId = Annotated[str, Meta(min_length=1, max_length=64)]


class LabelRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The true label of one decision: one of its choices. ``replace`` changes a label given
    before; without it, another label than the stored one is a 409."""

    label: Annotated[Choice, Meta(description="the true label: one of the decision's choices")]
    replace: Annotated[
        bool, Meta(description="change a label given before (else another label is a 409)")
    ] = False


class LabelItem(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One logged decision's true label."""

    judgment_id: Annotated[
        JudgmentId, Meta(description="the decision's judgment_id, as its response gave it")
    ]
    label: Annotated[Choice, Meta(description="the true label: one of the decision's choices")]


class LabelsRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Labels of many decisions; each is stored or refused on its own."""

    labels: Annotated[
        Annotated[list[LabelItem], Meta(min_length=1, max_length=MAX_LABELS)],
        Meta(description="each a judgment_id and its true label"),
    ]
    replace: Annotated[
        bool, Meta(description="change labels given before (else another label is refused)")
    ] = False


class LabelResult(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What became of one label: stored ("labeled", "relabeled"), already so ("unchanged"),
    or refused ("error", with the status a single label would have got and why)."""

    judgment_id: str
    label: str
    status: Literal["labeled", "relabeled", "unchanged", "error"]
    previous: str | None = None  # the label it replaced, or the one that stands
    status_code: int | None = None  # for an error: 404, 409 or 422
    detail: str | None = None


class LabelsResponse(msgspec.Struct, frozen=True, kw_only=True):
    results: list[LabelResult]  # one per label, in order


class LabeledExample(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One labelled prompt to fit on. Mark every example's item (``item_span``) or none:
    then the whole prompts' means compete, and requests to the profile mark none."""

    prompt: Annotated[
        str, Meta(description="the whole prompt, as a request to the profile will send it")
    ]
    label: Annotated[Choice, Meta(description="its true answer: one of the choices")]
    item_span: SpanField = None


FitMethod = Literal["auto", "temperature", "bias_temperature", "probe"]


class FitRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Labeled examples to fit a profile on, and how.

    ``method``: "temperature" fits a temperature; "bias_temperature" lets a per-choice bias
    compete with it (cross-validated NLL decides); "probe" fits a learned head on the model's
    hidden state, and needs at least 100 examples (``calibration.maps.probe.MIN_PROBE_EXAMPLES``)
    and an engine that exposes hidden states; "auto" lets all three compete, the probe only
    where it can be tried (the profile's note says when it was not).
    """

    choices: ChoicesField
    examples: Annotated[
        Annotated[list[LabeledExample], Meta(min_length=MIN_EXAMPLES, max_length=20_000)],
        Meta(description="the labelled prompts (a probe needs 100)"),
    ]
    system: SystemField = None
    response_prefix: PrefixField = None
    response_suffix: SuffixField = None
    target_precision: Annotated[
        Annotated[float, Meta(gt=0.0, lt=1.0)],
        Meta(description="the precision the certified threshold guarantees among accepted answers"),
    ] = 0.9
    delta: Annotated[
        Annotated[float, Meta(gt=0.0, lt=1.0)],
        Meta(description="the probability that the certificate is wrong, at most"),
    ] = 0.1
    alpha: Annotated[
        Annotated[float, Meta(gt=0.0, lt=1.0)],
        Meta(
            description="the conformal prediction set holds the true label with probability at least 1 - alpha"
        ),
    ] = 0.1
    method: Annotated[FitMethod, Meta(description="the map to fit; auto lets them compete")] = (
        "auto"
    )
    # calibration.certificates.class_certify
    per_class: Annotated[
        bool, Meta(description="also certify a threshold per predicted class, and serve that rule")
    ] = False


class CalibrationMapSummary(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    method: str
    temperature: float | None  # None for a probe: it does not rescale, it reads hidden states
    layers: list[int] | None = None  # a probe's hidden-state layers


class ProfileSummary(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    model: str
    choices: list[str]
    calibration_map: CalibrationMapSummary
    threshold: ThresholdResult
    metrics_after: MetricReport | None  # None for a profile fitted without labels
    n_examples: int
    created_at: str
    signal: SignalReport | None = None  # does the model beat the label prior? (labeled fits)
    label_free: LabelFree | None = None  # how a label-free correction was fitted
    values: dict[str, float] | None = None
    max_std: float | None = None
    # It carries the prompt it was fitted on: a request may send the item alone.
    takes_item: bool = False


class QueueEntry(msgspec.Struct, frozen=True, kw_only=True):
    """A logged decision to label, as a person sees it (``service.log.labelling_queue``)."""

    judgment_id: str
    stream: Literal["audit", "teach"]
    item: str  # the item alone where the request marked it, else the whole prompt
    prompt: str
    choices: list[str]  # the profile's order: label with one of them
    probabilities: dict[str, float]  # calibrated, as served
    choice: str
    decision: str


class LabelQueue(msgspec.Struct, frozen=True, kw_only=True):
    """What to label next under a profile: the next decisions of each stream, and what the
    labelled audit decisions say of its current version."""

    profile: str
    etag: str  # the version the health speaks of
    audit: list[QueueEntry]  # the next few, oldest first: they certify
    teach: list[QueueEntry]  # the next few, least certain first: they only fit
    pending_audit: int
    pending_teach: int
    unreadable: int  # unlabelled, but logged without the request: nothing to show
    n_audited: int
    n_audited_labeled: int
    threshold: float | None  # the version's certified threshold; None: none
    coverage: float  # its certified coverage; 0 where none
    labels: LabelsNeeded | None  # about how many audit labels more would open the gate


class RollbackRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Serve a kept version of a profile again: its ETag (``GET /profiles/{name}/versions``)."""

    etag: Annotated[
        Annotated[str, Meta(pattern='^"[0-9a-f]{64}"$')],
        Meta(description="the ETag of a kept version (GET /profiles/{name}/versions)"),
    ]


class RefitRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One background refit of a profile from its decision log, and what became of it."""

    at: str  # ISO 8601, UTC: when it finished
    from_etag: str  # the version it refitted
    etag: str | None  # the refit's version (kept whether served or not); None: it failed
    served: bool
    reason: str
    labels: int  # labelled decisions it read (audited and taught)
    coverage_before: float  # certified coverage of the version refitted (0: none certified)
    coverage_after: float | None  # the refit's; None: it failed


class ProfileVersion(msgspec.Struct, frozen=True, kw_only=True):
    etag: str
    stored_at: str  # ISO 8601, UTC: when it was last written
    current: bool  # the version served now


class ProfileVersions(msgspec.Struct, frozen=True, kw_only=True):
    """A profile's kept versions, newest first, and its background refits, newest last."""

    name: str
    versions: list[ProfileVersion]
    refits: list[RefitRecord]


class ErrorResponse(msgspec.Struct, frozen=True, kw_only=True):
    """Every error's body: the status again, what is wrong, and the field at fault if one is."""

    status_code: int
    detail: str
    field: str | None = None


class StatusResponse(msgspec.Struct, frozen=True, kw_only=True):
    status: str


class ReadyResponse(msgspec.Struct, frozen=True, kw_only=True):
    status: Literal["ready", "loading", "failed"]
    model: str | None = None  # when ready
    dtype: str | None = None  # when ready
    # When ready: whether a judgment's probabilities are independent of its batch and of the
    # prefix cache (judge.batch_invariant; off with judge serve --batch-variant).
    batch_invariant: bool | None = None
    # When ready, where the engine says: the arithmetic in words (``Judge.arithmetic``: the
    # chunk and block sizes measured for this machine's kernels).
    arithmetic: str | None = None
    detail: str | None = None  # why loading failed
