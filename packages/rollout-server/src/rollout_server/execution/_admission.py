"""Admission bookkeeping shared by the backends that own their slots (LocalBackend,
RayBackend): reservations of admitted rollouts, the ``max_queued`` bound, and the
load-based Retry-After from a moving mean of how long a rollout holds its slot."""

from __future__ import annotations

from typing import Final

__all__ = ["DEFAULT_ROLLOUT_DURATION_SEC", "DURATION_EMA_WEIGHT", "SlotAdmission"]

DEFAULT_ROLLOUT_DURATION_SEC: Final = 5.0
"""Assumed slot-holding time of one rollout until one has finished (for Retry-After)."""

DURATION_EMA_WEIGHT: Final = 0.2
"""Weight of the newest rollout in the moving mean of slot-holding time."""


class SlotAdmission:
    """Whether one more rollout may be admitted to ``slots`` slots, and when to retry.

    The backend says how many rollouts it holds (running or waiting for a slot) and how
    many slots it has; this class adds the rollouts admitted but not started yet
    (:meth:`try_reserve` until :meth:`release_reservation`).

    Args:
        max_queued: The most rollouts that may wait beyond the slots, or None for no bound
            (validated by the backend).
    """

    __slots__ = ("_mean_duration_sec", "max_queued", "reserved")

    def __init__(self, max_queued: int | None) -> None:
        self.max_queued = max_queued
        self.reserved = 0
        self._mean_duration_sec: float | None = None

    def has_capacity(self, holding: int, slots: int | None) -> bool:
        """False only when ``holding`` plus the reserved rollouts fill ``slots`` and
        ``max_queued`` (``slots`` is not None whenever ``max_queued`` is set)."""
        if self.max_queued is None:
            return True
        assert slots is not None  # max_queued needs a limit
        return holding + self.reserved < slots + self.max_queued

    def try_reserve(self, holding: int, slots: int | None) -> bool:
        """Count one admitted rollout until it starts, if :meth:`has_capacity` allows it."""
        if not self.has_capacity(holding, slots):
            return False
        self.reserved += 1
        return True

    def release_reservation(self) -> None:
        """The reserved rollout starts now (it takes its slot or its queue place at once)."""
        if self.reserved > 0:
            self.reserved -= 1

    def observe_duration(self, seconds: float) -> None:
        """Fold how long a finished rollout held its slot into the moving mean."""
        if self._mean_duration_sec is None:
            self._mean_duration_sec = seconds
        else:
            self._mean_duration_sec += DURATION_EMA_WEIGHT * (seconds - self._mean_duration_sec)

    def retry_after_sec(self, queued: int, slots: int | None) -> float:
        """``(queued + reserved + 1) * mean_duration / slots``, clamped to [1, 60] s;
        ``mean_duration`` is 5 s until a rollout has finished; 1 s without a limit."""
        if slots is None:
            return 1.0
        mean = (
            DEFAULT_ROLLOUT_DURATION_SEC
            if self._mean_duration_sec is None
            else self._mean_duration_sec
        )
        return min(60.0, max(1.0, (queued + self.reserved + 1) * mean / slots))
