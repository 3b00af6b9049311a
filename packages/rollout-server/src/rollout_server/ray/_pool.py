"""The worker pool of :class:`~rollout_server.RayBackend`, on the server's event loop.

The pool keeps ``size`` :class:`~rollout_server.ray._worker.RolloutWorker` actors, each
with ``slots`` slots (None: no limit):

* **Slots.** :class:`~rollout_server.ray._slots.WorkerSlots` (:attr:`WorkerPool.slots`)
  counts the slots each worker holds and queues the rollouts waiting for one; the pool
  tells it when a dispatch ends (a slot is free) and when a worker starts serving.
* **Calls.** One Ray call per rollout (``run``), whose reply is the outcome, and one
  ``events()`` call in flight per worker for the ``grading`` reports; each call's end is
  a callback on this loop (:func:`~rollout_server.ray._dispatch.when_done`), not a task.
* **Deadlines.** A dispatch with a deadline (the agent deadline plus the grace, then the
  grader's once it grades) holds one ``loop.call_at`` timer; when it fires, the rollout
  fails as ``timeout`` and is settled on its worker.
* **Deaths.** A worker is lost when a call to it fails with a Ray actor error (the
  process was killed, ran out of memory, its node was removed) or when the pool kills it
  (a rollout ignored its cancellation, or outlived its deadline plus the grace). Losing a
  worker fails each of its rollouts at once with the cause, kills the actor for good
  (``ray.kill(no_restart=True)``) and starts a replacement in its place, retried with a
  backoff until it serves. One incarnation per actor handle (no Ray-side restarts) keeps
  the fate of every call unambiguous; Ray never re-runs a call (``max_task_retries=0``).

* **Re-attach.** On durable state with a Ray cluster that outlives the server (see
  :class:`~rollout_server.RayBackend`), the pool has a ``namespace``: its workers are
  named, detached actors (``rollout-worker-<index>``) that keep the outcomes of their
  rollouts (``keep_outcomes``). A pool that starts takes over the named workers it finds
  serving, replaces those that are gone or do not answer (:attr:`WorkerPool.gone`), and
  kills named workers beyond its size. :meth:`WorkerPool.reattach` then collects, from
  each worker taken over, the outcomes of the rollouts the restarted server recovered,
  and waits again for those still running (:mod:`rollout_server.ray._reattach`).

Dispatches, deadlines and losses change the same counts and stay in this one class; what
it keeps per worker and per rollout lives in :mod:`rollout_server.ray._dispatch`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final

from rollout_types import RolloutStatus

from .._logtext import get_logger
from ..execution._backend import ExecutionRequest
from ._actors import NAME_RETRY_SEC, kill_actor, worker_name
from ._codec import encode_request
from ._dispatch import (
    Dispatch,
    PoolWorker,
    RolloutLostError,
    ServerDeadlineError,
    consume,
    describe_ray_error,
    lost_message,
    when_done,
)
from ._reattach import collect, retire_extra_workers, take_over
from ._slots import WorkerSlots
from ._worker import WorkerSpec

__all__ = ["WorkerPool", "worker_name"]

logger: Final = get_logger("rollout_server.ray_backend")

REPLACE_DELAYS_SEC: Final = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0)
"""Pauses before each attempt to start a replacement worker (the last one repeats)."""


class WorkerPool:
    """The pool of the module docstring.

    Args:
        remote_class: ``ray.remote(RolloutWorker)``.
        spec: What each worker builds its LocalBackend from.
        size: Number of workers.
        slots: Slots of each worker, or None for no limit.
        actor_options: Options of every actor (``.options(**actor_options)``).
        start_timeout_sec: Bound on one worker's start (its ``ready()`` answer).
        cancel_grace_sec: How long a cancelled rollout's worker has to acknowledge.
        deadline_grace_sec: How long past a rollout's deadline its worker has to report.
        namespace: The Ray namespace of named, detached workers that outlive the server
            process (module docstring), or None (anonymous workers of this process).
        keep_outcomes: How many outcomes each named worker keeps for a restarted server.

    Attributes:
        gone: Positions whose named worker was gone (or did not answer) when the pool
            started; their rollouts ended with the worker.
        retired: Named workers beyond the pool's size that the start killed.
    """

    def __init__(
        self,
        *,
        remote_class: Any,
        spec: WorkerSpec,
        size: int,
        slots: int | None,
        actor_options: dict[str, Any],
        start_timeout_sec: float,
        cancel_grace_sec: float,
        deadline_grace_sec: float,
        namespace: str | None = None,
        keep_outcomes: int = 0,
    ) -> None:
        self._remote_class = remote_class
        self.namespace = namespace
        self._keep = keep_outcomes if namespace is not None else 0
        self.gone: list[int] = []
        self.retired = 0
        self._spec = spec
        self.size = size
        self._options = actor_options
        self._start_timeout_sec = start_timeout_sec
        self._cancel_grace_sec = cancel_grace_sec
        self.deadline_grace_sec = deadline_grace_sec
        self._loop = asyncio.get_running_loop()
        self.workers: list[PoolWorker | None] = [None] * size
        self.slots = WorkerSlots(self.workers, slots, self._loop)
        # Keys unique across the server processes that share named workers.
        self._keys = itertools.count(time.time_ns())
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
        adopt = self.namespace
        if adopt is not None:
            self.retired += retire_extra_workers(adopt, self.size)
        results = await asyncio.gather(
            *(self._start_worker(index, adopt=adopt) for index in range(self.size)),
            return_exceptions=True,
        )
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            await self.close()
            raise RuntimeError(
                f"RayBackend could not start its workers: {describe_ray_error(errors[0])}"
            ) from errors[0]

    async def _start_worker(self, index: int, *, adopt: str | None = None) -> PoolWorker:
        if adopt is not None:  # the named worker of the previous server process, if it serves
            found = await take_over(
                index,
                namespace=adopt,
                start_timeout_sec=self._start_timeout_sec,
                fingerprint=self._spec.fingerprint(),
            )
            if found is not None:
                return self._serve(found)
            self.gone.append(index)
        handle = await self._create(index)
        worker = PoolWorker(index, handle)
        try:
            async with asyncio.timeout(self._start_timeout_sec):
                worker.info = await handle.ready.remote()
        except BaseException:
            kill_actor(handle)
            raise
        return self._serve(worker)

    async def _create(self, index: int) -> Any:
        """A new worker actor at ``index`` (named and detached with a namespace)."""
        if self.namespace is None:
            return self._remote_class.options(**self._options).remote(self._spec)
        options = {
            **self._options,
            "name": worker_name(index),
            "namespace": self.namespace,
            "lifetime": "detached",
        }
        async with asyncio.timeout(self._start_timeout_sec):
            while True:
                try:
                    return self._remote_class.options(**options).remote(self._spec, self._keep)
                except ValueError:  # the name is still taken by the worker just killed
                    await asyncio.sleep(NAME_RETRY_SEC)

    def _serve(self, worker: PoolWorker) -> PoolWorker:
        handle = worker.handle
        if self._closed:
            kill_actor(handle)
            raise RuntimeError("the pool closed while the worker started")
        worker.ready = True
        self.workers[worker.index] = worker
        self._poll_events(worker)
        logger.info(
            "Ray %s serves %s slot(s)",
            worker.label,
            "unlimited" if self.slots.per_worker is None else self.slots.per_worker,
        )
        self.slots.hand_out()
        return worker

    async def close(self, *, drain_sec: float = 5.0) -> None:
        """Stop the pool: let workers finish their file writes (bounded), then kill them."""
        self._closed = True
        for task in list(self._side_tasks):
            task.cancel()
        workers = [worker for worker in self.workers if worker is not None]
        live = [worker for worker in workers if worker.serving]
        if live:
            logger.info(
                "RayBackend: waiting up to %gs for %d rollout(s) and the file writes on %d "
                "worker(s)",
                drain_sec,
                sum(len(worker.inflight) for worker in live),
                len(live),
            )
            calls = [
                asyncio.wrap_future(worker.handle.shutdown.remote().future()) for worker in live
            ]
            _, pending = await asyncio.wait(calls, timeout=drain_sec)
            for call in calls:
                call.add_done_callback(consume)
            for call in pending:
                call.cancel()
            if pending:
                logger.warning(
                    "RayBackend: %d worker(s) did not finish within %gs; stopping them anyway",
                    len(pending),
                    drain_sec,
                )
        if workers:
            logger.info("RayBackend: stopping %d worker(s)", len(workers))
        for worker in workers:
            self._lose(worker, "the rollout server shut the pool down", replace=False)
        self.slots.close()

    # -- dispatch -------------------------------------------------------------------------

    def dispatch(
        self,
        worker: PoolWorker,
        request: ExecutionRequest,
        elapsed_sec: float,
        process_id: str,
        deadline: float | None,
    ) -> Dispatch:
        """Send one rollout to ``worker`` (whose slot the caller holds).

        Args:
            worker: From the pool's :attr:`slots` (``take()`` or ``acquire()``).
            request: The server's request (its ``on_status`` receives ``grading``).
            elapsed_sec: Seconds since the rollout's admission.
            process_id: The server's ``process_id`` (for the worker's rollout context).
            deadline: ``loop.time()`` past which the server stops waiting for the workflow
                (its deadline plus the grace), or None.
        """
        grader_timeout = request.grader_timeout_sec
        dispatch = Dispatch(
            next(self._keys),
            request,
            worker,
            self._loop.create_future(),
            None if grader_timeout is None else max(0.0, grader_timeout) + self.deadline_grace_sec,
        )
        key = dispatch.key
        worker.inflight[key] = dispatch
        try:
            when_done(
                self._loop,
                worker.run.remote(encode_request(key, request, elapsed_sec, process_id)),
                functools.partial(self._replied, dispatch),
            )
        except BaseException:
            self._end(dispatch)
            raise
        if deadline is not None:
            dispatch.timer = self._loop.call_at(deadline, self._expire, dispatch)
        return dispatch

    async def reattach(
        self, on_status: Mapping[str, Callable[[RolloutStatus], None]]
    ) -> tuple[dict[str, Any], dict[str, Dispatch]]:
        """Collect, from every worker taken over at the start, what it holds of the
        rollouts of ``on_status`` (by id, each with its status sink): the replies of those
        that finished, and a dispatch for each still running (it holds its worker's slot,
        and its deadline runs). Other rollouts still running there are cancelled (no
        server waits for them).

        Returns:
            ``(finished, running)``: ``run`` replies and dispatches, by rollout id.
        """
        workers = [w for w in self.workers if w is not None and w.serving and w.reattached]
        return await collect(
            workers,
            on_status,
            loop=self._loop,
            grace_sec=self.deadline_grace_sec,
            lose=self._lose,
            replied=self._replied,
            expire=self._expire,
        )

    def _replied(self, dispatch: Dispatch, call: concurrent.futures.Future[Any]) -> None:
        if call.cancelled():
            self._end(dispatch)
            return
        error = call.exception()
        if error is not None:
            from ray.exceptions import RayActorError

            if isinstance(error, RayActorError):
                self._lose(dispatch.worker, describe_ray_error(error))
                return
            self._end(dispatch)
            self._fail(
                dispatch,
                RolloutLostError(
                    f"Ray {dispatch.worker.label} could not return this rollout's result: "
                    f"{describe_ray_error(error)}"
                ),
            )
            return
        self._end(dispatch)
        reply = call.result()
        if reply is None:  # wait(): the worker holds no such rollout (any more)
            self._fail(
                dispatch,
                RolloutLostError(
                    f"Ray {dispatch.worker.label} no longer holds this rollout's outcome "
                    "(it kept it too long for the restarted server)"
                ),
            )
        elif not dispatch.future.done():
            dispatch.future.set_result(reply)

    @staticmethod
    def _fail(dispatch: Dispatch, error: Exception) -> None:
        if not dispatch.future.done():
            dispatch.future.set_exception(error)
            dispatch.future.add_done_callback(consume)

    def _expire(self, dispatch: Dispatch) -> None:
        dispatch.timer = None
        if dispatch.ended or dispatch.future.done():
            return
        request = dispatch.request
        phase, limit = (
            ("grader", request.grader_timeout_sec)
            if dispatch.grading
            else ("workflow", request.agent_timeout_sec)
        )
        message = (
            f"{phase} exceeded its {float(limit or 0.0)}s deadline, and Ray "
            f"{dispatch.worker.label} did not report within {self.deadline_grace_sec:g}s "
            "after it"
        )
        self._fail(dispatch, ServerDeadlineError(message))
        _ = self.settle(dispatch, "its deadline passed")

    def _grading(self, dispatch: Dispatch) -> None:
        """The worker reports that ``dispatch`` grades: relay it; its deadline is now the
        grader's."""
        if dispatch.grading:
            return
        dispatch.grading = True
        dispatch.cancel_timer()
        if dispatch.grader_budget_sec is not None:
            dispatch.timer = self._loop.call_later(
                dispatch.grader_budget_sec, self._expire, dispatch
            )
        dispatch.request.on_status(RolloutStatus.GRADING)

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
        with contextlib.suppress(Exception):
            worker.handle.cancel.remote([dispatch.key]).future().add_done_callback(consume)
        if dispatch.ended:
            return
        settled = dispatch.settled = self._loop.create_future()
        try:
            async with asyncio.timeout(self._cancel_grace_sec):
                await settled
        except TimeoutError:
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
        dispatch.cancel_timer()
        if dispatch.settled is not None and not dispatch.settled.done():
            dispatch.settled.set_result(None)
        worker = dispatch.worker
        worker.inflight.pop(dispatch.key, None)
        if worker.lost is None:
            self.slots.release(worker)

    # -- reports and deaths ---------------------------------------------------------------

    def _poll_events(self, worker: PoolWorker) -> None:
        try:
            when_done(
                self._loop,
                worker.handle.events.remote(),
                functools.partial(self._events_done, worker),
            )
        except Exception as exc:  # noqa: BLE001 - any failed call means the worker is gone
            self._lose(worker, describe_ray_error(exc))

    def _events_done(self, worker: PoolWorker, events: concurrent.futures.Future[Any]) -> None:
        if worker.lost is not None or events.cancelled():
            return
        error = events.exception()
        if error is not None:
            self._lose(worker, describe_ray_error(error))
            return
        for key in events.result():
            dispatch = worker.inflight.get(key)
            if dispatch is not None:
                self._grading(dispatch)
        self._poll_events(worker)

    def _lose(self, worker: PoolWorker, cause: str, *, replace: bool = True) -> None:
        """Mark ``worker`` lost: fail its rollouts with ``cause``, kill it, replace it."""
        if worker.lost is not None:
            return
        worker.lost = cause
        dispatches = list(worker.inflight.values())
        worker.inflight.clear()
        worker.held = 0
        for dispatch in dispatches:
            self._end(dispatch)
            self._fail(dispatch, RolloutLostError(lost_message(worker, cause)))
        kill_actor(worker.handle)
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
