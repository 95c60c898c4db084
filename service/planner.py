"""The decision core's planner: what every server front does between a judgment request and
its response, in one place.

``plan_judgment`` turns a request (its whole query, the profile it names, its overrides) into
a ``PlannedJudgment`` before any model work: the overrides checked (``scored``), the gate
opened on the profile's version and checked against the engine (``GateContext.opened``), the
query asking for what the gate reads and whether its prompt lies outside the profile's
template (``Gate.plan``). ``item_alone`` is the step before it for an item sent without its
prompt. After the model's pass, ``PlannedJudgment.respond`` turns the judgment into the
verdict, the response and the decision-log record (``GateContext.respond``).

HTTP (``service.web.serving_judge``) and MCP (``service.mcp.server``) plan every judgment
and respond to it here; each keeps its own way of running the model (the batcher, the lock)
and its cascade's later stages. The command line opens one gate for a whole file
(``service.cli.ask``) and plans each line on it with ``Gate.plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.gate_context import GateContext, ItemPrompt, item_prompt, scored

if TYPE_CHECKING:
    from collections.abc import Sequence

    from calibration import CalibrationProfile, Gate, Overrides, Verdict
    from calibration.gate import JudgingEngine
    from judge import Judgment, Query
    from service.log.record import LoggedDecision
    from service.schemas import JudgeResponse

__all__ = ["PlannedJudgment", "item_alone", "plan_judgment"]


@dataclass(frozen=True)
class PlannedJudgment:
    """A judgment request ready for the model: the query to run and the gate that decides."""

    query: Query  # asking for what the gate reads (a probe's layers, its adapter)
    gate: Gate
    # The prompt is not the profile's template around its item (``Gate.plan``).
    outside_template: bool = False

    def respond(
        self,
        judgment: Judgment,
        context: GateContext,
        *,
        model: str,
        choices: Sequence[str] | None = None,
        return_prompt: bool = False,
    ) -> tuple[JudgeResponse, Verdict, LoggedDecision | None]:
        """The gate's verdict on ``judgment``, the response (probabilities in ``choices``'
        order: the request's) and the decision-log record (None: no log)."""
        verdict = self.gate.decide(judgment, outside_template=self.outside_template)
        response, record = context.respond(
            judgment,
            verdict,
            self.gate,
            model=model,
            query=self.query,
            choices=choices,
            return_prompt=return_prompt,
        )
        return response, verdict, record


def item_alone(
    context: GateContext, name: str, item: str, field: str = "profile"
) -> tuple[ItemPrompt, tuple[CalibrationProfile, str]]:
    """What an item sent alone to profile ``name`` stands for (``item_prompt``: the prompt the
    profile was fitted on around it, the profile's choices and system prompt), and the
    version it was read from, which its gate must open on (the store is read once: a profile
    stored in between cannot render the item in one version's template and decide it under
    another's certificate). A missing profile is a ProfileError naming ``field``; one fitted
    on no task, a ProfileMismatchError naming ``item``."""
    version = context.read(name, field)
    assert version is not None  # a name reads a version, or raises
    return item_prompt(version[0], item), version


def plan_judgment(
    context: GateContext,
    engine: JudgingEngine,
    query: Query,
    name: str | None,
    overrides: Overrides,
    *,
    version: tuple[CalibrationProfile, str] | None = None,
    field: str | None = None,
    shared: bool = False,
) -> PlannedJudgment:
    """Plan ``query`` under profile ``name`` (on ``version`` where the request read it
    already) and ``overrides``; ``shared``: a question about a context other questions share.
    No model work, no tokenizing; a refusal names its field (``GateContext.opened``)."""
    overrides = scored(overrides, query.choices, profile=name)
    gate = context.opened(
        engine,
        name,
        overrides,
        template=query,
        choices=query.choices,
        field=field,
        version=version,
    )
    asked, outside = gate.plan(query, shared=shared)
    return PlannedJudgment(asked, gate, outside)
