"""Progress display: one ANSI line redrawn in place on a terminal, periodic lines otherwise.

Both forms show completed/total, pass rate, failures, infrastructure failures, the rate
of completions in this invocation and the estimated time left, e.g.::

    [##########..........] 25/50  pass 80.0%  failed 3  infra 0  12.5/s  ETA 2s

The bar never exceeds the terminal's width (a line that wraps cannot be redrawn in place):
on a narrow terminal the bar shrinks, then goes, then the rate, the infrastructure and
failure counts, the ETA and the pass rate go, in that order.

Every other line written while the bar is shown goes through :meth:`Progress.message`,
which clears the bar and redraws it below the line; :class:`ProgressLogHandler` sends log
records (the client's retry warnings, the pool's servers leaving or rejoining the
rotation) the same way, as ``rollout-eval: LEVEL logger: message``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Final, TextIO

from rollout_types import check_seconds

__all__ = [
    "PROGRESS_MODES",
    "Progress",
    "ProgressLogHandler",
    "format_duration",
    "routed_logging",
    "terminal_columns",
]

PROGRESS_MODES: Final = ("auto", "bar", "plain", "off")
"""``--progress`` values: ``auto`` picks ``bar`` on a terminal and ``plain`` otherwise."""

LOG_FORMAT: Final = "rollout-eval: %(levelname)s %(name)s: %(message)s"
"""How :class:`ProgressLogHandler` writes a log record."""

_CLEAR_LINE: Final = "\r\x1b[2K"
_BAR_WIDTH: Final = 20
_MIN_BAR_WIDTH: Final = 10
_DROP_ORDER: Final = ("rate", "infra", "failed", "eta", "pass")
"""The fields a narrow terminal loses, first to last (after the bar)."""


def terminal_columns(stream: TextIO) -> int:
    """The width of the terminal ``stream`` writes to; when it is none, ``$COLUMNS``, else
    the width of standard output's terminal, else 80."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return shutil.get_terminal_size().columns


def format_duration(seconds: float) -> str:
    """``75`` -> ``"1m15s"``; ``3725`` -> ``"1h02m"``; under a minute -> ``"42s"``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """Counts outcomes and shows them; writes only to ``stream`` (normally stderr).

    Args:
        total: Items in the run (including those done before a resume).
        stream: Where to write.
        mode: ``bar``, ``plain`` or ``off`` (resolve ``auto`` with :meth:`resolve_mode`).
        interval_sec: Seconds between plain lines (default 10.0); the bar redraws at
            most every 0.1 s.
        clock: Monotonic clock (injectable for tests).
        columns: The terminal's width, asked at every redraw (default: that of
            ``stream``'s terminal, see :func:`terminal_columns`).
    """

    def __init__(
        self,
        *,
        total: int,
        stream: TextIO,
        mode: str,
        interval_sec: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        columns: Callable[[], int] | None = None,
    ) -> None:
        if mode not in ("bar", "plain", "off"):
            raise ValueError(f"mode must be 'bar', 'plain' or 'off', not {mode!r}")
        check_seconds("interval_sec", interval_sec)
        self.total = total
        self.stream = stream
        self.mode = mode
        self.interval_sec = interval_sec
        self._clock = clock
        self._columns = columns or (lambda: terminal_columns(stream))
        self._started = clock()
        self._last_draw = -math.inf
        self._drawn = False
        self.done = 0
        self.passed = 0
        self.scored = 0
        self.failed = 0
        self.infra = 0
        self.new = 0

    @staticmethod
    def resolve_mode(mode: str, stream: TextIO) -> str:
        """Turn ``auto`` into ``bar`` when ``stream`` is a terminal, else ``plain``."""
        if mode != "auto":
            return mode
        isatty = getattr(stream, "isatty", None)
        return "bar" if isatty is not None and isatty() else "plain"

    def preload(self, *, done: int, passed: int, scored: int, failed: int) -> None:
        """Count the items finished before this invocation (a resumed run)."""
        self.done += done
        self.passed += passed
        self.scored += scored
        self.failed += failed

    def record(self, outcome: str, *, passed: bool = False) -> None:
        """Count one outcome of this invocation and redraw when due."""
        if outcome == "infra_failure":
            self.infra += 1
        else:
            self.done += 1
            self.new += 1
            if outcome in ("success", "failed"):
                self.scored += 1
                self.passed += passed
            if outcome == "failed":
                self.failed += 1
        self.draw()

    def line(self) -> str:
        """The current progress text: the bar fitted to the terminal in bar mode, else a
        plain line."""
        elapsed = self._clock() - self._started
        rate = self.new / elapsed if elapsed > 0 else 0.0
        remaining = self.total - self.done
        pass_text = f"{self.passed / self.scored * 100:.1f}%" if self.scored else "-"
        eta = format_duration(remaining / rate) if rate > 0 and remaining > 0 else "-"
        fields = self._fields(
            done=self.done,
            percent=pass_text,
            failed=self.failed,
            infra=self.infra,
            rate=rate,
            eta=eta,
        )
        if self.mode != "bar":
            return "rollout-eval: " + "  ".join(fields.values())
        width = self._columns() - 1  # writing the last column would wrap on some terminals
        bar_width, kept = self._layout(width)
        text = "  ".join(fields[name] for name in kept)
        if bar_width:
            filled = bar_width * self.done // self.total if self.total else bar_width
            text = f"[{'#' * filled}{'.' * (bar_width - filled)}] {text}"
        return text[: max(width, 1)]

    def _fields(
        self, *, done: int, percent: str, failed: int, infra: int, rate: float, eta: str
    ) -> dict[str, str]:
        return {
            "count": f"{done}/{self.total}",
            "pass": f"pass {percent}",
            "failed": f"failed {failed}",
            "infra": f"infra {infra}",
            "rate": f"{rate:.1f}/s",
            "eta": f"ETA {eta}",
        }

    def _layout(self, width: int) -> tuple[int, tuple[str, ...]]:
        """The bar's width (0: no bar) and the fields shown on a ``width``-column line.

        Chosen for the widest line this run can have (every count at the total, a
        three-digit rate, an ETA of minutes), so the layout does not change as the numbers
        do; see the module docstring for what goes first.
        """
        total = self.total
        widest = self._fields(
            done=total, percent="100.0%", failed=total, infra=total, rate=999.9, eta="59m59s"
        )
        text = "  ".join(widest.values())
        bar_width = min(_BAR_WIDTH, width - len(text) - 3)  # "[", "] "
        if bar_width >= _MIN_BAR_WIDTH:
            return bar_width, tuple(widest)
        for name in _DROP_ORDER:
            if len(text) <= width:
                break
            del widest[name]
            text = "  ".join(widest.values())
        return 0, tuple(widest)

    def draw(self, *, force: bool = False) -> None:
        """Redraw the bar (throttled to 10/s) or print a plain line (every interval)."""
        if self.mode == "off":
            return
        now = self._clock()
        due = 0.1 if self.mode == "bar" else self.interval_sec
        if not force and now - self._last_draw < due:
            return
        self._last_draw = now
        if self.mode == "bar":
            self.stream.write(_CLEAR_LINE + self.line())
            self._drawn = True
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """Print a message line without garbling the bar (the bar is redrawn after it)."""
        if self.mode == "bar" and self._drawn:
            self.stream.write(_CLEAR_LINE)
        self.stream.write(text + "\n")
        if self.mode == "bar" and self._drawn:
            self.stream.write(self.line())
        self.stream.flush()

    def close(self) -> None:
        """Draw the final state and end the line."""
        if self.mode == "off":
            return
        self.draw(force=True)
        if self.mode == "bar":
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


class ProgressLogHandler(logging.Handler):
    """Writes log records as ``rollout-eval: LEVEL logger: message`` lines through the run's
    :class:`Progress` (clearing its bar and redrawing it below the line), or straight to
    ``stream`` while no progress is shown.

    Args:
        stream: Where lines go while :attr:`progress` is None.
        level: The least severe level written (default WARNING, as Python's last-resort
            handler).

    Attributes:
        progress: The progress display that lines go through, or None.
    """

    def __init__(self, stream: TextIO, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.stream = stream
        self.progress: Progress | None = None
        self.setFormatter(logging.Formatter(LOG_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        """Write one record as one line."""
        try:
            text = self.format(record)
            if self.progress is not None:
                self.progress.message(text)
            else:
                self.stream.write(text + "\n")
                self.stream.flush()
        except Exception:  # noqa: BLE001 - logging's contract: report, never raise
            self.handleError(record)


@contextlib.contextmanager
def routed_logging(stream: TextIO) -> Iterator[ProgressLogHandler | None]:
    """While the block runs, route the log records of a process that has not configured
    logging (no handler on the root logger) through a :class:`ProgressLogHandler` on
    ``stream``; yields it, or None when logging is configured (it is then left alone).

    Every logger's records reach it (the client's and the pool's ``rollout_client``, and
    any library's), WARNING and worse. Inside a block that routes already (the CLI routes
    around a whole command: probes, the run, the report) the outer handler is shared and
    yielded; the :attr:`~ProgressLogHandler.progress` the inner block sets is undone when
    it ends.
    """
    root = logging.getLogger()
    for handler in root.handlers:
        if isinstance(handler, ProgressLogHandler):
            progress = handler.progress
            try:
                yield handler
            finally:
                handler.progress = progress
            return
    if root.handlers:
        yield None
        return
    handler = ProgressLogHandler(stream)
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
