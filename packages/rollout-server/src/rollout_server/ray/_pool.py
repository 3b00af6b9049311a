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
  and waits again for those still running (each holds its slot, with its deadline).

Dispatches, deadlines and losses change the same counts and stay in this one class; what
it keeps per worker and per rollout lives in :mod:`rollout_server.ray._dispatch`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import re
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final

from rollout_types import RolloutStatus

from .._logtext import get_logger
from ..execution._backend import ExecutionRequest
from ..observability._observer import NO_OBSERVER
from ._codec import decode_request, encode_request
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
from ._slots import WorkerSlots
from ._worker import Collected, WorkerSpec

__all__ = ["WorkerPool", "worker_name"]

logger: Final = get_logger("rollout_server.ray_backend")

REPLACE_DELAYS_SEC: Final = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0)
"""Pauses before each attempt to start a replacement worker (the last one repeats)."""

NAME_RETRY_SEC: Final = 0.2
"""Pause before creating a named worker again while Ray still holds the name of the one it
replaces (killed a moment ago)."""

WORKER_NAME: Final = re.compile(r"rollout-worker-(\d+)")


def worker_name(index: int) -> str:
    """The actor name of the named worker at position ``index``: ``rollout-worker-<index>``."""
    return f"rollout-worker-{index}"


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
        adopt = self.namespace is not None
        if adopt:
            self._retire_extra_workers()
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

    def _retire_extra_workers(self) -> None:
        """Kill the named workers of this namespace beyond the pool's size."""
        import ray

        for entry in ray.util.list_named_actors(all_namespaces=True):
            match = WORKER_NAME.fullmatch(str(entry.get("name", "")))
            if entry.get("namespace") != self.namespace or match is None:
                continue
            if int(match.group(1)) >= self.size:
                with contextlib.suppress(Exception):
                    self._kill(ray.get_actor(entry["name"], namespace=self.namespace))
                    self.retired += 1

    async def _start_worker(self, index: int, *, adopt: bool = False) -> PoolWorker:
        if adopt:
            found = await self._take_over(index)
            if found is not None:
                return found
        handle = await self._create(index)
        worker = PoolWorker(index, handle)
        try:
            async with asyncio.timeout(self._start_timeout_sec):
                worker.info = await handle.ready.remote()
        except BaseException:
            self._kill(handle)
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

    async def _take_over(self, index: int) -> PoolWorker | None:
        """The named worker at ``index`` if it serves (it outlived the previous server
        process), else None (noted in :attr:`gone`; one that does not answer is killed)."""
        import ray

        try:
            handle = ray.get_actor(worker_name(index), namespace=self.namespace)
        except ValueError:
            self.gone.append(index)
            return None
        worker = PoolWorker(index, handle)
        try:
            async with asyncio.timeout(self._start_timeout_sec):
                worker.info = await handle.ready.remote()
        except Exception as exc:  # noqa: BLE001 - any failure: the worker is replaced
            logger.warning(
                "Ray worker %d of the previous server process does not answer (%s); replacing it",
                index,
                describe_ray_error(exc),
            )
            self._kill(handle)
            self.gone.append(index)
            return None
        worker.reattached = True
        logger.info("Ray %s outlived the previous server process: re-attached", worker.label)
        if worker.info.get("spec") != self._spec.fingerprint():
            logger.warning(
                "Ray %s was started with another workflow, grader, config or artifact root "
                "than this server's (%s, not %s); it is re-attached to finish its rollouts and "
                "keeps serving with what it was started with: stop the server with SIGTERM "
                "(which stops the workers) to start them anew",
                worker.label,
                worker.info.get("spec"),
                self._spec.fingerprint(),
            )
        return self._serve(worker)

    def _serve(self, worker: PoolWorker) -> PoolWorker:
        handle = worker.handle
        if self._closed:
            self._kill(handle)
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
        ids = list(on_status)
        answers = await asyncio.gather(
            *(asyncio.wrap_future(w.handle.collect.remote(ids).future()) for w in workers),
            return_exceptions=True,
        )
        finished: dict[str, Any] = {}
        running: dict[str, Dispatch] = {}
        for worker, answer in zip(workers, answers, strict=True):
            worker.reattached = False
            if not isinstance(answer, Collected):
                cause = (
                    describe_ray_error(answer)
                    if isinstance(answer, BaseException)
                    else f"collect() answered {type(answer).__name__}"
                )
                self._lose(worker, cause)
                continue
            if answer.cancelled:
                logger.warning(
                    "Ray %s ran %d rollout(s) the restarted server does not wait for "
                    "(published or forgotten meanwhile): cancelled",
                    worker.label,
                    answer.cancelled,
                )
            finished.update(answer.finished)
            for rollout_id, (key, payload, since, grading) in answer.running.items():
                running[rollout_id] = self._rewait(
                    worker, key, payload, since, grading, on_status[rollout_id]
                )
        return finished, running

    def _rewait(  # noqa: PLR0917 - one running rollout as a worker described it
        self,
        worker: PoolWorker,
        key: int,
        payload: tuple[Any, ...],
        since: float,
        grading: bool,
        on_status: Callable[[RolloutStatus], None],
    ) -> Dispatch:
        """A dispatch for a rollout ``worker`` runs already (received ``since`` seconds
        ago), waiting on its ``wait`` call, with what is left of its deadline."""
        now = time.monotonic()
        request, _process_id = decode_request(
            payload, lambda elapsed: now - since - max(0.0, elapsed), on_status, NO_OBSERVER
        )
        grader_timeout = request.grader_timeout_sec
        dispatch = Dispatch(
            key,
            request,
            worker,
            self._loop.create_future(),
            None if grader_timeout is None else max(0.0, grader_timeout) + self.deadline_grace_sec,
        )
        worker.held += 1
        worker.inflight[key] = dispatch
        when_done(
            self._loop,
            worker.handle.wait.remote(key, request.id),
            functools.partial(self._replied, dispatch),
        )
        if grading:
            dispatch.grading = True
            on_status(RolloutStatus.GRADING)
            if dispatch.grader_budget_sec is not None:
                dispatch.timer = self._loop.call_later(
                    dispatch.grader_budget_sec, self._expire, dispatch
                )
        elif request.agent_timeout_sec is not None:
            left = request.admitted_at + request.agent_timeout_sec - now
            dispatch.timer = self._loop.call_later(
                max(0.0, left) + self.deadline_grace_sec, self._expire, dispatch
            )
        return dispatch

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
