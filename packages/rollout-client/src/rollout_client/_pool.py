"""``RolloutClientPool``: one client over several rollout servers.

One :class:`RolloutClient` per server does the protocol work (admission, result polls,
cancel, health); the pool chooses the server of each admission and keeps a view of every
server: the rollouts it has outstanding there, whether it is in rotation, until when a 429
keeps it busy, and its last ``process_id``.

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

The module is over 500 lines on purpose: routing, rotation and probes all read and change
the same per-server state (:class:`_Server`) and wake the same waiters, so split apart each
part would reach into the other's private state; about a quarter of it is docstrings.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Final, Self

import aiohttp
import attrs

from rollout_types import CancelRolloutsResponse, RolloutResultResponse, check_seconds

from ._admission import admission_answer, admission_deadline, is_shutting_down, request_body
from ._client import RolloutClient
from ._errors import (
    RolloutClientError,
    RolloutNotFoundError,
    RolloutProtocolError,
    RolloutProtocolVersionError,
    RolloutServersUnavailableError,
)
from ._handle import RolloutHandle
from ._retry import RetrySettings, parse_retry_after
from ._settings import ClientSettings, settings_with
from ._transport import classify

__all__ = [
    "ENDED_ROUTES_KEPT",
    "PROBE_INTERVAL_SEC",
    "UNAVAILABLE_STATUSES",
    "PoolServerStatus",
    "RolloutClientPool",
]

logger: Final = logging.getLogger("rollout_client")

PROBE_INTERVAL_SEC: Final = 5.0
"""Default pause between two health probes of a server out of rotation, seconds."""

ENDED_ROUTES_KEPT: Final = 10_000
"""Ended rollouts whose server the pool still remembers for :meth:`cancel_rollout`."""

UNAVAILABLE_STATUSES: Final = frozenset({502, 503, 504})
"""Statuses that take a server out of rotation: an admission answered so was not admitted
by the rollout server (503 is its "shutting down"; 502 and 504 come from a gateway in
front of it), and a result poll ends so only after its gateway retries."""


@attrs.frozen(kw_only=True)
class PoolServerStatus:
    """One server of a :class:`RolloutClientPool`, as the pool sees it.

    Attributes:
        url: The server's base URL.
        available: Whether it is in rotation (new rollouts may go to it).
        outstanding: Rollouts this pool admitted there (or is admitting) whose handle
            still polls.
        process_id: The server's last ``process_id`` seen in a ``/health`` answer, or None.
        restarts: How often that ``process_id`` changed while the pool watched.
        reason: Why it is out of rotation (None while available).
        health: The ``/health`` payload, when the status comes from
            :meth:`RolloutClientPool.health` and the server answered; else None.

    .. versionadded:: 0.2
    """

    url: str
    available: bool
    outstanding: int
    process_id: str | None
    restarts: int
    reason: str | None
    health: dict[str, Any] | None = None


class _Server:
    """The pool's mutable view of one server."""

    def __init__(self, *, index: int, client: RolloutClient) -> None:
        self.index = index
        self.client = client
        self.url = client.url
        self.outstanding = 0
        self.available = True
        self.reason: str | None = None
        self.shutting_down = False
        """Out of rotation because it is shutting down (its last reason says so)."""
        self.busy_until = -math.inf
        """``settings.clock`` time before which a 429 keeps it out of routing."""
        self.process_id: str | None = None
        self.restarts = 0
        self.changes = 0
        """Rotation changes so far: a probe's verdict counts only if none happened meanwhile."""
        self.probe: asyncio.Task[dict[str, Any] | None] | None = None
        self.probe_changes = 0
        self.watcher: asyncio.Task[None] | None = None

    def status(self, health: dict[str, Any] | None = None) -> PoolServerStatus:
        return PoolServerStatus(
            url=self.url,
            available=self.available,
            outstanding=self.outstanding,
            process_id=self.process_id,
            restarts=self.restarts,
            reason=self.reason,
            health=health,
        )


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class RolloutClientPool:
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
        clients = [
            RolloutClient(url=url, http_client=http_client, api_key=api_key, retry=retry)
            for url in urls
        ]
        if not clients:
            raise ValueError("urls must hold at least one rollout server URL")
        seen: set[str] = set()
        for client in clients:
            if client.url in seen:
                raise ValueError(f"urls lists {client.url!r} twice; list each server once")
            seen.add(client.url)
        self._admission_timeout_sec = (
            None
            if admission_timeout_sec is None
            else check_seconds("admission_timeout_sec", admission_timeout_sec, allow_negative=True)
        )
        self._probe_interval_sec = check_seconds("probe_interval_sec", probe_interval_sec)
        self._servers = tuple(_Server(index=i, client=c) for i, c in enumerate(clients))
        self._settings: ClientSettings = settings_with(retry)
        """The retry schedules, the 429 waits' sleep and the clock (as each client's)."""
        self._next = 0
        self._live: dict[str, _Server] = {}
        self._ended: dict[str, _Server] = {}
        self._started = False
        self._closed = False
        self._waiters: list[asyncio.Future[None]] = []

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
        """Stop probes and the polling of unfinished handles; close the sessions it owns.

        A caller-owned ``http_client`` stays open. Calling it twice is harmless.
        """
        self._closed = True
        tasks = [
            task
            for server in self._servers
            for task in (server.probe, server.watcher)
            if task is not None
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for server in self._servers:
            await server.client.aclose()

    def _ready(self) -> None:
        """Raise when closed; on first use, start a probe of every server."""
        if self._closed:
            raise RuntimeError("this RolloutClientPool is closed; create a new one")
        if not self._started:
            # Learn every server's process_id (and who is down) without delaying the caller.
            self._started = True
            for server in self._servers:
                self._probe_soon(server)

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
        """Admit a rollout on one of the servers and wait until it terminates.

        Arguments, errors and routing are those of :meth:`run_rollout_async`; the result
        and the polling errors those of :meth:`RolloutClient.run_rollout`.
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
        """Admit a rollout on one of the servers; the handle polls that server.

        The arguments are those of :meth:`RolloutClient.run_rollout_async`; the routing is
        described in the class docstring.

        Returns:
            The handle, bound to the server that admitted the rollout.

        Raises:
            ValueError: The request is invalid, or ``rollout_id`` is in flight through this
                pool already (checked before any I/O).
            TypeError: ``rollout_id`` is not a string or ``grade`` not a bool.
            RolloutServersUnavailableError: No server can take the rollout (its
                ``reasons`` say why, per server).
            RolloutAdmissionTimeoutError: ``admission_timeout_sec`` expired.
            RolloutProtocolVersionError: A server speaks an incompatible protocol version.
            RolloutProtocolError: A server answered a status other than 202, 429, 502, 503
                and 504 (409 for a duplicate id, 401, 422, ...), or an invalid 202 body.
        """
        self._ready()
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
        running = self._live.get(rollout_id)
        if running is not None:
            raise ValueError(
                f"rollout {rollout_id!r} is in flight through this pool already (admitted by "
                f"{running.url}); use a fresh rollout_id per attempt"
            )
        return await self._admit(rollout_id, body)

    async def _admit(self, rollout_id: str, body: bytes) -> RolloutHandle:
        """Try servers until one admits the rollout, within the admission deadline."""
        failed: dict[str, str] = {}
        async with admission_deadline(rollout_id, self._admission_timeout_sec) as attempt:
            while True:
                server = self._pick(failed)
                if server is None:
                    await self._when_none_free(rollout_id, failed)
                    continue
                attempt.in_flight = True
                handle = await self._try(server, rollout_id, body, failed)
                attempt.in_flight = False
                if handle is not None:
                    return handle

    async def _try(
        self, server: _Server, rollout_id: str, body: bytes, failed: dict[str, str]
    ) -> RolloutHandle | None:
        """One ``POST /rollout`` to ``server``: the handle, or None when another server (or
        a later attempt) must take the rollout; a server that failed goes into ``failed``."""
        server.outstanding += 1
        handle: RolloutHandle | None = None
        try:
            try:
                response, sent_at = await server.client._send_admission(body)
            except (aiohttp.ClientError, OSError) as exc:
                if classify(exc) is None:
                    raise
                failed[server.url] = f"POST /rollout failed: {_failure(exc)}"
                self._take_out(server, failed[server.url])
                return None
            if response.status == 429:
                server.busy_until = self._settings.clock() + parse_retry_after(
                    response.headers, self._settings.retry
                )
                return None
            if response.status in UNAVAILABLE_STATUSES:
                shutting_down = is_shutting_down(response)
                failed[server.url] = f"POST /rollout answered {response.status}" + (
                    " (shutting down)" if shutting_down else " (gateway)"
                )
                self._take_out(server, failed[server.url], shutting_down=shutting_down)
                return None
            admitted = admission_answer(rollout_id, response)
            handle = server.client._start_polling(admitted, sent_at)
        finally:
            if handle is None:
                server.outstanding -= 1
        self._track(server, handle)
        return handle

    def _pick(self, failed: Mapping[str, str]) -> _Server | None:
        """The free server in rotation with the fewest outstanding rollouts (round-robin ties)."""
        now = self._settings.clock()
        count = len(self._servers)
        best: _Server | None = None
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
            await self._settings.sleep(max(min(busy) - self._settings.clock(), 0.0))
            return
        out = [s for s in self._servers if not s.available and s.url not in failed]
        await self._probe_all(out)
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

    def _track(self, server: _Server, handle: RolloutHandle) -> None:
        rollout_id = handle.rollout_id
        self._ended.pop(rollout_id, None)
        self._live[rollout_id] = server
        self._notify()

        def finished(handle: RolloutHandle) -> None:
            server.outstanding -= 1
            if self._live.get(rollout_id) is server:
                del self._live[rollout_id]
                self._ended[rollout_id] = server
                if len(self._ended) > ENDED_ROUTES_KEPT:
                    del self._ended[next(iter(self._ended))]
            self._notify()
            task = handle._task
            exc = None if task.cancelled() else task.exception()
            if exc is None or self._closed:
                return
            if classify(exc) is not None or (
                isinstance(exc, RolloutProtocolError) and exc.status_code in UNAVAILABLE_STATUSES
            ):
                self._take_out(server, f"result poll of {rollout_id} failed: {_failure(exc)}")
            elif isinstance(exc, RolloutProtocolError) and exc.status_code == 404:
                self._probe_soon(server)  # it forgot an admitted rollout: did it restart?

        handle._on_done(finished)

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
        return await server.client.cancel_rollout(rollout_id)

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
        answers = await self._probe_all(self._servers)
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
                server.client.wait_idle(
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
            self._observe(server, idle[server.url])
        return idle

    # -- rotation and probes ------------------------------------------------------------

    def _take_out(self, server: _Server, reason: str, *, shutting_down: bool = False) -> None:
        server.reason = reason
        server.shutting_down = shutting_down
        if server.available:
            server.available = False
            server.changes += 1
            logger.warning("Rollout server %s is out of rotation: %s", server.url, reason)
            self._notify()
        if server.watcher is None and not self._closed:
            server.watcher = asyncio.get_running_loop().create_task(self._watch(server))

    def _bring_back(self, server: _Server) -> None:
        server.reason = None
        server.shutting_down = False
        if not server.available:
            server.available = True
            server.changes += 1
            server.busy_until = -math.inf
            logger.warning("Rollout server %s is back in rotation", server.url)
            self._notify()

    def _observe(self, server: _Server, health: Mapping[str, Any]) -> None:
        """Record the ``process_id`` of a health answer; a new one is a restart."""
        process_id = health.get("process_id")
        if not isinstance(process_id, str) or not process_id:
            return
        if server.process_id is not None and process_id != server.process_id:
            server.restarts += 1
            logger.warning(
                "Rollout server %s restarted (process_id %s, before %s): rollouts the earlier "
                "process admitted are lost",
                server.url,
                process_id,
                server.process_id,
            )
            self._notify()
        server.process_id = process_id

    async def _watch(self, server: _Server) -> None:
        """Probe a server out of rotation every ``probe_interval_sec`` until it is back."""
        try:
            while not server.available:
                await asyncio.sleep(self._probe_interval_sec)
                if not server.available:
                    await self._probe(server)
        finally:
            server.watcher = None

    def _probe_soon(self, server: _Server) -> None:
        """Start a probe unless one started since the server's last rotation change runs."""
        probe = server.probe
        if probe is None or probe.done() or server.probe_changes != server.changes:
            server.probe_changes = server.changes
            server.probe = asyncio.get_running_loop().create_task(
                self._probe_once(server, server.changes)
            )

    async def _probe(self, server: _Server) -> dict[str, Any] | None:
        """One ``GET /health`` of a server, shared by concurrent callers."""
        self._probe_soon(server)
        assert server.probe is not None
        return await asyncio.shield(server.probe)

    async def _probe_all(self, servers: Iterable[_Server]) -> list[dict[str, Any] | None]:
        return list(await asyncio.gather(*(self._probe(server) for server in servers)))

    async def _probe_once(self, server: _Server, changes: int) -> dict[str, Any] | None:
        """``GET /health``: bring the server back when healthy, take it out otherwise.

        The verdict is dropped when the server's rotation changed while the probe ran (the
        change came from later evidence, such as a failed admission).
        """
        try:
            health = await server.client.health()
        except (RolloutClientError, aiohttp.ClientError, OSError) as exc:
            if server.changes == changes:
                self._take_out(server, f"GET /health failed: {_failure(exc)}")
            return None
        self._observe(server, health)
        if server.changes != changes:
            return health
        lifecycle = health.get("lifecycle")
        if isinstance(lifecycle, dict) and lifecycle.get("accepting_rollouts") is False:
            reason = "shutting down (GET /health: accepting_rollouts is false)"
            self._take_out(server, reason, shutting_down=True)
        else:
            self._bring_back(server)
        return health

    # -- state changes, for callers inside the package ----------------------------------

    def _override_settings(self, **changes: Any) -> None:
        """Replace timing fields of the pool's settings and of every server's client (the
        seam of :func:`rollout_client.testing.override_timing`)."""
        self._settings = attrs.evolve(self._settings, **changes)
        for server in self._servers:
            server.client._settings = attrs.evolve(server.client._settings, **changes)

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds; it is checked after every change of a server's
        rotation or restarts, every admission and every handle that finishes. Unbounded:
        the caller bounds it."""
        loop = asyncio.get_running_loop()
        while not predicate():
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            await waiter


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
