"""``RolloutClientPool``: one client over several rollout servers.

One :class:`ServerChannel` per server does the protocol work (admission, result polls,
cancel, health), as for :class:`RolloutClient`; the pool chooses the server of each
admission and keeps a view of every server: the rollouts it has outstanding there, whether
it is in rotation, until when a 429 keeps it busy, and its last ``process_id``.

Routing of one admission (all of it within ``admission_timeout_sec``):

1. Among the servers in rotation that no 429 keeps busy, take the one with the fewest
   outstanding rollouts (admissions in progress count); ties go round-robin.
2. 429: the server is skipped until its ``Retry-After`` passes (read and clamped as
   :class:`RolloutClient` does, with the pool's :class:`RetrySettings`) and the next is
   tried; when every server in rotation is busy, wait for the first to be free again.
3. A transport failure, or 502, 503 or 504: the server is taken out of rotation and the
   next is tried (a 503 whose ``detail`` is "rollout server is shutting down" marks it as
   shutting down; another 503 is a gateway's). Anything else (202, 401, 409, 422, ...) is
   answered as :class:`RolloutClient` answers it.
4. When no server is left in rotation, the servers out of rotation are probed at once;
   when none of them comes back, :class:`RolloutServersUnavailableError` names each server
   and why it cannot be used, and which of them are shutting down.

A server out of rotation is probed with ``GET /health`` every ``probe_interval_sec`` and
comes back when it answers 200 and (when it says) accepts rollouts. Result polls that end
on a transport failure or a gateway status also take their server out. Every health answer
(probes, :meth:`RolloutClientPool.health`, :meth:`RolloutClientPool.wait_idle`) records the
server's ``process_id``; a new one means the server restarted, which is logged and counted.

Each server is a :class:`ServerChannel` (the protocol work, shared with
:class:`RolloutClient`); the pool's view of it and the probes live in ``_rotation.py``;
this module holds the routing and the public calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import aiohttp

from rollout_types import (
    CancelRolloutsResponse,
    RolloutInitRequest,
    RolloutResultResponse,
    check_api_key,
    check_seconds,
)

from ._admission import admission_answer, admission_deadline, is_shutting_down
from ._api import RolloutApi
from ._channel import ServerChannel, checked_session
from ._errors import (
    RolloutNotFoundError,
    RolloutProtocolError,
    RolloutProtocolVersionError,
    RolloutServersUnavailableError,
)
from ._handle import RolloutHandle
from ._retry import RetrySettings, parse_retry_after
from ._rotation import PROBE_INTERVAL_SEC, PoolServer, PoolServerStatus, Rotation, failure
from ._settings import settings_with
from ._transport import classify

__all__ = [
    "ENDED_ROUTES_KEPT",
    "PROBE_INTERVAL_SEC",
    "UNAVAILABLE_STATUSES",
    "RolloutClientPool",
]

ENDED_ROUTES_KEPT: Final = 10_000
"""Ended rollouts whose server the pool still remembers for :meth:`cancel_rollout`."""

UNAVAILABLE_STATUSES: Final = frozenset({502, 503, 504})
"""Statuses that take a server out of rotation: an admission answered so was not admitted
by the rollout server (503 is its "shutting down"; 502 and 504 come from a gateway in
front of it), and a result poll ends so only after its gateway retries."""


class RolloutClientPool(RolloutApi):
    """Spread rollouts over several rollout servers and survive one going away.

    It has the methods of :class:`RolloutClient`. Each admission goes to the server in
    rotation with the fewest outstanding rollouts (ties round-robin); a 429 from one server
    tries another, a transport failure or a 502/503/504 takes the server out of rotation
    and tries another. The returned :class:`RolloutHandle` stays bound to the server that
    admitted the rollout: its polls, and :meth:`cancel_rollout`, go there only. A server
    out of rotation is probed (``GET /health``) every ``probe_interval_sec`` and comes back
    once healthy; a changed ``process_id`` (a restart) is detected per server. See
    :meth:`servers` for the pool's view.

    A transport failure or gateway status during admission does not prove the server did
    not admit the rollout: if it did, nobody polls it there, and the server fails it as
    ``lease_expired`` (cancelling its work) when its polling lease runs out.

    Args:
        urls: Base URLs of the servers (at least one, no duplicates), such as
            ``["http://10.0.0.1:8000", "http://10.0.0.2:8000"]``.
        http_client: A session the caller owns and closes, used for every server; default
            None (each server's client creates its own, closed by :meth:`aclose`).
        admission_timeout_sec: Bound on one admission, every server tried, 429 waits and
            probes included, seconds; finite; zero or negative expire at once; default None
            (no bound).
        api_key: The servers' bearer key (the same for all); default None.
        probe_interval_sec: Pause between health probes of a server out of rotation,
            seconds; finite and > 0; default 5.
        retry: The retry schedules of every server's client (result polls, and the
            ``Retry-After`` clamp of a 429, which here skips the server that long);
            default None (``RetrySettings()``, as for :class:`RolloutClient`).

    Raises:
        ValueError: ``urls`` is empty, holds an invalid or duplicate URL, or a duration or
            ``api_key`` is invalid (as for :class:`RolloutClient`).
        TypeError: ``urls`` is a single string, ``http_client`` is not an
            :class:`aiohttp.ClientSession`, or ``retry`` not a
            :class:`~rollout_client.RetrySettings`.

    .. versionadded:: 0.2
    """

    def __init__(
        self,
        *,
        urls: Iterable[str],
        http_client: aiohttp.ClientSession | None = None,
        admission_timeout_sec: float | None = None,
        api_key: str | None = None,
        probe_interval_sec: float = PROBE_INTERVAL_SEC,
        retry: RetrySettings | None = None,
    ) -> None:
        given: object = urls
        if isinstance(given, str | bytes):
            raise TypeError(
                f"urls must be a list of server URLs, not a single string; got {given!r} "
                "(pass urls=[...])"
            )
        session = checked_session(http_client)
        settings = settings_with(retry)
        key = check_api_key(api_key)
        channels = [
            ServerChannel(url=url, api_key=key, session=session, settings=settings) for url in urls
        ]
        if not channels:
            raise ValueError("urls must hold at least one rollout server URL")
        seen: set[str] = set()
        for channel in channels:
            if channel.url in seen:
                raise ValueError(f"urls lists {channel.url!r} twice; list each server once")
            seen.add(channel.url)
        self._admission_timeout_sec = (
            None
            if admission_timeout_sec is None
            else check_seconds("admission_timeout_sec", admission_timeout_sec, allow_negative=True)
        )
        self._servers = tuple(PoolServer(index=i, channel=c) for i, c in enumerate(channels))
        self._rotation = Rotation(
            servers=self._servers,
            probe_interval_sec=check_seconds("probe_interval_sec", probe_interval_sec),
        )
        self._next = 0
        self._live: dict[str, PoolServer] = {}
        self._ended: dict[str, PoolServer] = {}
        self._started = False
        self._closed = False

    def __repr__(self) -> str:
        return f"<RolloutClientPool urls={list(self.urls)!r}>"

    @property
    def urls(self) -> tuple[str, ...]:
        """The servers' base URLs, trailing ``/`` removed, in the order given."""
        return tuple(server.url for server in self._servers)

    def servers(self) -> tuple[PoolServerStatus, ...]:
        """The pool's current view of each server, in the order of :attr:`urls`.

        Nothing is sent; :meth:`health` asks every server now.
        """
        return tuple(server.status() for server in self._servers)

    async def aclose(self) -> None:
        """Stop probes and the polling of unfinished handles; close the sessions it owns.

        A caller-owned ``http_client`` stays open. Calling it twice is harmless.
        """
        self._closed = True
        await self._rotation.aclose()
        for server in self._servers:
            await server.channel.aclose()

    def _channels(self) -> tuple[ServerChannel, ...]:
        return tuple(server.channel for server in self._servers)

    def _ready(self) -> None:
        """Raise when closed; on first use, start a probe of every server."""
        if self._closed:
            raise RuntimeError("this RolloutClientPool is closed; create a new one")
        if not self._started:
            # Learn every server's process_id (and who is down) without delaying the caller.
            self._started = True
            for server in self._servers:
                self._rotation.probe_soon(server)

    async def _submit(self, request: RolloutInitRequest) -> RolloutHandle:
        self._ready()
        rollout_id = request.rollout_id
        running = self._live.get(rollout_id)
        if running is not None:
            raise ValueError(
                f"rollout {rollout_id!r} is in flight through this pool already (admitted by "
                f"{running.url}); use a fresh rollout_id per attempt"
            )
        return await self._admit(request)

    async def _admit(self, request: RolloutInitRequest) -> RolloutHandle:
        """Try servers until one admits the rollout, within the admission deadline."""
        rollout_id = request.rollout_id
        failed: dict[str, str] = {}
        async with admission_deadline(rollout_id, self._admission_timeout_sec) as attempt:
            while True:
                server = self._pick(failed)
                if server is None:
                    await self._when_none_free(rollout_id, failed)
                    continue
                attempt.in_flight = True
                handle = await self._try(server, request, failed)
                attempt.in_flight = False
                if handle is not None:
                    return handle

    async def _try(
        self, server: PoolServer, request: RolloutInitRequest, failed: dict[str, str]
    ) -> RolloutHandle | None:
        """One ``POST /rollout`` to ``server``: the handle, or None when another server (or
        a later attempt) must take the rollout; a server that failed goes into ``failed``."""
        server.outstanding += 1
        handle: RolloutHandle | None = None
        try:
            try:
                response, sent_at = await server.channel.send_admission(request)
            except (aiohttp.ClientError, OSError) as exc:
                if classify(exc) is None:
                    raise
                failed[server.url] = f"POST /rollout failed: {failure(exc)}"
                self._rotation.take_out(server, failed[server.url])
                return None
            if response.status == 429:
                settings = server.channel.settings
                server.busy_until = settings.clock() + parse_retry_after(
                    response.headers, settings.retry
                )
                return None
            if response.status in UNAVAILABLE_STATUSES:
                shutting_down = is_shutting_down(response)
                failed[server.url] = f"POST /rollout answered {response.status}" + (
                    " (shutting down)" if shutting_down else " (gateway)"
                )
                self._rotation.take_out(server, failed[server.url], shutting_down=shutting_down)
                return None
            admitted = admission_answer(request.rollout_id, response)
            handle = server.channel.start_polling(
                admitted, sent_at, on_done=self._finished(server, admitted.rollout_id)
            )
        finally:
            if handle is None:
                server.outstanding -= 1
        self._track(server, handle.rollout_id)
        return handle

    def _pick(self, failed: Mapping[str, str]) -> PoolServer | None:
        """The free server in rotation with the fewest outstanding rollouts (round-robin ties)."""
        now = self._rotation.settings.clock()
        count = len(self._servers)
        best: PoolServer | None = None
        best_key = (0, 0)
        for server in self._servers:
            if not server.available or server.url in failed or server.busy_until > now:
                continue
            key = (server.outstanding, (server.index - self._next) % count)
            if best is None or key < best_key:
                best, best_key = server, key
        if best is not None:
            self._next = (best.index + 1) % count
        return best

    async def _when_none_free(self, rollout_id: str, failed: Mapping[str, str]) -> None:
        """Wait for a busy server, or probe the ones out of rotation; raise if none is left."""
        busy = [
            server.busy_until
            for server in self._servers
            if server.available and server.url not in failed
        ]
        if busy:
            settings = self._rotation.settings
            await settings.sleep(max(min(busy) - settings.clock(), 0.0))
            return
        out = [s for s in self._servers if not s.available and s.url not in failed]
        await self._rotation.probe_all(out)
        if any(server.available for server in out):
            return
        reasons = {s.url: failed.get(s.url) or s.reason or "out of rotation" for s in self._servers}
        raise RolloutServersUnavailableError(
            f"no rollout server can take rollout {rollout_id}: "
            + "; ".join(f"{url}: {why}" for url, why in reasons.items()),
            rollout_id=rollout_id,
            reasons=reasons,
            shutting_down=frozenset(s.url for s in self._servers if s.shutting_down),
        )

    def _track(self, server: PoolServer, rollout_id: str) -> None:
        self._ended.pop(rollout_id, None)
        self._live[rollout_id] = server
        self._rotation.notify()

    def _finished(
        self, server: PoolServer, rollout_id: str
    ) -> Callable[[asyncio.Task[RolloutResultResponse]], None]:
        """What to do once the polling of ``rollout_id`` on ``server`` has finished."""

        def finished(task: asyncio.Task[RolloutResultResponse]) -> None:
            server.outstanding -= 1
            if self._live.get(rollout_id) is server:
                del self._live[rollout_id]
                self._ended[rollout_id] = server
                if len(self._ended) > ENDED_ROUTES_KEPT:
                    del self._ended[next(iter(self._ended))]
            self._rotation.notify()
            exc = None if task.cancelled() else task.exception()
            if exc is None or self._closed:
                return
            if classify(exc) is not None or (
                isinstance(exc, RolloutProtocolError) and exc.status_code in UNAVAILABLE_STATUSES
            ):
                reason = f"result poll of {rollout_id} failed: {failure(exc)}"
                self._rotation.take_out(server, reason)
            elif isinstance(exc, RolloutProtocolError) and exc.status_code == 404:
                self._rotation.probe_soon(server)  # it forgot an admitted rollout: restarted?

        return finished

    async def cancel_rollout(self, rollout_id: str) -> CancelRolloutsResponse:
        """Ask the server that admitted a rollout to cancel it (as
        :meth:`RolloutClient.cancel_rollout`: bounded to 5 s, never retried).

        The pool knows the server of every rollout it has in flight and of the last
        10,000 (``ENDED_ROUTES_KEPT``) that ended.

        Raises:
            RolloutNotFoundError: This pool did not admit ``rollout_id`` (or forgot it).
            TimeoutError: No answer within 5 s.
            RolloutProtocolError: A status other than 200, or an invalid body.
            aiohttp.ClientError: The request failed on a transport error.
        """
        self._ready()
        given: object = rollout_id
        if not isinstance(given, str):
            raise TypeError(f"rollout_id must be a string; got {type(given).__name__}")
        server = self._live.get(rollout_id) or self._ended.get(rollout_id)
        if server is None:
            raise RolloutNotFoundError(
                f"rollout {rollout_id!r} was not admitted through this pool (or ended more "
                f"than {ENDED_ROUTES_KEPT} rollouts ago), so its server is unknown; cancel it "
                "with a RolloutClient on the server that admitted it"
            )
        return await server.channel.cancel_rollout(rollout_id)

    async def health(self) -> dict[str, PoolServerStatus]:
        """Ask every server's ``GET /health`` now (concurrently, each bounded to 10 s).

        A server that answers 200 is in rotation afterwards (unless its ``lifecycle`` says
        it is shutting down), one that does not is out; its ``process_id`` is recorded.
        No server's failure raises.

        Returns:
            Each server's status by URL, in the order of :attr:`urls`, with ``health``
            holding the payload of those that answered.
        """
        self._ready()
        answers = await self._rotation.probe_all(self._servers)
        return {
            server.url: server.status(answer)
            for server, answer in zip(self._servers, answers, strict=True)
        }

    async def wait_idle(
        self,
        timeout_sec: float = 120.0,
        poll_interval_sec: float = 1.0,
        process_ids: Mapping[str, str] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Wait until every server reports ``lifecycle.active_rollouts`` 0, concurrently.

        Each server is waited for as :meth:`RolloutClient.wait_idle` does, pinned to the
        ``process_id`` the pool last saw there (or the one ``process_ids`` gives), so a
        server that restarted meanwhile raises instead of looking idle.

        Args:
            timeout_sec: Overall bound, seconds; finite and > 0; default 120.
            poll_interval_sec: Pause between health checks of a server, seconds; finite and
                > 0; default 1.
            process_ids: Expected ``process_id`` by server URL (from :meth:`health`);
                default None: the pool's last observation (none yet: the first one seen).

        Returns:
            Each server's health payload that reported no active rollouts, by URL.

        Raises:
            ValueError: A duration is not finite and positive, or ``process_ids`` names a
                URL that is not one of the pool's.
            TimeoutError: A server did not become idle within ``timeout_sec``.
            RolloutProtocolError: A server restarted, has no lifecycle identity, or failed
                ``/health`` with a status not waited out (the message names the server).
        """
        self._ready()
        check_seconds("timeout_sec", timeout_sec)
        check_seconds("poll_interval_sec", poll_interval_sec)
        pins = dict(process_ids or {})
        unknown = sorted(set(pins) - set(self.urls))
        if unknown:
            raise ValueError(
                f"process_ids names {unknown}, which are not servers of this pool {list(self.urls)}"
            )
        tasks = {
            server: asyncio.ensure_future(
                server.channel.wait_idle(
                    timeout_sec, poll_interval_sec, pins.get(server.url, server.process_id)
                )
            )
            for server in self._servers
        }
        try:
            await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        idle: dict[str, dict[str, Any]] = {}
        for server, task in tasks.items():
            exc = None if task.cancelled() else task.exception()
            if isinstance(exc, RolloutProtocolError):
                raise _naming(server.url, exc) from exc
            if exc is not None:
                raise exc
            if task.cancelled():
                continue  # another server's failure stopped it; that one is raised above
            idle[server.url] = task.result()
            self._rotation.observe(server, idle[server.url])
        return idle

    async def _wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds; it is checked after every change of a server's
        rotation or restarts, every admission and every handle that finishes. Unbounded:
        the caller bounds it."""
        await self._rotation.wait_for(predicate)


def _naming(url: str, exc: RolloutProtocolError) -> RolloutProtocolError:
    """The same error with the server's URL in front of its message."""
    message = f"rollout server {url}: {exc}"
    if isinstance(exc, RolloutProtocolVersionError):
        return RolloutProtocolVersionError(
            message,
            status_code=exc.status_code,
            client_version=exc.client_version,
            server_version=exc.server_version,
        )
    return RolloutProtocolError(message, status_code=exc.status_code)
