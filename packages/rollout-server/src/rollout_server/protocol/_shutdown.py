"""Staged shutdown that keeps results collectable.

The stages, in order (each wait ends early once no execution is active, and every wait
ends at once on ``hurry``: a second signal):

1. close admissions: ``POST /rollout`` answers 503 from now on, result polls keep working;
2. wait up to :attr:`ShutdownTimeouts.drain_sec` for active executions to finish;
3. request cancellation of everything still running (backend first, then the server's own
   task, as ``POST /rollout/cancel`` with ``all``) and wait up to ``cleanup_sec``;
4. hard-cancel the execution tasks still active and wait up to ``force_sec``; executions
   still running then are abandoned, their ids logged once;
5. ``await backend.shutdown()``, bounded by ``backend_sec`` (after a second signal, by
   :data:`HURRIED_BACKEND_SHUTDOWN_SEC` at most: the backend still gets to release what it
   holds);
6. publish ``cancelled`` for any rollout still without a result (its task ignored every
   cancellation), then give pollers up to ``collect_sec`` to collect every result not yet
   delivered, those published before shutdown began included (it ends early once each
   has been delivered at least once). Results of rollouts a client cancelled itself
   (``POST /rollout/cancel`` before the shutdown's own cancellation in stage 3) are not
   waited for: their caller asked for no result. With nothing else to collect, there is
   no window at all;
7. close the registry: timers stop and waiting long polls answer at once.

Only after that does the ``rollout-server`` command stop listening.

The stages drive a :class:`ShutdownTarget` (what :class:`~rollout_server.RolloutServer`
offers them), so this module depends on no server class.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping
from typing import Any, Final, Protocol

import attrs

from rollout_types import CancelDisposition, RolloutErrorCategory, RolloutStatus, check_seconds

from .._errors import ServerConfigError
from .._logtext import get_logger, log_list
from ..execution._backend import ExecutionBackend
from ..state._record import RolloutRecord
from ..state._registry import RolloutRegistry

__all__ = [
    "HURRIED_BACKEND_SHUTDOWN_SEC",
    "MAX_LOGGED_IDS",
    "DeliveryWatch",
    "ShutdownTarget",
    "ShutdownTimeouts",
    "run_staged_shutdown",
]

logger: Final = get_logger("rollout_server.shutdown")

SHUTDOWN_ERR_MESSAGE: Final = "rollout server shut down before the rollout finished"
"""``err_message`` of a rollout whose execution outlived every shutdown stage."""

HURRIED_BACKEND_SHUTDOWN_SEC: Final = 2.0
"""Longest wait (seconds) for ``backend.shutdown()`` once a second signal has cut the
shutdown's waits short."""

MAX_LOGGED_IDS: Final = 50
"""Most rollout ids one shutdown log line lists (the rest are counted)."""


def _non_negative_finite(_inst: object, attribute: attrs.Attribute[float], value: object) -> None:
    check_seconds(attribute.name, value, allow_zero=True, error=ServerConfigError)


@attrs.frozen(kw_only=True)
class ShutdownTimeouts:
    """How long each stage of the staged shutdown may take, in float seconds (all >= 0).

    Attributes:
        drain_sec: Wait for active executions to finish on their own; default 10.0.
        cleanup_sec: Wait after requesting cancellation of everything; default 120.0.
        force_sec: Wait after hard-cancelling the remaining tasks; default 10.0.
        backend_sec: Bound on ``backend.shutdown()``; default 30.0.
        collect_sec: Window for pollers to collect the results not yet delivered when
            shutdown began or published since, before the server stops listening; default
            5.0.

    Raises:
        ServerConfigError: If a value is not a finite number >= 0.
    """

    drain_sec: float = attrs.field(default=10.0, validator=_non_negative_finite)
    cleanup_sec: float = attrs.field(default=120.0, validator=_non_negative_finite)
    force_sec: float = attrs.field(default=10.0, validator=_non_negative_finite)
    backend_sec: float = attrs.field(default=30.0, validator=_non_negative_finite)
    collect_sec: float = attrs.field(default=5.0, validator=_non_negative_finite)


class DeliveryWatch:
    """Tells the collect window when the results it waits for have each been delivered.

    One of the registry's publication observers (the server registers it): outside the
    collect window it does nothing; during it, each first delivery of a watched result
    counts, and the future from :meth:`watch` is done once none is left.
    """

    __slots__ = ("_done", "_owed")

    def __init__(self) -> None:
        self._owed: set[RolloutRecord] = set()
        self._done: asyncio.Future[None] | None = None

    def watch(
        self, records: list[RolloutRecord], loop: asyncio.AbstractEventLoop
    ) -> asyncio.Future[None]:
        """A future done once each of ``records`` (published, not yet delivered) has been
        delivered; it replaces any earlier watch."""
        self._owed = set(records)
        self._done = done = loop.create_future()
        if not self._owed:
            done.set_result(None)
        return done

    def published(
        self,
        record: RolloutRecord,
        status: RolloutStatus,
        category: RolloutErrorCategory | None,
    ) -> None:
        """Nothing to do: only deliveries count."""

    def delivered(self, record: RolloutRecord) -> None:
        """``record``'s result has been delivered for the first time."""
        owed = self._owed
        if owed and record in owed:
            owed.discard(record)
            done = self._done
            if not owed and done is not None and not done.done():
                done.set_result(None)


class ShutdownTarget(Protocol):
    """What the staged shutdown needs of the server it stops."""

    @property
    def registry(self) -> RolloutRegistry:
        """The rollouts (active executions, results to collect)."""
        ...

    @property
    def deliveries(self) -> DeliveryWatch:
        """Told of every first delivery of a result (a publication observer)."""
        ...

    @property
    def backend(self) -> ExecutionBackend:
        """The backend, whose ``shutdown()`` is awaited."""
        ...

    def begin_shutdown(self) -> None:
        """Close admissions."""
        ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a side task that :meth:`close` waits for or cancels."""
        ...

    async def cancel_everything(self) -> Mapping[str, CancelDisposition]:
        """Cancel every rollout without a result."""
        ...

    async def close(self) -> None:
        """Close the registry and end the side tasks."""
        ...


async def _wait_first(
    fut: asyncio.Future[Any], hurry: asyncio.Future[None], timeout: float
) -> bool:
    """Wait for ``fut`` (or ``hurry``) at most ``timeout`` seconds; True if ``fut`` is done."""
    if not fut.done() and not hurry.done() and timeout > 0:
        await asyncio.wait((fut, hurry), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    return fut.done()


async def run_staged_shutdown(
    server: ShutdownTarget,
    timeouts: ShutdownTimeouts,
    *,
    collect: bool,
    hurry: asyncio.Future[None],
) -> None:
    """Run the shutdown stages of the module docstring for ``server``.

    Args:
        server: The server to shut down.
        timeouts: The stage bounds.
        collect: Whether to hold the collect window (False once listeners have stopped).
        hurry: When done (a second signal), the remaining waits end at once.
    """
    registry = server.registry
    server.begin_shutdown()
    active = registry.active
    if active:
        logger.info("Draining %d in-flight rollout(s)", active)
        await _wait_first(registry.idle_future(), hurry, timeouts.drain_sec)
    requested: set[str] | None = None
    active = registry.active
    if active:
        # Taken before the shutdown's own cancellation records dispositions of its own.
        requested = _cancelled_by_request(registry)
        logger.info("Cancelling %d rollout(s) still running after the drain", active)
        loop = asyncio.get_running_loop()
        cleanup_end = loop.time() + timeouts.cleanup_sec
        # The backend's cancel_rollouts() counts against the cleanup bound: a backend that
        # hangs there cannot stall the shutdown (the request is left to finish on its own).
        cancelling = server.spawn(server.cancel_everything())
        await _wait_first(cancelling, hurry, timeouts.cleanup_sec)
        await _wait_first(registry.idle_future(), hurry, max(0.0, cleanup_end - loop.time()))
    active = registry.active
    if active:
        logger.warning(
            "Rollout shutdown: cleanup is unconfirmed for %d rollout(s) after the cleanup "
            "timeout; forcing cancellation.",
            active,
        )
        registry.force_cancel()
        await _wait_first(registry.idle_future(), hurry, timeouts.force_sec)
    abandoned_ids = registry.active_ids()
    if abandoned_ids:
        if hurry.done():
            logger.warning(
                "Shutdown waits cut short by a second signal; abandoning %d rollout "
                "execution(s) still running: %s",
                len(abandoned_ids),
                log_list(abandoned_ids, MAX_LOGGED_IDS),
            )
        else:
            logger.error(
                "%d rollout execution(s) ignored forced cancellation; abandoning them: %s",
                len(abandoned_ids),
                log_list(abandoned_ids, MAX_LOGGED_IDS),
            )
    await _shutdown_backend(server, timeouts.backend_sec, hurry)
    abandoned = registry.publish_unfinished(SHUTDOWN_ERR_MESSAGE)
    if abandoned:
        logger.warning("Published 'cancelled' for %d unfinished rollout(s)", abandoned)
    await registry.settled()  # results still being stored are published before collecting
    if collect and registry.undelivered:
        await _collect(server, timeouts.collect_sec, hurry, requested)
    await server.close()
    logger.info("Rollout server shutdown complete")


def _cancelled_by_request(registry: RolloutRegistry) -> set[str]:
    """The ids of held rollouts with a cancel disposition: until the shutdown's own
    cancellation runs, only ``POST /rollout/cancel`` records one (a lapsed lease publishes
    before it requests cancellation, so it records none)."""
    return {
        record.rollout_id
        for record in map(registry.get, registry.ids())
        if record is not None and record.disposition is not None
    }


async def _collect(
    server: ShutdownTarget,
    collect_sec: float,
    hurry: asyncio.Future[None],
    requested: set[str] | None,
) -> None:
    """Give pollers up to ``collect_sec`` to collect every result not yet delivered, except
    those of rollouts cancelled by request (``requested``; None: find them now)."""
    registry = server.registry
    if requested is None:
        requested = _cancelled_by_request(registry)
    undelivered = [
        record
        for record in map(registry.get, registry.ids())
        if record is not None and record.published and not record.delivered
    ]
    owed = [record for record in undelivered if record.rollout_id not in requested]
    waived = [record.rollout_id for record in undelivered if record.rollout_id in requested]
    if waived:
        logger.info(
            "Not waiting for %d result(s) of rollouts cancelled by request: %s",
            len(waived),
            log_list(waived, MAX_LOGGED_IDS),
        )
    if not owed:
        return
    logger.info("Waiting up to %.1fs for pollers to collect %d result(s)", collect_sec, len(owed))
    watched = server.deliveries.watch(owed, asyncio.get_running_loop())
    # The registry's own future also ends the window once every undelivered result is
    # gone (delivered, or removed when its retention elapsed).
    everything = registry.delivered_future()
    if not hurry.done() and collect_sec > 0:
        await asyncio.wait(
            (watched, everything, hurry), timeout=collect_sec, return_when=asyncio.FIRST_COMPLETED
        )


async def _shutdown_backend(
    server: ShutdownTarget, timeout: float, hurry: asyncio.Future[None]
) -> None:
    async def shutdown() -> None:
        await server.backend.shutdown()

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    task = asyncio.ensure_future(shutdown())
    await _wait_first(task, hurry, timeout)
    remaining = min(deadline - loop.time(), HURRIED_BACKEND_SHUTDOWN_SEC)
    if not task.done() and hurry.done() and remaining > 0:
        await asyncio.wait((task,), timeout=remaining)
    if not task.done():
        task.cancel()
        if hurry.done():
            logger.warning(
                "backend.shutdown() did not finish within %.1fs of the second signal; continuing",
                HURRIED_BACKEND_SHUTDOWN_SEC,
            )
        else:
            logger.error("backend.shutdown() did not finish within %.1fs; continuing", timeout)
        return
    exc = task.exception()
    if exc is not None:
        logger.error("backend.shutdown() failed; continuing", exc_info=exc)
