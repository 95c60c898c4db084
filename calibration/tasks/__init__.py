"""Labeled tasks: files on disk, and "judge a labeled set, then fit a calibration profile".

    calibration.tasks.files     Task, LabeledItem, load_task, load_split, task_prompt, TaskError
    calibration.tasks.labeled   LabeledScores, labeled_queries, judge_labeled, judge_task_items,
                    scores_from_judgments, fit_labeled, content_free_prompts,
                    load_prompts, judge_unlabeled, fit_unlabeled

Sits above ``judge`` and calibration's core (it uses both; nothing else in ``calibration``
imports it, so ``import calibration`` stays free of torch) and below ``service`` (which uses it), so the command line, the HTTP fit endpoint and the benchmarks calibrate the
same way.
"""

from calibration.tasks.files import LabeledItem, Task, TaskError, load_split, load_task, task_prompt
from calibration.tasks.labeled import (
    LabeledScores,
    content_free_prompts,
    fit_labeled,
    fit_unlabeled,
    judge_labeled,
    judge_task_items,
    judge_unlabeled,
    labeled_queries,
    load_prompts,
    scores_from_judgments,
)

__all__ = [
    "LabeledItem",
    "LabeledScores",
    "Task",
    "TaskError",
    "content_free_prompts",
    "fit_labeled",
    "fit_unlabeled",
    "judge_labeled",
    "judge_task_items",
    "judge_unlabeled",
    "labeled_queries",
    "load_prompts",
    "load_split",
    "load_task",
    "scores_from_judgments",
    "task_prompt",
]
