"""A labelling queue over the decision log: the next decision a person should label, from two
streams kept apart (``calibration.monitoring.labelling``).

* **audit**: the decisions the service marked for audit when it made them (a uniform random
  share of the traffic), unlabelled, oldest first. Only these certify: a refit certifies on
  them, and ``judge check`` reads the live precision from them. Each one skipped leaves the
  labelled audit sample a little less uniform, so the queue counts skips and says so.
* **teach**: every other unlabelled decision, the least certain first, spread over the logged
  hidden states where the log keeps them (``--log-features``): labels that teach a refit map
  the most. They fit a map; they never certify one.

A decision can be labelled only where the log kept its request (``--log-requests``): a person
must see the item. ``LabellingQueue`` alternates the streams asked for, stores each label as
it is given (``DecisionLog.label``: nothing is lost on a quit or a crash) and reports, after
each, what the labelled audit decisions say of the profile's version (``profile_health``:
the live precision and about how many labels more would open the gate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import numpy as np

from calibration import CalibrationProfile
from calibration.monitoring.labelling import next_stream, teach_rounds
from service.log.decision_log import DecisionLog, LabelOutcome
from service.log.health import ProfileHealth, profile_health
from service.log.record import LoggedDecision

__all__ = ["STREAMS", "LabellingQueue", "QueueItem", "Stream", "logged_prompt"]

Stream = Literal["audit", "teach"]
STREAMS: tuple[Stream, ...] = ("audit", "teach")


class QueueItem(msgspec.Struct, frozen=True, kw_only=True):
    """One decision to label, as a person sees it (``GET /profiles/{name}/queue`` carries
    it as ``service.schemas.QueueEntry``)."""

    judgment_id: str
    stream: Stream
    item: str  # what was judged: the item alone where the request marked it, else the prompt
    prompt: str
    choices: list[str]  # the profile's order
    probabilities: dict[str, float]  # calibrated, as served
    choice: str  # the service's answer
    decision: str  # accept or escalate


@dataclass
class LabellingQueue:
    """The unlabelled decisions of ``profile`` in ``log`` (every version of it), in the order
    a person should label them; ``etag``: the version whose certificate the state speaks of."""

    log: DecisionLog
    profile: CalibrationProfile
    etag: str
    streams: Sequence[Stream] = STREAMS
    # How many of the teach stream to put in order (None: all of it; past them, in the log's
    # order): a caller that shows the next few (GET /profiles/{name}/queue) need not order
    # thousands on every call.
    ahead: int | None = None
    _pending: dict[Stream, list[QueueItem]] = field(init=False)
    _turn: int = field(default=0, init=False)
    labelled: dict[Stream, int] = field(init=False)
    skipped: dict[Stream, int] = field(init=False)
    unreadable: int = field(default=0, init=False)  # unlabelled, but no request was logged

    def __post_init__(self) -> None:
        unknown = set(self.streams) - set(STREAMS)
        if unknown or not self.streams:
            raise ValueError(f"streams must be some of {STREAMS}, got {list(self.streams)}")
        records = self.log.decisions(profile=self.profile.name, labeled=False)
        # Each record with the prompt its logged request judged (parsed once), if it kept one.
        readable = [(r, p) for r in records if (p := logged_prompt(r)) is not None]
        self.unreadable = len(records) - len(readable)
        audit = [(r, p) for r, p in readable if r.audit]
        teach = [(r, p) for r, p in readable if not r.audit]
        order = self._teach_order([r for r, _ in teach])
        self._pending = {
            "audit": [self._item(r, p, "audit") for r, p in audit],
            "teach": [self._item(teach[i][0], teach[i][1], "teach") for i in order],
        }
        self.labelled = {"audit": 0, "teach": 0}
        self.skipped = {"audit": 0, "teach": 0}

    def pending(self, stream: Stream) -> int:
        """Decisions of ``stream`` still to label."""
        return len(self._pending[stream])

    def upcoming(self, stream: Stream, n: int) -> list[QueueItem]:
        """The next ``n`` decisions of ``stream``, in its order."""
        return list(self._pending[stream][:n])

    def next(self) -> QueueItem | None:
        """The next decision to label: the streams asked for in turn, each in its own order;
        None when none is left."""
        found = next_stream(self.streams, self._pending, self._turn)
        if found is None:
            return None
        stream, self._turn = found
        return self._pending[stream][0]

    def label(self, item: QueueItem, label: str) -> LabelOutcome:
        """Store ``label`` for ``item`` (one of its choices) and take it off the queue."""
        if label not in item.choices:
            raise ValueError(f"label must be one of {item.choices}, got {label!r}")
        outcome = self.log.label(item.judgment_id, label)
        self._drop(item)
        self.labelled[item.stream] += 1
        return outcome

    def skip(self, item: QueueItem) -> None:
        """Take ``item`` off the queue unlabelled (for this session)."""
        self._drop(item)
        self.skipped[item.stream] += 1

    def health(self) -> ProfileHealth:
        """What the labelled audit decisions of the profile's version say now."""
        return profile_health(self.log, self.profile, self.etag)

    def _drop(self, item: QueueItem) -> None:
        pending = self._pending[item.stream]
        pending[:] = [p for p in pending if p.judgment_id != item.judgment_id]

    def _item(
        self,
        record: LoggedDecision,
        judged: tuple[str, tuple[int, int] | None],
        stream: Stream,
    ) -> QueueItem:
        prompt, span = judged
        choices = list(self.profile.choices)
        return QueueItem(
            judgment_id=record.judgment_id,
            stream=stream,
            item=prompt if span is None else prompt[span[0] : span[1]],
            prompt=prompt,
            choices=choices,
            probabilities={c: float(record.probabilities.get(c, 0.0)) for c in choices},
            choice=record.choice,
            decision=record.decision,
        )

    def _teach_order(self, records: list[LoggedDecision]) -> np.ndarray:
        """Every index of ``records``: the first ``ahead`` (or all) in the order to teach,
        the rest after them as logged."""
        if not records:
            return np.zeros(0, dtype=np.int64)
        choices = list(self.profile.choices)
        p = np.array([[r.probabilities.get(c, 0.0) for c in choices] for r in records])
        features = None
        if all(r.features is not None for r in records):
            rows = [r.features.array()[0] for r in records if r.features is not None]
            if len({row.shape for row in rows}) == 1:
                features = np.stack(rows)
        first = teach_rounds(p, features=features, count=self.ahead)
        return np.concatenate([first, np.setdiff1d(np.arange(len(records)), first)])


def logged_prompt(record: LoggedDecision) -> tuple[str, tuple[int, int] | None] | None:
    """The prompt a logged request judged and the item's span in it; None where the log kept
    no request (or one with no prompt: a typed question's)."""
    request: Any = record.request
    if not isinstance(request, dict) or not isinstance(request.get("query"), dict):
        return None
    query = request["query"]
    prompt = query.get("prompt")
    if not isinstance(prompt, str):
        return None
    span = query.get("item_span")
    if isinstance(span, list | tuple) and len(span) == 2 and all(isinstance(v, int) for v in span):
        return prompt, (span[0], span[1])
    return prompt, None
