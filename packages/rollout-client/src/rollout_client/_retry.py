"""The client's retry settings (:class:`RetrySettings`, public) and the arithmetic that
applies them: the 429 ``Retry-After`` clamp and the lease-fit rule of result polls."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Final

import attrs

from rollout_types import check_seconds

__all__ = [
    "DEFAULT_RETRY",
    "WAIT_IDLE_RETRY_STATUSES",
    "RetrySettings",
    "next_delay",
    "parse_retry_after",
    "retry_fits_lease",
]


def _seconds(value: object, *, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds; got {value!r}")
    return check_seconds(name, value, allow_zero=True)


def _delays(value: object, *, name: str) -> tuple[float, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a sequence of seconds such as (0.1, 0.5); got {value!r}")
    return tuple(_seconds(delay, name=f"each of {name}") for delay in value)


def _transport_delays(value: Iterable[float]) -> tuple[float, ...]:
    return _delays(value, name="transport_delays_sec")


def _gateway_delays(value: Iterable[float]) -> tuple[float, ...]:
    return _delays(value, name="gateway_delays_sec")


def _default_sec(value: float) -> float:
    return _seconds(value, name="retry_after_default_sec")


def _min_sec(value: float) -> float:
    return _seconds(value, name="retry_after_min_sec")


def _max_sec(value: float) -> float:
    return _seconds(value, name="retry_after_max_sec")


def _statuses(value: Iterable[int]) -> frozenset[int]:
    given: object = value
    if isinstance(given, str | bytes) or not isinstance(given, Iterable):
        raise TypeError(f"gateway_statuses must be a set of HTTP statuses; got {value!r}")
    statuses = frozenset(given)
    for status in statuses:
        if isinstance(status, bool) or not isinstance(status, int):
            raise TypeError(f"gateway_statuses must hold integers such as 502; got {status!r}")
        if not 400 <= status <= 599:
            raise ValueError(
                "gateway_statuses must hold HTTP error statuses (integers from 400 to 599); "
                f"got {status}"
            )
    return statuses


def _clamp_order(instance: RetrySettings, _attribute: object, maximum: float) -> None:
    if maximum < instance.retry_after_min_sec:
        raise ValueError(
            f"retry_after_max_sec ({maximum}) must not be below retry_after_min_sec "
            f"({instance.retry_after_min_sec})"
        )


@attrs.frozen(kw_only=True)
class RetrySettings:
    """How a :class:`RolloutClient` retries: the backoff schedules, as data.

    The defaults are osmosis-ai 0.3.8's schedules (what the protocol requires); pass another
    instance to ``RolloutClient(retry=...)`` to change them, e.g.
    ``RetrySettings(gateway_delays_sec=())`` to fail on the first gateway error.

    A result poll (``GET /rollout/{id}/result``) has two independent schedules:

    * transport failures (a dropped, reset or refused connection, a broken payload, a read
      timeout) are retried ``len(transport_delays_sec)`` times; by default at most 2 times,
      after 0.1 s and then 0.5 s (0.6 s of backoff in total);
    * a status in ``gateway_statuses`` (by default 502, 503 and 504, from a proxy or load
      balancer) is retried ``len(gateway_delays_sec)`` times; by default at most 6 times,
      after 0.25, 0.5, 1, 2, 4 and 8 s (15.75 s of backoff in total).

    A poll can therefore mix up to 2 + 6 retries; both counters restart after every 200.
    Every retry must also fit the polling lease: with ``d`` the next delay and ``read`` a
    full poll (the server's ``result_wait_timeout_sec`` plus 10 s of read grace), a retry
    starts only if ``now + d + read`` is strictly before the last confirmed lease deadline
    (the send time of the last successful poll, or of the admission, plus
    ``polling_lease_timeout_sec``); it is checked again after sleeping with ``d = 0``.
    Otherwise the error is raised at once: the server would expire the lease first.

    Admission (``POST /rollout``) retries only HTTP 429, after the answer's
    ``Retry-After``: a decimal number of seconds clamped to
    [``retry_after_min_sec``, ``retry_after_max_sec``] (by default [0.05, 60] s); a missing,
    non-numeric (an HTTP date included) or non-finite value gives
    ``retry_after_default_sec`` (1 s). The admission deadline (``admission_timeout_sec``)
    bounds the waiting. Admission and cancellation are never replayed on any other failure.

    Every value is in float seconds, finite and not negative (0 retries at once).

    Attributes:
        transport_delays_sec: Backoff before each retry of a result poll after a transport
            failure; default ``(0.1, 0.5)``.
        gateway_delays_sec: Backoff before each retry of a result poll answered with a
            status in ``gateway_statuses``; default ``(0.25, 0.5, 1.0, 2.0, 4.0, 8.0)``.
        gateway_statuses: HTTP statuses (400-599) a result poll retries; default
            ``{502, 503, 504}``.
        retry_after_default_sec: Admission backoff after a 429 without a usable
            ``Retry-After``; default 1.0.
        retry_after_min_sec: Shortest admission backoff after a 429; default 0.05.
        retry_after_max_sec: Longest admission backoff after a 429; default 60.0; not below
            ``retry_after_min_sec``.

    Raises:
        TypeError: A value is not a number (or a sequence / set of them).
        ValueError: A delay is negative or not finite, a status is not from 400 to 599, or
            ``retry_after_max_sec < retry_after_min_sec``.

    .. versionadded:: 0.2
    """

    transport_delays_sec: tuple[float, ...] = attrs.field(
        default=(0.1, 0.5), converter=_transport_delays
    )
    gateway_delays_sec: tuple[float, ...] = attrs.field(
        default=(0.25, 0.5, 1.0, 2.0, 4.0, 8.0), converter=_gateway_delays
    )
    gateway_statuses: frozenset[int] = attrs.field(
        default=frozenset({502, 503, 504}), converter=_statuses
    )
    retry_after_default_sec: float = attrs.field(default=1.0, converter=_default_sec)
    retry_after_min_sec: float = attrs.field(default=0.05, converter=_min_sec)
    retry_after_max_sec: float = attrs.field(
        default=60.0, converter=_max_sec, validator=_clamp_order
    )


DEFAULT_RETRY: Final = RetrySettings()
"""The protocol's schedules (osmosis-ai 0.3.8)."""

WAIT_IDLE_RETRY_STATUSES: Final = frozenset({408, 429, 500, 502, 503, 504})
"""``GET /health`` statuses that :meth:`RolloutClient.wait_idle` waits out."""

_DECIMAL: Final = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def next_delay(delays: tuple[float, ...], attempt: int) -> float | None:
    """The backoff before retry ``attempt + 1`` (0-based), or None once ``delays`` ran out."""
    return delays[attempt] if attempt < len(delays) else None


def parse_retry_after(headers: Mapping[str, str], retry: RetrySettings = DEFAULT_RETRY) -> float:
    """Read the admission backoff from a 429's ``Retry-After`` header.

    Args:
        headers: The response headers (case-insensitive mapping).
        retry: The clamp and the default (see :class:`RetrySettings`).

    Returns:
        The delay in seconds.
    """
    raw = headers.get("Retry-After")
    if raw is None or _DECIMAL.fullmatch(raw.strip()) is None:
        return retry.retry_after_default_sec
    value = float(raw.strip())
    if not math.isfinite(value):
        return retry.retry_after_default_sec
    return min(max(value, retry.retry_after_min_sec), retry.retry_after_max_sec)


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
