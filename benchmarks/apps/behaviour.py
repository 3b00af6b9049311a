"""What the benchmark workflow does, shared by both stacks' apps (standard library only).

The workflow returns :data:`FIXED_MESSAGES` and the grader sets reward
:data:`FIXED_REWARD`. The request's ``metadata`` can make the workflow wait first:

- ``{"sleep_sec": s}``: sleep ``s`` seconds (the notification-latency workload).
- ``{"hold_sec": s}``: wait until the server process receives ``SIGUSR1``, at most ``s``
  seconds (the many-in-flight workload: every held rollout finishes at the same moment).

No metadata (None) means return at once.
"""

from __future__ import annotations

import asyncio
import math
import signal
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


class _Release:
    """One release event per event loop, set when :data:`RELEASE_SIGNAL` arrives."""

    loop: asyncio.AbstractEventLoop | None = None
    event: asyncio.Event | None = None

    @classmethod
    def current(cls) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if cls.loop is not loop or cls.event is None:
            cls.loop, cls.event = loop, asyncio.Event()
            loop.add_signal_handler(RELEASE_SIGNAL, cls.release)
        return cls.event

    @classmethod
    def release(cls) -> None:
        # Set the event the held rollouts wait on; later holds wait for the next signal.
        if cls.event is not None:
            cls.event.set()
        cls.event = asyncio.Event()


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
    sleep_sec = _seconds(metadata, "sleep_sec")
    if sleep_sec is not None:
        await asyncio.sleep(sleep_sec)
    hold_sec = _seconds(metadata, "hold_sec")
    if hold_sec is not None:
        event = _Release.current()
        try:
            await asyncio.wait_for(event.wait(), hold_sec)
        except TimeoutError:
            pass  # released by the bound instead: the latency figures will show it


def fixed_messages() -> list[dict[str, Any]]:
    """A fresh copy of :data:`FIXED_MESSAGES` (servers may mutate what they are given)."""
    return [dict(message) for message in FIXED_MESSAGES]
