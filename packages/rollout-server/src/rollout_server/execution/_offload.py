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
* once jobs have become slow (most of the last 16 slower than ``slow_job_sec``, or one
  slower than ``stall_sec``: a slow or network file system), runs every batch in a worker
  thread of the loop's default executor instead, for ``thread_mode_sec``, then tries the
  loop again. A batch in a thread that has not finished after ``thread_timeout_sec``
  fails its jobs' futures with :class:`TimeoutError` (the thread goes on): one timer per
  batch bounds every wait, where a timeout per caller would cost a timer per job.

A job's duration is wall time, so a job during which the process was preempted looks
slow; on a busy machine that happens to single jobs all the time. Hence a majority of
recent jobs, not a mean that one preemption of tens of milliseconds would tip over (with
a moving mean, a third of the benchmark's runs moved to threads for no reason, costing
a fifth of the server's CPU).

A plain alternative, one writer thread fed by a queue (jobs always off the loop), was
measured against this (``benchmarks/README.md``, "File jobs: on the loop or one writer
thread"): it delivered results later (notification p99) and cost more CPU per rollout at
low concurrency, so the batching stays.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

from .._logtext import get_logger

__all__ = [
    "DEFAULT_SLOW_JOB_SEC",
    "DEFAULT_STALL_SEC",
    "DEFAULT_THREAD_MODE_SEC",
    "DEFAULT_THREAD_TIMEOUT_SEC",
    "DEFAULT_TURN_BUDGET_SEC",
    "RECENT_JOBS",
    "BatchOffloader",
]

DEFAULT_SLOW_JOB_SEC: Final = 0.002
"""A job on the loop slower than this (seconds) counts as slow; when most recent jobs are,
jobs move to a worker thread. A local disk takes tens of microseconds per job."""

DEFAULT_STALL_SEC: Final = 0.1
"""One job on the loop slower than this (seconds) moves jobs to a worker thread at once."""

RECENT_JOBS: Final = 16
"""How many of the latest jobs on the loop the majority rule looks at."""

DEFAULT_THREAD_MODE_SEC: Final = 10.0
"""How long (seconds) jobs stay in worker threads after a slow one."""

DEFAULT_THREAD_TIMEOUT_SEC: Final = 10.0
"""How long (seconds) the jobs of a batch in a worker thread may take before their futures
fail with TimeoutError."""

DEFAULT_TURN_BUDGET_SEC: Final = 0.005
"""Most loop time (seconds) one turn spends on jobs before leaving the rest to the next."""

logger: Final = get_logger("rollout_server.files")

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


def _expire(batch: list[_Job], timeout_sec: float) -> None:
    """Fail the futures of a thread batch's unfinished jobs (the thread goes on)."""
    for _job, fut in batch:
        _settle_one(
            fut,
            False,
            TimeoutError(
                f"the file job did not finish within {timeout_sec:g} s in a worker thread "
                "(a slow or hung file system); it goes on there, its outcome unreported"
            ),
        )


# Speed: benchmarks/README.md, "LocalBackend: files and copies", row "File jobs (a rollout's
#   directory, its trajectory write) of one loop turn ..."
class BatchOffloader:
    """Run short blocking jobs of one event loop in batches, on the loop or in a thread.

    Jobs run one after another in submission order (a batch in a worker thread runs in
    one thread; batches of different turns may overlap there). Keep jobs short: file
    system calls, not computation.

    Args:
        slow_job_sec: A job on the loop slower than this many seconds is slow; when more
            than half of the last :data:`RECENT_JOBS` were, jobs switch to worker threads.
            Default 0.002.
        stall_sec: One job on the loop slower than this many seconds switches jobs to
            worker threads at once. Default 0.1.
        thread_mode_sec: How long (seconds) batches then run in worker threads; default
            10.
        thread_timeout_sec: How long (seconds) a batch in a worker thread may run before
            the futures of its unfinished jobs fail with :class:`TimeoutError`; default 10.
        turn_budget_sec: Loop time (seconds) one turn may spend on jobs; the rest is
            left to the next turn. Default 0.005.
    """

    def __init__(
        self,
        *,
        slow_job_sec: float = DEFAULT_SLOW_JOB_SEC,
        stall_sec: float = DEFAULT_STALL_SEC,
        thread_mode_sec: float = DEFAULT_THREAD_MODE_SEC,
        thread_timeout_sec: float = DEFAULT_THREAD_TIMEOUT_SEC,
        turn_budget_sec: float = DEFAULT_TURN_BUDGET_SEC,
    ) -> None:
        self._slow_job_sec = slow_job_sec
        self._stall_sec = stall_sec
        self._thread_mode_sec = thread_mode_sec
        self._thread_timeout_sec = thread_timeout_sec
        self._turn_budget_sec = turn_budget_sec
        self._pending: list[_Job] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads_until = -1.0
        # Whether each of the latest jobs on the loop was slow, and how many were.
        self._recent: collections.deque[bool] = collections.deque(maxlen=RECENT_JOBS)
        self._slow_count = 0

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
            dropped. It fails with :class:`TimeoutError` when the job ran in a worker
            thread and its batch took longer than ``thread_timeout_sec``.
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
            self._threads_until = -1.0  # try the loop again, with a fresh record
            self._recent.clear()
            self._slow_count = 0
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
        timer = loop.call_later(self._thread_timeout_sec, _expire, batch, self._thread_timeout_sec)

        def settle(finished: asyncio.Future[list[tuple[bool, Any]]]) -> None:
            timer.cancel()
            _settle(batch, finished)

        done.add_done_callback(settle)

    def _run_here(self, loop: asyncio.AbstractEventLoop) -> None:
        pending = self._pending
        clock = time.perf_counter
        start = clock()
        turn_end = start + self._turn_budget_sec
        ran = 0
        recent = self._recent
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
                took = ended - began
                slow = took > self._slow_job_sec
                if len(recent) == RECENT_JOBS and recent[0]:
                    self._slow_count -= 1
                recent.append(slow)
                self._slow_count += slow
                if took > self._stall_sec or self._slow_count * 2 > RECENT_JOBS:
                    self._threads_until = time.monotonic() + self._thread_mode_sec
                    logger.info(
                        "File jobs are slow (%d of the last %d took over %.1f ms; the latest "
                        "%.1f ms); running them in a worker thread for the next %.0f s",
                        self._slow_count,
                        len(recent),
                        self._slow_job_sec * 1000.0,
                        took * 1000.0,
                        self._thread_mode_sec,
                    )
                    break
                if ended >= turn_end:
                    break
        finally:
            del pending[:ran]
        if pending:
            # Over budget, or the file system turned slow: the rest goes next turn.
            loop.call_soon(self._dispatch, loop)
