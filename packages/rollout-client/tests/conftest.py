"""Shared fixtures of rollout-client's tests: small misbehaving aiohttp servers on 127.0.0.1.

* ``serve`` starts an aiohttp app built from route definitions on 127.0.0.1 port 0 and
  records every request it receives (``FakeServer.requests``).
* ``make_client`` builds a :class:`RolloutClient` whose backoff sleeps are instant and
  whose lease clock is simulated (``FakeTime``, installed with the public
  ``rollout_client.testing.override_timing``): every sleep advances the clock by its
  delay, so retry schedules and the lease-fit rule run without waiting.
* Every async test runs under the default event loop and under uvloop (when installed).

These tests never import ``rollout_server``: the client test session installs only
rollout-client and rollout-types.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
import pytest
from aiohttp import web

from rollout_client import RolloutClient
from rollout_client.testing import override_timing

try:
    import uvloop
except ImportError:  # pragma: no cover - not installed in every session
    uvloop = None  # type: ignore[assignment]

EVENT_SEC = 10.0
"""Upper bound on waiting for something a test expects (never reached when all is well)."""


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Run every async test on the default loop and on uvloop."""
    factories: dict[str, Any] = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


def init_body(
    rollout_id: str,
    *,
    wait: float = 0.05,
    lease: float = 60.0,
    status: str = "queued",
    lease_token: str = "tok-1",  # noqa: S107 - a test token, not a secret
) -> dict[str, Any]:
    """A 202 admission body."""
    return {
        "rollout_id": rollout_id,
        "status": status,
        "polling_lease_token": lease_token,
        "result_wait_timeout_sec": wait,
        "polling_lease_timeout_sec": lease,
    }


def result_body(rollout_id: str, status: str = "success", **fields: Any) -> dict[str, Any]:
    """A 200 result body; a success carries a sample with reward 0.5 unless overridden."""
    body: dict[str, Any] = {
        "rollout_id": rollout_id,
        "status": status,
        "sample": None,
        "err_message": None,
        "err_category": None,
    }
    if status == "success":
        body["sample"] = {
            "messages": [{"role": "assistant", "content": "42"}],
            "label": "42",
            "reward": 0.5,
            "remove_sample": False,
            "metrics": {},
            "extra_fields": {},
        }
    body.update(fields)
    return body


@attrs.define
class Seen:
    """One request a fake server received."""

    method: str
    raw_path: str
    headers: dict[str, str]
    body: bytes


class FakeServer:
    """A running fake server: its base URL, what it received, and a release switch."""

    def __init__(self) -> None:
        self.url = ""
        self.requests: list[Seen] = []
        self.release = asyncio.Event()
        """Set at teardown: handlers that hang on purpose wait on it."""
        self.site: web.TCPSite | None = None

    def stop_listening(self) -> None:
        """Close the listening socket now: new connections are refused, open ones live on."""
        assert self.site is not None
        listener = self.site._server
        assert listener is not None
        listener.close()

    def seen(self, method: str, path_prefix: str = "") -> list[Seen]:
        """The received requests with this method whose raw path starts with the prefix."""
        return [
            r for r in self.requests if r.method == method and r.raw_path.startswith(path_prefix)
        ]

    async def hang(self) -> None:
        """Block a handler until teardown."""
        await self.release.wait()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[FakeServer]]]:
    """Start fake servers: ``await serve(web.post("/rollout", handler), ...)``."""
    runners: list[tuple[web.AppRunner, FakeServer]] = []

    async def start(*routes: web.RouteDef) -> FakeServer:
        server = FakeServer()

        @web.middleware
        async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
            server.requests.append(
                Seen(
                    method=request.method,
                    raw_path=request.raw_path,
                    headers=dict(request.headers),
                    body=await request.read(),
                )
            )
            return await handler(request)

        app = web.Application(middlewares=[record])
        app.add_routes([web.route(r.method, r.path, _as_coroutine(r.handler)) for r in routes])
        runner = web.AppRunner(
            app, handle_signals=False, handler_cancellation=True, shutdown_timeout=0.5
        )
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server.site = site
        host, port = runner.addresses[0][:2]
        server.url = f"http://{host}:{port}"
        runners.append((runner, server))
        return server

    yield start
    for runner, server in runners:
        server.release.set()
        await runner.cleanup()


def _as_coroutine(handler: Callable[[web.Request], Any]) -> Handler:
    """Let tests write plain (lambda) handlers; aiohttp wants coroutine functions."""
    if inspect.iscoroutinefunction(handler):
        return handler

    async def call(request: web.Request) -> web.StreamResponse:
        response = handler(request)
        if inspect.isawaitable(response):
            response = await response
        assert isinstance(response, web.StreamResponse)
        return response

    return call


class FakeTime:
    """A simulated clock for lease deadlines: real monotonic time plus every sleep so far.

    ``sleeps`` records each backoff delay; ``extra`` adds more simulated time per sleep (to
    model an oversleeping event loop).
    """

    def __init__(self) -> None:
        self.offset = 0.0
        self.sleeps: list[float] = []
        self.extra = 0.0

    def clock(self) -> float:
        return time.monotonic() + self.offset

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        self.offset += delay + self.extra
        await asyncio.sleep(0)


@pytest.fixture
def fake_time() -> FakeTime:
    """The simulated clock and instant sleeps ``make_client`` installs."""
    return FakeTime()


@pytest.fixture
async def make_client(
    fake_time: FakeTime,
) -> AsyncIterator[Callable[..., RolloutClient]]:
    """Build clients with instant sleeps (see ``FakeTime``); closed at teardown.

    Keyword ``timing`` (a dict) passes more arguments to ``override_timing`` (such as
    ``result_read_grace_sec``); ``real_time=True`` keeps the real sleep and clock. Other
    keywords go to :class:`RolloutClient` (``retry=RetrySettings(...)``, ...).
    """
    clients: list[RolloutClient] = []

    def build(
        url: str,
        *,
        timing: dict[str, Any] | None = None,
        real_time: bool = False,
        **kwargs: Any,
    ) -> RolloutClient:
        client = RolloutClient(url=url, **kwargs)
        if not real_time:
            override_timing(client, sleep=fake_time.sleep, clock=fake_time.clock)
        override_timing(client, **(timing or {}))
        clients.append(client)
        return client

    yield build
    for client in clients:
        await client.aclose()


def json_response(body: Any, status: int = 200, **headers: str) -> web.Response:
    """A JSON answer."""
    return web.json_response(body, status=status, headers=headers or None)


def drop(request: web.Request) -> web.Response:
    """Close the connection without answering (the client sees a disconnect)."""
    assert request.transport is not None
    request.transport.close()
    return web.Response()


def scripted(*answers: Callable[[web.Request], Any]) -> Handler:
    """A handler that gives ``answers`` in order, repeating the last one."""
    remaining = list(answers)

    async def handler(request: web.Request) -> web.StreamResponse:
        answer = remaining.pop(0) if len(remaining) > 1 else remaining[0]
        response = answer(request)
        if asyncio.iscoroutine(response):
            response = await response
        assert isinstance(response, web.StreamResponse)
        return response

    return handler
