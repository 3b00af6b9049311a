"""``AdmissionTurns``: admissions in arrival order, for a backend whose ``admission_mode``
is ``"started_work"`` (see :mod:`rollout_server.protocol._server`, which owns one per
server)."""

from __future__ import annotations

import asyncio
import collections

__all__ = ["AdmissionTurns"]


class AdmissionTurns:
    """Admissions in arrival order, each asking a ``"started_work"`` backend only once
    every rollout admitted before it has started (and so counts in the backend's answer).

    Used only for backends whose ``admission_mode`` is ``"started_work"``.
    Without contention an admission passes at once; otherwise it waits for its turn, which
    comes once the rollouts admitted before it have taken their first step (usually the
    next loop turn).
    """

    __slots__ = ("_held", "_loop", "_waiters", "unstarted")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._held = False
        self.unstarted = 0
        """Admitted rollouts whose execution has not taken its first step yet."""

    async def take(self) -> None:
        """Wait until this admission may ask the backend; pair it with :meth:`give_back`."""
        if not self.unstarted and not self._waiters and not self._held:
            self._held = True
            return
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give_back()  # the turn was handed over just before the cancellation
            else:
                self._waiters.remove(waiter)
            raise

    def give_back(self) -> None:
        """End this admission's turn (it admitted a rollout or refused one)."""
        self._held = False
        self._pass_on()

    def started(self) -> None:
        """One admitted rollout is about to take its first step."""
        self.unstarted -= 1
        if not self.unstarted and self._waiters:
            # After that step (queued behind it), when the backend counts the rollout.
            self._loop.call_soon(self._pass_on)

    def _pass_on(self) -> None:
        if self._held or self.unstarted:
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._held = True
                waiter.set_result(None)
                return
