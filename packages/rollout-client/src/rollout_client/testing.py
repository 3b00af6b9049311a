"""Hooks for tests of code that uses :class:`~rollout_client.RolloutClient` or
:class:`~rollout_client.RolloutClientPool`.

Production code needs none of this: the client's timings are the protocol's. Tests use
:func:`override_timing` to make backoff sleeps instant, to drive the lease clock themselves,
or to shorten a bound they want to see expire, the way ``stamina.set_testing`` makes retries
instant (but per client, never process-wide).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from rollout_types import check_seconds

from ._api import retime
from ._client import RolloutClient
from ._pool import RolloutClientPool

__all__ = ["override_timing"]


def override_timing(
    client: RolloutClient | RolloutClientPool,
    *,
    sleep: Callable[[float], Awaitable[None]] | None = None,
    clock: Callable[[], float] | None = None,
    result_read_grace_sec: float | None = None,
    cancel_timeout_sec: float | None = None,
) -> None:
    """Replace the sleep, the clock or a bound of ``client``; None keeps the current one.

    Call it right after creating the client: a rollout already admitted keeps the timing
    it was admitted with; later admissions and calls use the new one. For a pool it
    changes the client of every server and the pool's own waits (429s) alike.

    Args:
        client: The client (or pool) to change.
        sleep: Awaited for every backoff (poll retries, 429 ``Retry-After``,
            :meth:`~rollout_client.RolloutClient.wait_idle` intervals, re-polls of an
            unknown status) with the delay in seconds; default :func:`asyncio.sleep`. An
            instant sleep that records its delays shows the retry schedule without waiting.
        clock: Monotonic seconds for polling-lease deadlines; default
            :func:`time.monotonic`. It must agree with ``sleep``: a clock that advances by
            each (instant) sleep's delay makes the lease-fit rule see the time the backoff
            would have taken.
        result_read_grace_sec: Added to the server's ``result_wait_timeout_sec`` for a
            result poll's read timeout and for the full poll the lease-fit rule reserves;
            finite and > 0; default 10.
        cancel_timeout_sec: Wall-clock bound on
            :meth:`~rollout_client.RolloutClient.cancel_rollout`; finite and > 0; default 5.

    Raises:
        TypeError: ``client`` is not a :class:`~rollout_client.RolloutClient` or
            :class:`~rollout_client.RolloutClientPool`, or ``sleep`` / ``clock`` is not
            callable.
        ValueError: A bound is not a finite number > 0.

    .. versionadded:: 0.2
    """
    given: object = client
    if not isinstance(given, RolloutClient | RolloutClientPool):
        raise TypeError(
            f"client must be a RolloutClient or RolloutClientPool; got {type(given).__name__}"
        )
    changes: dict[str, Any] = {}
    for name, hook in (("sleep", sleep), ("clock", clock)):
        if hook is not None:
            if not callable(hook):
                raise TypeError(f"{name} must be callable; got {hook!r}")
            changes[name] = hook
    for name, seconds in (
        ("result_read_grace_sec", result_read_grace_sec),
        ("cancel_timeout_sec", cancel_timeout_sec),
    ):
        if seconds is not None:
            changes[name] = check_seconds(name, seconds)
    retime(client, changes)
