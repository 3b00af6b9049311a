"""What the benchmark workflow does, shared by both stacks' apps (standard library only).

The workflow returns :data:`FIXED_MESSAGES` and the grader sets reward
:data:`FIXED_REWARD`. The request's ``metadata`` can make the workflow wait first:

- ``{"sleep_sec": s}``: sleep ``s`` seconds (the notification-latency workload).
- ``{"hold_sec": s}``: wait until the server process receives ``SIGUSR1`` (the
  many-in-flight workload: every held rollout finishes at the same moment), at most ``s``
  seconds after the first rollout of that release began to wait. The bound is one timer per
  release, not one per rollout, so a held rollout costs both stacks no more than a waiter
  on one shared event.

- ``{"memory_report": path}``: write the largest allocation sites of the server process to
  ``path`` (only when the server runs with ``ROLLOUT_BENCH_TRACEMALLOC=1``, which starts
  :mod:`tracemalloc` at import; a diagnostic for RSS per in-flight rollout, never used by the
  suite's measured runs).

No metadata (None) means return at once.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import tracemalloc
from pathlib import Path
from typing import Any, Final

__all__ = [
    "FIXED_MESSAGES",
    "FIXED_REWARD",
    "HOLD_LIMIT_SEC",
    "RELEASE_SIGNAL",
    "fixed_messages",
    "install_release_guard",
    "wait_as_told",
]

FIXED_MESSAGES: Final = (
    {"role": "user", "content": "What is 6 * 7?"},
    {"role": "assistant", "content": "42"},
)
"""The conversation every benchmark rollout returns."""

FIXED_REWARD: Final = 1.0
"""The reward the benchmark grader gives every rollout."""

RELEASE_SIGNAL: Final = signal.SIGUSR1
"""The signal that releases every held rollout of the server process at once."""

HOLD_LIMIT_SEC: Final = 600.0
"""Longest ``hold_sec`` honoured: a lost release signal cannot hold a rollout forever."""

TRACEMALLOC_ENV: Final = "ROLLOUT_BENCH_TRACEMALLOC"
"""Set to 1 to trace allocations in the server (for ``memory_report``)."""

if os.environ.get(TRACEMALLOC_ENV) == "1" and not tracemalloc.is_tracing():
    tracemalloc.start(1)


class _Release:
    """One release event per event loop, set when :data:`RELEASE_SIGNAL` arrives or when
    the bound armed by the release's first hold runs out."""

    loop: asyncio.AbstractEventLoop | None = None
    event: asyncio.Event | None = None
    bound: asyncio.TimerHandle | None = None

    @classmethod
    def current(cls, bound_sec: float) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if cls.loop is not loop or cls.event is None:
            cls.loop, cls.event, cls.bound = loop, asyncio.Event(), None
            loop.add_signal_handler(RELEASE_SIGNAL, cls.release)
        if cls.bound is None:
            cls.bound = loop.call_later(bound_sec, cls.release)
        return cls.event

    @classmethod
    def release(cls) -> None:
        # Set the event the held rollouts wait on; later holds wait for the next release.
        if cls.event is not None:
            cls.event.set()
        if cls.bound is not None:
            cls.bound.cancel()
        cls.event, cls.bound = asyncio.Event(), None


def install_release_guard() -> None:
    """Ignore :data:`RELEASE_SIGNAL` until the first held rollout installs its handler.

    Without this, a release signal that arrives before any rollout waits would kill the
    server (the default action of ``SIGUSR1``).
    """
    signal.signal(RELEASE_SIGNAL, signal.SIG_IGN)


def _seconds(metadata: dict[str, Any], key: str) -> float | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"metadata[{key!r}] must be a finite number of seconds; got {value!r}")
    return min(max(float(value), 0.0), HOLD_LIMIT_SEC)


async def wait_as_told(metadata: dict[str, Any] | None) -> None:
    """Sleep or hold as the request's ``metadata`` says (see the module docstring).

    Raises:
        ValueError: When ``sleep_sec`` or ``hold_sec`` is not a finite number.
    """
    if not metadata:
        return
    report = metadata.get("memory_report")
    if isinstance(report, str) and tracemalloc.is_tracing():
        _write_memory_report(Path(report))
    sleep_sec = _seconds(metadata, "sleep_sec")
    if sleep_sec is not None:
        await asyncio.sleep(sleep_sec)
    hold_sec = _seconds(metadata, "hold_sec")
    if hold_sec is not None:
        # Released by the bound instead of the signal: the latency figures will show it.
        await _Release.current(hold_sec).wait()


def _write_memory_report(path: Path, top: int = 40) -> None:
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    total = sum(stat.size for stat in snapshot.statistics("filename"))
    lines = [f"traced: {total / 1024:.0f} KiB", "", "by line:"]
    lines += [str(stat) for stat in snapshot.statistics("lineno")[:top]]
    lines += ["", "by file:"]
    lines += [str(stat) for stat in snapshot.statistics("filename")[:top]]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def fixed_messages() -> list[dict[str, Any]]:
    """A fresh copy of :data:`FIXED_MESSAGES` (servers may mutate what they are given)."""
    return [dict(message) for message in FIXED_MESSAGES]
