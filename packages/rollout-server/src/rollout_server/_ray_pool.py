"""The worker pool of :class:`~rollout_server.RayBackend`, on the server's event loop.

The pool keeps ``size`` :class:`~rollout_server._ray_worker.RolloutWorker` actors, each
with ``slots`` slots, and does the accounting the server's admission relies on:

* **Slots.** A rollout holds a slot of one worker from its dispatch until the worker has
  acknowledged its end (its ``run`` call returned) or the worker is gone. Waiting
  rollouts queue here, in arrival order; a freed slot goes straight to the oldest waiter,
  on the least-loaded live worker (not by fixed chunks).
* **Statuses.** One ``events()`` call in flight per worker carries the ``running`` and
  ``grading`` changes of its rollouts; the watcher applies them and asks again.
* **Deaths.** A worker is lost when a call to it fails with a Ray actor error (the
  process was killed, ran out of memory, its node was removed) or when the pool kills it
  (a rollout ignored its cancellation, or outlived its deadline plus the grace). Losing a
  worker fails each of its rollouts at once with the cause, kills the actor for good
  (``ray.kill(no_restart=True)``) and starts a replacement in its place, retried with a
  backoff until it serves. One incarnation per actor handle (no Ray-side restarts) keeps
  the fate of every call unambiguous; Ray never re-runs a call (``max_task_retries=0``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import Coroutine
from typing import Any, Final

from rollout_types import RolloutStatus

from ._backend import ExecutionRequest
from ._ray_worker import WorkerSpec

__all__ = ["Dispatch", "PoolWorker", "RolloutLostError", "WorkerPool"]

logger: Final = logging.getLogger("rollout_server.ray_backend")

REPLACE_DELAYS_SEC: Final = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0)
"""Pauses before each attempt to start a replacement worker (the last one repeats)."""

CAUSE_MAX_CHARS: Final = 600
"""Longest Ray error text quoted in a rollout's ``err_message``."""


class RolloutLostError(Exception):
    """The worker of a rollout is gone; the message names the worker and the cause."""


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: a failed call nobody awaits is not logged as unhandled


def _future(ref: Any) -> asyncio.Future[Any]:
    """An asyncio future of a Ray ``ObjectRef`` on the running loop."""
    return asyncio.wrap_future(ref.future())


def describe_ray_error(exc: BaseException) -> str:
    """A one-line description of a Ray error, at most :data:`CAUSE_MAX_CHARS` long."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if len(text) > CAUSE_MAX_CHARS:
        text = text[: CAUSE_MAX_CHARS - 3] + "..."
    return f"{type(exc).__name__}: {text}"


class PoolWorker:
    """One incarnation of a pool position: an actor handle and the rollouts it holds."""

    def __init__(self, index: int, handle: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.index = index
        self.handle = handle
        self.info: dict[str, Any] = {}
        self.ready = False
        self.held = 0
        self.inflight: dict[int, Dispatch] = {}
        self.lost: asyncio.Future[str] = loop.create_future()
        self.watcher: asyncio.Task[None] | None = None

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
            "alive": self.ready and not self.lost.done(),
            "running": self.held,
            "pid": self.info.get("pid"),
            "node_ip": self.info.get("node_ip"),
            "node_id": self.info.get("node_id"),
        }


class Dispatch:
    """One rollout on one worker: its call, its status relay and its server deadline."""

    def __init__(self, key: int, request: ExecutionRequest, worker: PoolWorker) -> None:
        self.key = key
        self.request = request
        self.worker = worker
        self.call: asyncio.Future[Any] | None = None
        self.ended = False
        self.grading = False
        self.deadline: asyncio.Timeout | None = None
        self.grading_budget_sec: float | None = None

    def apply(self, status: str) -> None:
        """Relay a status change from the worker to the server's registry."""
        try:
            value = RolloutStatus(status)
        except ValueError:
            logger.warning("Rollout %s: ignoring unknown status %r", self.request.id, status)
            return
        if value is RolloutStatus.GRADING and not self.grading:
            self.grading = True
            if self.deadline is not None:
                budget = self.grading_budget_sec
                self.deadline.reschedule(
                    None if budget is None else asyncio.get_running_loop().time() + budget
                )
        self.request.on_status(value)


class WorkerPool:
    """The pool of the module docstring.

    Args:
        remote_class: ``ray.remote(RolloutWorker)``.
        spec: What each worker builds its LocalBackend from.
        size: Number of workers.
        actor_options: Options of every actor (``.options(**actor_options)``).
        start_timeout_sec: Bound on one worker's start (its ``ready()`` answer).
        cancel_grace_sec: How long a cancelled rollout's worker has to acknowledge.
    """

    def __init__(
        self,
        *,
        remote_class: Any,
        spec: WorkerSpec,
        size: int,
        actor_options: dict[str, Any],
        start_timeout_sec: float,
        cancel_grace_sec: float,
    ) -> None:
        self._remote_class = remote_class
        self._spec = spec
        self.size = size
        self.slots = spec.slots
        self._options = actor_options
        self._start_timeout_sec = start_timeout_sec
        self._cancel_grace_sec = cancel_grace_sec
        self._loop = asyncio.get_running_loop()
        self.workers: list[PoolWorker | None] = [None] * size
        self._waiters: collections.deque[asyncio.Future[PoolWorker]] = collections.deque()
        self._keys = itertools.count(1)
        self._side_tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.replacements = 0
        self.lost_count = 0

    # -- start and stop -------------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker and wait until each serves.

        Raises:
            RuntimeError: When a worker cannot start (the cause is in the message).
        """
        results = await asyncio.gather(
            *(self._start_worker(index) for index in range(self.size)), return_exceptions=True
        )
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            await self.close()
            raise RuntimeError(
                f"RayBackend could not start its workers: {describe_ray_error(errors[0])}"
            ) from errors[0]

    async def _start_worker(self, index: int) -> PoolWorker:
        handle = self._remote_class.options(**self._options).remote(self._spec)
        worker = PoolWorker(index, handle, self._loop)
        try:
            async with asyncio.timeout(self._start_timeout_sec):
                worker.info = await handle.ready.remote()
        except BaseException:
            self._kill(handle)
            raise
        if self._closed:
            self._kill(handle)
            raise RuntimeError("the pool closed while the worker started")
        worker.ready = True
        self.workers[index] = worker
        worker.watcher = self._loop.create_task(self._watch(worker))
        logger.info("Ray %s serves %d slot(s)", worker.label, self.slots)
        self._hand_out()
        return worker

    async def close(self, *, drain_sec: float = 5.0) -> None:
        """Stop the pool: let workers finish their file writes (bounded), then kill them."""
        self._closed = True
        for task in list(self._side_tasks):
            task.cancel()
        workers = [worker for worker in self.workers if worker is not None]
        for worker in workers:
            if worker.watcher is not None:
                worker.watcher.cancel()
        live = [w for w in workers if w.ready and not w.lost.done()]
        if live:
            calls = [_future(w.handle.shutdown.remote()) for w in live]
            _, pending = await asyncio.wait(calls, timeout=drain_sec)
            for call in calls:
                call.add_done_callback(_consume)
            for call in pending:
                call.cancel()
        for worker in workers:
            self._lose(worker, "the rollout server shut the pool down", replace=False)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.cancel()
        self._waiters.clear()

    # -- slots ----------------------------------------------------------------------------

    @property
    def alive(self) -> int:
        """Workers that serve now."""
        return sum(1 for w in self.workers if w is not None and w.ready and not w.lost.done())

    @property
    def queued(self) -> int:
        """Rollouts waiting for a slot."""
        return sum(1 for waiter in self._waiters if not waiter.done())

    @property
    def running(self) -> int:
        """Slots held on live workers."""
        return sum(w.held for w in self.workers if w is not None and not w.lost.done())

    def free_slots(self) -> int:
        """Slots free on live workers now."""
        return sum(
            self.slots - w.held
            for w in self.workers
            if w is not None and w.ready and not w.lost.done()
        )

    def _least_loaded(self) -> PoolWorker | None:
        best: PoolWorker | None = None
        for worker in self.workers:
            if (
                worker is not None
                and worker.ready
                and not worker.lost.done()
                and worker.held < self.slots
                and (best is None or worker.held < best.held)
            ):
                best = worker
        return best

    async def acquire(self, deadline: float | None) -> PoolWorker | None:
        """Take a slot on the least-loaded live worker, waiting in arrival order.

        Args:
            deadline: ``time.monotonic()`` value past which to stop waiting, or None.

        Returns:
            The worker whose slot is now held, or None when ``deadline`` passed first.

        Raises:
            asyncio.CancelledError: When cancelled while waiting (no slot is held then).
        """
        if not self._waiters:
            worker = self._least_loaded()
            if worker is not None:
                worker.held += 1
                return worker
        if self._closed:
            raise RuntimeError("the RayBackend pool is closed")
        waiter: asyncio.Future[PoolWorker] = self._loop.create_future()
        self._waiters.append(waiter)
        try:
            if deadline is None:
                return await waiter
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._remove(waiter)
                return None
            async with asyncio.timeout(remaining):
                return await waiter
        except TimeoutError:
            self._give_back(waiter)
            return None
        except asyncio.CancelledError:
            self._give_back(waiter)
            raise

    def _give_back(self, waiter: asyncio.Future[PoolWorker]) -> None:
        if waiter.done() and not waiter.cancelled():
            # A slot was handed over in the same instant: pass it on.
            self._release(waiter.result())
        else:
            self._remove(waiter)

    def _remove(self, waiter: asyncio.Future[PoolWorker]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)

    def _release(self, worker: PoolWorker) -> None:
        worker.held -= 1
        self._hand_out()

    def _hand_out(self) -> None:
        while self._waiters:
            worker = self._least_loaded()
            if worker is None:
                return
            waiter = self._waiters.popleft()
            if not waiter.done():
                worker.held += 1
                waiter.set_result(worker)

    # -- dispatch -------------------------------------------------------------------------

    def dispatch(
        self, worker: PoolWorker, request: ExecutionRequest, payload: tuple[Any, ...]
    ) -> Dispatch:
        """Send one rollout to ``worker`` (whose slot the caller holds).

        Args:
            worker: From :meth:`acquire`.
            request: The server's request (its ``on_status`` receives the relayed changes).
            payload: The arguments of ``RolloutWorker.run`` after the key.
        """
        dispatch = Dispatch(next(self._keys), request, worker)
        worker.inflight[dispatch.key] = dispatch
        try:
            call = _future(worker.handle.run.remote(dispatch.key, *payload))
        except BaseException:
            self._end(dispatch)
            raise
        dispatch.call = call
        call.add_done_callback(lambda _call: self._call_done(dispatch, call))
        return dispatch

    def _call_done(self, dispatch: Dispatch, call: asyncio.Future[Any]) -> None:
        error = None if call.cancelled() else call.exception()
        if error is not None:
            from ray.exceptions import RayActorError

            if isinstance(error, RayActorError):
                self._lose(dispatch.worker, describe_ray_error(error))
                return
        self._end(dispatch)

    async def wait(self, dispatch: Dispatch, deadline: asyncio.Timeout) -> Any:
        """What the worker's ``run`` call returned for ``dispatch``.

        Raises:
            RolloutLostError: When the worker is lost first (or the call fails).
            TimeoutError: When ``deadline`` passes first (the worker keeps the rollout
                until :meth:`stop` settles it).
        """
        call = dispatch.call
        assert call is not None
        worker = dispatch.worker
        dispatch.deadline = deadline
        async with deadline:
            if not call.done() and not worker.lost.done():
                await asyncio.wait((call, worker.lost), return_when=asyncio.FIRST_COMPLETED)
        if call.done() and not call.cancelled():
            error = call.exception()
            if error is None:
                return call.result()
            if worker.lost.done():  # an actor error: the worker is gone
                raise RolloutLostError(_lost_message(worker, worker.lost.result())) from error
            raise RolloutLostError(
                f"Ray {worker.label} could not return this rollout's result: "
                f"{describe_ray_error(error)}"
            ) from error
        raise RolloutLostError(_lost_message(worker, worker.lost.result()))

    async def stop(self, dispatch: Dispatch, why: str) -> None:
        """Cancel ``dispatch`` on its worker and wait (at most the cancel grace, shielded)
        for the acknowledgement; without one, kill the worker (its other rollouts fail).

        A cancellation of the caller ends its wait; the settling goes on in the pool.
        """
        if not dispatch.ended:
            await asyncio.shield(self.settle(dispatch, why))

    def settle(self, dispatch: Dispatch, why: str) -> asyncio.Task[None]:
        """Start settling ``dispatch`` in the pool, as :meth:`stop` does, without waiting."""
        return self._spawn(self._settle(dispatch, why))

    async def _settle(self, dispatch: Dispatch, why: str) -> None:
        worker = dispatch.worker
        call = dispatch.call
        assert call is not None
        with contextlib.suppress(Exception):
            _future(worker.handle.cancel.remote([dispatch.key])).add_done_callback(_consume)
        if not call.done() and not worker.lost.done():
            await asyncio.wait(
                (call, worker.lost),
                timeout=self._cancel_grace_sec,
                return_when=asyncio.FIRST_COMPLETED,
            )
        if not dispatch.ended and not call.done():
            grace = self._cancel_grace_sec
            logger.warning(
                "Rollout %s did not stop within %.1fs of its cancellation (%s): killing Ray %s",
                dispatch.request.id,
                grace,
                why,
                worker.label,
            )
            self._lose(
                worker,
                f"the pool killed it because rollout {dispatch.request.id!r} did not stop "
                f"within {grace:g}s of its cancellation ({why})",
            )

    def _end(self, dispatch: Dispatch) -> None:
        if dispatch.ended:
            return
        dispatch.ended = True
        worker = dispatch.worker
        worker.inflight.pop(dispatch.key, None)
        if not worker.lost.done():
            self._release(worker)

    # -- statuses and deaths --------------------------------------------------------------

    async def _watch(self, worker: PoolWorker) -> None:
        while True:
            try:
                batch = await worker.handle.events.remote()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failed call means the worker is gone
                self._lose(worker, describe_ray_error(exc))
                return
            for key, status in batch:
                dispatch = worker.inflight.get(key)
                if dispatch is not None:
                    dispatch.apply(status)

    def _lose(self, worker: PoolWorker, cause: str, *, replace: bool = True) -> None:
        """Mark ``worker`` lost: fail its rollouts with ``cause``, kill it, replace it."""
        if worker.lost.done():
            return
        worker.lost.set_result(cause)
        worker.ready = False
        dispatches = list(worker.inflight.values())
        worker.inflight.clear()
        for dispatch in dispatches:
            dispatch.ended = True
        worker.held = 0
        if worker.watcher is not None and worker.watcher is not asyncio.current_task():
            worker.watcher.cancel()
        self._kill(worker.handle)
        if replace and not self._closed:
            self.lost_count += 1
            logger.error(
                "Ray %s is lost with %d rollout(s) in flight: %s; starting a replacement",
                worker.label,
                len(dispatches),
                cause,
            )
            _ = self._spawn(self._replace(worker.index))

    async def _replace(self, index: int) -> None:
        for attempt in itertools.count():
            delay = REPLACE_DELAYS_SEC[min(attempt, len(REPLACE_DELAYS_SEC) - 1)]
            if delay:
                await asyncio.sleep(delay)
            if self._closed:
                return
            try:
                await self._start_worker(index)
            except Exception as exc:  # noqa: BLE001 - logged; the next attempt follows
                logger.error(
                    "Replacement of Ray worker %d failed (attempt %d): %s",
                    index,
                    attempt + 1,
                    describe_ray_error(exc),
                )
            else:
                self.replacements += 1
                return

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self._loop.create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)
        return task

    @staticmethod
    def _kill(handle: Any) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(handle, no_restart=True)


def _lost_message(worker: PoolWorker, cause: str) -> str:
    return (
        f"Ray {worker.label} was lost while running this rollout ({cause}); the rollout was "
        "not retried: submit it again with a new rollout_id"
    )
