"""``BatchOffloader``: run a rollout's short blocking file jobs at the cheapest place.

A rollout's file work (its artifacts directory, its trajectory) takes tens of
microseconds of system calls on a local disk, while a hop to a worker thread and back
(``asyncio.to_thread``) costs more than that in futures, locks, loop wake-ups and GIL
hand-overs: with hundreds of rollouts a second, worker threads fighting the event loop
for the GIL cost the server about a fifth of its CPU. So the offloader collects the jobs
submitted during one event-loop turn and, at the end of the turn:

* runs them on the loop itself while the file system is fast, for at most
  ``turn_budget_sec`` per turn (the rest waits for the next turn, so network work keeps
  flowing);
* once jobs have become slow (a moving mean of their duration above ``slow_job_sec``: a
  slow or network file system, not one hiccup of a local disk), runs every batch in a
  worker thread of the loop's default executor instead, for ``thread_mode_sec``, then
  tries the loop again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

__all__ = [
    "DEFAULT_SLOW_JOB_SEC",
    "DEFAULT_THREAD_MODE_SEC",
    "DEFAULT_TURN_BUDGET_SEC",
    "BatchOffloader",
]

DEFAULT_SLOW_JOB_SEC: Final = 0.002
"""When the moving mean of job durations on the loop exceeds this (seconds), jobs move to a
worker thread. A local disk takes tens of microseconds per job."""

MEAN_WEIGHT: Final = 0.1
"""Weight of the newest job in the moving mean of job durations."""

DEFAULT_THREAD_MODE_SEC: Final = 10.0
"""How long (seconds) jobs stay in worker threads after a slow one."""

DEFAULT_TURN_BUDGET_SEC: Final = 0.005
"""Most loop time (seconds) one turn spends on jobs before leaving the rest to the next."""

logger: Final = logging.getLogger("rollout_server.files")

_T = TypeVar("_T")
_Job = tuple[Callable[[], Any], "asyncio.Future[Any]"]


def _run_batch(jobs: list[Callable[[], Any]]) -> list[tuple[bool, Any]]:
    """Run each job in order (in a worker thread); one failure never stops the others."""
    results: list[tuple[bool, Any]] = []
    for job in jobs:
        try:
            results.append((True, job()))
        except Exception as exc:  # noqa: BLE001 - handed to the job's own future
            results.append((False, exc))
    return results


def _settle_one(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():  # cancelled meanwhile: the outcome is dropped
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


def _settle(batch: list[_Job], done: asyncio.Future[list[tuple[bool, Any]]]) -> None:
    """Hand each job's outcome to its future (on the loop)."""
    if done.cancelled():
        for _job, fut in batch:
            fut.cancel()
        return
    error = done.exception()
    if error is not None:
        for _job, fut in batch:
            _settle_one(fut, False, error)
        return
    for (_job, fut), (ok, value) in zip(batch, done.result(), strict=True):
        _settle_one(fut, ok, value)


class BatchOffloader:
    """Run short blocking jobs of one event loop in batches, on the loop or in a thread.

    Jobs run one after another in submission order (a batch in a worker thread runs in
    one thread; batches of different turns may overlap there). Keep jobs short: file
    system calls, not computation.

    Args:
        slow_job_sec: When the moving mean of job durations on the loop (weight 0.1 for
            the newest) exceeds this many seconds, jobs switch to worker threads.
        thread_mode_sec: How long batches then run in worker threads.
        turn_budget_sec: Loop time one turn may spend on jobs; the rest is left to the
            next turn.
    """

    def __init__(
        self,
        *,
        slow_job_sec: float = DEFAULT_SLOW_JOB_SEC,
        thread_mode_sec: float = DEFAULT_THREAD_MODE_SEC,
        turn_budget_sec: float = DEFAULT_TURN_BUDGET_SEC,
    ) -> None:
        self._slow_job_sec = slow_job_sec
        self._thread_mode_sec = thread_mode_sec
        self._turn_budget_sec = turn_budget_sec
        self._pending: list[_Job] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads_until = -1.0
        self._mean_job_sec = 0.0

    @property
    def in_thread_mode(self) -> bool:
        """Whether batches currently run in worker threads (jobs had turned slow)."""
        return time.monotonic() < self._threads_until

    def submit(self, job: Callable[[], _T]) -> asyncio.Future[_T]:
        """Schedule ``job`` for the end of this loop turn.

        Args:
            job: A blocking callable without arguments.

        Returns:
            A future of the running loop with the job's return value or exception.
            Cancelling it does not stop a job already running; its outcome is then
            dropped.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[_T] = loop.create_future()
        if loop is not self._loop:
            # A new loop (an earlier one closed with jobs unsent): start afresh.
            self._loop = loop
            self._pending = []
        if not self._pending:
            loop.call_soon(self._dispatch, loop)
        self._pending.append((job, fut))
        return fut

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:
            return
        if self._threads_until >= 0.0:
            if time.monotonic() < self._threads_until:
                self._to_thread(loop)
                return
            self._threads_until = -1.0  # try the loop again, with a fresh mean
            self._mean_job_sec = 0.0
        self._run_here(loop)

    def _to_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            done = loop.run_in_executor(None, _run_batch, [job for job, _fut in batch])
        except RuntimeError as exc:  # the executor has been shut down
            for _job, fut in batch:
                _settle_one(fut, False, exc)
            return
        done.add_done_callback(lambda finished: _settle(batch, finished))

    def _run_here(self, loop: asyncio.AbstractEventLoop) -> None:
        pending = self._pending
        clock = time.perf_counter
        start = clock()
        turn_end = start + self._turn_budget_sec
        ran = 0
        mean = self._mean_job_sec
        try:
            for job, fut in pending:
                ran += 1
                if fut.done():  # cancelled before it started: skip the work
                    continue
                began = clock()
                try:
                    value = job()
                except Exception as exc:  # noqa: BLE001 - handed to the job's own future
                    _settle_one(fut, False, exc)
                else:
                    _settle_one(fut, True, value)
                ended = clock()
                mean += MEAN_WEIGHT * (ended - began - mean)
                if mean > self._slow_job_sec:
                    self._threads_until = time.monotonic() + self._thread_mode_sec
                    logger.info(
                        "File jobs are slow (%.1f ms each on average); running them in a "
                        "worker thread for the next %.0f s",
                        mean * 1000.0,
                        self._thread_mode_sec,
                    )
                    break
                if ended >= turn_end:
                    break
        finally:
            self._mean_job_sec = mean
            del pending[:ran]
        if pending:
            # Over budget, or the file system turned slow: the rest goes next turn.
            loop.call_soon(self._dispatch, loop)
