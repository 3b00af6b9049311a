"""The ``rollout-server`` command's logging: :func:`configure_logging` and its handler,
``TurnBufferedStreamHandler``.

A plain :class:`logging.StreamHandler` on stderr makes one ``write`` system call per record
(stderr is line-buffered), which at hundreds of rollouts per second is a sizeable share of
the event loop's time. This handler formats each record at once but, on an event-loop
thread, writes the records of one loop turn together at the end of the turn; elsewhere
(no running loop: start-up, worker threads, exit) it writes at once, after anything still
buffered, so lines keep their order.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Final, TextIO

from ..observability._jsonlog import JsonFormatter

__all__ = ["LOG_FORMAT", "TurnBufferedStreamHandler", "configure_logging"]

LOG_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The line format of ``--log-format text``."""


def configure_logging(level: str, log_format: str) -> None:
    """Log to stderr at ``level``, as ``text`` (:data:`LOG_FORMAT`) or ``json`` lines
    (:class:`~rollout_server.observability._jsonlog.JsonFormatter`), unless the root logger
    has handlers already (then only its level is set)."""
    if logging.getLogger().handlers:
        logging.getLogger().setLevel(level)
        return
    # One write per event-loop turn, not per line (a line per rollout at INFO).
    handler = TurnBufferedStreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])


# Speed: benchmarks/README.md, "Server: the `rollout-server serve` process", row "The log lines of
#   one loop turn written with one `write` ..."
class TurnBufferedStreamHandler(logging.StreamHandler[TextIO]):
    """A stream handler that writes once per event-loop turn.

    Args:
        stream: Where lines go (e.g. ``sys.stderr``).
    """

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self._lines: list[str] = []
        self._scheduled_on: asyncio.AbstractEventLoop | None = None

    def emit(self, record: logging.LogRecord) -> None:
        """Format ``record`` and buffer it for the end of the loop turn (or write it now)."""
        try:
            line = self.format(record) + self.terminator
        except Exception:  # noqa: BLE001 - logging never raises into the caller
            self.handleError(record)
            return
        loop = asyncio._get_running_loop()
        # Handler.handle() holds self.lock here.
        self._lines.append(line)
        if loop is None or loop.is_closed():
            self.flush()
            return
        if self._scheduled_on is not loop:
            try:
                loop.call_soon(self.flush)
            except RuntimeError:  # the loop is closing
                self.flush()
                return
            self._scheduled_on = loop

    def flush(self) -> None:
        """Write every buffered line and flush the stream."""
        with self.lock if self.lock is not None else _NO_LOCK:
            self._scheduled_on = None
            lines = self._lines
            if lines:
                self._lines = []
                try:
                    self.stream.write("".join(lines))
                except Exception:  # noqa: BLE001 - as StreamHandler: report, never raise
                    self.handleError(logging.makeLogRecord({"msg": "".join(lines)}))
                    return
            stream_flush = getattr(self.stream, "flush", None)
            if stream_flush is not None:
                stream_flush()


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_exc: object) -> None:
        return None


_NO_LOCK = _NoLock()
