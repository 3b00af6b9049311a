"""Retry schedules of the client, as data, and the arithmetic that applies them.

Two independent schedules govern one result poll (``GET /rollout/{id}/result``), as in
osmosis-ai 0.3.7+:

* :data:`TRANSPORT_RETRY`: a dropped or reset connection, a refused connection, a broken
  payload or a read timeout is retried at most twice, after 0.1 s and then 0.5 s
  (0.6 s of backoff in total);
* :data:`GATEWAY_RETRY`: HTTP 502, 503 or 504 (from a proxy or load balancer) is retried at
  most six times, after 0.25, 0.5, 1, 2, 4 and 8 s (15.75 s of backoff in total).

A poll can therefore mix up to 2 + 6 retries; both counters restart after every 200.
Every retry must also fit the polling lease (:func:`retry_fits_lease`): the server
expires a rollout nobody polled for ``polling_lease_timeout_sec``, so a retry whose
backoff plus a full long poll would end after the last confirmed lease deadline is
pointless and the error is raised at once.

Admission (``POST /rollout``) retries only HTTP 429, after the server's ``Retry-After``
(:func:`parse_retry_after`). Admission and cancellation are never replayed on any other
failure.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Final

import attrs

__all__ = [
    "GATEWAY_RETRY",
    "RETRY_AFTER_DEFAULT_SEC",
    "RETRY_AFTER_MAX_SEC",
    "RETRY_AFTER_MIN_SEC",
    "TRANSPORT_RETRY",
    "WAIT_IDLE_RETRY_STATUSES",
    "RetrySchedule",
    "parse_retry_after",
    "retry_fits_lease",
]


@attrs.frozen(kw_only=True)
class RetrySchedule:
    """A bounded retry schedule: ``delays[n]`` seconds before retry ``n + 1``.

    Attributes:
        delays: Backoff before each retry, in seconds; ``len(delays)`` is the most retries.
        statuses: HTTP statuses the schedule retries (empty for transport failures).
    """

    delays: tuple[float, ...]
    statuses: frozenset[int] = frozenset()

    def delay(self, attempt: int) -> float | None:
        """The backoff before retry ``attempt + 1`` (0-based), or None once exhausted."""
        return self.delays[attempt] if attempt < len(self.delays) else None


TRANSPORT_RETRY: Final = RetrySchedule(delays=(0.1, 0.5))
"""Result-poll transport failures: at most 2 retries, after 0.1 s then 0.5 s."""

GATEWAY_RETRY: Final = RetrySchedule(
    delays=(0.25, 0.5, 1.0, 2.0, 4.0, 8.0), statuses=frozenset({502, 503, 504})
)
"""Result-poll gateway statuses 502/503/504: at most 6 retries, 0.25 s doubling to 8 s."""

WAIT_IDLE_RETRY_STATUSES: Final = frozenset({408, 429, 500, 502, 503, 504})
"""``GET /health`` statuses that :meth:`RolloutClient.wait_idle` waits out."""

RETRY_AFTER_DEFAULT_SEC: Final = 1.0
"""Admission backoff after a 429 whose ``Retry-After`` is missing, non-numeric or not finite."""

RETRY_AFTER_MIN_SEC: Final = 0.05
"""Shortest admission backoff after a 429, whatever ``Retry-After`` says."""

RETRY_AFTER_MAX_SEC: Final = 60.0
"""Longest admission backoff after a 429, whatever ``Retry-After`` says."""


_DECIMAL: Final = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def parse_retry_after(headers: Mapping[str, str]) -> float:
    """Read the admission backoff from a 429's ``Retry-After`` header.

    The value is a decimal number of seconds. A missing, non-numeric (an HTTP date
    included) or non-finite value gives :data:`RETRY_AFTER_DEFAULT_SEC` (1 s); a number is
    clamped to [:data:`RETRY_AFTER_MIN_SEC`, :data:`RETRY_AFTER_MAX_SEC`] (0.05 s to 60 s).

    Args:
        headers: The response headers (case-insensitive mapping).

    Returns:
        The delay in seconds.
    """
    raw = headers.get("Retry-After")
    if raw is None or _DECIMAL.fullmatch(raw.strip()) is None:
        return RETRY_AFTER_DEFAULT_SEC
    value = float(raw.strip())
    if not math.isfinite(value):
        return RETRY_AFTER_DEFAULT_SEC
    return min(max(value, RETRY_AFTER_MIN_SEC), RETRY_AFTER_MAX_SEC)


def retry_fits_lease(
    *, now: float, delay_sec: float, read_timeout_sec: float, lease_deadline: float
) -> bool:
    """Tell whether a retry after ``delay_sec`` can complete before the lease deadline.

    The rule of osmosis-ai 0.3.8: retry only if ``now + delay + read_timeout`` is strictly
    before ``lease_deadline``, where the deadline is the send time of the last successful
    poll (or of the admission) plus ``polling_lease_timeout_sec``. Failed requests never
    move the deadline. Call it with ``delay_sec=0`` after sleeping to re-check.

    Args:
        now: The current time on the clock the deadline was taken from, in seconds.
        delay_sec: The backoff still to wait, in seconds.
        read_timeout_sec: The longest a full poll may take (server wait + grace), seconds.
        lease_deadline: The last confirmed lease deadline on the same clock.

    Returns:
        True when the retry fits.
    """
    return now + delay_sec + read_timeout_sec < lease_deadline
