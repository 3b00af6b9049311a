"""What :class:`~rollout_server.LocalBackend` and :class:`~rollout_server.RayBackend` share:
a backend whose rollouts each hold one of a bounded number of slots.

:class:`SlotBackend` holds the admission side (``max_queued``, reservations and the
load-based Retry-After of :class:`~rollout_server.execution._admission.SlotAdmission`, the
``concurrency`` entry of ``/health``) and the wait for a slot within the agent deadline
(:meth:`SlotBackend._queue_for_slot`). A subclass says where its slots are: how many
rollouts hold or wait for one, how to take one at once, and how to wait for one.
"""

from __future__ import annotations

import abc
import asyncio
import time
from typing import Any, ClassVar, Generic, TypeVar

from rollout_types import RolloutStatus

from ..observability import _tracing
from ._admission import SlotAdmission
from ._backend import AdmissionMode, ExecutionBackend
from ._phases import RolloutRun

__all__ = ["SlotBackend", "check_max_queued"]

SlotT = TypeVar("SlotT")
"""What holds a slot: a worker of RayBackend's pool, True for LocalBackend's limiter."""


def check_max_queued(max_queued: object, slots: int | None) -> None:
    """Refuse a ``max_queued`` that is not an int >= 0 or None, or one without a slot
    limit (``slots`` None: nothing ever queues).

    Raises:
        ValueError: Saying which and why.
    """
    if max_queued is not None and (
        not isinstance(max_queued, int) or isinstance(max_queued, bool) or max_queued < 0
    ):
        raise ValueError(
            f"max_queued must be an int >= 0, or None to queue without bound; got {max_queued!r}"
        )
    if slots is None and max_queued is not None:
        raise ValueError(
            f"max_queued={max_queued} needs a concurrency limit, but the workflow config "
            "has concurrency.max_concurrent=None (no limit, so nothing ever queues): set "
            "max_concurrent, or drop max_queued"
        )


class SlotBackend(ExecutionBackend, Generic[SlotT]):
    """A backend whose rollouts each hold a slot, and wait for one in arrival order.

    It reports ``queued``/``running`` itself and counts its reservations
    (``admission_mode = "reservations"``). Subclasses implement the slot hooks below.

    Args:
        slots: All the backend's slots, or None for no limit.
        max_queued: The most rollouts that may wait for a slot, or None for no bound.

    Raises:
        ValueError: From :func:`check_max_queued`.
    """

    reports_queue_status: ClassVar[bool] = True
    admission_mode: ClassVar[AdmissionMode] = "reservations"

    def __init__(self, *, slots: int | None, max_queued: int | None) -> None:
        check_max_queued(max_queued, slots)
        self._admission = SlotAdmission(max_queued)
        self._slot_total = slots

    # -- the slots, as the subclass has them ---------------------------------------------

    @abc.abstractmethod
    def _load(self) -> tuple[int, int]:
        """Rollouts holding a slot, and rollouts waiting for one, now."""

    def _live_slots(self) -> int | None:
        """Slots that take rollouts now (None: no limit); default all of them."""
        return self._slot_total

    @abc.abstractmethod
    def _take_slot(self) -> SlotT | None:
        """A slot now, or None when none is free or others wait already."""

    @abc.abstractmethod
    async def _wait_for_slot(self, deadline: float | None) -> SlotT | None:
        """Wait in arrival order for a slot; None once ``loop.time()`` passes ``deadline``
        (no slot is held then, nor after a cancellation)."""

    # -- admission -----------------------------------------------------------------------

    @property
    def max_queued(self) -> int | None:
        """The bound on waiting rollouts, or None."""
        return self._admission.max_queued

    def has_capacity(self) -> bool:
        """False only when ``max_queued`` rollouts wait beyond the slots that take rollouts
        now, counting admitted rollouts that have not started yet (reserved by
        :meth:`try_reserve`)."""
        running, queued = self._load()
        return self._admission.has_capacity(running + queued, self._live_slots())

    def try_reserve(self) -> bool:
        """Count one admitted rollout until it starts, if :meth:`has_capacity` allows it."""
        running, queued = self._load()
        return self._admission.try_reserve(running + queued, self._live_slots())

    def release_reservation(self) -> None:
        """The reserved rollout starts now (it takes its slot or its queue place at once)."""
        self._admission.release_reservation()

    def retry_after_sec(self) -> float:
        """How long a refused caller should wait: until the rollouts queued ahead of it
        would have drained.

        ``(queued + reserved + 1) * mean_duration / slots``, clamped to [1, 60] s, where
        ``slots`` counts all the backend's slots and ``mean_duration`` is a moving mean
        (weight 0.2 for the newest) of how long finished rollouts held their slot, 5 s
        until one has finished. 1 s without a limit (which never refuses). The server
        rounds it up to whole seconds.
        """
        return self._admission.retry_after_sec(self._load()[1], self._slot_total)

    def _concurrency(self) -> dict[str, Any]:
        """``/health``'s ``concurrency``: ``max_concurrent`` (all the slots, None without
        a limit), ``queued``, ``running`` and ``max_queued``."""
        running, queued = self._load()
        return {
            "max_concurrent": self._slot_total,
            "queued": queued,
            "running": running,
            "max_queued": self._admission.max_queued,
        }

    # -- execution -----------------------------------------------------------------------

    async def _queue_for_slot(self, run: RolloutRun) -> SlotT | None:
        """Take a slot, or wait for one (status ``queued``) within what is left of the
        agent deadline; None when that deadline passed first (no slot is held then).

        The wait is the ``queue`` span; its time goes to ``run.queued_sec`` and to the
        request's observer (cancelled or not). A budget already spent takes no slot.
        """
        request = run.request
        timeout = request.agent_timeout_sec
        with _tracing.phase_span("queue", request.id):
            try:
                if timeout is not None and timeout - (time.monotonic() - run.entered) <= 0:
                    return None
                slot = self._take_slot()
                if slot is not None:
                    return slot
                request.on_status(RolloutStatus.QUEUED)
                loop = asyncio.get_running_loop()
                # The agent deadline on the loop's clock (time.monotonic() for asyncio and
                # uvloop, but not necessarily for every loop).
                deadline = (
                    None
                    if timeout is None
                    else loop.time() + (run.entered + timeout - time.monotonic())
                )
                return await self._wait_for_slot(deadline)
            finally:
                run.queued_sec = time.monotonic() - run.entered
                request.observer.observe_queue_wait(run.queued_sec)

    def _slot_held_for(self, seconds: float) -> None:
        """A rollout that finished held its slot ``seconds`` (for Retry-After)."""
        self._admission.observe_duration(seconds)
