"""``RecordTable``: the records one registry holds, by id, and how they leave.

The base of :class:`~rollout_server.state._registry.RolloutRegistry` (one object: the
registry stays the single writer of records). This part holds the table itself (records by
id, execution tasks, the deadline queue), the lookups the routes and the shutdown make, the
rollouts recovered from a durable store, retention and removal, and the futures that wait
for the whole registry (idle, every result delivered, an id removed). Admission, status,
publication, leases and task ends are the registry's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from ._deadlines import DeadlineQueue
from ._durability import StoreLink, restored_record
from ._record import RolloutRecord
from ._store import StoredRollout

__all__ = ["RecordTable", "resolve"]


def resolve(fut: asyncio.Future[None]) -> None:
    """Set ``fut``'s result unless it is done."""
    if not fut.done():
        fut.set_result(None)


class RecordTable:
    """The records of one registry (see the module docstring).

    Args:
        polling_lease_timeout_sec: Seconds without a poll before a rollout's lease lapses.
        result_retention_sec: Seconds a published result stays (and its id stays reserved)
            once the execution has finished.
    """

    def __init__(self, *, polling_lease_timeout_sec: float, result_retention_sec: float) -> None:
        self._deadlines = DeadlineQueue()
        self._lease_sec = polling_lease_timeout_sec
        self._retention_sec = result_retention_sec
        self._records: dict[str, RolloutRecord] = {}
        self._tasks: dict[asyncio.Task[Any], RolloutRecord] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Future[None] | None = None
        self._undelivered = 0
        self._delivered: asyncio.Future[None] | None = None
        self._removal_waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._closed = False
        self._link: StoreLink | None = None

    # -- lookup ---------------------------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the registry runs on (the running loop at first use)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def get(self, rollout_id: str) -> RolloutRecord | None:
        """The record held for ``rollout_id``, or None."""
        return self._records.get(rollout_id)

    def __contains__(self, rollout_id: object) -> bool:
        link = self._link
        return rollout_id in self._records or (link is not None and rollout_id in link.holding)

    def __len__(self) -> int:
        return len(self._records)

    def ids(self) -> list[str]:
        """Every id currently held (live or retained), in admission order."""
        return list(self._records)

    @property
    def active(self) -> int:
        """How many execution tasks have not completed (``lifecycle.active_rollouts``)."""
        return len(self._tasks)

    def active_ids(self) -> list[str]:
        """The ids of the rollouts whose execution task has not completed."""
        return [record.rollout_id for record in self._tasks.values()]

    def in_flight(self) -> Iterable[RolloutRecord]:
        """The records whose execution task has not completed (a live view: iterate it
        without awaiting in between)."""
        return self._tasks.values()

    @property
    def undelivered(self) -> int:
        """How many held results are published and not yet returned by any poll."""
        return self._undelivered

    @property
    def store_link(self) -> StoreLink | None:
        """The link to the durable store (admissions are written through it), or None."""
        return self._link

    def restore(self, rows: Iterable[StoredRollout]) -> list[RolloutRecord]:
        """Hold the rollouts a store recovered (ids not held yet); each result stays
        collectable until its stored retention deadline.

        Returns:
            The recovered records without a result (their execution ended with the process
            that admitted them); the caller publishes their end.
        """
        loop = self.loop
        now, wall = loop.time(), time.time()
        unfinished: list[RolloutRecord] = []
        for row in rows:
            if row.rollout_id in self._records:
                continue
            record = restored_record(row, loop_time=now, lease_sec=self._lease_sec)
            self._records[row.rollout_id] = record
            if record.body is None:
                unfinished.append(record)
            elif not self._closed:
                left = max((row.retention_deadline or wall) - wall, 0.0)
                record.retention_timer = self._deadlines.add(
                    loop, now + left, self._on_retention_elapsed, record
                )
        return unfinished

    async def settled(self) -> None:
        """Wait until every publication asked for so far is fixed: with a durable store,
        until the results being written are durable (or failed, and so served from
        memory); at once without one, or when none is being written."""
        link = self._link
        if link is not None and link.publishing:
            await link.store.flush()

    # -- retention and removal --------------------------------------------------------

    def _on_retention_elapsed(self, record: RolloutRecord) -> None:
        record.retention_timer = None
        record.retention_elapsed = True
        if record.finished:
            self._remove(record)

    def _remove(self, record: RolloutRecord) -> None:
        if self._records.get(record.rollout_id) is not record:
            return
        del self._records[record.rollout_id]
        if self._link is not None:
            self._link.store.forget(record.rollout_id)
        if not record.delivered:
            self._count_delivered()
        for fut in self._removal_waiters.pop(record.rollout_id, ()):
            resolve(fut)

    def _tasks_ended(self) -> None:
        """Resolve the idle future, if one waits (no execution task is active now)."""
        if self._idle is not None:
            resolve(self._idle)
            self._idle = None

    def _count_delivered(self) -> None:
        """One published result fewer awaits its first delivery (delivered or removed)."""
        self._undelivered -= 1
        if self._undelivered == 0 and self._delivered is not None:
            resolve(self._delivered)

    # -- waiting for the whole table ---------------------------------------------------

    def idle_future(self) -> asyncio.Future[None]:
        """A future that is done once no execution task is active (done now if none is)."""
        if self._idle is None or self._idle.done():
            self._idle = self.loop.create_future()
        if not self._tasks:
            resolve(self._idle)
        return self._idle

    def delivered_future(self) -> asyncio.Future[None]:
        """A future that is done once every published result held has been delivered (or
        removed); done now if none is waiting."""
        if self._delivered is None or self._delivered.done():
            self._delivered = self.loop.create_future()
        if self._undelivered == 0:
            resolve(self._delivered)
        return self._delivered

    async def wait_removed(self, rollout_id: str) -> None:
        """Wait until ``rollout_id`` is no longer held (retention over and execution done).

        Returns at once if it is not held. The wait itself is unbounded: bound it with
        ``asyncio.timeout()``.
        """
        if rollout_id not in self._records:
            return
        fut: asyncio.Future[None] = self.loop.create_future()
        self._removal_waiters.setdefault(rollout_id, []).append(fut)
        await fut
