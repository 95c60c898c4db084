"""A server's watch on the class mix of each profile version's traffic: once it has left the
mix the certificate was measured on, the version's decisions escalate (``prior_shift``) until
the profile is re-certified.

After each request's decisions are logged, ``ShiftWatch.logged`` counts them per profile
version; every ``every`` of them one worker thread reads the version's decisions logged since
its last check and runs ``calibration.monitoring.label_shift.mix_shift`` on all its answers read so far
(against the profile's reference, a sequential test: over the whole stream a false hold at
most ``alpha``, however often it runs). A version found shifted stays held (``hold``): the gates the server opens for it carry a
``calibration.policy.Hold`` and escalate everything, saying why; with ``correct`` (``judge
serve --correct-prior``) they also serve the probabilities moved to the live prior estimated
at detection. A new version (a refit, a PUT, a rollback to another ETag) is unheld, and its own
stream starts afresh. At start, every stored profile's current version is checked once, so
that a restart does not forget a hold.

Requests never wait: judging reads the holds found so far.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from calibration import ProfileError
from calibration.monitoring.label_shift import mix_shift, prior_weights
from calibration.policy import Hold
from service.log.decision_log import DecisionLog, DecisionLogError
from service.log.health import DEFAULT_WINDOW, live_prior
from service.log.record import LoggedDecision

if TYPE_CHECKING:
    from collections.abc import Sequence

    from service.profiles import ProfileStore

__all__ = ["ShiftWatch"]


class _Seen:
    """A version's answers (choice indices) in the order decided, and where reading stopped."""

    def __init__(self) -> None:
        self.answers: list[int] = []
        self.last_at: float | None = None
        self._at_last: set[str] = set()  # the decisions read that were made at ``last_at``

    def add(self, records: Sequence[LoggedDecision], index: dict[str, int]) -> None:
        """The decisions made at or after ``last_at`` (as the log gives them), oldest first,
        less those already read."""
        for r in records:
            if r.created_at == self.last_at and r.judgment_id in self._at_last:
                continue
            self.answers.append(index[r.choice])
            if r.created_at != self.last_at:
                self.last_at, self._at_last = r.created_at, set()
            self._at_last.add(r.judgment_id)


log = logging.getLogger("judge.shift")


class ShiftWatch:
    """Holds on profile versions whose traffic's class mix moved (see the module docstring)."""

    def __init__(
        self,
        store: ProfileStore,
        decision_log: DecisionLog,
        *,
        every: int,
        alpha: float = 0.01,
        correct: bool = False,
    ) -> None:
        self.store = store
        self.decision_log = decision_log
        self.every = every
        self.alpha = alpha
        self.correct = correct
        self._holds: dict[tuple[str, str], Hold] = {}
        self._counts: dict[tuple[str, str], int] = {}
        # Each version's answers read so far (worker thread only): a check reads the log's
        # decisions since the last one, not the whole version again.
        self._seen: dict[tuple[str, str], _Seen] = {}
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="judge-shift")
        for name in store.names():
            try:
                _, etag = store.get_tagged(name)
            except ProfileError:
                continue
            self._worker.submit(self._check, name, etag)

    def hold(self, name: str | None, etag: str | None) -> Hold | None:
        """The hold on version ``etag`` of profile ``name``; None: none (found so far)."""
        if name is None or etag is None:
            return None
        with self._lock:
            return self._holds.get((name, etag))

    def logged(self, records: Sequence[LoggedDecision]) -> list[Future[None]]:
        """Count a request's logged decisions; a version that reached ``every`` more since its
        last check is checked again in the background (the futures, for tests)."""
        due = []
        with self._lock:
            for r in records:
                if r.profile is None or r.profile_etag is None:
                    continue
                key = (r.profile, r.profile_etag)
                if key in self._holds:
                    continue  # held until re-certified: nothing to check
                self._counts[key] = self._counts.get(key, 0) + 1
                if self._counts[key] >= self.every:
                    self._counts[key] = 0
                    due.append(key)
        return [self._worker.submit(self._check, *key) for key in due]

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)

    def _check(self, name: str, etag: str) -> None:
        try:
            profile, current = self.store.get_tagged(name)
            if current != etag or profile.reference is None:
                return  # another version is served now, or there is nothing to test against
            seen = self._seen.setdefault((name, etag), _Seen())
            records = self.decision_log.decisions(
                profile=name, profile_etag=etag, since=seen.last_at
            )
            seen.add(records, {c: j for j, c in enumerate(profile.choices)})
            answers = np.asarray(seen.answers)
            mix = mix_shift(profile.reference, answers, alpha=self.alpha, choices=profile.choices)
            if not mix.shifted:
                return
            newest = self.decision_log.decisions(
                profile=name, profile_etag=etag, limit=DEFAULT_WINDOW
            )
        except (ProfileError, DecisionLogError) as exc:
            log.warning("checking the class mix of %s failed: %s", name, exc)
            return
        prior = live_prior(profile, newest, alpha=self.alpha)
        weights = None
        if self.correct and prior is not None:
            weights = [float(v) for v in prior_weights(prior.source, prior.estimate)]
        moved = (
            ""
            if prior is None
            else "; live prior about "
            + ", ".join(f"{c} {v:.2f}" for c, v in zip(prior.choices, prior.estimate, strict=True))
            + " against "
            + ", ".join(f"{v:.2f}" for v in prior.source)
            + (" (probabilities moved to it)" if weights is not None else "")
        )
        hold = Hold(
            reason=f"profile {name!r}: {mix.reason}{moved}; every decision escalates until the "
            "profile is re-certified on traffic like today's",
            prior_weights=weights,
        )
        with self._lock:
            self._holds[(name, etag)] = hold
        log.warning("holding %s (ETag %s): %s", name, etag, hold.reason)
