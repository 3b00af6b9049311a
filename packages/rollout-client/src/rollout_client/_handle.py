"""``RolloutHandle``: an admitted rollout whose result is polled in the background."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any, Final

from rollout_types import RolloutResultResponse, RolloutStatus, is_terminal

__all__ = ["RolloutHandle"]

_RANK: Final[dict[str, int]] = {
    RolloutStatus.QUEUED: 0,
    RolloutStatus.RUNNING: 1,
    RolloutStatus.GRADING: 2,
    RolloutStatus.SUCCESS: 3,
}
"""Milestone order; ``unknown`` and statuses from newer servers have no rank."""

PollFactory = Callable[
    [Callable[[RolloutResultResponse], None]], asyncio.Task[RolloutResultResponse]
]
"""Starts the polling task, given the callback that records each result it reads."""


def _reached(status: RolloutStatus | str, milestone: RolloutStatus) -> bool:
    if is_terminal(status):
        return True
    rank = _RANK.get(status)
    return rank is not None and rank >= _RANK[milestone]


class RolloutHandle:
    """An admitted rollout, polled by a background task until it terminates.

    ``await handle`` returns the terminal :class:`~rollout_types.RolloutResultResponse`
    (the same one :meth:`RolloutClient.run_rollout` returns) or raises what ended polling.
    Awaiting never cancels the polling task: if the awaiting task is cancelled (a timeout
    around ``await handle``, say), polling goes on; :meth:`cancel` stops it.

    Handles are created by :meth:`RolloutClient.run_rollout_async`, inside a running loop.
    """

    def __init__(self, *, rollout_id: str, status: RolloutStatus | str, poll: PollFactory) -> None:
        self._rollout_id = rollout_id
        self._status: RolloutStatus | str = status
        self._latest: RolloutResultResponse | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._task = poll(self._update)
        self._task.add_done_callback(self._finished)

    def __repr__(self) -> str:
        state = "done" if self._task.done() else "polling"
        return f"<RolloutHandle {self._rollout_id!r} status={str(self._status)!r} {state}>"

    @property
    def rollout_id(self) -> str:
        """The admitted rollout's id."""
        return self._rollout_id

    @property
    def status(self) -> RolloutStatus | str:
        """The latest observed status; the admission's (``queued``) until the first poll.

        A status this client does not know (from a newer server) is kept as the raw string.
        """
        return self._status

    @property
    def latest_result(self) -> RolloutResultResponse | None:
        """The latest result response, or None before the first poll answered."""
        return self._latest

    def done(self) -> bool:
        """Whether polling has finished: with a result, an exception or a cancellation."""
        return self._task.done()

    def cancel(self) -> bool:
        """Cancel the local polling task; the server is not contacted.

        The server notices when the polling lease expires (the rollout then fails as
        ``lease_expired`` and its work is cancelled). Use
        :meth:`RolloutClient.cancel_rollout` to cancel the work itself.

        Returns:
            False if polling had already finished, True otherwise.
        """
        return self._task.cancel()

    def __await__(self) -> Generator[Any, None, RolloutResultResponse]:
        return asyncio.shield(self._task).__await__()

    async def wait_for_completion(self) -> RolloutResultResponse:
        """Wait for the terminal result; the same as ``await handle``.

        Raises:
            asyncio.CancelledError: The handle was cancelled with :meth:`cancel`.
            RolloutProtocolError: The server answered a poll in a way the protocol forbids.
            aiohttp.ClientError: Polling failed on a transport error it does not retry.
        """
        return await self

    async def wait_for_running(self) -> RolloutStatus | str:
        """Wait until the rollout is running, or further along, or terminal.

        Returns:
            The latest status once ``running`` is reached or passed (``grading`` or a
            terminal status if polling never saw ``running``).

        Raises:
            The exception that ended polling, as :meth:`wait_for_completion`.
        """
        return await self._wait_for(RolloutStatus.RUNNING)

    async def wait_for_grading(self) -> RolloutStatus | str:
        """Wait until the rollout is grading, or terminal.

        Returns:
            The latest status once ``grading`` is reached or passed; the terminal status
            when grading was skipped or execution failed.

        Raises:
            The exception that ended polling, as :meth:`wait_for_completion`.
        """
        return await self._wait_for(RolloutStatus.GRADING)

    async def _wait_for(self, milestone: RolloutStatus) -> RolloutStatus | str:
        loop = asyncio.get_running_loop()
        while True:
            if _reached(self._status, milestone):
                return self._status
            if self._task.done():
                return (await self).status
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def _update(self, result: RolloutResultResponse) -> None:
        self._latest = result
        self._status = result.status
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _finished(self, task: asyncio.Task[RolloutResultResponse]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved here; awaiting the handle re-raises it
        self._wake()
