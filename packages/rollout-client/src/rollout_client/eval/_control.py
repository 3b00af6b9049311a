"""How a run is stopped early: :class:`RunControl`, shared by the caller, the recorder (its
stop rule) and the scheduler (which stops starting rollouts, and cancels the in-flight ones
or collects them)."""

from __future__ import annotations

import asyncio

__all__ = ["RunControl"]


class RunControl:
    """Lets the caller stop a run: :meth:`request_stop` is what the first Ctrl-C does.

    Attributes:
        stop: Set once the run starts no new rollouts (after a stop or a drain).
        cancel: Set once the in-flight rollouts are to be cancelled too (a stop).
        reason: Why the run stops, or None.
        interrupted: Whether the stop was an interruption (Ctrl-C, SIGTERM).
    """

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.cancel = asyncio.Event()
        self.reason: str | None = None
        self.interrupted = False

    @property
    def draining(self) -> bool:
        """Whether the run starts no new rollouts but collects the in-flight ones."""
        return self.stop.is_set() and not self.cancel.is_set()

    def request_stop(self, reason: str, *, interrupted: bool = False) -> None:
        """Stop starting rollouts and cancel the in-flight ones.

        The first stop's reason is kept; a stop during a drain replaces the drain's reason,
        since it is why the rollouts being collected were cancelled.
        """
        if self.cancel.is_set():
            return
        self.reason = reason
        self.interrupted = interrupted
        self.stop.set()
        self.cancel.set()

    def request_drain(self, reason: str) -> None:
        """Stop starting rollouts but let the in-flight ones finish and be recorded (the
        server is shutting down and still serves their results); no effect once stopping.

        .. versionadded:: 0.2
        """
        if self.stop.is_set():
            return
        self.reason = reason
        self.stop.set()
