"""The scheduling half of a run: at most ``concurrency`` work items in flight, each with a
fresh rollout id and a deadline, and stopping when :class:`RunControl` says so.

Rollout ids: with ``--n 1`` a fresh ``uuid4().hex`` per item; with ``--n`` K > 1 the K runs
of a row are a group (GRPO's n samples of one prompt): a fresh ``uuid4().hex`` group id per
row and per invocation, the item of run ``r`` is ``<group>-<r>`` and is sent with
``group_id=<group>`` (a server's model gateway routes the group to one model endpoint; a
pool keeps it on one server). A resumed run gives the rows it runs again new group ids,
so every rollout id stays fresh. Each run of a row is still scheduled, deadlined, recorded
and resumed as its own item (an infrastructure failure is never scored, it stays pending).

A stop (the stop rule, Ctrl-C, a failing worker) starts no new rollouts and cancels the
in-flight ones: admitted rollouts on the server (through a separate client, bounded),
admissions still in progress locally. Cancelled items are not recorded and stay pending.
A drain (the server is shutting down) starts no new rollouts, abandons the admissions in
progress and collects the admitted rollouts, each bounded by its item deadline; a stop
during the drain cancels what is left. An admission that finds no server (a restart) is
tried again with a fresh rollout id for up to 16.6 s (:mod:`._outage`). How each ending is
recorded is the :class:`~._recorder.Recorder`'s business.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Final

from rollout_types import RolloutResultResponse

from ._client_seam import RunClient, RunHandle, start_rollout
from ._control import RunControl
from ._dataset import DatasetRow
from ._options import EvalOptions
from ._outage import ADMISSION_OUTAGE_DELAYS_SEC, is_outage
from ._progress import Progress
from ._recorder import Recorder

__all__ = ["SETTLE_TIMEOUT_SEC", "Scheduler"]

SETTLE_TIMEOUT_SEC: Final = 30.0
"""How long a stop waits for cancelled in-flight rollouts to report ``cancelled``."""

Item = tuple[int, int]


@dataclasses.dataclass(eq=False)
class _Flight:
    """One work item in flight: its rollout id, then its admission, then its handle."""

    item: Item
    rollout_id: str
    handle: RunHandle | None = None
    admission: asyncio.Future[Any] | None = None
    cancel_sent: bool = False


class Scheduler:
    """Runs work items through the client and hands every ending to the recorder.

    Args:
        options: The run's options (request fields, the item deadline).
        rows: The dataset rows by index.
        client: The client that admits and polls.
        cancel_client_factory: Builds the client that sends cancellations (on first use).
        control: Watched for a stop.
        recorder: Records every ending.
        progress: Where messages go.
    """

    def __init__(
        self,
        *,
        options: EvalOptions,
        rows: Mapping[int, DatasetRow],
        client: RunClient,
        cancel_client_factory: Callable[[], RunClient],
        control: RunControl,
        recorder: Recorder,
        progress: Progress,
    ) -> None:
        self.options = options
        self.rows = rows
        self.client = client
        self.cancel_client_factory = cancel_client_factory
        self.control = control
        self.recorder = recorder
        self.progress = progress
        self.flights: dict[str, _Flight] = {}
        self.deadline_sec = options.deadline_sec()
        self._cancel_client: RunClient | None = None
        self._cancel_tasks: set[asyncio.Task[None]] = set()
        self._cancel_failures: list[Exception] = []
        self._in_flight_at_stop: set[Item] = set()
        self._groups: dict[int, str] = {}

    def _ids(self, item: Item) -> tuple[str, str | None]:
        """The rollout id and group id (None with ``--n 1``) of a work item."""
        if self.options.n == 1:
            return uuid.uuid4().hex, None
        group = self._groups.setdefault(item[0], uuid.uuid4().hex)
        return f"{group}-{item[1]}", group

    def cancelled_items(self) -> frozenset[Item]:
        """The items in flight when the run stopped that ended without a journal record
        (cancelled on the server, or their admission abandoned): pending, and counted as
        ``cancelled`` in the summary."""
        return frozenset(self._in_flight_at_stop - self.recorder.recorded_items)

    # -- one item -------------------------------------------------------------------

    async def run_item(self, item: Item) -> None:
        """Admit one item, await its result within the deadline, and record the ending."""
        rollout_id, group_id = self._ids(item)
        flight = _Flight(item=item, rollout_id=rollout_id)
        key = flight.rollout_id
        self.flights[key] = flight
        started = time.monotonic()
        try:
            admission = asyncio.ensure_future(self._admit(flight, group_id))
            flight.admission = admission
            try:
                handle = await admission
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if admission.cancelled() and (task is None or task.cancelling() == 0):
                    return  # abandoned by a stop (see cancel_in_flight): the item stays pending
                raise
            except Exception as exc:  # noqa: BLE001 - every failure is classified
                self.recorder.record_exception(
                    item,
                    flight.rollout_id,
                    exc,
                    latency_sec=time.monotonic() - started,
                    phase="admission",
                )
                return
            flight.handle = handle
            admitted = time.monotonic()
            if self.control.stop.is_set():
                self.send_cancel(flight)
            deadline = asyncio.timeout(self.deadline_sec)
            try:
                async with deadline:
                    result: RolloutResultResponse = await handle
            except Exception as exc:  # noqa: BLE001 - every failure is classified
                if deadline.expired():
                    await self._overrun(flight, handle, admitted)
                    return
                self.recorder.record_exception(
                    item,
                    flight.rollout_id,
                    exc,
                    latency_sec=time.monotonic() - admitted,
                    phase="result",
                )
                return
            self.recorder.record_result(
                item,
                flight.rollout_id,
                result,
                latency_sec=time.monotonic() - admitted,
                cancel_requested=flight.cancel_sent,
            )
        finally:
            self.flights.pop(key, None)

    async def _admit(self, flight: _Flight, group_id: str | None) -> RunHandle:
        """Admit ``flight``'s item, riding out a server outage (see :mod:`._outage`): an
        admission that found no server is tried again after each of
        :data:`~._outage.ADMISSION_OUTAGE_DELAYS_SEC` with a fresh rollout id (in its
        group: ``<group>-<run>-a<attempt>``), unless the run is stopping; the last failure
        is raised."""
        attempt = 0
        while True:
            try:
                handle: RunHandle = await start_rollout(
                    self.client,
                    options=self.options,
                    row=self.rows[flight.item[0]],
                    rollout_id=flight.rollout_id,
                    item=flight.item,
                    group_id=group_id,
                )
            except Exception as exc:
                if (
                    attempt >= len(ADMISSION_OUTAGE_DELAYS_SEC)
                    or self.control.stop.is_set()
                    or not is_outage(exc)
                ):
                    raise
            else:
                return handle
            await asyncio.sleep(ADMISSION_OUTAGE_DELAYS_SEC[attempt])
            attempt += 1
            flight.rollout_id = (
                uuid.uuid4().hex if group_id is None else f"{group_id}-{flight.item[1]}-a{attempt}"
            )

    async def _overrun(self, flight: _Flight, handle: RunHandle, admitted: float) -> None:
        self.send_cancel(flight)
        with contextlib.suppress(Exception, asyncio.TimeoutError):
            async with asyncio.timeout(SETTLE_TIMEOUT_SEC):
                await handle
        if not handle.done():
            handle.cancel()
        self.recorder.record_overrun(
            flight.item,
            flight.rollout_id,
            deadline_sec=self.deadline_sec,
            latency_sec=time.monotonic() - admitted,
        )

    # -- cancellation ---------------------------------------------------------------

    def send_cancel(self, flight: _Flight) -> None:
        """Ask the server to cancel one admitted rollout (in the background, bounded)."""
        if flight.cancel_sent:
            return
        flight.cancel_sent = True
        task = asyncio.get_running_loop().create_task(self._cancel(flight.rollout_id))
        self._cancel_tasks.add(task)
        task.add_done_callback(self._cancel_tasks.discard)

    async def _cancel(self, rollout_id: str) -> None:
        if self._cancel_client is None:
            # A separate session: the polling session may be busy with long polls.
            self._cancel_client = self.cancel_client_factory()
        try:
            await self._cancel_client.cancel_rollout(rollout_id)
        except Exception as exc:  # noqa: BLE001 - best effort: the lease expires otherwise
            self._cancel_failures.append(exc)  # reported once, by close()

    def cancel_in_flight(self) -> None:
        """Cancel every in-flight rollout: admitted ones on the server, admissions locally.

        An admission abandoned mid-request may still have been admitted; the server then
        fails that rollout as ``lease_expired`` (and cancels its work) when nobody polls it.
        """
        for flight in list(self.flights.values()):
            if flight.handle is not None:
                self.send_cancel(flight)
            elif flight.admission is not None:
                flight.admission.cancel()

    async def close(self) -> None:
        """Finish pending cancel requests (bounded) and close the cancel client.

        When this task is being cancelled (a second Ctrl-C), the requests are abandoned.
        """
        task = asyncio.current_task()
        hurry = task is not None and task.cancelling() > 0
        if self._cancel_tasks and not hurry:
            await asyncio.wait(set(self._cancel_tasks), timeout=SETTLE_TIMEOUT_SEC)
        for cancel_task in set(self._cancel_tasks):
            cancel_task.cancel()
        if self._cancel_failures:
            last = self._cancel_failures[-1]
            self.progress.message(
                f"rollout-eval: could not cancel {len(self._cancel_failures)} rollout(s) on the "
                f"server (last: {type(last).__name__}: {last}); their polling leases expire "
                "instead"
            )
        if self._cancel_client is not None:
            await self._cancel_client.aclose()

    # -- the pool -------------------------------------------------------------------

    async def run_items(self, items: list[Item], concurrency: int) -> None:
        """Run ``items`` with ``concurrency`` workers until done, stopped or drained.

        Raises:
            Exception: What a worker raised (an unwritable journal, a bug), after the
                others were stopped cleanly.
        """
        queue = deque(items)

        async def worker() -> None:
            while queue and not self.control.stop.is_set():
                await self.run_item(queue.popleft())

        workers = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(items)))]
        stop_waiter = asyncio.create_task(self.control.stop.wait())
        cancel_waiter = asyncio.create_task(self.control.cancel.wait())
        drain_started = False
        try:
            pending: set[asyncio.Task[Any]] = set(workers)
            while pending and not self.control.cancel.is_set():
                # Before a stop, watch for one; while draining, watch for a stop that
                # cancels what is being collected.
                watch = cancel_waiter if self.control.stop.is_set() else stop_waiter
                done, pending = await asyncio.wait(
                    pending | {watch}, return_when=asyncio.FIRST_COMPLETED
                )
                pending.discard(watch)
                failed = [t for t in done if t is not watch and t.exception() is not None]
                if failed:
                    # A bug or an unwritable journal: stop the others cleanly, then raise.
                    exc = failed[0].exception()
                    self.control.request_stop(f"stopping after an error: {exc!r}")
                elif self.control.draining and not drain_started:
                    drain_started = True
                    self._drain()
            if self.control.cancel.is_set():
                await self._stop(workers)
            outcomes = await asyncio.gather(*workers, return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, Exception):
                    raise outcome
        finally:
            stop_waiter.cancel()
            cancel_waiter.cancel()
            for task in workers:
                task.cancel()
            await asyncio.gather(stop_waiter, cancel_waiter, *workers, return_exceptions=True)
            for flight in list(self.flights.values()):
                if flight.handle is not None and not flight.handle.done():
                    flight.handle.cancel()

    def _drain(self) -> None:
        """Say why no rollouts start any more, abandon the admissions in progress, and
        leave the admitted rollouts to finish (each within its item deadline)."""
        admitted = sum(1 for flight in self.flights.values() if flight.handle is not None)
        collecting = (
            f"; collecting the {admitted} in flight (Ctrl-C cancels them)" if admitted else ""
        )
        self.progress.message(
            f"rollout-eval: {self.control.reason}: starting no new rollouts{collecting}"
        )
        for flight in list(self.flights.values()):
            if flight.handle is None and flight.admission is not None:
                flight.admission.cancel()

    async def _stop(self, workers: list[asyncio.Task[None]]) -> None:
        """Say why the run stops, cancel the in-flight rollouts and let the workers settle."""
        if self.control.reason:
            self.progress.message(f"rollout-eval: {self.control.reason}")
        self._in_flight_at_stop = {flight.item for flight in self.flights.values()}
        if self.flights:
            self.progress.message(
                f"rollout-eval: cancelling {len(self.flights)} in-flight rollouts on the "
                "server; they stay pending (re-run the same command to resume)"
            )
        self.cancel_in_flight()
        _, still = await asyncio.wait(workers, timeout=SETTLE_TIMEOUT_SEC)
        for task in still:
            task.cancel()
