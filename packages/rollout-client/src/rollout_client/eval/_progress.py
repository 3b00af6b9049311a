"""Progress display: one ANSI line redrawn in place on a terminal, periodic lines otherwise.

Both forms show completed/total, pass rate, failures, infrastructure failures, the rate
of completions in this invocation and the estimated time left, e.g.::

    [##########..........] 25/50  pass 80.0%  failed 3  infra 0  12.5/s  ETA 2s
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Final, TextIO

from rollout_types import check_seconds

__all__ = ["PROGRESS_MODES", "Progress", "format_duration"]

PROGRESS_MODES: Final = ("auto", "bar", "plain", "off")
"""``--progress`` values: ``auto`` picks ``bar`` on a terminal and ``plain`` otherwise."""

_CLEAR_LINE: Final = "\r\x1b[2K"
_BAR_WIDTH: Final = 20


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
    """

    def __init__(
        self,
        *,
        total: int,
        stream: TextIO,
        mode: str,
        interval_sec: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in ("bar", "plain", "off"):
            raise ValueError(f"mode must be 'bar', 'plain' or 'off', not {mode!r}")
        check_seconds("interval_sec", interval_sec)
        self.total = total
        self.stream = stream
        self.mode = mode
        self.interval_sec = interval_sec
        self._clock = clock
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
        """The current progress text (without bar decoration for plain mode)."""
        elapsed = self._clock() - self._started
        rate = self.new / elapsed if elapsed > 0 else 0.0
        remaining = self.total - self.done
        pass_text = f"{self.passed / self.scored * 100:.1f}%" if self.scored else "-"
        eta = format_duration(remaining / rate) if rate > 0 and remaining > 0 else "-"
        text = (
            f"{self.done}/{self.total}  pass {pass_text}  failed {self.failed}  "
            f"infra {self.infra}  {rate:.1f}/s  ETA {eta}"
        )
        if self.mode == "bar":
            filled = _BAR_WIDTH * self.done // self.total if self.total else _BAR_WIDTH
            return f"[{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {text}"
        return f"rollout-eval: {text}"

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
