"""``DeadlineQueue``: many deadlines of one event loop on a single loop timer.

Every admitted rollout has a lease deadline, every published one a retention deadline and
every long poll a wait deadline. A loop timer handle costs about half a kilobyte (uvloop's
handle and its libuv timer); with ten thousand rollouts in flight that is megabytes. Here a
deadline is a small heap entry, and one loop timer is armed for the earliest.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Any, Final

__all__ = ["DeadlineQueue", "Entry", "due_at", "pending_argument"]

Entry = list[Any]
"""A scheduled deadline: ``[when, sequence, callback, argument]`` (callback None once
cancelled). Treat it as opaque: read it with :func:`pending_argument` and
:func:`due_at`."""


def pending_argument(entry: Entry) -> Any:
    """The argument of a deadline still pending; None once it has fired or been cancelled."""
    return entry[3]


def due_at(entry: Entry) -> float:
    """The loop time (seconds) at which ``entry`` is (or was) due."""
    when: float = entry[0]
    return when


FIRE_SLACK_SEC: Final = 0.001
"""Deadlines this close to the loop's time are due (loop timers may fire up to one clock
tick early)."""

MIN_COMPACT: Final = 1024
"""Cancelled entries tolerated before the heap is rebuilt without them (and only once
they outnumber the live ones)."""


# Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "One deadline heap on
#   one loop timer ..."
class DeadlineQueue:
    """Deadlines on one loop, each calling ``callback(argument)`` once it is due.

    Callbacks of deadlines due together run in deadline order in one loop callback; an
    exception in one goes to the loop's exception handler and the rest still run.
    Cancelling is O(1) (the entry is dropped lazily); the heap is compacted when
    cancelled entries outnumber live ones.
    """

    def __init__(self) -> None:
        self._heap: list[Entry] = []
        self._sequence = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0
        self._cancelled = 0

    def __len__(self) -> int:
        """Live (not cancelled, not yet due) deadlines."""
        return len(self._heap) - self._cancelled

    def add(
        self,
        loop: asyncio.AbstractEventLoop,
        when: float,
        callback: Callable[[Any], object],
        argument: Any,
    ) -> Entry:
        """Call ``callback(argument)`` on ``loop`` at loop time ``when`` (seconds).

        Returns:
            The entry, for :meth:`cancel`.
        """
        if loop is not self._loop:
            # A new loop: the old one's timer and deadlines are gone with it.
            self.clear()
            self._loop = loop
        entry: Entry = [when, next(self._sequence), callback, argument]
        heapq.heappush(self._heap, entry)
        if self._timer is None or when < self._timer_when:
            self._arm(loop, when)
        return entry

    def bring_forward(
        self,
        loop: asyncio.AbstractEventLoop,
        entry: Entry,
        when: float,
        callback: Callable[[Any], object] | None = None,
    ) -> Entry:
        """Make a pending ``entry`` due at loop time ``when`` (seconds) at the latest.

        Args:
            loop: The loop of the queue.
            entry: The pending deadline.
            when: Its new latest time, loop seconds.
            callback: What the moved entry calls instead of its own callback (with the
                same argument); None keeps its own.

        Returns:
            ``entry`` itself when it is due by then already (or no longer pending), else
            the entry that replaces it (``entry`` is cancelled).
        """
        own = entry[2]
        if own is None or entry[0] <= when:
            return entry
        argument = entry[3]
        self.cancel(entry)
        return self.add(loop, when, own if callback is None else callback, argument)

    def cancel(self, entry: Entry) -> None:
        """Drop ``entry`` (no effect if it has fired or is cancelled already)."""
        if entry[2] is None:
            return
        entry[2] = entry[3] = None
        self._cancelled += 1
        heap = self._heap
        if self._cancelled > MIN_COMPACT and self._cancelled * 2 > len(heap):
            heap[:] = [live for live in heap if live[2] is not None]
            heapq.heapify(heap)
            self._cancelled = 0

    def clear(self) -> None:
        """Drop every deadline and the loop timer."""
        for entry in self._heap:
            entry[2] = entry[3] = None
        self._heap = []
        self._cancelled = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._fire)
        self._timer_when = when

    def _fire(self) -> None:
        self._timer = None
        loop = self._loop
        assert loop is not None
        heap = self._heap
        due_by = loop.time() + FIRE_SLACK_SEC
        while heap and heap[0][0] <= due_by:
            entry = heapq.heappop(heap)
            callback, argument = entry[2], entry[3]
            if callback is None:
                self._cancelled -= 1
                continue
            entry[2] = entry[3] = None
            try:
                callback(argument)
            except Exception as exc:  # noqa: BLE001 - as a loop callback would: reported
                loop.call_exception_handler(
                    {
                        "message": f"Exception in deadline callback {callback!r}",
                        "exception": exc,
                    }
                )
        # Skip cancelled entries at the top so the timer is armed for a live deadline.
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
            self._cancelled -= 1
        # A callback may have added deadlines (and armed the timer for the first of them);
        # the timer must serve the earliest.
        armed = self._armed_for()
        if heap and (armed is None or heap[0][0] < armed):
            self._arm(loop, heap[0][0])

    def _armed_for(self) -> float | None:
        """The loop time the timer is armed for, or None when it is not armed."""
        return None if self._timer is None else self._timer_when
