"""Shared fixtures of the cross-package tests: a real rollout server on 127.0.0.1.

``serve_app`` serves an aiohttp app over real HTTP on 127.0.0.1 (port 0) inside the test's
event loop and returns a :class:`RunningServer` (its base ``url``, the ``app`` and the
``RolloutServer`` state); ``serve_rollout`` does the same for
``create_rollout_server(backend=..., **options)``. Servers are stopped at teardown.
:data:`FAST_TIMINGS` are protocol timings short enough for tests.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import attrs
import pytest
from aiohttp import web

from rollout_server import (
    ROLLOUT_SERVER_KEY,
    ExecutionBackend,
    RolloutServer,
    create_rollout_server,
)

FAST_TIMINGS: Final[dict[str, float]] = {
    "result_wait_timeout_sec": 0.5,
    "polling_lease_timeout_sec": 15.0,
}
"""Server timings for tests: half-second long polls, a lease that never expires by accident."""

EVENT_SEC: Final = 20.0
"""Upper bound on waiting for something a test expects (never reached when all is well)."""


class Watched(io.StringIO):
    """A stream that sets ``seen`` once a write contains ``marker``."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker
        self.seen = asyncio.Event()

    def write(self, text: str) -> int:
        if self.marker in text:
            self.seen.set()
        return super().write(text)


@attrs.define(kw_only=True)
class RunningServer:
    """A rollout server serving on 127.0.0.1."""

    url: str
    app: web.Application
    runner: web.AppRunner
    stopped: bool = False

    @property
    def state(self) -> RolloutServer:
        """The server's :class:`RolloutServer` (registry, backend, lifecycle)."""
        return self.app[ROLLOUT_SERVER_KEY]

    async def stop(self) -> None:
        """Stop serving (runs the server's staged shutdown and cleanup); idempotent."""
        if not self.stopped:
            self.stopped = True
            await self.runner.cleanup()


ServeApp = Callable[[web.Application], Awaitable[RunningServer]]
ServeRollout = Callable[..., Awaitable[RunningServer]]


@pytest.fixture
async def serve_app() -> AsyncIterator[ServeApp]:
    """Serve aiohttp apps (such as one from ``create_rollout_server``) on 127.0.0.1."""
    running: list[RunningServer] = []

    async def start(app: web.Application) -> RunningServer:
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=2.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        server = RunningServer(url=f"http://{host}:{port}", app=app, runner=runner)
        running.append(server)
        return server

    yield start
    for server in reversed(running):
        await server.stop()


@pytest.fixture
def serve_rollout(serve_app: ServeApp) -> ServeRollout:
    """Start rollout servers: ``await serve_rollout(backend, api_key=..., ...)``.

    Keyword options go to :func:`create_rollout_server`; :data:`FAST_TIMINGS` apply unless
    overridden.
    """

    async def start(backend: ExecutionBackend, **options: Any) -> RunningServer:
        return await serve_app(
            create_rollout_server(backend=backend, **{**FAST_TIMINGS, **options})
        )

    return start
