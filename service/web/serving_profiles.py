"""``/profiles``: list, store and fit calibration profiles.

A fit judges its examples through the same queue as every request and fits on a worker thread
(``calibration.tasks.fit_labeled``); if its client leaves, the request is cancelled and nothing
is written. A fit whose method may be a probe ("auto", "probe") judges its examples with the
hidden states of ``calibration.maps.probe.candidate_layers``; a probe that cannot be fitted is
refused (``method``) before any model work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import re
from collections.abc import Sequence
from datetime import UTC, datetime

import anyio.to_thread
import msgspec
import numpy as np

from calibration import (
    CalibrationError,
    CalibrationProfile,
    FitError,
    ProfileError,
    ProfileNotFoundError,
)
from calibration.carry import carry
from calibration.fit_data import Provenance
from calibration.fit_settings import FitSettings
from calibration.fitting import resolve_methods
from calibration.maps.map_types import CalibrationMap, Probe
from calibration.maps.probe import candidate_layers, probe_weights
from calibration.profile import NAME_PATTERN
from calibration.tasks import fit_labeled, labeled_queries, scores_from_judgments
from judge import Fingerprint, Judgment, Prepared
from service.errors import BadFieldError, UnprocessableError
from service.profiles import ALWAYS, Preconditions
from service.schemas import (
    CalibrationMapSummary,
    FitRequest,
    ProfileSummary,
    ProfileVersion,
    ProfileVersions,
)
from service.web.serving_core import ServiceCore, Ticket

__all__ = ["ProfileServing"]


class ProfileServing:
    """The profile store behind the endpoints, and fits that judge through the queue."""

    def __init__(self, service: ServiceCore) -> None:
        self.service = service

    async def fit(self, name: str, request: FitRequest, ticket: Ticket) -> CalibrationProfile:
        """Judge the labeled examples, fit a profile on them, save it and return it."""
        engine = self.service.engine()
        if not re.fullmatch(NAME_PATTERN, name):
            raise BadFieldError("name", f"profile name {name!r} must match {NAME_PATTERN}")
        for i, example in enumerate(request.examples):
            if example.label not in request.choices:
                raise UnprocessableError(
                    f"examples[{i}].label",
                    f"label {example.label!r} is not one of the choices {request.choices}",
                )
        labels = {e.label for e in request.examples}
        if len(labels) < 2:
            raise UnprocessableError(
                "examples",
                f"all {len(request.examples)} examples have the label {labels.pop()!r}: "
                "calibration needs examples of at least two choices",
            )
        template = {
            "system": request.system,
            "response_prefix": request.response_prefix,
            "response_suffix": request.response_suffix,
        }
        fingerprint = engine.fingerprint(**template)
        layers = _fit_layers(request, fingerprint)  # refuses an impossible probe up front
        marked = {e.item_span is not None for e in request.examples}
        if len(marked) > 1:
            raise UnprocessableError(
                "examples",
                "some examples mark their item_span and some do not: mark every example's "
                "item, or none",
            )
        queries = labeled_queries(
            [e.prompt for e in request.examples],
            request.choices,
            system=request.system,
            response_prefix=request.response_prefix,
            response_suffix=request.response_suffix,
            feature_layers=layers,
            span_layers=layers,  # their means over the items compete too
            item_spans=[e.item_span for e in request.examples],
        )
        fields = [f"examples[{i}].prompt" for i in range(len(queries))]
        ready: list[Prepared] = []
        for i, prepared in enumerate(await self.service.prepare(engine, queries, fields)):
            if not isinstance(prepared, Prepared):
                if prepared.field in (None, "prompt"):  # the engine's name for the field
                    prepared.field = fields[i]
                elif prepared.field == "item_span":
                    prepared.field = f"examples[{i}].item_span"
                raise prepared
            ready.append(prepared)
        judgments: list[Judgment] = []
        # The hidden states, kept as one float32 array rather than in the judgments: as lists
        # of Python floats, 20,000 examples at 5 layers of 576 would take about 2 GB.
        features: np.ndarray | None = None  # (n, m, H)
        means: np.ndarray | None = None  # (n, m, H): over each item
        wave = (
            4 * self.service.config.max_batch_size
        )  # jobs queued at once: a bounded share of the queue
        for start in range(0, len(ready), wave):
            results = await asyncio.gather(
                *(
                    self.service.batcher.judge(
                        ready[i], owner=ticket.owner, deadline=ticket.deadline
                    )
                    for i in range(start, min(start + wave, len(ready)))
                )
            )
            for i, result in enumerate(results, start):
                if layers:
                    row = _features_of(result.features, layers)  # (m, H)
                    mean = _features_of(result.span_features, layers)
                    if features is None or means is None:
                        features = np.empty((len(queries), *row.shape), dtype=np.float32)
                        means = np.empty_like(features)
                    features[i], means[i] = row, mean
                    result = msgspec.structs.replace(result, features=None, span_features=None)
                judgments.append(result)
        scores = scores_from_judgments(
            judgments, [e.label for e in request.examples], request.choices
        )
        if features is not None:
            scores = dataclasses.replace(
                scores,
                features=features,
                feature_layers=layers,
                span_features=means,
                span="item" if marked == {True} else "prompt",
            )
        fit = functools.partial(
            fit_labeled,
            name,
            scores,
            request.choices,
            Provenance(
                fingerprint=fingerprint,
                dataset=f"POST /profiles/{name}/fit",
                dataset_sha256=hashlib.sha256(msgspec.json.encode(request.examples)).hexdigest(),
            ),
            FitSettings(
                target_precision=request.target_precision,
                delta=request.delta,
                alpha=request.alpha,
                methods=_FIT_METHODS[request.method],
                per_class=request.per_class,
            ),
        )
        try:
            profile = (await anyio.to_thread.run_sync(fit)).profile
        except (CalibrationError, ValueError) as exc:  # e.g. every example has the same label
            # The fitter's own refusals of a method ("method 'probe' needs ...") name it.
            field = "method" if str(exc).startswith("method ") else "examples"
            raise UnprocessableError(
                field, f"cannot fit a profile on these examples: {exc}"
            ) from exc
        self.service.store.put(profile)
        return profile

    def summaries(self) -> list[ProfileSummary]:
        summaries = []
        for name in self.service.store.names():
            try:
                p = self.service.store.get(name)
            except ProfileError:
                continue  # an unreadable file is not a profile; GET /profiles/{name} says why
            summaries.append(
                carry(
                    p,
                    ProfileSummary,
                    model=p.fingerprint.model,
                    calibration_map=_map_summary(p.calibration_map),
                    takes_item=p.template is not None,
                )
            )
        return summaries

    def versions(self, name: str) -> ProfileVersions:
        """``name``'s kept versions (newest first) and the background refits of it since this
        server started; a 404 where no profile is stored under ``name`` (for one deleted, the
        404 names its newest kept version)."""
        store, refitter = self.service.store, self.service.refitter
        kept = store.versions(name)
        try:
            current = store.etag(name)
        except ProfileNotFoundError:
            if not kept:
                raise
            # Deleted: nothing is served under the name, but its versions are kept.
            raise ProfileNotFoundError(
                f"no profile named {name!r}: it was deleted; {len(kept)} versions are kept, "
                f"newest {kept[0].etag} (POST /profiles/{name}/rollback serves one again)"
            ) from None
        return ProfileVersions(
            name=name,
            versions=[
                ProfileVersion(
                    etag=v.etag,
                    stored_at=datetime.fromtimestamp(v.stored_at, UTC).isoformat(
                        timespec="seconds"
                    ),
                    current=v.etag == current,
                )
                for v in kept
            ],
            refits=[] if refitter is None else list(refitter.refits.get(name, [])),
        )

    def put(self, name: str, profile: CalibrationProfile, when: Preconditions = ALWAYS) -> str:
        """Store ``profile`` under ``name`` and return its ETag.

        ``when.if_match`` replaces only one of those versions, ``when.if_none_match``
        (``["*"]``) only creates; the store compares and writes in one step, under its lock, so
        it may block while another writer holds it (call it off the event loop).
        """
        if profile.name != name:
            raise UnprocessableError(
                "name", f"the profile is named {profile.name!r} but the path says {name!r}"
            )
        return self.service.store.put(profile, when)


# FitRequest.method -> fit_labeled's methods: the candidates that compete with no scaling.
_FIT_METHODS: dict[str, str | list[str]] = {
    "auto": "auto",
    "temperature": ["temperature"],
    "bias_temperature": ["temperature", "bias_temperature"],
    "probe": ["probe"],
}


def _fit_layers(request: FitRequest, fingerprint: Fingerprint) -> tuple[int, ...]:
    """The hidden-state layers to judge a fit's examples with: a probe's candidates, or none.

    An explicit probe that cannot be fitted (no hidden states, too few examples, more weights
    than a profile may hold: ``calibration.fitting.resolve_methods``) is refused here, naming
    ``method``, before any model work; "auto" fits without one, and its profile's note says
    why.
    """
    if request.method not in ("auto", "probe"):
        return ()
    num_layers, hidden_size = fingerprint.num_layers, fingerprint.hidden_size
    if num_layers is None or hidden_size is None:
        if request.method == "probe":
            raise UnprocessableError(
                "method",
                f"method 'probe' reads the model's hidden states, and this server's engine "
                f"({fingerprint.model}) exposes none; use method auto or temperature",
            )
        return ()
    if request.method == "probe":
        try:  # the fitter's own rules for when a probe can be fitted, before any model work
            weights = probe_weights(len(request.choices), hidden_size)
            resolve_methods(["probe"], len(request.examples), weights)
        except FitError as exc:
            raise UnprocessableError("method", str(exc)) from exc
    # "auto": the fitter decides whether the probe can compete, and its note says why not.
    return candidate_layers(num_layers)


def _features_of(states: dict[int, list[float]] | None, layers: Sequence[int]) -> np.ndarray:
    """(m, H) float32: a judgment's hidden states (``features`` or ``span_features``) of
    ``layers``, in that order."""
    features = states or {}
    missing = [n for n in layers if n not in features]
    if missing:  # the engine broke its contract: the layers asked for come back
        raise RuntimeError(f"the engine returned no features for layers {missing}")
    return np.asarray([features[n] for n in layers], dtype=np.float32)


def _temperature(calibration_map: CalibrationMap) -> float | None:
    """The map's temperature; None for a probe, which has none (its ``temperature`` is 1)."""
    return None if isinstance(calibration_map, Probe) else calibration_map.temperature


def _map_summary(calibration_map: CalibrationMap) -> CalibrationMapSummary:
    layers = list(calibration_map.layers) if isinstance(calibration_map, Probe) else None
    return CalibrationMapSummary(
        method=calibration_map.method, temperature=_temperature(calibration_map), layers=layers
    )
