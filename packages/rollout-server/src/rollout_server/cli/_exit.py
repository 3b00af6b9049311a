"""How the ``rollout-server`` process ends, whatever user code does: the exit guard that
bounds the exit from the first signal on, the immediate exit, and the last cancellation of
tasks still running after the shutdown.

The process exits within the shutdown's stage bounds: tasks that ignore cancellation after
the last stage are abandoned (their rollout ids logged once by the shutdown) and the process
exits without waiting for them; should the exit itself hang (a thread of user code that never
returns, a blocked event loop), the process exits 0 once the sum of the stage bounds plus
:data:`EXIT_SLACK_SEC` has passed since the first signal (:data:`EXIT_SLACK_SEC` after a
second one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from types import FrameType
from typing import Any, Final

from .._logtext import get_logger

__all__ = [
    "EXIT_SLACK_SEC",
    "LEFTOVER_TASK_GRACE_SEC",
    "ExitGuard",
    "end_leftover_tasks",
    "exit_now",
]

logger: Final = get_logger("rollout_server.cli")

EXIT_SLACK_SEC: Final = 15.0
"""Time allowed, on top of the shutdown's stage bounds, for what follows the stages (the
listeners closing, in-flight requests answering, tasks ignoring cancellation getting a
last chance); past it the process exits 0 anyway (see the module docstring)."""

LEFTOVER_TASK_GRACE_SEC: Final = 1.0
"""After the shutdown, how long tasks still running (user code's own tasks, executions that
ignored every cancellation) get to end once cancelled before the process exits without
them."""


class ExitGuard:
    """Bounds the command's exit, whatever user code does (see the module docstring).

    From the first signal on, a daemon timer ends the process with status 0 once the
    shutdown has had its stage bounds plus :data:`EXIT_SLACK_SEC`; a further signal moves
    that to :data:`EXIT_SLACK_SEC` from then. Once a shutdown has begun or serving is over,
    a signal that reaches the guard's handler (:meth:`install`;
    :func:`~rollout_server.cli._serve.serve` hands the signals back to it when it stops
    listening) exits at once.
    """

    def __init__(self) -> None:
        self.bound_sec = EXIT_SLACK_SEC
        self._timer: threading.Timer | None = None
        self._signals = 0
        self._serving_over = False

    def install(self) -> None:
        """Handle SIGTERM and SIGINT before serving; until a shutdown begins, they keep their
        default action (SIGTERM ends the process, SIGINT raises KeyboardInterrupt)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, OSError):  # not the main thread
                signal.signal(signum, self._handle)

    def on_signal(self, _signum: int) -> None:
        """Called for each SIGTERM/SIGINT while serving (the drain handles the signal)."""
        self._signals += 1
        self._arm(self.bound_sec if self._signals == 1 else EXIT_SLACK_SEC)

    def after_serving(self) -> None:
        """From now on, a SIGTERM or SIGINT ends the process at once, with status 0."""
        self._serving_over = True

    def disarm(self) -> None:
        """The exit went as planned: stop the timer."""
        if self._timer is not None:
            self._timer.cancel()

    def _arm(self, seconds: float) -> None:
        self.disarm()
        message = f"Shutdown still not over {seconds:g} s after the signal; exiting now"
        self._timer = threading.Timer(seconds, exit_now, args=(0, message))
        self._timer.daemon = True
        self._timer.start()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._serving_over or self._signals:
            exit_now(0, f"Received {signal.Signals(signum).name} again: exiting now")
        if signum == signal.SIGINT:
            signal.default_int_handler(signum, frame)
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


def exit_now(status: int, message: str) -> None:
    """Log ``message``, flush the logs and end the process with ``status``, without waiting
    for threads or tasks of user code."""
    logger.warning("%s", message)
    logging.shutdown()
    os._exit(status)


async def end_leftover_tasks(grace_sec: float) -> list[asyncio.Task[Any]]:
    """Cancel every task but this one, wait up to ``grace_sec``; return those still running."""
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=grace_sec)
    return [task for task in tasks if not task.done()]
