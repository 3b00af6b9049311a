"""``ExecutionObserver``: where a backend reports how long each phase of a rollout took.

The server hands every :class:`~rollout_server.ExecutionRequest` an observer (its metrics,
or this class's no-op default when metrics are off); a backend calls it on the event loop
as each phase ends. The observer is defined here, beside the backend interface, so that
backend code reports timings without importing the server's protocol layer, and the
server's metrics (:mod:`rollout_server.protocol._metrics`) implement it.
"""

from __future__ import annotations

from typing import Final

__all__ = ["NO_OBSERVER", "ExecutionObserver"]


class ExecutionObserver:
    """Receives what a backend measured of a rollout's phases; this base ignores it all.

    Every method takes float seconds, is called on the server's event loop, must be cheap
    (it runs once per phase of every rollout) and never raises. A backend that has no such
    phase (no queue, no grader, no files) simply never reports it.

    .. versionadded:: 0.2
    """

    __slots__ = ()

    def observe_queue_wait(self, seconds: float) -> None:
        """A rollout stopped waiting for an execution slot (it got one, its deadline passed
        or it was cancelled): ``seconds`` since admission."""

    def observe_workflow(self, seconds: float) -> None:
        """A rollout's workflow ended (returned, failed, timed out or was cancelled)."""

    def observe_grading(self, seconds: float) -> None:
        """A rollout's grader ended (returned, failed, timed out or was cancelled)."""

    def observe_trajectory_write(self, seconds: float, *, failed: bool) -> None:
        """A rollout's trajectory write ended; ``failed`` when the file was not written."""


NO_OBSERVER: Final = ExecutionObserver()
"""The observer of a request the server does not measure (metrics off, or a request built
by hand): every report is dropped."""
