"""The rotation of ``RolloutClientPool``: its view of each server, and the probes.

:class:`PoolServer` is the pool's mutable view of one server (its :class:`ServerChannel`,
outstanding rollouts, whether it is in rotation and why not, 429 busy time, last
``process_id``). :class:`Rotation` changes that view: it takes a server out of rotation,
probes it with ``GET /health`` every ``probe_interval_sec`` until it is healthy again,
records every health answer's ``process_id`` (a new one is a restart) and wakes whoever
waits for a change. The routing of admissions is the pool's (``_pool.py``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import aiohttp
import attrs

from ._channel import ServerChannel
from ._errors import RolloutClientError
from ._settings import ClientSettings

__all__ = ["PROBE_INTERVAL_SEC", "PoolServer", "PoolServerStatus", "Rotation", "failure"]

logger: Final = logging.getLogger("rollout_client")

PROBE_INTERVAL_SEC: Final = 5.0
"""Default pause between two health probes of a server out of rotation, seconds."""


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


class PoolServer:
    """The pool's mutable view of one server."""

    def __init__(self, *, index: int, channel: ServerChannel) -> None:
        self.index = index
        self.channel = channel
        self.url = channel.url
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


def failure(exc: BaseException) -> str:
    """An exception as a reason: its type, and its message when it has one."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Rotation:
    """Which servers are in rotation, the probes that bring them back, and change waiters.

    Args:
        servers: The pool's servers, in the order of its URLs.
        probe_interval_sec: Pause between probes of a server out of rotation, seconds.
    """

    def __init__(self, *, servers: tuple[PoolServer, ...], probe_interval_sec: float) -> None:
        self.servers = servers
        self.closed = False
        self._probe_interval_sec = probe_interval_sec
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def settings(self) -> ClientSettings:
        """The timing every server's channel uses (the 429 waits' sleep and clock)."""
        return self.servers[0].channel.settings

    async def aclose(self) -> None:
        """Stop every probe and watcher; later failures take no server out."""
        self.closed = True
        tasks = [
            task
            for server in self.servers
            for task in (server.probe, server.watcher)
            if task is not None
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def take_out(self, server: PoolServer, reason: str, *, shutting_down: bool = False) -> None:
        """Take ``server`` out of rotation for ``reason`` and watch it until it is back."""
        server.reason = reason
        server.shutting_down = shutting_down
        if server.available:
            server.available = False
            server.changes += 1
            logger.warning("Rollout server %s is out of rotation: %s", server.url, reason)
            self.notify()
        if server.watcher is None and not self.closed:
            server.watcher = asyncio.get_running_loop().create_task(self._watch(server))

    def _bring_back(self, server: PoolServer) -> None:
        server.reason = None
        server.shutting_down = False
        if not server.available:
            server.available = True
            server.changes += 1
            server.busy_until = -math.inf
            logger.warning("Rollout server %s is back in rotation", server.url)
            self.notify()

    def observe(self, server: PoolServer, health: Mapping[str, Any]) -> None:
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
            self.notify()
        server.process_id = process_id

    async def _watch(self, server: PoolServer) -> None:
        """Probe a server out of rotation every ``probe_interval_sec`` until it is back."""
        try:
            while not server.available:
                await asyncio.sleep(self._probe_interval_sec)
                if not server.available:
                    await self.probe(server)
        finally:
            server.watcher = None

    def probe_soon(self, server: PoolServer) -> None:
        """Start a probe unless one started since the server's last rotation change runs."""
        probe = server.probe
        if probe is None or probe.done() or server.probe_changes != server.changes:
            server.probe_changes = server.changes
            server.probe = asyncio.get_running_loop().create_task(
                self._probe_once(server, server.changes)
            )

    async def probe(self, server: PoolServer) -> dict[str, Any] | None:
        """One ``GET /health`` of a server, shared by concurrent callers."""
        self.probe_soon(server)
        assert server.probe is not None
        return await asyncio.shield(server.probe)

    async def probe_all(self, servers: Iterable[PoolServer]) -> list[dict[str, Any] | None]:
        """Probe ``servers`` concurrently: each one's health payload, or None."""
        return list(await asyncio.gather(*(self.probe(server) for server in servers)))

    async def _probe_once(self, server: PoolServer, changes: int) -> dict[str, Any] | None:
        """``GET /health``: bring the server back when healthy, take it out otherwise.

        The verdict is dropped when the server's rotation changed while the probe ran (the
        change came from later evidence, such as a failed admission).
        """
        try:
            health = await server.channel.health()
        except (RolloutClientError, aiohttp.ClientError, OSError) as exc:
            if server.changes == changes:
                self.take_out(server, f"GET /health failed: {failure(exc)}")
            return None
        self.observe(server, health)
        if server.changes != changes:
            return health
        lifecycle = health.get("lifecycle")
        if isinstance(lifecycle, dict) and lifecycle.get("accepting_rollouts") is False:
            reason = "shutting down (GET /health: accepting_rollouts is false)"
            self.take_out(server, reason, shutting_down=True)
        else:
            self._bring_back(server)
        return health

    def notify(self) -> None:
        """Wake every :meth:`wait_for` to check its predicate again."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds; it is checked after every :meth:`notify`.
        Unbounded: the caller bounds it."""
        loop = asyncio.get_running_loop()
        while not predicate():
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            await waiter
