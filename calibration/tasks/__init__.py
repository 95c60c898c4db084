"""Labeled tasks: files on disk, and "judge a labeled set, then fit a calibration profile".

    calibration.tasks.files     Task, LabeledItem, load_task, load_split, task_prompt, task_template,
                                TaskError
    calibration.tasks.labeled   LabeledScores, labeled_queries, judge_labeled, judge_task_items,
                    scores_from_judgments, fit_labeled, content_free_prompts,
                    load_prompts, judge_unlabeled, fit_unlabeled
    calibration.tasks.qualify   qualify_on_task, qualify_engine (``judge qualify``)
    calibration.tasks.cascade   CascadeStageData, FittedCascade, fit_cascade, cascade_decisions
    calibration.tasks.adapter   AdapterProfile, fit_adapter_profile (``--method adapter``;
                                its training in calibration.tasks.adapter.training)
    calibration.tasks.item_queue  ItemQueue, PoolItem, Advice, advise, load_pool (``judge label
                                --queue --items``)
    calibration.tasks.pool_scores judge_pool, pool_key: a file's scores, judged once and kept

Sits above ``judge`` and calibration's core (it uses both; nothing else in ``calibration``
imports it, so ``import calibration`` stays free of torch) and below ``service`` (which uses it), so the command line, the HTTP fit endpoint and the benchmarks calibrate the
same way.
"""

# Everything the two modules export, and only that: a name added to a module's __all__ is
# exported here without a second list to keep in step.
from calibration.tasks import adapter, cascade, files, item_queue, labeled, pool_scores, qualify
from calibration.tasks.adapter import *  # noqa: F403
from calibration.tasks.cascade import *  # noqa: F403
from calibration.tasks.files import *  # noqa: F403
from calibration.tasks.item_queue import *  # noqa: F403
from calibration.tasks.labeled import *  # noqa: F403
from calibration.tasks.pool_scores import *  # noqa: F403
from calibration.tasks.qualify import *  # noqa: F403

__all__ = sorted(
    [
        *adapter.__all__,
        *cascade.__all__,
        *files.__all__,
        *item_queue.__all__,
        *labeled.__all__,
        *pool_scores.__all__,
        *qualify.__all__,
    ]
)
