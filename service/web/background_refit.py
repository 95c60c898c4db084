"""Refit without a person: once enough new labels of a profile's decisions arrive, the server
refits it from the decision log in the background and serves the refit only if it is better.

``judge serve --refit-every N``: after a label request stores new labels, one worker thread
counts each stored profile's labelled decisions; where N or more arrived since the profile's
last refit (or since the server started), and a quarter of those the last refit read if that
is more (``refit_due``: a refit's cost grows with the log), it runs ``service.log.refit.refit_from_log`` (the
audited labels certify, the others only fit; the next look of the lineage, at its share of
delta). The refit is kept among the profile's versions whatever happens; it is served only
when the coverage it certifies is at least the coverage the version it refits certified at
the same target (a version that certifies none is replaced by a refit that certifies none
either: both escalate everything, and the refit's map has seen more labels), and only if that
version is still the one stored (a write in between wins: If-Match). Each attempt is logged and kept in memory (``refits``:
``GET /profiles/{name}/versions``); a rollback is ``POST /profiles/{name}/rollback``.

Requests are never blocked: label requests only hand the worker a nudge, and judging reads
whichever version is stored.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from calibration import ProfileError
from calibration.profile import certified_coverage
from service.log.adapter_refit import retrain_from_log
from service.log.backends import mask_target
from service.log.decision_log import DecisionLog, DecisionLogError
from service.log.refit import RefitError, refit_from_log, refit_settings
from service.profiles import PreconditionFailedError, Preconditions, ProfileStore
from service.schemas import RefitRecord

if TYPE_CHECKING:
    from judge.engine import Judge

__all__ = ["KEPT_REFITS", "REFIT_GROWTH", "BackgroundRefit", "refit_due"]

log = logging.getLogger("judge.refit")

KEPT_REFITS = 50  # per profile, the newest, in memory
# The new labels a refit waits for grow with those the last one read: ``every``, or this share
# of the labels at the last refit where that is more. A refit reads every labelled decision,
# so its cost grows with the log (3.9 s at 3,364 labels on 2 AVX2 cores, benchmarks/
# bench_soak.py); spaced so, refits take a bounded share of the machine however long it
# serves, and their looks come fewer, each with a larger share of delta.
REFIT_GROWTH = 0.25


def refit_due(labelled: int, at_last: int, every: int) -> bool:
    """Whether ``labelled`` labels warrant a refit, the last one having read ``at_last``."""
    return labelled - at_last >= max(every, math.ceil(REFIT_GROWTH * at_last))


class BackgroundRefit:
    """One worker that refits profiles from ``decision_log`` every ``every`` new labels."""

    def __init__(
        self,
        store: ProfileStore,
        decision_log: DecisionLog,
        log_target: str,
        every: int,
        trainer: Callable[[], Judge | None] | None = None,
    ) -> None:
        self.store = store
        # With --refit-adapters: the judge an adapter profile's adapter is retrained with (the
        # served one's sibling: its weights, its own caches); None: heads only.
        self.trainer = trainer
        self.decision_log = decision_log
        self.log_name = mask_target(log_target)
        self.every = every
        self.refits: dict[str, list[RefitRecord]] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="judge-refit")
        self._lock = threading.Lock()
        self._queued = False
        # Each profile's labelled decisions at its last refit; labels before the server
        # started count as old (a profile stored later counts all of its own).
        self._counted: dict[str, int] = {
            name: decision_log.count(name, labeled=True) for name in store.names()
        }

    def labels_arrived(self) -> Future[None] | None:
        """A nudge after labels were stored: the worker checks every profile once more (one
        check queued at a time; a nudge while one is queued joins it)."""
        with self._lock:
            if self._queued:
                return None
            self._queued = True
        return self._worker.submit(self._check)

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)

    def _check(self) -> None:
        with self._lock:
            self._queued = False
        for name in self.store.names():
            try:
                labelled = self.decision_log.count(name, labeled=True)
                if refit_due(labelled, self._counted.get(name, 0), self.every):
                    self._counted[name] = labelled
                    self._refit(name, labelled)
            except Exception:  # a refit must never take the worker down with it
                log.exception("background refit of profile %r failed", name)

    def _refit(self, name: str, labelled: int) -> None:
        try:
            profile, etag = self.store.get_tagged(name)
        except ProfileError:
            return  # unreadable, or deleted meanwhile: its own GET says why
        before = certified_coverage(profile)
        engine = None if profile.adapter is None or self.trainer is None else self.trainer()
        try:
            if engine is not None:
                fitted = retrain_from_log(
                    self.decision_log,
                    profile,
                    engine,
                    refit_settings(profile),
                    name=name,
                    log_name=self.log_name,
                )
            else:
                fitted = refit_from_log(
                    self.decision_log,
                    profile,
                    refit_settings(profile),
                    name=name,
                    log_name=self.log_name,
                )
        except (RefitError, DecisionLogError, ValueError) as exc:
            self._record(name, etag, None, False, f"not refitted: {exc}", labelled, before, None)
            return
        refit = fitted.profile
        after = certified_coverage(refit)
        kept = self.store.keep(refit)
        if refit.threshold.threshold is None and profile.threshold.threshold is not None:
            served, why = (
                False,
                f"not served: the refit certifies no threshold ({refit.threshold.reason}), "
                f"and the version it refits certifies coverage {before:.3f}",
            )
        elif after < before:
            served, why = (
                False,
                (
                    f"not served: the refit certifies coverage {after:.3f}, below the "
                    f"{before:.3f} of the version it refits"
                ),
            )
        else:
            try:
                self.store.put(refit, Preconditions(if_match=[etag]))
            except PreconditionFailedError:
                served, why = False, "not served: the profile changed while it was refitted"
            else:
                served, why = (
                    True,
                    (
                        f"served: look {fitted.recertification.look}, coverage {after:.3f} (was "
                        f"{before:.3f}) on {fitted.audited} audited and {fitted.taught} taught labels"
                        + (f"; {fitted.notes[0]}" if engine is not None else "")
                    ),
                )
        self._record(name, etag, kept, served, why, labelled, before, after)

    def _record(
        self,
        name: str,
        from_etag: str,
        etag: str | None,
        served: bool,
        reason: str,
        labelled: int,
        before: float,
        after: float | None,
    ) -> None:
        record = RefitRecord(
            at=datetime.now(UTC).isoformat(timespec="seconds"),
            from_etag=from_etag,
            etag=etag,
            served=served,
            reason=reason,
            labels=labelled,
            coverage_before=before,
            coverage_after=after,
        )
        with self._lock:
            kept = self.refits.setdefault(name, [])
            kept.append(record)
            del kept[:-KEPT_REFITS]
        log.info("background refit of profile %r from %s: %s", name, from_etag, reason)
