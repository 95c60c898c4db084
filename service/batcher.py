"""Coalescing concurrent requests into batched forward passes.

Every request that needs the model becomes a job on one bounded queue, served by one worker
that owns the model: the forward pass never runs on the event loop, and never in two threads
at once (two would only fight over the same cores). Single judgments waiting in the queue are
taken together, up to ``max_batch_size`` of them, waiting at most ``max_wait_ms`` for more to
arrive after the first; other jobs (shared-context batches, profile fits) run alone. A full
queue is refused at once (the service answers 503 with Retry-After) rather than letting
latency grow without bound, and every job has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread

from judge.engine import Query

__all__ = ["Batcher", "QueueFullError"]


class QueueFullError(Exception):
    """The job queue is at capacity; the caller should retry later."""


@dataclass
class _Job:
    future: asyncio.Future[Any]
    query: Query | None = None  # a single judgment, which may be coalesced with others
    call: Callable[[], Any] | None = None  # anything else, run alone
    enqueued: float = field(default_factory=time.perf_counter)


def _alone(fn: Callable[[], Any]) -> list[Any]:
    return [fn()]


class Batcher:
    """Serializes model work and coalesces single judgments into batches."""

    def __init__(
        self,
        judge_each: Callable[[Sequence[Query]], list[Any]],
        *,
        max_batch_size: int = 16,
        max_wait_ms: float = 5.0,
        max_queue: int = 256,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        if max_batch_size < 1 or max_queue < 1 or max_wait_ms < 0:
            raise ValueError("max_batch_size and max_queue must be >= 1, max_wait_ms >= 0")
        self._judge_each = judge_each
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000
        self._queue: asyncio.Queue[_Job] = asyncio.Queue(maxsize=max_queue)
        self._on_batch = on_batch
        self._worker: asyncio.Task[None] | None = None

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None

    async def judge(self, query: Query, timeout: float) -> Any:
        """The engine's result for ``query``: a Judgment, or a JudgeError to raise."""
        return await self._submit(
            _Job(asyncio.get_running_loop().create_future(), query=query), timeout
        )

    async def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run ``fn`` on the model's thread, alone."""
        return await self._submit(
            _Job(asyncio.get_running_loop().create_future(), call=fn), timeout
        )

    async def _submit(self, job: _Job, timeout: float) -> Any:
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            raise QueueFullError(f"the queue holds {self._queue.maxsize} jobs") from None
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), timeout)
        except TimeoutError:
            job.future.cancel()  # the worker skips it if it has not started yet
            raise

    async def _run(self) -> None:
        pending: _Job | None = None
        while True:
            job = pending or await self._queue.get()
            pending = None
            if job.future.done():
                continue
            if job.call is not None:
                await self._finish([job], functools.partial(_alone, job.call))
                continue
            batch = [job]
            deadline = time.perf_counter() + self.max_wait
            while len(batch) < self.max_batch_size:
                remaining = deadline - time.perf_counter()
                try:
                    nxt = (
                        self._queue.get_nowait()
                        if remaining <= 0
                        else await asyncio.wait_for(self._queue.get(), remaining)
                    )
                except (TimeoutError, asyncio.QueueEmpty):
                    break
                if nxt.future.done():
                    continue
                if nxt.call is not None:
                    pending = nxt  # runs alone, after this batch
                    break
                batch.append(nxt)
            queries = [j.query for j in batch if j.query is not None]
            if self._on_batch is not None:
                self._on_batch(len(queries))
            await self._finish(batch, functools.partial(self._judge_each, queries))

    async def _finish(self, jobs: list[_Job], work: Callable[[], list[Any]]) -> None:
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
