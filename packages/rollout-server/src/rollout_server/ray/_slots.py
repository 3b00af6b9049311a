"""The slots of :class:`~rollout_server.ray._pool.WorkerPool`'s workers, and the rollouts
waiting for one: the counts RayBackend's admission relies on.

A rollout holds a slot of one worker from its dispatch until the worker has acknowledged
its end (its ``run`` call returned) or the worker is gone. Waiting rollouts queue here, in
arrival order; a freed slot goes straight to the oldest waiter, on the least-loaded live
worker (not by fixed chunks). The pool says when a slot is freed (:meth:`WorkerSlots.release`)
and when a worker starts serving (:meth:`WorkerSlots.hand_out`); this module never calls Ray.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

from ._dispatch import PoolWorker

__all__ = ["WorkerSlots"]


class WorkerSlots:
    """The slots of ``workers`` (each position's live incarnation, or None) and the queue.

    Args:
        workers: The pool's positions (the pool replaces their entries; this class reads
            them).
        per_worker: Slots of each worker, or None for no limit.
        loop: The server's event loop.
    """

    __slots__ = ("_closed", "_loop", "_waiters", "_workers", "per_worker")

    def __init__(
        self,
        workers: list[PoolWorker | None],
        per_worker: int | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._workers = workers
        self.per_worker = per_worker
        self._loop = loop
        self._waiters: collections.deque[asyncio.Future[PoolWorker]] = collections.deque()
        self._closed = False

    @property
    def alive(self) -> int:
        """Workers that serve now."""
        return sum(1 for worker in self._workers if worker is not None and worker.serving)

    @property
    def queued(self) -> int:
        """Rollouts waiting for a slot."""
        return sum(1 for waiter in self._waiters if not waiter.done())

    @property
    def running(self) -> int:
        """Slots held on live workers."""
        return sum(worker.held for worker in self._workers if worker is not None and worker.serving)

    def capacity(self) -> int | None:
        """Slots of the live workers, or None without a limit."""
        return None if self.per_worker is None else self.per_worker * self.alive

    def free_slots(self) -> int | None:
        """Slots free on live workers now, or None without a limit."""
        capacity = self.capacity()
        return None if capacity is None else capacity - self.running

    def take(self) -> PoolWorker | None:
        """A slot on the least-loaded live worker now, or None (every slot is busy, or
        others wait already)."""
        if self._waiters:
            return None
        return self._least_loaded()

    def _least_loaded(self) -> PoolWorker | None:
        best: PoolWorker | None = None
        limit = self.per_worker
        for worker in self._workers:
            if (
                worker is not None
                and worker.serving
                and (limit is None or worker.held < limit)
                and (best is None or worker.held < best.held)
            ):
                best = worker
        if best is not None:
            best.held += 1
        return best

    async def acquire(self, deadline: float | None) -> PoolWorker | None:
        """Wait for a slot on the least-loaded live worker, in arrival order.

        Args:
            deadline: ``loop.time()`` past which to stop waiting, or None.

        Returns:
            The worker whose slot is now held, or None when ``deadline`` passed first.

        Raises:
            asyncio.CancelledError: When cancelled while waiting (no slot is held then),
                or when the pool closes meanwhile.
            RuntimeError: When the pool is closed.
        """
        if self._closed:
            raise RuntimeError("the RayBackend pool is closed")
        waiter: asyncio.Future[PoolWorker] = self._loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
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
            self.release(waiter.result())
        else:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def release(self, worker: PoolWorker) -> None:
        """``worker`` no longer holds one of the slots it held (it is still live)."""
        worker.held -= 1
        if self._waiters:
            self.hand_out()

    def hand_out(self) -> None:
        """Give free slots to the oldest waiters (a worker started serving, or a slot is
        free)."""
        while self._waiters:
            if self._waiters[0].done():
                del self._waiters[0]
                continue
            worker = self._least_loaded()
            if worker is None:
                return
            self._waiters.popleft().set_result(worker)

    def close(self) -> None:
        """Cancel every wait, and refuse new ones (the pool is closing)."""
        self._closed = True
        for waiter in self._waiters:
            if not waiter.done():
                waiter.cancel()
        self._waiters.clear()
