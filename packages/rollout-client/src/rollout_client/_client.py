"""``RolloutClient``: submit rollouts to a rollout server and collect their results."""

from __future__ import annotations

from typing import Any

import aiohttp

from rollout_types import (
    CancelRolloutsResponse,
    RolloutInitRequest,
    check_api_key,
    check_seconds,
)

from ._api import RolloutApi
from ._channel import ServerChannel, checked_session
from ._handle import RolloutHandle
from ._retry import RetrySettings
from ._settings import settings_with

__all__ = ["RolloutClient"]


class RolloutClient(RolloutApi):
    """Submit rollouts to a rollout server and long-poll their results.

    Works with ``rollout-server`` and with osmosis-ai 0.3.3-0.3.8 servers (the pull
    protocol). Every request carries ``Authorization: Bearer <api_key>`` when ``api_key``
    is set and this project's ``X-Rollout-Protocol-Version`` header; redirects are never
    followed, so the key never reaches another URL.

    Connection limits: without ``http_client`` the client creates (on first use, inside
    the running loop) one :class:`aiohttp.ClientSession` whose ``TCPConnector`` has
    ``limit=0`` and ``limit_per_host=0`` (no pool bound) and a 30 s keep-alive. Each
    rollout keeps one long poll outstanding and HTTP/1.1 carries one request per
    connection, so N concurrent rollouts hold N connections; a bounded pool (aiohttp's
    default is 100; osmosis-ai's httpx default fails with pool timeouts past about 100
    rollouts) would make polls queue and miss their polling lease. The bounds are instead
    per request: connecting 10 s (``sock_connect``), a poll's read ``wait + 10`` s
    (``sock_read``, ``wait`` being the server's ``result_wait_timeout_sec``), a poll's pool
    wait plus connect at most the time left on its lease, admission reads 30 s, ``health()``
    10 s and ``cancel_rollout()`` 5 s overall; never aiohttp's 300 s default total. Raise
    the process's open-file limit (``ulimit -n``) above the number of concurrent rollouts.
    A session passed as ``http_client`` is used as given (its connector's limits apply; give
    it ``limit=0`` for more rollouts than its limit).

    Args:
        url: Base URL of the rollout server, such as ``http://127.0.0.1:8000``; trailing
            ``/`` are removed and a path prefix is kept.
        http_client: A session the caller owns and closes; default None (the client creates
            its own, closed by :meth:`aclose`).
        admission_timeout_sec: Bound on admission (``POST /rollout`` requests and 429
            backoff), seconds; finite; zero or negative expire at once; default None (no
            bound). It does not limit execution.
        api_key: The server's bearer key; default None (no ``Authorization`` header).
        retry: The retry schedules of result polls and the 429 backoff of admission;
            default None (``RetrySettings()``: osmosis-ai 0.3.8's, see
            :class:`~rollout_client.RetrySettings`).

    Raises:
        ValueError: ``url`` is not an absolute http(s) URL, ``admission_timeout_sec`` is
            not finite, or ``api_key`` is empty, whitespace-only or holds control
            characters.
        TypeError: ``http_client`` is not an :class:`aiohttp.ClientSession`, or ``retry``
            not a :class:`~rollout_client.RetrySettings`.

    .. versionadded:: 0.1
    .. versionchanged:: 0.2
       The ``retry`` parameter.
    """

    def __init__(
        self,
        *,
        url: str,
        http_client: aiohttp.ClientSession | None = None,
        admission_timeout_sec: float | None = None,
        api_key: str | None = None,
        retry: RetrySettings | None = None,
    ) -> None:
        session = checked_session(http_client)
        self._admission_timeout_sec = (
            None
            if admission_timeout_sec is None
            else check_seconds("admission_timeout_sec", admission_timeout_sec, allow_negative=True)
        )
        self._channel = ServerChannel(
            url=url,
            api_key=check_api_key(api_key),
            session=session,
            settings=settings_with(retry),
        )
        self._closed = False

    def __repr__(self) -> str:
        return f"<RolloutClient url={str(self._channel.transport.base_url)!r}>"

    @property
    def url(self) -> str:
        """The server's base URL, trailing ``/`` removed."""
        return self._channel.url

    def _channels(self) -> tuple[ServerChannel, ...]:
        return (self._channel,)

    async def aclose(self) -> None:
        """Stop the polling of unfinished handles and close the session if the client owns it.

        A caller-owned ``http_client`` stays open. Awaiting a handle stopped here raises
        :class:`asyncio.CancelledError`. Calling it twice is harmless.
        """
        self._closed = True
        await self._channel.aclose()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this RolloutClient is closed; create a new one")

    async def _submit(self, request: RolloutInitRequest) -> RolloutHandle:
        self._check_open()
        return await self._channel.admit(request, timeout_sec=self._admission_timeout_sec)

    async def cancel_rollout(self, rollout_id: str) -> CancelRolloutsResponse:
        """Ask the server to cancel a rollout; bounded to 5 s wall clock, pool wait included.

        Cancellation is acknowledged, not awaited: keep polling the handle to observe the
        terminal result after cleanup. The request is never retried.

        Args:
            rollout_id: The rollout to cancel.

        Returns:
            The dispositions (``cancelled_queued``, ``cancelled_running`` or ``not_found``).

        Raises:
            TimeoutError: No answer within 5 s (the server may or may not have the request).
            RolloutProtocolError: A status other than 200, or an invalid body.
            aiohttp.ClientError: The request failed on a transport error.
        """
        self._check_open()
        return await self._channel.cancel_rollout(rollout_id)

    async def health(self) -> dict[str, Any]:
        """Fetch ``GET /health``: backend fields plus ``instance_id``, ``process_id`` and
        ``lifecycle`` (``accepting_rollouts``, ``active_rollouts``).

        Bounded to 10 s. Nothing is assumed about the backend's keys.

        Returns:
            The decoded JSON object.

        Raises:
            RolloutProtocolError: A status other than 200 (``GET /health failed``), or a
                body that is not a JSON object (``GET /health returned invalid JSON``).
            TimeoutError: No answer within 10 s.
            aiohttp.ClientError: The request failed on a transport error.
        """
        self._check_open()
        return await self._channel.health()

    async def wait_idle(
        self,
        timeout_sec: float = 120.0,
        poll_interval_sec: float = 1.0,
        process_id: str | None = None,
    ) -> dict[str, Any]:
        """Poll ``GET /health`` until ``lifecycle.active_rollouts`` is 0.

        It observes completion only: it does not stop new admissions. Transport errors and
        HTTP 408, 429, 500, 502, 503 and 504 are waited out until ``timeout_sec``.

        Args:
            timeout_sec: Overall bound, seconds; finite and > 0; default 120.
            poll_interval_sec: Pause between health checks, seconds; finite and > 0;
                default 1.
            process_id: The server process expected (from a prior :meth:`health`); default
                None pins the first one observed.

        Returns:
            The health payload that reported no active rollouts.

        Raises:
            ValueError: A duration is not finite and positive, or ``process_id`` is empty.
            TimeoutError: The server did not become idle within ``timeout_sec``.
            RolloutProtocolError: The server reports no ``process_id`` ("no lifecycle
                identity", as servers before osmosis-ai 0.3.5) or no valid ``lifecycle``;
                its ``process_id`` changed while polling or differs from ``process_id``
                (the server restarted); or ``/health`` failed with another status (401,
                404, invalid JSON, ...).
        """
        self._check_open()
        return await self._channel.wait_idle(timeout_sec, poll_interval_sec, process_id)
