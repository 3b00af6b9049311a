"""``RolloutClient``: submit rollouts to a rollout server and collect their results."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, Final, Self

import aiohttp

from rollout_types import (
    PROTOCOL_VERSION,
    CancelRolloutsRequest,
    CancelRolloutsResponse,
    RolloutInitRequest,
    RolloutInitResponse,
    RolloutLifecycle,
    RolloutResultResponse,
    WireValidationError,
    check_api_key,
    check_seconds,
    dumps,
    loads,
    structure_wire,
)

from ._errors import (
    UNAUTHORIZED_HINT,
    RolloutAdmissionTimeoutError,
    RolloutProtocolError,
    RolloutProtocolVersionError,
)
from ._handle import RolloutHandle
from ._polling import Lease, poll_until_terminal
from ._retry import WAIT_IDLE_RETRY_STATUSES, parse_retry_after
from ._settings import DEFAULT_SETTINGS, ClientSettings
from ._transport import HttpResponse, Transport

__all__ = ["RolloutClient"]

_MAY_HAVE_SUCCEEDED: Final = (
    "; admission may have succeeded; the server requests cancellation when an unobserved "
    "rollout's polling lease expires"
)
_CALLBACK_PROTOCOL_SERVER: Final = "0.3 (osmosis-ai <= 0.3.2 callback protocol)"
_DETAIL_LIMIT: Final = 300


def _detail(body: bytes) -> str:
    """A short, secret-free summary of an error body's ``detail`` for messages."""
    try:
        detail = loads(body).get("detail")
    except (WireValidationError, AttributeError):
        return ""
    if isinstance(detail, str):
        text = detail
    elif isinstance(detail, list):
        parts = []
        for entry in detail:
            if isinstance(entry, dict):
                loc = ".".join(str(p) for p in entry.get("loc", ()))
                parts.append(f"{loc}: {entry.get('msg', '')}")
        text = "; ".join(parts)
    else:
        return ""
    if len(text) > _DETAIL_LIMIT:
        text = text[:_DETAIL_LIMIT] + "..."
    return f": {text}" if text else ""


def _is_callback_protocol_rejection(body: bytes) -> bool:
    """Whether a 422 is an osmosis-ai <= 0.3.2 server missing ``completion_callback_url``."""
    try:
        detail = loads(body).get("detail")
    except (WireValidationError, AttributeError):
        return False
    return isinstance(detail, list) and any(
        isinstance(entry, dict) and entry.get("loc") == ["body", "completion_callback_url"]
        for entry in detail
    )


_ADMISSION_HINTS: Final = {
    401: UNAUTHORIZED_HINT,
    409: " (the rollout_id is already registered on the server: use a fresh id per attempt)",
    503: " (the server is shutting down and admits no new rollouts)",
}


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

    Raises:
        ValueError: ``url`` is not an absolute http(s) URL, ``admission_timeout_sec`` is
            not finite, or ``api_key`` is empty, whitespace-only or holds control
            characters.
        TypeError: ``http_client`` is not an :class:`aiohttp.ClientSession`.

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        *,
        url: str,
        http_client: aiohttp.ClientSession | None = None,
        admission_timeout_sec: float | None = None,
        api_key: str | None = None,
    ) -> None:
        session: object = http_client
        if session is not None and not isinstance(session, aiohttp.ClientSession):
            raise TypeError(
                f"http_client must be an aiohttp.ClientSession or None; got "
                f"{type(session).__name__}"
            )
        self._admission_timeout_sec = (
            None
            if admission_timeout_sec is None
            else check_seconds("admission_timeout_sec", admission_timeout_sec, allow_negative=True)
        )
        self._transport = Transport(url=url, api_key=check_api_key(api_key), session=http_client)
        self._settings: ClientSettings = DEFAULT_SETTINGS
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

    def _timeout(self, *, read_sec: float, pool_sec: float) -> aiohttp.ClientTimeout:
        connect = self._settings.connect_timeout_sec
        return aiohttp.ClientTimeout(
            total=None, connect=max(pool_sec, connect), sock_connect=connect, sock_read=read_sec
        )

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

        Admission retries HTTP 429 after the answer's ``Retry-After`` (missing or invalid:
        1 s; clamped to [0.05, 60] s) and accepts only a 202 whose body is valid and echoes
        ``rollout_id``. Nothing else is retried: a caller that retries after a transport
        error must expect 409 if the first attempt was in fact admitted.

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
        request = _build_request(
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
        try:
            body = dumps(request).encode()
        except (ValueError, TypeError) as exc:
            raise ValueError(
                f"the request for rollout {rollout_id!r} is not valid JSON: {exc}; "
                "messages, metadata and extra_fields must hold finite JSON values only"
            ) from exc
        admitted, sent_at = await self._admit(rollout_id, body)
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

    async def _admit(self, rollout_id: str, body: bytes) -> tuple[RolloutInitResponse, float]:
        """POST the admission, retrying 429s, within the admission deadline."""
        timeout_sec = self._admission_timeout_sec
        if timeout_sec is not None and timeout_sec <= 0:
            raise RolloutAdmissionTimeoutError(
                f"admission for rollout {rollout_id} timed out after {timeout_sec} seconds",
                rollout_id=rollout_id,
                may_have_succeeded=False,
            )
        settings = self._settings
        url = self._transport.url("rollout")
        loop = asyncio.get_running_loop()
        scope = asyncio.timeout_at(None if timeout_sec is None else loop.time() + timeout_sec)
        in_flight = False
        try:
            async with scope:
                while True:
                    sent_at = settings.clock()
                    in_flight = True
                    response = await self._transport.send(
                        "POST",
                        url,
                        body=body,
                        timeout=self._timeout(
                            read_sec=settings.admission_read_timeout_sec,
                            pool_sec=settings.admission_read_timeout_sec,
                        ),
                    )
                    in_flight = False
                    if response.status == 429:
                        await settings.sleep(parse_retry_after(response.headers))
                        continue
                    return _admission_answer(rollout_id, response), sent_at
        except TimeoutError as exc:
            if not scope.expired():
                raise
            raise RolloutAdmissionTimeoutError(
                f"admission for rollout {rollout_id} timed out after {timeout_sec} seconds"
                + (_MAY_HAVE_SUCCEEDED if in_flight else ""),
                rollout_id=rollout_id,
                may_have_succeeded=in_flight,
            ) from exc

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
                f"POST /rollout/cancel returned {response.status}{_detail(response.body)}",
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
                    timeout=self._timeout(read_sec=bound, pool_sec=bound),
                )
        except TimeoutError as exc:
            if isinstance(exc, aiohttp.ClientError):
                raise
            raise TimeoutError(f"GET /health did not answer within {bound} seconds") from exc
        if response.status != 200:
            raise RolloutProtocolError(
                f"GET /health failed with HTTP {response.status}{_detail(response.body)}",
                status_code=response.status,
            )
        try:
            data = loads(response.body)
        except WireValidationError as exc:
            raise RolloutProtocolError(
                "GET /health returned invalid JSON", status_code=200
            ) from exc
        if not isinstance(data, dict):
            raise RolloutProtocolError(
                f"GET /health returned invalid JSON: expected an object, got {type(data).__name__}",
                status_code=200,
            )
        return data

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
                        pinned = _check_identity(health, pinned)
                        lifecycle = _lifecycle(health)
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


def _check_identity(health: dict[str, Any], pinned: object) -> str:
    """Return the process id to pin, or raise when the server has none or restarted."""
    process_id = health.get("process_id")
    if not isinstance(process_id, str) or not process_id:
        raise RolloutProtocolError(
            "Server has no lifecycle identity: GET /health carries no process_id (servers "
            "before osmosis-ai 0.3.5 report none), so wait_idle() cannot tell a restart",
            status_code=200,
        )
    if pinned is None:
        return process_id
    if process_id != pinned:
        raise RolloutProtocolError(
            f"Server restarted while waiting: its process_id is {process_id!r}, expected "
            f"{pinned!r}; work of the earlier process cannot be observed any more",
            status_code=200,
        )
    return process_id


def _lifecycle(health: dict[str, Any]) -> RolloutLifecycle:
    try:
        return structure_wire(health.get("lifecycle"), RolloutLifecycle, loc=("lifecycle",))
    except WireValidationError as exc:
        raise RolloutProtocolError(
            f"Server has no valid lifecycle state: {exc}", status_code=200
        ) from exc


def _admission_answer(rollout_id: str, response: HttpResponse) -> RolloutInitResponse:
    """Accept a 202 with a valid body for ``rollout_id``; raise for anything else."""
    status = response.status
    if status == 202:
        try:
            admitted = structure_wire(loads(response.body), RolloutInitResponse)
        except WireValidationError as exc:
            raise RolloutProtocolError(
                f"POST /rollout returned an invalid response: {exc}", status_code=202
            ) from exc
        if admitted.rollout_id != rollout_id:
            raise RolloutProtocolError(
                f"POST /rollout returned a different rollout_id ({admitted.rollout_id!r} "
                f"instead of {rollout_id!r})",
                status_code=202,
            )
        return admitted
    if status == 422 and _is_callback_protocol_rejection(response.body):
        raise RolloutProtocolVersionError(
            "the rollout server speaks the pre-0.3.3 callback protocol (osmosis-ai <= 0.3.2, "
            "it requires completion_callback_url) and is too old for this client, which "
            f"speaks the pull protocol (rollout protocol {PROTOCOL_VERSION}); upgrade the "
            "client and the server together",
            status_code=422,
            client_version=PROTOCOL_VERSION,
            server_version=_CALLBACK_PROTOCOL_SERVER,
        )
    raise RolloutProtocolError(
        f"POST /rollout returned {status}; only 202 and 429 are accepted"
        + _ADMISSION_HINTS.get(status, "")
        + _detail(response.body),
        status_code=status,
    )


def _build_request(
    *,
    initial_messages: list[dict[str, Any]],
    chat_completions_url: str,
    rollout_id: str,
    llm_api_key: str | None,
    label: str | None,
    metadata: dict[str, Any] | None,
    grade: bool,
    agent_timeout_sec: float | None,
    grader_timeout_sec: float | None,
    extra_fields: dict[str, Any] | None,
) -> RolloutInitRequest:
    """Build the admission body and validate it as the server would (spec section 3.2)."""
    checks: tuple[tuple[str, object, type | tuple[type, ...], bool], ...] = (
        ("rollout_id", rollout_id, str, False),
        ("chat_completions_url", chat_completions_url, str, False),
        ("initial_messages", initial_messages, list, False),
        ("llm_api_key", llm_api_key, str, True),
        ("label", label, str, True),
        ("metadata", metadata, dict, True),
        ("grade", grade, bool, False),
        ("extra_fields", extra_fields, dict, True),
    )
    for name, value, expected, optional in checks:
        if (value is None and optional) or isinstance(value, expected):
            continue
        wanted = expected.__name__ if isinstance(expected, type) else expected
        raise TypeError(
            f"{name} must be {'None or ' if optional else ''}a {wanted}; got {type(value).__name__}"
        )
    for name, seconds in (
        ("agent_timeout_sec", agent_timeout_sec),
        ("grader_timeout_sec", grader_timeout_sec),
    ):
        if seconds is not None:
            check_seconds(name, seconds, allow_negative=True)
    return RolloutInitRequest(
        initial_messages=initial_messages,
        rollout_id=rollout_id,
        chat_completions_url=chat_completions_url,
        label=label,
        metadata=metadata,
        llm_api_key=llm_api_key,
        grade=grade,
        agent_timeout_sec=agent_timeout_sec,
        grader_timeout_sec=grader_timeout_sec,
        extra_fields=extra_fields,
    )
