"""A FIFO concurrency limiter that counts who waits and who holds a slot.

``asyncio.Semaphore`` cannot say how many tasks wait, and a waiter cancelled just after
being woken needs care not to leak the slot. This limiter hands a freed slot directly to
the oldest live waiter, so the counts are exact at every moment and a cancelled waiter
never holds, or loses, a slot.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

__all__ = ["ConcurrencyLimiter"]


class ConcurrencyLimiter:
    """At most ``max_concurrent`` holders at a time; the others wait in arrival order.

    Args:
        max_concurrent: The number of slots (an int of at least 1), or None for no limit
            (then nobody ever waits and ``queued`` stays 0).

    Raises:
        ValueError: When ``max_concurrent`` is not None and not an int of at least 1.
    """

    def __init__(self, max_concurrent: int | None) -> None:
        given: object = max_concurrent
        if given is not None and (
            not isinstance(given, int) or isinstance(given, bool) or given < 1
        ):
            raise ValueError(
                f"max_concurrent must be an int of at least 1, or None for no limit; "
                f"got {max_concurrent!r}"
            )
        self._max = max_concurrent
        self._running = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def max_concurrent(self) -> int | None:
        """The number of slots, or None for no limit."""
        return self._max

    @property
    def running(self) -> int:
        """How many callers hold a slot now."""
        return self._running

    @property
    def queued(self) -> int:
        """How many callers wait for a slot now."""
        return len(self._waiters)

    @property
    def has_free_slot(self) -> bool:
        """Whether an :meth:`acquire` now would get a slot without waiting."""
        return self._max is None or (self._running < self._max and not self._waiters)

    def take(self) -> bool:
        """Take a slot if one is free now (True; pair it with :meth:`release`)."""
        if self.has_free_slot:
            self._running += 1
            return True
        return False

    async def acquire(self) -> None:
        """Wait for a slot and take it; pair every successful call with :meth:`release`.

        Cancellation while waiting leaves the queue at once and takes no slot (a slot handed
        over in the same instant is passed on to the next waiter).
        """
        if self.take():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # The slot was handed to us just before the cancellation: pass it on.
                self.release()
            else:
                self._remove(waiter)
            raise

    def release(self) -> None:
        """Give a slot back, handing it straight to the oldest waiter if there is one."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # The slot moves to the waiter; running is unchanged.
                return
        if self._running <= 0:
            raise RuntimeError("ConcurrencyLimiter.release() called more often than acquire()")
        self._running -= 1

    def snapshot(self) -> dict[str, Any]:
        """``{"max_concurrent", "queued", "running"}``, as ``/health`` reports them."""
        return {"max_concurrent": self._max, "queued": self.queued, "running": self._running}

    def _remove(self, waiter: asyncio.Future[None]) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
