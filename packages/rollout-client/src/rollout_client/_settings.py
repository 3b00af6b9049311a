"""The client's timings and retry settings, gathered in one frozen object.

:data:`DEFAULT_SETTINGS` holds the protocol's values. ``RolloutClient(retry=...)`` replaces
the retry schedules; :func:`rollout_client.testing.override_timing` replaces the sleep,
the clock and the bounds tests shorten.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Final

import aiohttp
import attrs

from ._retry import DEFAULT_RETRY, RetrySettings

__all__ = [
    "ADMISSION_READ_TIMEOUT_SEC",
    "CANCEL_TIMEOUT_SEC",
    "CONNECT_TIMEOUT_SEC",
    "DEFAULT_SETTINGS",
    "HEALTH_TIMEOUT_SEC",
    "RESULT_READ_GRACE_SEC",
    "UNKNOWN_STATUS_REPOLL_SEC",
    "ClientSettings",
    "settings_with",
]

RESULT_READ_GRACE_SEC: Final = 10.0
"""Added to the server's ``result_wait_timeout_sec`` to get a result poll's read timeout."""

CONNECT_TIMEOUT_SEC: Final = 10.0
"""Bound on opening one TCP connection (``sock_connect``), seconds."""

ADMISSION_READ_TIMEOUT_SEC: Final = 30.0
"""Bound on reading each chunk of the ``POST /rollout`` answer (``sock_read``), seconds.

The server answers admission at once; ``admission_timeout_sec`` bounds admission as a whole.
"""

HEALTH_TIMEOUT_SEC: Final = 10.0
"""Bound on one ``GET /health`` exchange, pool wait and connect included, seconds."""

CANCEL_TIMEOUT_SEC: Final = 5.0
"""Wall-clock bound on :meth:`RolloutClient.cancel_rollout`, pool wait included, seconds."""

UNKNOWN_STATUS_REPOLL_SEC: Final = 1.0
"""Longest pause before re-polling a rollout that twice reported a status this client does
not know (a newer server's status might be terminal and answer at once)."""


async def _real_sleep(delay_sec: float) -> None:
    await asyncio.sleep(delay_sec)


@attrs.frozen(kw_only=True)
class ClientSettings:
    """Timings (float seconds) and retry schedules one :class:`RolloutClient` uses."""

    retry: RetrySettings = DEFAULT_RETRY
    result_read_grace_sec: float = RESULT_READ_GRACE_SEC
    connect_timeout_sec: float = CONNECT_TIMEOUT_SEC
    admission_read_timeout_sec: float = ADMISSION_READ_TIMEOUT_SEC
    health_timeout_sec: float = HEALTH_TIMEOUT_SEC
    cancel_timeout_sec: float = CANCEL_TIMEOUT_SEC
    unknown_status_repoll_sec: float = UNKNOWN_STATUS_REPOLL_SEC
    sleep: Callable[[float], Awaitable[None]] = _real_sleep
    """Backoff sleeps (retries, 429s, ``wait_idle`` intervals)."""
    clock: Callable[[], float] = time.monotonic
    """The clock of lease deadlines; must agree with ``sleep``."""

    # Speed: benchmarks/README.md, "Client", row "One session for every request of a client ..."
    def timeout(self, *, read_sec: float, pool_sec: float) -> aiohttp.ClientTimeout:
        """A request's aiohttp bounds: connect, pool wait plus connect, and each read."""
        connect = self.connect_timeout_sec
        return aiohttp.ClientTimeout(
            total=None, connect=max(pool_sec, connect), sock_connect=connect, sock_read=read_sec
        )


DEFAULT_SETTINGS: Final = ClientSettings()
"""The protocol's timings and schedules."""


def settings_with(retry: RetrySettings | None) -> ClientSettings:
    """The protocol's timings with ``retry``'s schedules (None: the protocol's too).

    Raises:
        TypeError: ``retry`` is not a :class:`RetrySettings` or None.
    """
    given: object = retry
    if given is not None and not isinstance(given, RetrySettings):
        raise TypeError(
            f"retry must be a rollout_client.RetrySettings or None; got {type(given).__name__}"
        )
    return DEFAULT_SETTINGS if retry is None else attrs.evolve(DEFAULT_SETTINGS, retry=retry)
