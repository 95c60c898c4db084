"""Retrain an adapter profile from its decision log: the adapter itself, not only its head.

``refit_from_log`` refits a map from the scores the log kept, which for an adapter profile
are the adapted model's: it can refit the head, never the adapter. This retrains both, as
``judge calibrate --method adapter`` does on a task (``calibration.tasks.fit_adapter_profile``),
on the items of the profile's labelled decisions: each logged request's item (the log must
keep requests, ``--log-requests``), put back in the profile's prompt. The audited labels are
split as a fit's are and alone certify; the others (a teach stream's) only train (their
``taught`` mark). The result is the next look of the lineage, at its share of delta, like any
refit from the log; where the frozen probe or a scalar map now beats the retrained adapter on
the validation fold, that map is the result and says why.

It judges every item with the base model and trains for minutes on the machine's cores: the
server runs it in its background refit (``judge serve --refit-every N --refit-adapters``),
never on a request's path.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import msgspec
import numpy as np

from calibration import CalibrationProfile, FitSettings
from calibration.certificates.recertify import Recertification
from calibration.maps.probe import MIN_PROBE_EXAMPLES
from calibration.tasks import LabeledItem, LabeledItems, Task, fit_adapter_profile
from calibration.tasks.adapter.training import AdapterSettings
from judge.engine import Judge
from service.install import missing_adapter_extra
from service.log.decision_log import DecisionLog
from service.log.labelling_queue import logged_prompt
from service.log.record import LoggedDecision
from service.log.refit import LogRefit, RefitError, labelled_decisions

__all__ = ["logged_items", "retrain_from_log"]


def logged_items(
    records: list[LoggedDecision], profile: CalibrationProfile
) -> tuple[list[LabeledItem], int]:
    """The labelled decisions' items, each with its label and whether it only teaches (not
    audited), and how many were left out: no request kept, no item marked in it, or a prompt
    that is not the profile's own around the item."""
    template = profile.template
    items, left_out = [], 0
    for r in records:
        judged = logged_prompt(r)
        if template is None or judged is None or judged[1] is None or r.label is None:
            left_out += 1
            continue
        prompt, (start, end) = judged[0], judged[1]
        text = prompt[start:end]
        if template.render(text)[0] != prompt:
            left_out += 1
            continue
        items.append(LabeledItem(id=r.judgment_id, text=text, label=r.label, taught=not r.audit))
    return items, left_out


def retrain_from_log(
    log: DecisionLog,
    profile: CalibrationProfile,
    engine: Judge,
    settings: FitSettings,
    *,
    name: str,
    log_name: str,
    adapter_settings: AdapterSettings | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> LogRefit:
    """The next version of adapter profile ``profile`` (named ``name``), its adapter trained
    anew on the items of its labelled decisions in ``log`` by ``engine`` (the base model, no
    adapter merged); ``settings`` as ``refit_settings`` gives them (their delta the
    lineage's). ``adapter_settings``: default the profile's adapter's blocks and rank."""
    adapter = profile.adapter
    if adapter is None:
        raise RefitError(f"profile {profile.name!r} has no adapter to retrain")
    if (missing := missing_adapter_extra()) is not None:
        raise RefitError(missing)
    if profile.template is None:
        raise RefitError(
            f"profile {profile.name!r} keeps no prompt template: its logged items cannot be "
            "put back in the prompt they were judged in"
        )
    items, left_out = logged_items(labelled_decisions(log, profile), profile)
    audited = sum(not item.taught for item in items)
    if audited < MIN_PROBE_EXAMPLES:
        raise RefitError(
            f"{audited} audited, labelled decisions of {profile.name!r} kept their item; an "
            f"adapter starts from a probe, which needs {MIN_PROBE_EXAMPLES} (label more, and "
            "serve with --log-requests)"
        )
    recertification = Recertification.after(profile.recertification, settings.delta, log_name)
    taught = len(items) - audited
    digest = hashlib.sha256(
        msgspec.json.encode([[item.id, item.label] for item in items])
    ).hexdigest()
    task = Task(
        name=profile.name,
        choices=list(profile.choices),
        instruction="",
        path=f"decision log {recertification.log}",
        template=profile.template,
    )
    trained = adapter_settings or AdapterSettings(
        blocks=len(adapter.blocks), rank=adapter.rank, alpha=adapter.alpha, seed=settings.seed
    )
    fitted = fit_adapter_profile(
        engine,
        task,
        LabeledItems(
            items,
            f"decision log {recertification.log}: {audited} audited decisions of "
            f"{profile.name}" + (f" and {taught} others labeled (train only)" if taught else ""),
            digest,
        ),
        name,
        settings=msgspec.structs.replace(settings, delta=recertification.spent),
        adapter_settings=trained,
        progress=progress,
    )
    refit = msgspec.structs.replace(fitted.profile, recertification=recertification)
    notes = [f"adapter retrained: {fitted.fit.note}; kept: {fitted.winner}"]
    if left_out:
        notes.append(
            f"{left_out} labelled decisions left out: no request kept, no item marked, or "
            "another prompt than the profile's"
        )
    only = np.array([item.taught for item in items], dtype=bool)
    return LogRefit(
        refit, recertification, audited, taught, notes, fitted.scores, only if taught else None
    )
