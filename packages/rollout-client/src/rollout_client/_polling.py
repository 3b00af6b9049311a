"""The result-polling loop of one rollout (wire protocol section 6.3)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

import aiohttp
import attrs

from rollout_types import (
    LEASE_HEADER,
    RolloutResultResponse,
    RolloutStatus,
    WireValidationError,
    is_terminal,
    loads,
    structure_wire,
)

from ._errors import UNAUTHORIZED_HINT, RolloutProtocolError
from ._retry import next_delay, retry_fits_lease
from ._settings import ClientSettings
from ._transport import HttpResponse, Transport, TransportFailure, classify

__all__ = ["Lease", "poll_until_terminal"]

logger: Final = logging.getLogger("rollout_client")

_KNOWN_STATUSES: Final = frozenset(RolloutStatus)


@attrs.frozen(kw_only=True)
class Lease:
    """What admission granted: the token and the server's timings, in seconds."""

    token: str = attrs.field(repr=False)
    result_wait_timeout_sec: float
    polling_lease_timeout_sec: float


class _LeaseRanOut(Exception):  # noqa: N818 - internal signal, never escapes the poller
    """The lease-bounded retry ran out of time; the previous error is what to raise."""


class _Poller:
    """Polls one rollout until a terminal status; one instance per handle."""

    def __init__(
        self,
        *,
        transport: Transport,
        settings: ClientSettings,
        rollout_id: str,
        lease: Lease,
        lease_deadline: float,
        on_result: Callable[[RolloutResultResponse], None],
    ) -> None:
        self._transport = transport
        self._settings = settings
        self._rollout_id = rollout_id
        self._lease = lease
        self._deadline = lease_deadline
        self._on_result = on_result
        self._url = transport.url("rollout", rollout_id, "result")
        self._path = f"GET /rollout/{rollout_id}/result"
        self._read_timeout = lease.result_wait_timeout_sec + settings.result_read_grace_sec
        self._headers = {LEASE_HEADER: lease.token}

    # Speed: benchmarks/README.md, "Client", row "One session for every request of a client ..."
    def _timeout(self) -> aiohttp.ClientTimeout:
        # The pool wait plus connect (``connect``) may last as long as the lease still
        # does (a poll sent after that is too late anyway), never less than a connect.
        remaining = self._deadline - self._settings.clock()
        return self._settings.timeout(read_sec=self._read_timeout, pool_sec=remaining)

    async def run(self) -> RolloutResultResponse:
        previous: RolloutResultResponse | None = None
        while True:
            result = await self._poll_once()
            self._on_result(result)
            if is_terminal(result.status):
                return result
            if (
                result.status not in _KNOWN_STATUSES
                and previous is not None
                and previous.status == result.status
            ):
                # A status from a newer server, twice in a row: it may be terminal there
                # and answer at once, so keep the re-poll cadence humane (and in the lease).
                lease = self._lease
                pause = min(
                    self._settings.unknown_status_repoll_sec,
                    (lease.polling_lease_timeout_sec - lease.result_wait_timeout_sec) / 2,
                )
                await self._settings.sleep(pause)
            previous = result

    async def _poll_once(self) -> RolloutResultResponse:
        """One poll cycle: a GET and its retries, until a valid 200."""
        settings = self._settings
        transport_attempts = gateway_attempts = 0
        last_error: BaseException | None = None
        while True:
            sent_at = settings.clock()
            try:
                if last_error is None:
                    response = await self._get()
                else:
                    response = await self._get_within_lease()
            except _LeaseRanOut as exc:
                assert last_error is not None
                raise last_error from exc.__cause__
            except (aiohttp.ClientError, OSError) as exc:
                if classify(exc) is not TransportFailure.RETRYABLE:
                    raise
                await self._backoff(
                    settings.retry.transport_delays_sec,
                    transport_attempts,
                    exc,
                    type(exc).__name__,
                )
                transport_attempts += 1
                last_error = exc
                continue
            if response.status == 200:
                result = self._parse(response)
                self._deadline = sent_at + self._lease.polling_lease_timeout_sec
                return result
            error = RolloutProtocolError(
                f"{self._path} returned {response.status}" + _explain_status(response.status),
                status_code=response.status,
            )
            if response.status not in settings.retry.gateway_statuses:
                raise error
            await self._backoff(
                settings.retry.gateway_delays_sec,
                gateway_attempts,
                error,
                f"HTTP {response.status}",
            )
            gateway_attempts += 1
            last_error = error

    async def _backoff(
        self, delays: tuple[float, ...], attempt: int, error: BaseException, cause: str
    ) -> None:
        """Sleep before a retry, or raise ``error`` when the retry cannot fit the lease."""
        settings = self._settings
        delay = next_delay(delays, attempt)
        if delay is None or not retry_fits_lease(
            now=settings.clock(),
            delay_sec=delay,
            read_timeout_sec=self._read_timeout,
            lease_deadline=self._deadline,
        ):
            raise error
        logger.warning(
            "Retrying result read for rollout %s after %s (attempt %d) in %.2fs",
            self._rollout_id,
            cause,
            attempt + 1,
            delay,
        )
        await settings.sleep(delay)
        if not retry_fits_lease(
            now=settings.clock(),
            delay_sec=0.0,
            read_timeout_sec=self._read_timeout,
            lease_deadline=self._deadline,
        ):
            raise error

    async def _get(self) -> HttpResponse:
        return await self._transport.send(
            "GET", self._url, timeout=self._timeout(), headers=self._headers
        )

    async def _get_within_lease(self) -> HttpResponse:
        """A retried GET, bounded by the time left on the lease.

        Raises:
            _LeaseRanOut: The bound fired (chained from its ``TimeoutError``).
        """
        remaining = self._deadline - self._settings.clock()
        scope = asyncio.timeout(remaining)
        try:
            async with scope:
                return await self._get()
        except TimeoutError as exc:
            if scope.expired():
                raise _LeaseRanOut from exc
            raise

    def _parse(self, response: HttpResponse) -> RolloutResultResponse:
        try:
            result = structure_wire(loads(response.body), RolloutResultResponse)
        except WireValidationError as exc:
            raise RolloutProtocolError(
                f"{self._path} returned an invalid response: {exc}", status_code=200
            ) from exc
        if result.rollout_id != self._rollout_id:
            raise RolloutProtocolError(
                f"{self._path} returned a different rollout_id ({result.rollout_id!r})",
                status_code=200,
            )
        return result


def _explain_status(status: int) -> str:
    hints = {
        401: UNAUTHORIZED_HINT,
        403: " (the polling lease is invalid: it expired or belongs to another admission)",
        404: " (the server does not know this rollout: never admitted, or retention ended)",
    }
    return hints.get(status, "")


async def poll_until_terminal(
    *,
    transport: Transport,
    settings: ClientSettings,
    rollout_id: str,
    lease: Lease,
    lease_deadline: float,
    on_result: Callable[[RolloutResultResponse], None],
) -> RolloutResultResponse:
    """Long-poll ``GET /rollout/{id}/result`` until the rollout reports a terminal status.

    Args:
        transport: Where to send the polls.
        settings: Timings and retry schedules.
        rollout_id: The admitted rollout.
        lease: The admission's lease token and timings.
        lease_deadline: The initial lease deadline on ``settings.clock``: the admission's
            send time plus ``polling_lease_timeout_sec``.
        on_result: Called with every valid 200 answer, terminal one included.

    Returns:
        The terminal result.

    Raises:
        RolloutProtocolError: An unexpected status (after the gateway retries for
            502/503/504), an invalid body or a different ``rollout_id``.
        aiohttp.ClientError: A transport failure that is not retried or outlasted its
            retries (see ``_transport.classify``).
    """
    poller = _Poller(
        transport=transport,
        settings=settings,
        rollout_id=rollout_id,
        lease=lease,
        lease_deadline=lease_deadline,
        on_result=on_result,
    )
    return await poller.run()
