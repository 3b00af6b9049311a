"""``LongPollWaits``: the long polls waiting on rollouts, and when each one ends.

A long poll waits on a plain future in its record's waiter list, bounded by one deadline
entry of the registry's :class:`~rollout_server.state._deadlines.DeadlineQueue` (no loop timer
and no coroutine frame of this module per waiting poll). A wait ends:

* at once, when the result is published or the registry closes (:meth:`LongPollWaits.wake`);
* within ``status_change_grace_sec`` of a non-terminal status change
  (:meth:`LongPollWaits.status_changed`): each waiting entry is brought forward to at most
  the grace away, so a result published within that time is answered instead of the
  passing status (one round trip instead of two: LocalBackend goes ``running`` →
  ``grading`` → published within a millisecond for a quick grader). A grace that ends
  while the event loop has been saturated all along is put off by another grace, up to
  the poll's own wait: a busy server answers the result rather than spend its time on
  progress answers and the re-polls they bring;
* within ``status_change_grace_sec`` of the poll's arrival, when the status then is not the
  one last answered to the caller (``record.delivered_status``: the admission answers
  ``queued``): exactly as if the status had changed as the poll arrived, so no change
  stays unseen for a whole wait because it happened between two polls (LocalBackend
  reports ``running`` right after admission, before the first poll arrives);
* at the poll's own wait (``result_wait_timeout_sec``), when nothing happened.

The registry owns one instance and calls :meth:`~LongPollWaits.wake` and
:meth:`~LongPollWaits.status_changed`; the result route calls :meth:`~LongPollWaits.begin`
and :meth:`~LongPollWaits.end` around its ``await``. What a poll answers once its wait is
over is the route's business, not this class's (it notes an in-progress answer with
:meth:`RolloutRegistry.deliver_status
<rollout_server.state._registry.RolloutRegistry.deliver_status>`).
This class is the one place that decides when a waiting poll ends: count waits here.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable
from typing import Final

from ._deadlines import FIRE_SLACK_SEC, DeadlineQueue, Entry, due_at, pending_argument
from ._record import RolloutRecord

__all__ = [
    "CPU_READING_INTERVAL_SEC",
    "DEFAULT_STATUS_CHANGE_GRACE_SEC",
    "SATURATED_LOOP_SHARE",
    "LongPollWaits",
]

# Speed: benchmarks/README.md, "Server: when a waiting poll answers", row "Status-change grace ..."
DEFAULT_STATUS_CHANGE_GRACE_SEC: Final = 1.0
"""Longest time (seconds) a long poll goes on waiting after a non-terminal status change
(during the poll, or since the status last answered to the caller), for a result that may
follow: then it answers the status it finds (spec 4.6 step 3). A rollout that ends within
it is answered in one round trip; a phase that lasts longer is reported at most this much
(plus a round trip) after it began."""

# Speed: benchmarks/README.md, "Server: when a waiting poll answers", row "Saturated-loop rule ..."
SATURATED_LOOP_SHARE: Final = 0.9
"""A status-change grace is put off by another grace (up to the poll's own wait) when the
thread running the event loop spent at least this share of the grace on the CPU (CPU
seconds per second): the loop was saturated throughout, so the result is likely queued
behind other work, and a progress answer would add a response and a re-poll to that work.
With 5,000 held rollouts released together on a 2-core machine, the server needs 1.2-2.3 s
of CPU; beyond the 1 s grace, polls answered ``grading`` and re-polled, which made the
burst longer still."""

# Speed: benchmarks/README.md, "Server: when a waiting poll answers", row "Saturated-loop rule ..."
CPU_READING_INTERVAL_SEC: Final = 0.01
"""Longest time (loop seconds) one reading of the loop thread's CPU clock serves the graces
that start or end after it. Each grace is judged over the span from the reading before it
began to the reading when it ends, which is exact for that span and at most this much
longer than the grace. The clock is a system call: read once per poll, it took a sixth of
the server's py-spy samples while 5,000 held rollouts were admitted and long-polled (3% once
shared this way)."""


def _entries(waiters: Entry | tuple[Entry, ...]) -> tuple[Entry, ...]:
    return waiters if isinstance(waiters, tuple) else (waiters,)


def _list_waiters(record: RolloutRecord, entries: list[Entry]) -> None:
    """Keep ``entries`` as the waiting polls of ``record`` (None, one entry, or a tuple)."""
    if not entries:
        record.poll_entries = None
    else:
        record.poll_entries = entries[0] if len(entries) == 1 else tuple(entries)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


# Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "One deadline heap on
#   one loop timer ..."
# Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "A waiting poll is a
#   plain future in one deadline entry ..."
# Speed: benchmarks/README.md, "Server: when a waiting poll answers", row "Saturated-loop rule ..."
class LongPollWaits:
    """The waiting long polls of one registry.

    A record's waiting polls are kept on the record itself (its ``_waiters`` slot, which
    only this class writes): none (None, the usual case while nobody polls), one deadline
    entry, or a tuple of entries; each entry's argument is the poll's future.

    Args:
        deadlines: The registry's deadline queue (wait deadlines and graces go there).
        status_change_grace_sec: After a non-terminal status change, each waiting poll
            ends within this many seconds, or at once when the result is published
            meanwhile; so does a poll that arrives to find a status it has not answered
            yet. 0 ends them at once. Default :data:`DEFAULT_STATUS_CHANGE_GRACE_SEC`.
            A grace during which the event loop was saturated is put off
            (:data:`SATURATED_LOOP_SHARE`).
        loop_cpu_clock: CPU seconds used so far by the thread that runs the event loop,
            read on that thread; default :func:`time.thread_time`.

    Raises:
        ValueError: If ``status_change_grace_sec`` is below 0 or NaN.
    """

    __slots__ = (
        "_closed",
        "_cpu_read_at",
        "_cpu_seconds",
        "_deadlines",
        "_grace_sec",
        "_loop",
        "_loop_cpu_clock",
    )

    def __init__(
        self,
        deadlines: DeadlineQueue,
        *,
        status_change_grace_sec: float = DEFAULT_STATUS_CHANGE_GRACE_SEC,
        loop_cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        if not status_change_grace_sec >= 0.0:
            raise ValueError(
                f"status_change_grace_sec must be a number of seconds >= 0; got "
                f"{status_change_grace_sec!r}"
            )
        self._deadlines = deadlines
        self._grace_sec = status_change_grace_sec
        self._loop_cpu_clock = loop_cpu_clock
        self._cpu_read_at = -math.inf
        self._cpu_seconds = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the waits run on (the running loop at first use)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (later waits return at once)."""
        return self._closed

    # Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "A waiting poll is a
    #   plain future in one deadline entry ..."
    # Speed: benchmarks/README.md, "Server: when a waiting poll answers", row "A poll that finds a
    #   status not yet answered ..."
    def begin(self, record: RolloutRecord, timeout: float) -> asyncio.Future[None] | None:
        """Start a long poll's wait on ``record``.

        The wait is for the status to differ from ``record.delivered_status``, the one last
        answered to the caller. When it differs already (a change between two polls), the
        wait is the status-change grace, as if the change happened now: a result published
        within it is answered instead.

        The long-polling handler awaits the returned future itself (no coroutine frame of
        this class per waiting poll) and must pass it to :meth:`end` in a ``finally``.

        Args:
            record: The rollout to watch.
            timeout: Longest wait, seconds.

        Returns:
            A future that is done on publication, :meth:`close`, the timeout, or within
            the status-change grace after a status change (or after now, when the status
            differs already); None when there is nothing to wait for (the result is
            published, the waits are closed, or the status differs already and the grace
            is 0).
        """
        if record.body is not None or self._closed:
            return None
        unseen = record.status is not record.delivered_status
        grace = self._grace_sec
        if unseen and grace <= 0.0:
            return None
        loop = self.loop
        fut: asyncio.Future[None] = loop.create_future()
        now = loop.time()
        until = now + timeout
        if unseen and grace < timeout:
            since, cpu_since = self._cpu_reading(now)
            check = functools.partial(self._end_grace, record, until, since, cpu_since)
            entry = self._deadlines.add(loop, now + grace, check, fut)
        else:
            entry = self._deadlines.add(loop, until, _resolve, fut)
        waiters = record.poll_entries
        record.poll_entries = entry if waiters is None else (*_entries(waiters), entry)
        return fut

    def end(self, record: RolloutRecord, fut: asyncio.Future[None]) -> None:
        """Finish a wait started by :meth:`begin` (whether it ended or was cancelled):
        cancel its future if pending and drop its deadline."""
        if not fut.done():
            fut.cancel()
        waiters = record.poll_entries
        if waiters is None:
            return  # a wake-up took (and cancelled) every entry
        # Keep the other polls' live entries; drop this poll's and any that have fired.
        kept: list[Entry] = []
        for entry in _entries(waiters):
            other = pending_argument(entry)
            if other is fut:
                self._deadlines.cancel(entry)
            elif other is not None:
                kept.append(entry)
        _list_waiters(record, kept)

    def wake(self, record: RolloutRecord) -> None:
        """End every waiting poll of ``record`` at once (its result is published, or the
        registry is closing)."""
        waiters = record.poll_entries
        if waiters is None:
            return
        record.poll_entries = None
        for entry in _entries(waiters):
            fut = pending_argument(entry)  # before cancel() clears it; None once fired
            self._deadlines.cancel(entry)
            if fut is not None and not fut.done():
                fut.set_result(None)

    # Speed: benchmarks/README.md, "Server: when a waiting poll answers", row "Status-change grace
    #   ..."
    def status_changed(self, record: RolloutRecord) -> None:
        """End every waiting poll of ``record`` within the status-change grace."""
        waiters = record.poll_entries
        if waiters is None:
            return
        if self._grace_sec <= 0.0:
            self.wake(record)
            return
        now = self.loop.time()
        by = now + self._grace_sec
        if isinstance(waiters, tuple):
            record.poll_entries = tuple(self._move(record, entry, now, by) for entry in waiters)
        else:
            record.poll_entries = self._move(record, waiters, now, by)

    def _move(self, record: RolloutRecord, entry: Entry, now: float, by: float) -> Entry:
        """Bring the waiting poll ``entry`` of ``record`` forward to ``by`` (loop seconds)
        for a status change at ``now``, unless it is due by then already (a grace of its
        own, or its wait): returns the entry now listed."""
        until = due_at(entry)
        if until <= by:
            return entry
        since, cpu_since = self._cpu_reading(now)
        check = functools.partial(self._end_grace, record, until, since, cpu_since)
        return self._deadlines.bring_forward(self.loop, entry, by, check)

    def _cpu_reading(self, now: float) -> tuple[float, float]:
        """The latest reading of the loop thread's CPU clock, as (loop seconds when read,
        CPU seconds), read again when older than :data:`CPU_READING_INTERVAL_SEC` at
        ``now`` (loop seconds)."""
        if now - self._cpu_read_at >= CPU_READING_INTERVAL_SEC:
            self._cpu_read_at = now
            self._cpu_seconds = self._loop_cpu_clock()
        return self._cpu_read_at, self._cpu_seconds

    def close(self) -> None:
        """Refuse later waits (:meth:`begin` returns None); the registry wakes the current
        ones record by record."""
        self._closed = True

    def _end_grace(
        self,
        record: RolloutRecord,
        until: float,
        since: float,
        cpu_since: float,
        fut: asyncio.Future[None],
    ) -> None:
        """The grace of a poll waiting on ``record`` is over: end its wait, or put it off by
        another grace when the loop was saturated since ``since`` (loop seconds; the loop
        thread's CPU clock read ``cpu_since`` then), never beyond ``until``, the poll's own
        deadline (loop seconds)."""
        if fut.done():
            return  # ended otherwise (publication and close() end every wait at once)
        loop = self.loop
        now = loop.time()
        read_at, cpu = self._cpu_reading(now)
        span = read_at - since
        if (
            span > FIRE_SLACK_SEC
            and cpu - cpu_since >= SATURATED_LOOP_SHARE * span
            and until - now > FIRE_SLACK_SEC
        ):
            when = now + self._grace_sec
            if when < until:
                check = functools.partial(self._end_grace, record, until, read_at, cpu)
                entry = self._deadlines.add(loop, when, check, fut)
            else:
                entry = self._deadlines.add(loop, until, _resolve, fut)
            # This poll's own entry has fired; keep the entries still pending, and the new.
            waiters = record.poll_entries
            live = () if waiters is None else _entries(waiters)
            kept = [other for other in live if pending_argument(other) is not None]
            _list_waiters(record, [*kept, entry])
            return
        fut.set_result(None)
