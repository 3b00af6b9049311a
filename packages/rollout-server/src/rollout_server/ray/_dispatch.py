"""What :class:`~rollout_server.ray._pool.WorkerPool` keeps per worker and per rollout,
and how Ray calls end on the server's loop.

* :class:`PoolWorker`: one incarnation of a pool position (its actor handle, the rollouts
  it holds, why it was lost);
* :class:`Dispatch`: one rollout on one worker (its result future, its server deadline);
* :func:`when_done`: one callback on the loop when a Ray call ends (no task per call);
* the errors a dispatch's future may get (:class:`RolloutLostError`,
  :class:`ServerDeadlineError`) and the messages that name a lost worker.

This module does not import Ray: it only calls methods of the handles and references
the pool passes in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from typing import Any, Final

from ..execution._backend import ExecutionRequest

__all__ = [
    "CAUSE_MAX_CHARS",
    "Dispatch",
    "PoolWorker",
    "RolloutLostError",
    "ServerDeadlineError",
    "consume",
    "describe_ray_error",
    "lost_message",
    "when_done",
]

CAUSE_MAX_CHARS: Final = 600
"""Longest Ray error text quoted in a rollout's ``err_message``."""


class RolloutLostError(Exception):
    """The worker of a rollout is gone, or could not return its result; the message says
    which worker and why."""


class ServerDeadlineError(Exception):
    """A rollout's worker did not report within the grace after the rollout's deadline."""


def describe_ray_error(exc: BaseException) -> str:
    """A one-line description of a Ray error, at most :data:`CAUSE_MAX_CHARS` long."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if len(text) > CAUSE_MAX_CHARS:
        text = text[: CAUSE_MAX_CHARS - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def consume(future: asyncio.Future[Any] | concurrent.futures.Future[Any]) -> None:
    """Retrieve a done call's exception, so that one nobody awaits is not logged."""
    if not future.cancelled():
        future.exception()  # retrieved: a failed call nobody awaits is not logged as unhandled


def when_done(
    loop: asyncio.AbstractEventLoop,
    ref: Any,
    callback: Callable[[concurrent.futures.Future[Any]], None],
) -> None:
    """Call ``callback(future)`` on ``loop`` once the Ray call of ``ref`` has ended.

    One Ray-side future and one hop to the loop per call (``asyncio.wrap_future()`` would
    add an asyncio future and a second loop turn); the callback gets a done
    ``concurrent.futures.Future``.
    """

    def hop(future: concurrent.futures.Future[Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits anymore
            loop.call_soon_threadsafe(callback, future)

    ref.future().add_done_callback(hop)


class PoolWorker:
    """One incarnation of a pool position: an actor handle and the rollouts it holds."""

    def __init__(self, index: int, handle: Any) -> None:
        self.index = index
        self.handle = handle
        self.run = handle.run
        self.info: dict[str, Any] = {}
        self.ready = False
        self.held = 0
        self.inflight: dict[int, Dispatch] = {}
        self.lost: str | None = None
        self.reattached = False
        """Found serving when the pool started (a named worker that outlived the server
        process before), until the pool has collected what it holds."""

    @property
    def serving(self) -> bool:
        """Started and not lost."""
        return self.ready and self.lost is None

    @property
    def label(self) -> str:
        """``worker <index> (pid <pid> on <node ip>)``, as messages name it."""
        pid = self.info.get("pid")
        where = f" (pid {pid} on {self.info.get('node_ip')})" if pid is not None else ""
        return f"worker {self.index}{where}"

    def describe(self) -> dict[str, Any]:
        """This worker's ``/health`` entry."""
        return {
            "index": self.index,
            "alive": self.serving,
            "running": self.held,
            "pid": self.info.get("pid"),
            "node_ip": self.info.get("node_ip"),
            "node_id": self.info.get("node_id"),
        }


class Dispatch:
    """One rollout on one worker: its call, its result future and its server deadline.

    ``future`` gets the ``run`` call's reply, or :class:`RolloutLostError`, or
    :class:`ServerDeadlineError`; ``ended`` is True once the worker no longer holds the
    rollout (the call returned, or the worker is lost).
    """

    __slots__ = (
        "ended",
        "future",
        "grader_budget_sec",
        "grading",
        "key",
        "request",
        "settled",
        "timer",
        "worker",
    )

    def __init__(
        self,
        key: int,
        request: ExecutionRequest,
        worker: PoolWorker,
        future: asyncio.Future[Any],
        grader_budget_sec: float | None,
    ) -> None:
        self.key = key
        self.request = request
        self.worker = worker
        self.future = future
        self.grader_budget_sec = grader_budget_sec
        self.ended = False
        self.grading = False
        self.timer: asyncio.TimerHandle | None = None
        self.settled: asyncio.Future[None] | None = None

    def cancel_timer(self) -> None:
        """Stop the server deadline's timer, if one is set."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def lost_message(worker: PoolWorker, cause: str) -> str:
    """The ``err_message`` of a rollout whose ``worker`` was lost for ``cause``."""
    return (
        f"Ray {worker.label} was lost while running this rollout ({cause}); the rollout was "
        "not retried: submit it again with a new rollout_id"
    )
