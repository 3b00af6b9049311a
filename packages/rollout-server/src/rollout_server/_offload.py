"""``BatchOffloader``: run short blocking jobs off the event loop, many per thread hop.

A rollout's file work (its artifacts directory, its trajectory) takes tens of microseconds
of system calls, while a hop to a worker thread and back (``asyncio.to_thread``) costs
several times that in futures, locks and loop wake-ups. The offloader collects the jobs
submitted during one event-loop turn and runs them as one batch in the loop's default
executor: under load, hundreds of rollouts share one hop; a lone job still runs at once.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["BatchOffloader"]

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


def _settle(batch: list[_Job], done: asyncio.Future[list[tuple[bool, Any]]]) -> None:
    """Hand each job's outcome to its future (on the loop); skip futures cancelled meanwhile."""
    if done.cancelled():
        for _job, fut in batch:
            fut.cancel()
        return
    error = done.exception()
    if error is not None:
        for _job, fut in batch:
            if not fut.done():
                fut.set_exception(error)
        return
    for (_job, fut), (ok, value) in zip(batch, done.result(), strict=True):
        if fut.done():
            continue
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)


class BatchOffloader:
    """Run blocking jobs in the running loop's default executor, one batch per loop turn.

    Jobs of one batch run one after another in one worker thread, in submission order;
    batches of different turns may run concurrently. Keep jobs short (file system calls):
    a slow job delays the rest of its batch.
    """

    def __init__(self) -> None:
        self._pending: list[_Job] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def submit(self, job: Callable[[], _T]) -> asyncio.Future[_T]:
        """Schedule ``job`` for the batch of this loop turn.

        Args:
            job: A blocking callable without arguments.

        Returns:
            A future of the running loop with the job's return value or exception.
            Cancelling it does not stop the job (it runs in a thread); its outcome is
            then dropped.
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
        batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            done = loop.run_in_executor(None, _run_batch, [job for job, _fut in batch])
        except RuntimeError as exc:  # the executor has been shut down
            for _job, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        done.add_done_callback(functools.partial(_settle, batch))
