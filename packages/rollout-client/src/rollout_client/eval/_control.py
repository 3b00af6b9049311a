"""How a run is stopped early: :class:`RunControl`, shared by the caller, the recorder (its
stop rule) and the scheduler (which stops starting rollouts and cancels the in-flight ones)."""

from __future__ import annotations

import asyncio

__all__ = ["RunControl"]


class RunControl:
    """Lets the caller stop a run: :meth:`request_stop` is what the first Ctrl-C does."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.reason: str | None = None
        self.interrupted = False

    def request_stop(self, reason: str, *, interrupted: bool = False) -> None:
        """Stop starting rollouts, cancel the in-flight ones; the first reason is kept."""
        if not self.stop.is_set():
            self.reason = reason
            self.interrupted = interrupted
            self.stop.set()
