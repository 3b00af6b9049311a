"""``RolloutClient``: submit rollouts to a rollout server and collect their results."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, Self

import aiohttp

from rollout_types import (
    CancelRolloutsRequest,
    CancelRolloutsResponse,
    RolloutInitResponse,
    RolloutResultResponse,
    WireValidationError,
    check_api_key,
    check_seconds,
    dumps,
    loads,
    structure_wire,
)

from ._admission import admit, request_body, send_admission
from ._errors import RolloutProtocolError, RolloutProtocolVersionError
from ._handle import RolloutHandle
from ._health import check_identity, health_payload, lifecycle_of
from ._polling import Lease, poll_until_terminal
from ._retry import WAIT_IDLE_RETRY_STATUSES, RetrySettings
from ._settings import ClientSettings, settings_with
from ._transport import HttpResponse, Transport

__all__ = ["RolloutClient"]


class RolloutClient:
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
        session: object = http_client
        if session is not None and not isinstance(session, aiohttp.ClientSession):
            raise TypeError(
                f"http_client must be an aiohttp.ClientSession or None; got "
                f"{type(session).__name__}"
            )
        given: object = retry
        if given is not None and not isinstance(given, RetrySettings):
            raise TypeError(
                f"retry must be a rollout_client.RetrySettings or None; got {type(given).__name__}"
            )
        self._admission_timeout_sec = (
            None
            if admission_timeout_sec is None
            else check_seconds("admission_timeout_sec", admission_timeout_sec, allow_negative=True)
        )
        self._transport = Transport(url=url, api_key=check_api_key(api_key), session=http_client)
        self._settings: ClientSettings = settings_with(retry)
        self._handles: set[RolloutHandle] = set()
        self._closed = False

    def __repr__(self) -> str:
        return f"<RolloutClient url={str(self._transport.base_url)!r}>"

    @property
    def url(self) -> str:
        """The server's base URL, trailing ``/`` removed."""
        return str(self._transport.base_url).rstrip("/")

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the polling of unfinished handles and close the session if the client owns it.

        A caller-owned ``http_client`` stays open. Awaiting a handle stopped here raises
        :class:`asyncio.CancelledError`. Calling it twice is harmless.
        """
        self._closed = True
        pending = [handle for handle in self._handles if not handle.done()]
        for handle in pending:
            handle.cancel()
        if pending:
            # Each handle keeps its own outcome; this only waits for the tasks to stop.
            await asyncio.wait([handle._task for handle in pending])
        await self._transport.aclose()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this RolloutClient is closed; create a new one")

    async def run_rollout(  # noqa: PLR0917 - the documented osmosis-ai signature
        self,
        initial_messages: list[dict[str, Any]],
        chat_completions_url: str,
        rollout_id: str,
        llm_api_key: str | None = None,
        label: str | None = None,
        metadata: dict[str, Any] | None = None,
        grade: bool = True,
        agent_timeout_sec: float | None = None,
        grader_timeout_sec: float | None = None,
        extra_fields: dict[str, Any] | None = None,
    ) -> RolloutResultResponse:
        """Admit a rollout and wait until it terminates.

        Arguments, errors and admission behave as in :meth:`run_rollout_async`. If the
        calling task is cancelled, polling stops too (the server then expires the lease).

        Returns:
            The terminal result: check ``status``, ``sample``, ``err_message`` and
            ``err_category`` to tell success from execution failure.

        Raises:
            RolloutProtocolError: A poll got a status or body the protocol forbids
                (502/503/504 only after their retries).
            aiohttp.ClientError: A poll failed on a transport error it does not retry, or
                after its retries.
        """
        handle = await self.run_rollout_async(
            initial_messages,
            chat_completions_url,
            rollout_id,
            llm_api_key=llm_api_key,
            label=label,
            metadata=metadata,
            grade=grade,
            agent_timeout_sec=agent_timeout_sec,
            grader_timeout_sec=grader_timeout_sec,
            extra_fields=extra_fields,
        )
        try:
            return await handle
        except asyncio.CancelledError:
            handle.cancel()
            raise

    async def run_rollout_async(  # noqa: PLR0917 - the documented osmosis-ai signature
        self,
        initial_messages: list[dict[str, Any]],
        chat_completions_url: str,
        rollout_id: str,
        llm_api_key: str | None = None,
        label: str | None = None,
        metadata: dict[str, Any] | None = None,
        grade: bool = True,
        agent_timeout_sec: float | None = None,
        grader_timeout_sec: float | None = None,
        extra_fields: dict[str, Any] | None = None,
    ) -> RolloutHandle:
        """Admit a rollout and return a handle that polls its result in the background.

        Admission retries HTTP 429 after the answer's ``Retry-After`` (by default missing
        or invalid: 1 s; clamped to [0.05, 60] s; see :class:`~rollout_client.RetrySettings`)
        and accepts only a 202 whose body is valid and echoes ``rollout_id``. Nothing else
        is retried: a caller that retries after a transport error must expect 409 if the
        first attempt was in fact admitted.

        Args:
            initial_messages: The prompt: a list of JSON objects (chat messages).
            chat_completions_url: Base URL of the OpenAI-compatible endpoint the agent calls.
            rollout_id: A fresh id per attempt: one path segment (not empty, ``.`` or
                ``..``, without ``/``, ``\\`` or NUL); percent-encoded in URLs.
            llm_api_key: Key for the chat endpoint (not for the rollout server); not ``""``;
                default None.
            label: Ground truth for the grader; default None.
            metadata: JSON object passed to workflow and grader; default None.
            grade: Whether to grade; default True.
            agent_timeout_sec: Workflow budget, seconds; finite; default None (unbounded).
            grader_timeout_sec: Grader budget, seconds; finite; default None (unbounded).
            extra_fields: JSON object persisted with the trajectory; default None.

        Returns:
            The handle; await it for the terminal result.

        Raises:
            ValueError: The request is invalid (checked before any I/O).
            TypeError: ``rollout_id`` is not a string or ``grade`` not a bool.
            RolloutProtocolVersionError: The server speaks an incompatible protocol
                version (also an osmosis-ai <= 0.3.2 server, answering 422).
            RolloutProtocolError: Any status but 202 and 429 (409 for a duplicate id, 503
                while the server shuts down, ...), or an invalid 202 body.
            RolloutAdmissionTimeoutError: ``admission_timeout_sec`` expired.
            aiohttp.ClientError: The POST failed on a transport error (not retried).
        """
        self._check_open()
        body = request_body(
            initial_messages=initial_messages,
            chat_completions_url=chat_completions_url,
            rollout_id=rollout_id,
            llm_api_key=llm_api_key,
            label=label,
            metadata=metadata,
            grade=grade,
            agent_timeout_sec=agent_timeout_sec,
            grader_timeout_sec=grader_timeout_sec,
            extra_fields=extra_fields,
        )
        admitted, sent_at = await admit(
            self._transport,
            self._settings,
            rollout_id=rollout_id,
            body=body,
            timeout_sec=self._admission_timeout_sec,
        )
        return self._start_polling(admitted, sent_at)

    # -- seams of RolloutClientPool, which routes each admission itself -----------------

    async def _send_admission(self, body: bytes) -> tuple[HttpResponse, float]:
        """One ``POST /rollout`` to this client's server (no 429 retry, no deadline)."""
        return await send_admission(self._transport, self._settings, body)

    def _start_polling(self, admitted: RolloutInitResponse, sent_at: float) -> RolloutHandle:
        """The handle of an admitted rollout, polling this client's server in the background.

        ``sent_at`` is the send time (``settings.clock``) of the admission that answered.
        """
        rollout_id = admitted.rollout_id
        lease = Lease(
            token=admitted.polling_lease_token,
            result_wait_timeout_sec=admitted.result_wait_timeout_sec,
            polling_lease_timeout_sec=admitted.polling_lease_timeout_sec,
        )
        transport, settings = self._transport, self._settings

        def poll(
            on_result: Callable[[RolloutResultResponse], None],
        ) -> Coroutine[Any, Any, RolloutResultResponse]:
            return poll_until_terminal(
                transport=transport,
                settings=settings,
                rollout_id=rollout_id,
                lease=lease,
                lease_deadline=sent_at + lease.polling_lease_timeout_sec,
                on_result=on_result,
            )

        handle = RolloutHandle(rollout_id=rollout_id, status=admitted.status, poll=poll)
        self._handles.add(handle)
        handle._on_done(self._handles.discard)
        return handle

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
        given: object = rollout_id
        if not isinstance(given, str):
            raise TypeError(f"rollout_id must be a string; got {type(given).__name__}")
        body = dumps(CancelRolloutsRequest(ids=[rollout_id])).encode()
        bound = self._settings.cancel_timeout_sec
        timeout = aiohttp.ClientTimeout(
            total=bound, sock_connect=min(bound, self._settings.connect_timeout_sec)
        )
        try:
            async with asyncio.timeout(bound):
                response = await self._transport.send(
                    "POST", self._transport.url("rollout", "cancel"), body=body, timeout=timeout
                )
        except TimeoutError as exc:
            raise TimeoutError(
                f"cancelling rollout {rollout_id!r} did not finish within {bound} seconds "
                "(connection wait included); the server may or may not have received it"
            ) from exc
        if response.status != 200:
            raise RolloutProtocolError(
                f"POST /rollout/cancel returned {response.status}{response.detail_suffix()}",
                status_code=response.status,
            )
        try:
            return structure_wire(loads(response.body), CancelRolloutsResponse)
        except WireValidationError as exc:
            raise RolloutProtocolError(
                f"POST /rollout/cancel returned an invalid response: {exc}", status_code=200
            ) from exc

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
        bound = self._settings.health_timeout_sec
        try:
            async with asyncio.timeout(bound):
                response = await self._transport.send(
                    "GET",
                    self._transport.url("health"),
                    timeout=self._settings.timeout(read_sec=bound, pool_sec=bound),
                )
        except TimeoutError as exc:
            if isinstance(exc, aiohttp.ClientError):
                raise
            raise TimeoutError(f"GET /health did not answer within {bound} seconds") from exc
        return health_payload(response)

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
        timeout = check_seconds("timeout_sec", timeout_sec)
        interval = check_seconds("poll_interval_sec", poll_interval_sec)
        pinned: object = process_id
        if pinned is not None and (not isinstance(pinned, str) or not pinned):
            raise ValueError(
                f"process_id must be a non-empty string from health(), or None; got {pinned!r}"
            )
        last = "no answer yet"
        scope = asyncio.timeout(timeout)
        try:
            async with scope:
                while True:
                    try:
                        health = await self.health()
                    except RolloutProtocolVersionError:
                        raise
                    except RolloutProtocolError as exc:
                        if exc.status_code == 200 or exc.status_code not in (
                            WAIT_IDLE_RETRY_STATUSES
                        ):
                            raise
                        last = f"HTTP {exc.status_code}"
                    except (aiohttp.ClientError, OSError) as exc:
                        last = f"{type(exc).__name__}: {exc}"
                    else:
                        pinned = check_identity(health, pinned)
                        lifecycle = lifecycle_of(health)
                        if lifecycle.active_rollouts == 0:
                            return health
                        last = f"active_rollouts={lifecycle.active_rollouts}"
                    await self._settings.sleep(interval)
        except TimeoutError as exc:
            if not scope.expired():
                raise
            raise TimeoutError(
                f"the rollout server at {self.url} did not become idle within {timeout} "
                f"seconds (last observation: {last})"
            ) from exc
