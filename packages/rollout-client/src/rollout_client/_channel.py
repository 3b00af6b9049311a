"""``ServerChannel``: the protocol calls against one rollout server.

One channel per server does all of the protocol's work there: a ``POST /rollout``
(single attempts, or admission with its 429 loop), the background result polls of the
rollouts it admitted, ``POST /rollout/cancel``, ``GET /health`` and the ``wait_idle``
loop. :class:`~rollout_client.RolloutClient` holds one channel; ``RolloutClientPool``
holds one per server and routes each admission itself. A channel owns its transport
(session), its timing settings and the polling tasks of its rollouts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import attrs

from rollout_types import (
    CancelRolloutsRequest,
    CancelRolloutsResponse,
    RolloutInitRequest,
    RolloutInitResponse,
    RolloutResultResponse,
    WireValidationError,
    check_seconds,
    dumps,
    loads,
    structure_wire,
)

from ._admission import admit, encode_request, send_admission
from ._errors import RolloutProtocolError, RolloutProtocolVersionError
from ._handle import RolloutHandle
from ._health import check_identity, health_payload, lifecycle_of
from ._polling import Lease, poll_until_terminal
from ._retry import WAIT_IDLE_RETRY_STATUSES
from ._settings import ClientSettings
from ._transport import HttpResponse, Transport

__all__ = ["PollingDone", "ServerChannel", "checked_session"]

PollingDone = Callable[[asyncio.Task[RolloutResultResponse]], None]
"""Called with a rollout's polling task once it has finished (result, error or cancel)."""


def checked_session(http_client: object) -> aiohttp.ClientSession | None:
    """``http_client`` as given, when it is a session or None.

    Raises:
        TypeError: It is anything else.
    """
    if http_client is not None and not isinstance(http_client, aiohttp.ClientSession):
        raise TypeError(
            f"http_client must be an aiohttp.ClientSession or None; got "
            f"{type(http_client).__name__}"
        )
    return http_client


class ServerChannel:
    """Admit, poll, cancel and check health against one rollout server.

    Args:
        url: The server's base URL (checked by :class:`Transport`).
        api_key: The server's bearer key (already checked), or None.
        session: A caller-owned session, or None for one the channel creates and closes.
        settings: The timings and retry schedules; :meth:`override_timing` replaces them.
    """

    def __init__(
        self,
        *,
        url: str,
        api_key: str | None,
        session: aiohttp.ClientSession | None,
        settings: ClientSettings,
    ) -> None:
        self.transport = Transport(url=url, api_key=api_key, session=session)
        self.settings = settings
        self._polls: set[asyncio.Task[RolloutResultResponse]] = set()

    @property
    def url(self) -> str:
        """The server's base URL, trailing ``/`` removed."""
        return str(self.transport.base_url).rstrip("/")

    def override_timing(self, changes: dict[str, Any]) -> None:
        """Replace fields of the settings; rollouts admitted already keep their timing."""
        self.settings = attrs.evolve(self.settings, **changes)

    def polling(self) -> tuple[asyncio.Task[RolloutResultResponse], ...]:
        """The polling tasks of rollouts admitted here that have not finished."""
        return tuple(self._polls)

    async def aclose(self) -> None:
        """Stop every unfinished poll and close the session if the channel owns it."""
        pending = [task for task in self._polls if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            # Each handle keeps its own outcome; this only waits for the tasks to stop.
            await asyncio.wait(pending)
        await self.transport.aclose()

    # -- admission ----------------------------------------------------------------------

    async def send_admission(self, request: RolloutInitRequest) -> tuple[HttpResponse, float]:
        """One ``POST /rollout`` (no 429 retry, no deadline): the answer and its send time."""
        return await send_admission(self.transport, self.settings, encode_request(request))

    async def admit(
        self, request: RolloutInitRequest, *, timeout_sec: float | None
    ) -> RolloutHandle:
        """Admit ``request`` here, retrying 429s within ``timeout_sec``; return its handle."""
        admitted, sent_at = await admit(
            self.transport,
            self.settings,
            rollout_id=request.rollout_id,
            body=encode_request(request),
            timeout_sec=timeout_sec,
        )
        return self.start_polling(admitted, sent_at)

    def start_polling(
        self,
        admitted: RolloutInitResponse,
        sent_at: float,
        *,
        on_done: PollingDone | None = None,
    ) -> RolloutHandle:
        """The handle of an admitted rollout, polling this server in the background.

        Args:
            admitted: The 202 answer.
            sent_at: The send time (``settings.clock``) of the admission that answered.
            on_done: Called with the polling task once it has finished; default None.
        """
        rollout_id = admitted.rollout_id
        lease = Lease(
            token=admitted.polling_lease_token,
            result_wait_timeout_sec=admitted.result_wait_timeout_sec,
            polling_lease_timeout_sec=admitted.polling_lease_timeout_sec,
        )
        transport, settings = self.transport, self.settings
        started: list[asyncio.Task[RolloutResultResponse]] = []

        def poll(
            on_result: Callable[[RolloutResultResponse], None],
        ) -> asyncio.Task[RolloutResultResponse]:
            task = asyncio.get_running_loop().create_task(
                poll_until_terminal(
                    transport=transport,
                    settings=settings,
                    rollout_id=rollout_id,
                    lease=lease,
                    lease_deadline=sent_at + lease.polling_lease_timeout_sec,
                    on_result=on_result,
                ),
                name=f"rollout-poll:{rollout_id}",
            )
            started.append(task)
            return task

        handle = RolloutHandle(rollout_id=rollout_id, status=admitted.status, poll=poll)
        (task,) = started
        self._polls.add(task)
        # After the handle's own callback, so that the handle is final when these run.
        task.add_done_callback(self._polls.discard)
        if on_done is not None:
            task.add_done_callback(on_done)
        return handle

    # -- cancel and health --------------------------------------------------------------

    async def cancel_rollout(self, rollout_id: str) -> CancelRolloutsResponse:
        """``POST /rollout/cancel`` for one rollout, as :meth:`RolloutClient.cancel_rollout`."""
        given: object = rollout_id
        if not isinstance(given, str):
            raise TypeError(f"rollout_id must be a string; got {type(given).__name__}")
        body = dumps(CancelRolloutsRequest(ids=[rollout_id])).encode()
        bound = self.settings.cancel_timeout_sec
        timeout = aiohttp.ClientTimeout(
            total=bound, sock_connect=min(bound, self.settings.connect_timeout_sec)
        )
        try:
            async with asyncio.timeout(bound):
                response = await self.transport.send(
                    "POST", self.transport.url("rollout", "cancel"), body=body, timeout=timeout
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
        """``GET /health``, as :meth:`RolloutClient.health`."""
        bound = self.settings.health_timeout_sec
        try:
            async with asyncio.timeout(bound):
                response = await self.transport.send(
                    "GET",
                    self.transport.url("health"),
                    timeout=self.settings.timeout(read_sec=bound, pool_sec=bound),
                )
        except TimeoutError as exc:
            if isinstance(exc, aiohttp.ClientError):
                raise
            raise TimeoutError(f"GET /health did not answer within {bound} seconds") from exc
        return health_payload(response)

    async def wait_idle(
        self, timeout_sec: float, poll_interval_sec: float, process_id: str | None
    ) -> dict[str, Any]:
        """Poll ``GET /health`` until no rollout is active, as :meth:`RolloutClient.wait_idle`."""
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
                    await self.settings.sleep(interval)
        except TimeoutError as exc:
            if not scope.expired():
                raise
            raise TimeoutError(
                f"the rollout server at {self.url} did not become idle within {timeout} "
                f"seconds (last observation: {last})"
            ) from exc
