"""The rollout registry: one record per admitted rollout, with its lease, result and retention.

The registry owns every rollout's state and is the only writer of a
:class:`~rollout_server.state._record.RolloutRecord`. It runs on one event loop, so plain attribute
updates between awaits need no lock; nothing on the poll path takes a global lock.

Deadlines are entries of one shared timer structure (:class:`DeadlineQueue`: a heap
served by a single loop timer), never sleeping tasks nor a loop timer each:

* the lease timer of a record is armed once at registration and re-armed lazily: a poll
  only moves ``lease_deadline``; when the timer fires early it re-arms itself at the new
  deadline, so renewal costs one float assignment;
* the retention timer is armed once, at publication;
* the deadlines of waiting long polls belong to :attr:`RolloutRegistry.waits`
  (:class:`~rollout_server.state._waiting.LongPollWaits`), which publication and status changes
  wake.

A result is published exactly once: the first of the execution's end (the registry
publishes it when the task is done, asking ``outcome_of`` what the execution produced),
cancellation, lease expiry or shutdown wins. Its
:class:`~rollout_server.state._publication.PublicationObserver` objects (the server's metrics
and tracing) hear of each publication and first delivery.

The registry is the one writer of a record: admission, status, lease, cancellation,
publication, delivery and retention each change the same record, and keeping every write in
one class is what makes each rule hold once. How a rollout's end is worded (the messages,
what a task's end publishes, the "finished" log line, the observer protocol) lives in
:mod:`rollout_server.state._publication`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from rollout_types import (
    CancelDisposition,
    RolloutErrorCategory,
    RolloutSample,
    RolloutStatus,
    RolloutTurn,
)

from .._logtext import get_logger
from ._bodies import result_body
from ._deadlines import FIRE_SLACK_SEC
from ._durability import TOKEN_BYTES, StoreLink, new_token
from ._publication import LEASE_EXPIRED_MESSAGE, PublicationObserver, log_finished, task_end
from ._record import ResultFields, RolloutRecord, token_digest
from ._store import StateStore
from ._table import RecordTable
from ._waiting import DEFAULT_STATUS_CHANGE_GRACE_SEC, LongPollWaits

__all__ = ["TOKEN_BYTES", "PublicationObserver", "RolloutRegistry"]

logger: Final = get_logger("rollout_server.registry")


def _no_outcome(_rollout_id: str, _task: asyncio.Task[Any]) -> ResultFields | None:
    return None


# Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "One deadline heap on
#   one loop timer ..."
# Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "The execution task runs
#   `backend.execute()` itself ..."
class RolloutRegistry(RecordTable):
    """Every admitted rollout of one server, by id.

    Args:
        polling_lease_timeout_sec: Seconds without a poll before a rollout's lease lapses.
        result_retention_sec: Seconds a published result stays (and its id stays reserved)
            once the execution has finished.
        on_lease_expired: Called with the record right after a lapsed lease has been
            published as ``lease_expired`` (the server requests cancellation there).
        outcome_of: Called with the rollout id and its execution task once that task has
            returned or raised an ``Exception``; returns the result to publish (None: the
            task ended without a result, published as a crash). The registry publishes
            it unless the lease lapsed meanwhile; a cancelled or crashed task is
            published without asking. Default: every task ends without a result.
        status_change_grace_sec: After a non-terminal status change, each waiting long poll
            ends within this many seconds (see :class:`LongPollWaits`); default
            :data:`~rollout_server.state._waiting.DEFAULT_STATUS_CHANGE_GRACE_SEC`.
        loop_cpu_clock: CPU seconds used so far by the thread that runs the event loop,
            read on that thread; default :func:`time.thread_time`.
        observers: Told of every publication and first delivery; default none.

    Attributes:
        waits: The waiting long polls (the result route begins and ends each wait there).

    Raises:
        ValueError: If ``status_change_grace_sec`` is below 0 or NaN.
    """

    def __init__(
        self,
        *,
        polling_lease_timeout_sec: float,
        result_retention_sec: float,
        on_lease_expired: Callable[[RolloutRecord], None] = lambda _record: None,
        outcome_of: Callable[[str, asyncio.Task[Any]], ResultFields | None] = _no_outcome,
        status_change_grace_sec: float = DEFAULT_STATUS_CHANGE_GRACE_SEC,
        loop_cpu_clock: Callable[[], float] = time.thread_time,
        observers: Sequence[PublicationObserver] = (),
    ) -> None:
        super().__init__(
            polling_lease_timeout_sec=polling_lease_timeout_sec,
            result_retention_sec=result_retention_sec,
        )
        self.waits = LongPollWaits(
            self._deadlines,
            status_change_grace_sec=status_change_grace_sec,
            loop_cpu_clock=loop_cpu_clock,
        )
        self._on_lease_expired = on_lease_expired
        self._outcome_of = outcome_of
        self._observers = tuple(observers)
        # Bound once, and one context for every task's done callback (it reads no context
        # variable): per rollout, a bound method costs 64 bytes and a copied context 72.
        self._lease_callback = self._on_lease_timer
        self._done_callback = self._on_task_done
        self._callback_context = contextvars.Context()

    # -- admission ------------------------------------------------------------------------

    def register(
        self,
        rollout_id: str,
        start: Callable[[RolloutRecord], asyncio.Task[Any]],
        admitted_at: float | None = None,
        token: str | None = None,
    ) -> tuple[RolloutRecord, str]:
        """Admit ``rollout_id``: create its record and lease and start its execution task.

        The caller has checked that the id is not held. Registration and task creation
        happen in one step, so no cancel can see a record without its task.

        Args:
            rollout_id: The id to admit.
            start: Creates the execution task of the new record on :attr:`loop`.
            admitted_at: The admission's :func:`time.monotonic` stamp; default now.
            token: The lease token of the stored admission
                (:meth:`StoreLink.admit <rollout_server.state._durability.StoreLink.admit>`);
                default a new one.

        Returns:
            The record and the lease token (43 characters of base64url).
        """
        loop = self.loop
        if token is None:
            token = new_token()
        record = RolloutRecord(
            rollout_id,
            token_digest(token),
            loop.time() + self._lease_sec,
            time.monotonic() if admitted_at is None else admitted_at,
        )
        self._records[rollout_id] = record
        try:
            task = start(record)
        except BaseException:
            del self._records[rollout_id]
            raise
        record.task = task
        self._tasks[task] = record
        task.add_done_callback(self._done_callback, context=self._callback_context)
        record.lease_timer = self._deadlines.add(
            loop, record.lease_deadline, self._lease_callback, record
        )
        return record, token

    def adopt(self, record: RolloutRecord, task: asyncio.Task[Any]) -> None:
        """Give a recovered record without a result (:meth:`restore`) the execution task
        that waits for it again (its backend outlived the previous server process): it
        counts as started, and its lease (fresh at the restore) runs from now on."""
        record.task = task
        record.started = True
        self._tasks[task] = record
        task.add_done_callback(self._done_callback, context=self._callback_context)
        record.lease_timer = self._deadlines.add(
            self.loop, record.lease_deadline, self._lease_callback, record
        )

    # -- progress and publication ---------------------------------------------------------

    def mark_started(self, record: RolloutRecord) -> bool:
        """Note that the execution task of ``record`` is about to take its first step.

        Returns:
            True if it starts; False if a cancellation landed first (``execute()`` then
            never runs, and the rollout is published as ``cancelled`` without a message).
        """
        task = record.task
        if task is None or task.done() or task.cancelling():
            return False
        record.started = True
        return True

    def set_status(self, record: RolloutRecord, status: RolloutStatus | str) -> None:
        """Report a non-terminal status change; ignored once the result is published.

        Terminal statuses are reported through the execution outcome, never here; an
        unknown or terminal value is logged and ignored.
        """
        if record.body is not None:
            return
        try:
            value = RolloutStatus(status)
        except ValueError:
            logger.warning(
                "Ignoring unknown status %r reported for rollout %s", status, record.rollout_id
            )
            return
        if value in (RolloutStatus.SUCCESS, RolloutStatus.FAILURE, RolloutStatus.CANCELLED):
            logger.warning(
                "Ignoring terminal status %r reported through on_status for rollout %s "
                "(terminal results come from the execution outcome)",
                value.value,
                record.rollout_id,
            )
            return
        if value is not record.status:
            record.status = value
            self.waits.status_changed(record)

    def record_disposition(self, record: RolloutRecord, disposition: CancelDisposition) -> None:
        """Keep the cancel disposition answered for ``record`` (repeated cancels answer it
        again); ignored once the result is published."""
        if record.body is None:
            record.disposition = disposition
            if self._link is not None:
                self._link.store.note_disposition(record.rollout_id, disposition)

    # Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "A result is encoded
    #   once, at publication ..."
    def publish(
        self,
        record: RolloutRecord,
        *,
        status: RolloutStatus,
        sample: RolloutSample | None = None,
        err_message: str | None = None,
        err_category: RolloutErrorCategory | None = None,
        turns: list[RolloutTurn] | None = None,
    ) -> bool:
        """Fix the result of ``record``, unless one is fixed already (exactly once).

        Wakes every long poll, stops the lease timer (the token stays valid), starts the
        retention timer and logs the rollout's one "finished" line (INFO, DEBUG for a
        success). With a durable store all that happens once the result is durable (polls
        wait until then); should the write fail, the result is served from memory anyway
        (logged at ERROR: a restart would lose it).

        Returns:
            True if this call published, False if a result was already fixed.
        """
        link = self._link
        if record.body is not None or (link is not None and record in link.publishing):
            return False
        body = result_body(
            rollout_id=record.rollout_id,
            status=status,
            sample=sample,
            err_message=err_message,
            err_category=err_category,
            turns=turns,
        )
        self._undelivered += 1
        if link is None:
            self._fix(record, body, status, sample, err_message, err_category)
        else:
            fut = link.publication(record, status, body)
            fields = ResultFields(status, sample, err_message, err_category)
            fixed = functools.partial(self._stored, record, body, fields)
            fut.add_done_callback(fixed, context=self._callback_context)
        return True

    def _stored(
        self,
        record: RolloutRecord,
        body: bytes,
        fields: ResultFields,
        fut: asyncio.Future[None],
    ) -> None:
        """The write of a result is over: fix it (durable or not)."""
        assert self._link is not None
        self._link.publishing.discard(record)
        error = None if fut.cancelled() else fut.exception()
        if fut.cancelled() or error is not None:
            logger.error(
                "The result of rollout %s could not be stored (%s); it is served from this "
                "process's memory only, and a restart would lose it",
                record.rollout_id,
                error or "cancelled",
            )
        self._fix(
            record, body, fields.status, fields.sample, fields.err_message, fields.err_category
        )

    def _fix(  # noqa: PLR0917 - the fields of publish(), positional on the hot path
        self,
        record: RolloutRecord,
        body: bytes,
        status: RolloutStatus,
        sample: RolloutSample | None,
        err_message: str | None,
        err_category: RolloutErrorCategory | None,
    ) -> None:
        """Fix the result of ``record`` (its write, if any, is over)."""
        record.body = body
        record.status = status
        log_finished(record, status, sample, err_message, err_category)
        if record.lease_timer is not None:
            self._deadlines.cancel(record.lease_timer)
            record.lease_timer = None
        self.waits.wake(record)
        if not self._closed:
            loop = self.loop
            record.retention_timer = self._deadlines.add(
                loop, loop.time() + self._retention_sec, self._on_retention_elapsed, record
            )
        for observer in self._observers:
            observer.published(record, status, err_category)

    # Speed: benchmarks/README.md, "Server: when a waiting poll answers", row "A poll that finds a
    #   status not yet answered ..."
    def deliver_status(self, record: RolloutRecord) -> RolloutStatus:
        """Note that a poll answers the current in-progress status of ``record`` (the
        status-change grace then no longer applies to it: see
        :meth:`LongPollWaits.begin <rollout_server.state._waiting.LongPollWaits.begin>`).

        Returns:
            That status.
        """
        status = record.delivered_status = record.status
        return status

    def mark_delivered(self, record: RolloutRecord) -> None:
        """Note that a poll has returned the published result of ``record``."""
        if record.delivered:
            return
        record.delivered = True
        self._count_delivered()
        for observer in self._observers:
            observer.delivered(record)

    # -- durable state --------------------------------------------------------------------

    def attach_store(self, store: StateStore, *, process_id: str) -> None:
        """Keep admissions and publications in ``store`` from now on (before serving; a
        store that is not ``durable`` changes nothing)."""
        if store.durable:
            self._link = StoreLink(
                store,
                process_id=process_id,
                lease_sec=self._lease_sec,
                retention_sec=self._retention_sec,
            )

    # -- leases ---------------------------------------------------------------------------

    def renew(self, record: RolloutRecord) -> bool:
        """Renew the lease of an unpublished rollout on the arrival of a valid poll.

        Returns:
            True if renewed; False if the lease had already lapsed, in which case the
            result is now published as ``lease_expired``.
        """
        now = self.loop.time()
        if now >= record.lease_deadline:
            self._expire(record)
            return False
        record.lease_deadline = now + self._lease_sec
        return True

    def _on_lease_timer(self, record: RolloutRecord) -> None:
        record.lease_timer = None
        if record.body is not None:
            return
        loop = self.loop
        if record.lease_deadline - loop.time() > FIRE_SLACK_SEC:
            record.lease_timer = self._deadlines.add(
                loop, record.lease_deadline, self._lease_callback, record
            )
            return
        self._expire(record)

    def _expire(self, record: RolloutRecord) -> None:
        if self.publish(
            record,
            status=RolloutStatus.FAILURE,
            err_message=LEASE_EXPIRED_MESSAGE,
            err_category=RolloutErrorCategory.LEASE_EXPIRED,
        ):
            self._on_lease_expired(record)

    # -- cancellation ---------------------------------------------------------------------

    def cancel_task(self, record: RolloutRecord) -> bool:
        """Cancel the execution task of ``record`` unless it is done or already cancelling.

        Returns:
            True if a cancellation was requested now.
        """
        task = record.task
        if task is None or task.done() or task.cancelling():
            return False
        task.cancel()
        return True

    def force_cancel(self) -> int:
        """Cancel every active execution task again, even those already cancelling.

        Returns:
            How many tasks were cancelled.
        """
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        return len(tasks)

    def publish_unfinished(self, err_message: str) -> int:
        """Publish ``cancelled`` with ``err_message`` for every record without a result.

        Returns:
            How many records were published.
        """
        unpublished = [record for record in self._records.values() if record.body is None]
        cancelled = RolloutStatus.CANCELLED
        return sum(self.publish(r, status=cancelled, err_message=err_message) for r in unpublished)

    # -- task completion and retention ----------------------------------------------------

    def _on_task_done(self, task: asyncio.Task[Any]) -> None:
        record = self._tasks.pop(task)
        record.task = None
        self._publish_end(record, task)
        record.finished = True
        if record.retention_elapsed:
            self._remove(record)
        if not self._tasks:
            self._tasks_ended()

    def _publish_end(self, record: RolloutRecord, task: asyncio.Task[Any]) -> None:
        """Publish how the execution task of ``record`` ended (a no-op if a result is fixed
        already): the one place a task's end is published (what it publishes:
        :func:`~rollout_server.state._publication.task_end`). An outcome of the execution
        loses to a lease that lapsed meanwhile (``lease_expired``, as if the lease timer had
        won)."""
        fields, from_outcome = task_end(record, task, self._outcome_of)
        if from_outcome and record.body is None and self.loop.time() >= record.lease_deadline:
            self._expire(record)
            return
        self.publish(
            record,
            status=fields.status,
            sample=fields.sample,
            err_message=fields.err_message,
            err_category=fields.err_category,
            turns=fields.turns,
        )

    def close(self) -> None:
        """Stop every lease and retention timer and answer every waiting long poll.

        Records stay readable, so polls that arrive while the server stops listening still
        get their result; later waits return at once.
        """
        self._closed = True
        waits = self.waits
        waits.close()
        for record in self._records.values():
            for timer in (record.lease_timer, record.retention_timer):
                if timer is not None:
                    self._deadlines.cancel(timer)
            record.lease_timer = None
            record.retention_timer = None
            waits.wake(record)
