"""Fit a profile whose probe reads a layer under low-rank adapters trained on the labels.

The steps, each on the items the step may see (the probe split of ``calibration.fitting``,
5:1:4, fixed by the labels and the seed before anything is fitted):

1. judge every item with the model as loaded and fit a probe on the fit split
   (``method probe``): it chooses the layer, what to read of it and the regularisation
   (``AdapterProfile.probe``). The profile the adapter must beat is that probe's, or, with the
   settings' methods "auto", whichever of the scalar maps and the probe ``auto`` chooses on
   the same split (``AdapterProfile.rival``): so ``--method adapter`` chooses between
   temperature, probe and adapter by measurement on items none of them was fitted on;
2. warm-start a head on that layer's states alone (the probe's choice, refitted without the
   choices' log-probabilities, which the layers above the adapter would change) and train
   adapters under it on the fit split's items (``calibration.tasks.adapter.training``: a validation fold of
   those stops it and sets its temperature);
3. keep what wins on the validation fold, items neither map was fitted on: the adapter's
   head (its temperature applied) against the rival's out-of-fold probabilities there (a
   scalar map's are its fit's: one or a few parameters), by NLL. Where the rival wins, its
   profile is the result and says why;
4. else judge every item again with the adapters merged, and certify the trained head as
   given (``fit_profile(trained=TrainedHead(...))``) on the conformal and certify splits,
   which neither the adapters nor the head saw: the guarantee is the probe's, exact.

``torch`` and peft are imported only by the training (``calibration.tasks.adapter.training``),
when this runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from calibration.fit_data import Provenance
from calibration.fit_settings import DEFAULT_SETTINGS, FitSettings
from calibration.maps.map_types import Probe
from calibration.maps.probe import candidate_layers, fit_probe_weights, probe_input
from calibration.tasks.files import (
    LabeledItems,
    Task,
    task_item_span,
    task_prompt,
    task_template,
    taught_items,
)
from calibration.tasks.labeled import LabeledScores, fit_labeled, judge_task_items, labeled_queries

if TYPE_CHECKING:
    from calibration import CalibrationProfile
    from calibration.tasks.adapter.training import AdapterFit, AdapterSettings
    from judge.engine import Judge

__all__ = ["AdapterProfile", "fit_adapter_profile"]


@dataclass(frozen=True)
class AdapterProfile:
    """The profile kept, the frozen probe's on the same split, and how the adapter did."""

    profile: CalibrationProfile  # the adapter's, or the rival's where it won (``winner``)
    probe: CalibrationProfile  # the probe the adapter's head started from
    rival: CalibrationProfile  # what the adapter had to beat: the probe, or auto's choice
    fit: AdapterFit
    # The profile's engine's scores of every item (columns in task.choices order): the
    # adapted engine's, or the base engine's where the rival was kept.
    scores: LabeledScores
    # "adapter", or the rival's method ("probe", "temperature", ...): the lower NLL on the
    # validation fold.
    winner: str
    # NLL on the validation fold: "adapter" (its head), "rival" (out of fold).
    validation_nll: dict[str, float]


def fit_adapter_profile(
    engine: Judge,
    task: Task,
    labeled: LabeledItems,
    name: str,
    *,
    settings: FitSettings = DEFAULT_SETTINGS,
    adapter_settings: AdapterSettings | None = None,
    batch_size: int = 8,
    progress: Callable[[str, int, int], None] | None = None,
    keep_adapter: bool = False,
) -> AdapterProfile:
    """Fit and certify an adapter profile on the ``labeled`` items of ``task`` (see the module
    docstring); ``progress(stage, done, total)`` follows the judging ("judge", "judge
    adapted") and the training ("states", "train"). ``keep_adapter``: certify the adapter
    even where the rival wins on the validation fold. ``settings.methods`` "auto" (the
    default) makes the rival auto's choice between the scalar maps and the probe; any other
    methods, the probe."""
    from calibration.fitting import TrainedHead, split_with_taught
    from calibration.maps.scaling import CalibrationFit
    from calibration.tasks.adapter.training import fit_adapter, require_peft

    require_peft()  # before the judging, minutes before the training would find it missing
    items = labeled.items
    taught = taught_items(items)  # chosen to teach: they train the adapter, never certify

    def judged(judge: Judge, stage: str, layers: Sequence[int]) -> LabeledScores:
        done = [0]

        def step(n: int) -> None:
            done[0] += n
            if progress is not None:
                progress(stage, done[0], len(items))

        scores = judge_task_items(
            judge,
            task,
            items,
            batch_size=batch_size,
            progress=step,
            feature_layers=layers,
            span_layers=layers,
        )
        return dataclasses.replace(scores, fit_only=taught)

    fingerprint = engine.fingerprint()
    num_layers = fingerprint.num_layers
    if not num_layers:
        raise ValueError("an adapter needs a model that reports its layers")
    probe_settings = msgspec.structs.replace(settings, methods=("probe",))
    base = judged(engine, "judge", candidate_layers(num_layers))
    provenance = Provenance(
        fingerprint=fingerprint,
        dataset=labeled.dataset,
        dataset_sha256=labeled.sha256,
        template=task_template(task),
    )
    auto = settings.methods == "auto"
    rival = fit_labeled(name, base, task.choices, provenance, settings if auto else probe_settings)
    rival_profile, rival_oof = rival.profile, rival.out_of_sample
    if isinstance(rival_profile.calibration_map, Probe):
        probe_profile = rival_profile
    else:  # auto chose a scalar map: the head still starts from the probe
        probe_profile = fit_labeled(name, base, task.choices, provenance, probe_settings).profile
    if rival_profile.split != probe_profile.split:
        raise AssertionError("auto and the probe must share the probe split")  # 5:1:4 both
    probe = probe_profile.calibration_map
    assert isinstance(probe, Probe)  # method probe
    layer, reads = max(probe.layers), probe.reads
    fit_idx, _, _, _ = split_with_taught(
        base.labels, settings.seed, True, taught, allotment=settings.allotment
    )
    k = len(task.choices)
    x = probe_input(reads, [layer], base.features, base.span_features, base.feature_layers)
    x_fit, y_fit = x[fit_idx], base.labels[fit_idx]

    def warm_start(train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # The probe's layer, reads and C, refitted without the log-probabilities, on the
        # training items alone (the validation fold stays new to the head).
        zeros = np.zeros((train.shape[0], k))
        w, b = fit_probe_weights(x_fit[train], zeros, y_fit[train], k, probe.l2)
        return w[:, : x.shape[1]], b

    prompts = [task_prompt(task, items[i].text) for i in fit_idx]
    spans = [task_item_span(task, items[i].text) for i in fit_idx]
    queries = labeled_queries(prompts, task.choices, item_spans=spans)
    fit = fit_adapter(
        engine,
        queries,
        y_fit,
        layer=layer,
        reads=reads,
        warm_start=warm_start,
        settings=adapter_settings,
        progress=progress,
    )
    val = fit_idx[fit.validation_index]
    nll = {
        "adapter": _nll(fit.validation_probabilities, y_fit[fit.validation_index]),
        "rival": _nll(rival_oof[val], base.labels[val]),
    }
    rival_method = rival_profile.calibration_map.method
    # An adapter that no epoch improved over its warm start is LoRA at zero: its head alone,
    # a probe with fewer items and no log-probabilities, which the probe itself beats.
    learned = fit.best_epoch > 0
    winner = "adapter" if learned and nll["adapter"] < nll["rival"] else rival_method
    if winner != "adapter" and not keep_adapter:
        why = (
            f" Adapter tried and not kept: {fit.note}; on those {val.shape[0]} validation items "
            f"its NLL {nll['adapter']:.4f} against the {rival_method} map's "
            f"{'out-of-fold ' if rival_method == 'probe' else ''}{nll['rival']:.4f}"
            + ("." if learned else ", and no epoch improved on its warm start.")
        )
        kept = msgspec.structs.replace(rival_profile, note=rival_profile.note + why)
        return AdapterProfile(kept, probe_profile, rival_profile, fit, base, winner, nll)
    adapted = judged(engine.adapted(fit.adapter), "judge adapted", [layer])
    head = Probe(
        layers=[layer],
        num_layers=num_layers,
        feature_dim=x.shape[1] // len(reads.split("+")),
        # The choices' log-probabilities are read with weight 0: the head was trained without.
        weights=np.concatenate([fit.weights, np.zeros((k, k))], axis=1).tolist(),
        intercept=fit.intercept.tolist(),
        l2=probe.l2,
        reads=reads,
        span=probe.span,
    )
    profile = fit_labeled(
        name,
        adapted,
        task.choices,
        provenance,
        probe_settings,  # the head served is a probe's, given
        trained=TrainedHead(
            CalibrationFit(
                map=head,
                cv_nll={"adapter, validation fold": fit.validation_nll},
                note=fit.note + ". ",
                method="probe",
            ),
            fit.adapter,
        ),
    ).profile
    return AdapterProfile(profile, probe_profile, rival_profile, fit, adapted, winner, nll)


def _nll(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """The mean negative log-likelihood of ``labels`` (n,) under (n, k) ``probabilities``."""
    p = probabilities[np.arange(labels.shape[0]), labels]
    return float(-np.log(np.clip(p, 1e-12, 1.0)).mean())
