"""RayBackend's parts that need no Ray: the slot accounting of the worker pool."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from rollout_server.ray._dispatch import PoolWorker
from rollout_server.ray._slots import WorkerSlots

EVENT_SEC = 5.0


def _workers(count: int) -> list[PoolWorker | None]:
    workers: list[PoolWorker | None] = []
    for index in range(count):
        worker = PoolWorker(index, types.SimpleNamespace(run=None))
        worker.ready = True
        workers.append(worker)
    return workers


class TestWorkerSlots:
    async def test_slots_go_to_the_least_loaded_live_worker(self) -> None:
        """take() fills the least-loaded live worker first and skips lost ones; the
        counts follow."""
        workers = _workers(3)
        lost = workers[2]
        assert lost is not None
        lost.lost = "gone"
        slots = WorkerSlots(workers, 2, asyncio.get_running_loop())
        taken = [slots.take() for _ in range(4)]
        assert [w.index for w in taken if w is not None] == [0, 1, 0, 1]
        assert slots.take() is None
        assert (slots.alive, slots.running, slots.capacity(), slots.free_slots()) == (2, 4, 4, 0)

    async def test_waiters_are_served_in_arrival_order_within_their_deadline(self) -> None:
        """A freed slot goes to the oldest waiter; a waiter whose deadline passes leaves
        the queue with nothing held."""
        workers = _workers(1)
        loop = asyncio.get_running_loop()
        slots = WorkerSlots(workers, 1, loop)
        held = slots.take()
        assert held is not None
        first = asyncio.create_task(slots.acquire(None))
        second = asyncio.create_task(slots.acquire(None))
        late = slots.acquire(loop.time() - 1.0)
        assert await asyncio.wait_for(late, EVENT_SEC) is None
        await asyncio.sleep(0)  # both waiters queue
        assert slots.queued == 2
        assert slots.take() is None  # others wait: no overtaking
        slots.release(held)
        assert await asyncio.wait_for(first, EVENT_SEC) is held
        assert not second.done()
        slots.release(held)
        assert await asyncio.wait_for(second, EVENT_SEC) is held
        assert (slots.queued, slots.running) == (0, 1)

    async def test_a_cancelled_waiter_holds_no_slot(self) -> None:
        """A waiter cancelled in the instant it was handed a slot passes the slot on."""
        workers = _workers(1)
        slots = WorkerSlots(workers, 1, asyncio.get_running_loop())
        held = slots.take()
        assert held is not None
        cancelled = asyncio.create_task(slots.acquire(None))
        after = asyncio.create_task(slots.acquire(None))
        await asyncio.sleep(0)
        slots.release(held)  # hands the slot to `cancelled`...
        cancelled.cancel()  # ...which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert await asyncio.wait_for(after, EVENT_SEC) is held
        assert slots.running == 1

    async def test_closing_ends_every_wait(self) -> None:
        """close() cancels the waiters and refuses new waits."""
        workers = _workers(1)
        slots = WorkerSlots(workers, 1, asyncio.get_running_loop())
        assert slots.take() is not None
        waiter = asyncio.create_task(slots.acquire(time.monotonic() + 60.0))
        await asyncio.sleep(0)
        slots.close()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        with pytest.raises(RuntimeError, match="pool is closed"):
            await slots.acquire(None)

    async def test_a_worker_that_starts_serving_takes_the_waiters(self) -> None:
        """hand_out() gives a new worker's slots to the oldest waiters; without a limit
        nobody waits."""
        workers: list[PoolWorker | None] = [None]
        slots = WorkerSlots(workers, 2, asyncio.get_running_loop())
        assert slots.take() is None
        assert slots.capacity() == 0
        waiter = asyncio.create_task(slots.acquire(None))
        await asyncio.sleep(0)
        workers[0] = _workers(1)[0]
        slots.hand_out()
        assert await asyncio.wait_for(waiter, EVENT_SEC) is workers[0]
        unlimited = WorkerSlots(_workers(1), None, asyncio.get_running_loop())
        assert all(unlimited.take() is not None for _ in range(10))
        assert (unlimited.capacity(), unlimited.free_slots()) == (None, None)
