"""Model work on one thread: fair between requests, bounded per pass, dropped when unwanted.

Every piece of model work is a job, served by one worker that owns the model: the forward
pass never runs on the event loop, and never in two threads at once (two would only fight
over the same cores).

- **Bounded passes.** Single judgments waiting in the queue are coalesced into one pass, up to
  ``max_batch_size`` of them and ``max_batch_tokens`` tokens in all, waiting at most
  ``max_wait_ms`` for more to arrive after the first. Other jobs (a chunk of shared-context
  questions) run alone. With each query's own tokens bounded by the service, no pass holds the
  model for long.
- **Fair.** Jobs are queued per owner (one request), and the worker takes owners in turn, so a
  request with hundreds of items or a long fit interleaves with everyone else instead of
  making them wait for all of it.
- **No wasted work.** Every job has a deadline. A job whose waiter has gone (its client
  disconnected, so the request's task was cancelled) or whose deadline has passed is dropped
  before it runs; a request made of many jobs loses the rest of them at once.
- **Bounded queue.** More than ``max_jobs`` waiting is refused at once (the service answers 503
  with Retry-After) rather than letting latency grow without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio.to_thread

from judge.engine import Query

__all__ = ["Batcher", "DeadlineError", "QueueFullError"]


class QueueFullError(Exception):
    """The job queue is at capacity; the caller should retry later."""


class DeadlineError(TimeoutError):
    """The request's deadline passed before its model work was done."""


@dataclass
class _Job:
    future: asyncio.Future[Any]
    owner: Hashable
    deadline: float  # time.monotonic() after which nobody wants the result
    query: Query | None = None  # a single judgment, which may be coalesced with others
    tokens: int = 0  # the query's size, for the pass's token bound
    call: Callable[[], Any] | None = None  # anything else, run alone

    def wanted(self, now: float) -> bool:
        return not self.future.done() and now < self.deadline


def _alone(fn: Callable[[], Any]) -> list[Any]:
    return [fn()]


class Batcher:
    """Serializes model work, coalesces single judgments and takes requests in turn."""

    def __init__(
        self,
        judge_each: Callable[[Sequence[Query]], list[Any]],
        *,
        max_batch_size: int = 16,
        max_batch_tokens: int = 4096,
        max_wait_ms: float = 5.0,
        max_jobs: int = 4096,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        if max_batch_size < 1 or max_batch_tokens < 1 or max_jobs < 1 or max_wait_ms < 0:
            raise ValueError(
                "max_batch_size, max_batch_tokens and max_jobs must be >= 1, max_wait_ms >= 0"
            )
        self._judge_each = judge_each
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait_ms / 1000
        self.max_jobs = max_jobs
        self._on_batch = on_batch
        self._owners: OrderedDict[Hashable, deque[_Job]] = OrderedDict()
        self._count = 0
        self._arrived = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self.dropped = 0  # jobs dropped unrun: waiter gone or deadline passed
        self.run = 0  # jobs whose work ran

    @property
    def depth(self) -> int:
        return self._count

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None

    async def judge(self, query: Query, *, tokens: int, owner: Hashable, deadline: float) -> Any:
        """The engine's result for ``query``: a Judgment, or a JudgeError to raise."""
        future = asyncio.get_running_loop().create_future()
        return await self._submit(_Job(future, owner, deadline, query=query, tokens=tokens))

    async def call(self, fn: Callable[[], Any], *, owner: Hashable, deadline: float) -> Any:
        """Run ``fn`` on the model's thread, alone."""
        future = asyncio.get_running_loop().create_future()
        return await self._submit(_Job(future, owner, deadline, call=fn))

    async def _submit(self, job: _Job) -> Any:
        if self._count >= self.max_jobs:
            raise QueueFullError(f"{self._count} jobs are waiting for the model")
        remaining = job.deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineError("the request's deadline passed before its work was queued")
        self._owners.setdefault(job.owner, deque()).append(job)
        self._count += 1
        self._arrived.set()
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), remaining)
        except TimeoutError:
            raise DeadlineError("the request's deadline passed waiting for the model") from None
        finally:
            job.future.cancel()  # a no-op once done; otherwise the worker drops the job

    def _take(self, *, coalescable: bool, budget: int) -> _Job | None:
        """The next wanted job, owners in turn; with ``coalescable``, a query within ``budget``."""
        now = time.monotonic()
        for owner in list(self._owners):
            jobs = self._owners[owner]
            while jobs and not jobs[0].wanted(now):
                jobs.popleft()
                self._count -= 1
                self.dropped += 1
            if not jobs:
                del self._owners[owner]
                continue
            head = jobs[0]
            if coalescable and (head.query is None or head.tokens > budget):
                continue
            jobs.popleft()
            self._count -= 1
            self._owners.move_to_end(owner)  # its next job waits for everyone else's turn
            if not jobs:
                del self._owners[owner]
            return head
        return None

    async def _next(self) -> _Job:
        while True:
            job = self._take(coalescable=False, budget=0)
            if job is not None:
                return job
            self._arrived.clear()
            await self._arrived.wait()

    async def _run(self) -> None:
        while True:
            job = await self._next()
            if job.call is not None:
                await self._finish([job], functools.partial(_alone, job.call))
                continue
            batch, tokens = [job], job.tokens
            until = time.monotonic() + self.max_wait
            while len(batch) < self.max_batch_size:
                nxt = self._take(coalescable=True, budget=self.max_batch_tokens - tokens)
                if nxt is not None:
                    batch.append(nxt)
                    tokens += nxt.tokens
                    continue
                remaining = until - time.monotonic()
                if remaining <= 0:
                    break
                self._arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), remaining)
            if self._on_batch is not None:
                self._on_batch(len(batch))
            queries = [j.query for j in batch if j.query is not None]
            await self._finish(batch, functools.partial(self._judge_each, queries))

    async def _finish(self, jobs: list[_Job], work: Callable[[], list[Any]]) -> None:
        self.run += len(jobs)
        try:
            results = await anyio.to_thread.run_sync(work)
        except Exception as exc:  # an unexpected failure fails its jobs, not the worker
            for j in jobs:
                if not j.future.done():
                    j.future.set_exception(exc)
            return
        for j, result in zip(jobs, results, strict=True):
            if not j.future.done():
                j.future.set_result(result)
