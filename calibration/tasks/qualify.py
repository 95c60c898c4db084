"""Judge a task's items the four ways ``calibration.qualify`` measures, and qualify an engine.

For one task: the test items as ``task_prompt`` writes them; the same items again in the
reverse order and another batch size (each lands in another slot of another batch, on a warm
prefix cache: an "identical run" that batching could change); the same items with the
allowed answers listed in the reverse order; and items of the other split, for the
temperature and the label prior of the signal verdict. ``qualify_engine`` does it for a
suite of tasks and says whether the engine qualifies on every one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from calibration.qualify import Criteria, Qualification, TaskQualification, qualify_task
from calibration.tasks.files import Task, load_split
from calibration.tasks.labeled import LabeledScores, judge_task_items
from judge import Engine

__all__ = ["qualify_engine", "qualify_on_task"]

# The rerun's batch size: prime, and unlike the first run's, so that no item keeps its slot.
_RERUN_BATCH = 3


def qualify_on_task(
    engine: Engine,
    task: Task,
    *,
    limit: int | None = None,
    fit_limit: int | None = None,
    split: str = "test",
    fit_split: str = "calibration",
    batch_size: int = 8,
    criteria: Criteria | None = None,
    progress: Callable[[int], None] | None = None,
) -> TaskQualification:
    """Judge ``task``'s ``split`` (the first ``limit`` items) three ways and its ``fit_split``
    (the first ``fit_limit``) once, and measure them against ``criteria``."""
    items, _ = load_split(task, split, limit)
    fit_items, _ = load_split(task, fit_split, fit_limit)
    first = judge_task_items(engine, task, items, batch_size=batch_size, progress=progress)
    again = judge_task_items(engine, task, items[::-1], batch_size=_RERUN_BATCH, progress=progress)
    listed = msgspec.structs.replace(task, choices=task.choices[::-1])
    reordered = judge_task_items(
        engine, listed, items, choices=task.choices, batch_size=batch_size, progress=progress
    )
    fit = judge_task_items(engine, task, fit_items, batch_size=batch_size, progress=progress)
    return qualify_task(
        task.name,
        first.log_probabilities,
        first.labels,
        first.choice_mass,
        rerun_log_probs=_reversed(again).log_probabilities,
        reordered_log_probs=reordered.log_probabilities,
        fit_log_probs=fit.log_probabilities,
        fit_labels=fit.labels,
        choices=list(task.choices),
        criteria=criteria,
    )


def qualify_engine(
    engine: Engine,
    tasks: Sequence[Task],
    *,
    criteria: Criteria | None = None,
    limit: int | None = None,
    fit_limit: int | None = None,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
) -> Qualification:
    """``qualify_on_task`` on each of ``tasks``, their default splits; the engine qualifies
    when no task misses a criterion."""
    rule = Criteria() if criteria is None else criteria
    results = [
        qualify_on_task(
            engine,
            task,
            limit=limit,
            fit_limit=fit_limit,
            batch_size=batch_size,
            criteria=rule,
            progress=progress,
        )
        for task in tasks
    ]
    return Qualification(
        fingerprint=engine.fingerprint(),
        arithmetic=str(getattr(engine, "arithmetic", "unknown")),
        criteria=rule,
        tasks=results,
        qualifies=all(r.qualifies for r in results),
    )


def _reversed(scores: LabeledScores) -> LabeledScores:
    return LabeledScores(
        log_probabilities=scores.log_probabilities[::-1],
        choice_mass=scores.choice_mass[::-1],
        labels=scores.labels[::-1],
    )
