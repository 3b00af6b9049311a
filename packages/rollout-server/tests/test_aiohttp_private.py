"""The private attributes of aiohttp the server relies on still exist, and the undocumented
methods it overrides keep their signatures (see _aiohttp_private).

If one of these fails after an aiohttp upgrade, that release renamed, dropped or reshaped an
attribute or method: for an attribute the server still works (the code there is a no-op
without it) but loses what it bought; for a method, the override in
:mod:`rollout_server.http._connection` must follow. Update
:mod:`rollout_server.http._aiohttp_private` and the override together.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import StreamReader, web, web_protocol

from rollout_server.http._aiohttp_private import (
    KEEPALIVE_HANDLE,
    MAKE_HANDLER,
    OVERRIDDEN_METHODS,
    PRIVATE_ATTRIBUTES,
    install_request_handler,
    last_parsed_payload,
    parsed_count,
    pause_keepalive_timer,
)
from rollout_server.http._connection import GuardedRequestHandler


async def _serve_one(aiohttp_client: Any, handler: Any, app: web.Application | None = None) -> Any:
    """Serve ``handler`` at ``POST /`` and send it one request; return the test client."""
    app = web.Application() if app is None else app
    app.router.add_post("/", handler)
    client = await aiohttp_client(app)
    async with client.post("/", data=b"body") as response:
        assert response.status == 200
        await response.read()
    return client


class _Recording(web.RequestHandler):
    """A connection protocol that records what the private accessors see as data arrives."""

    seen: list[Any]

    def __init__(self, manager: web.Server, *, seen: list[Any], **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.seen = seen

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.seen.append((parsed_count(self), last_parsed_payload(self)))


class TestPrivateAttributes:
    async def test_each_one_exists_on_a_real_request_handler(self, aiohttp_client: Any) -> None:
        """After a real request, the connection's handler is aiohttp's RequestHandler, its
        server a web.Server and its app a web.Application, each with every attribute listed
        in PRIVATE_ATTRIBUTES."""
        protocols: list[Any] = []

        async def handler(request: web.Request) -> web.Response:
            protocols.append(request.protocol)
            return web.Response(text="ok")

        app = web.Application()
        client = await _serve_one(aiohttp_client, handler, app)
        (protocol,) = protocols
        assert set(PRIVATE_ATTRIBUTES) == {"RequestHandler", "Server", "Application"}
        assert isinstance(protocol, web_protocol.RequestHandler)
        holders = {
            "RequestHandler": protocol,
            "Server": client.server.runner.server,
            "Application": app,
        }
        assert isinstance(holders["Server"], web.Server)
        for cls, names in PRIVATE_ATTRIBUTES.items():
            for name in names:
                assert hasattr(holders[cls], name), f"aiohttp's {cls} has no {name} any more"

    async def test_the_keepalive_timer_is_a_timer_the_pause_cancels(
        self, aiohttp_client: Any
    ) -> None:
        """During a request the keep-alive attribute holds a cancellable timer (asyncio's or
        uvloop's; None where aiohttp keeps none); pausing cancels it and leaves None."""
        seen: list[Any] = []

        async def handler(request: web.Request) -> web.Response:
            handle = getattr(request.protocol, KEEPALIVE_HANDLE)
            pause_keepalive_timer(request)
            seen.append((handle, getattr(request.protocol, KEEPALIVE_HANDLE)))
            return web.Response(text="ok")

        await _serve_one(aiohttp_client, handler)
        ((before, after),) = seen
        assert before is None or callable(before.cancel)
        if before is not None:
            assert before.cancelled()
        assert after is None


def parameters(method: Callable[..., Any]) -> str:
    """A method's parameters after ``self``, without annotations: ``(request, status=500)``."""
    signature = inspect.signature(method)
    bare = [
        parameter.replace(annotation=inspect.Parameter.empty)
        for parameter in list(signature.parameters.values())[1:]
    ]
    return str(signature.replace(parameters=bare, return_annotation=inspect.Signature.empty))


class TestOverriddenMethods:
    @pytest.mark.parametrize("name", sorted(OVERRIDDEN_METHODS))
    def test_aiohttp_keeps_each_signature(self, name: str) -> None:
        """Each undocumented RequestHandler method the server overrides still exists on
        aiohttp's class with the registered parameters."""
        method = getattr(web_protocol.RequestHandler, name, None)
        assert callable(method), f"aiohttp's RequestHandler has no {name} any more"
        assert parameters(method) == OVERRIDDEN_METHODS[name]

    @pytest.mark.parametrize("name", sorted(OVERRIDDEN_METHODS))
    def test_the_override_takes_the_same_parameters(self, name: str) -> None:
        """GuardedRequestHandler's override of each registered method takes the parameters
        aiohttp calls it with."""
        assert parameters(getattr(GuardedRequestHandler, name)) == OVERRIDDEN_METHODS[name]

    def test_every_override_is_registered(self) -> None:
        """Every aiohttp method GuardedRequestHandler overrides is registered, except those of
        asyncio.Protocol (documented API)."""
        own = {
            name
            for name, value in vars(GuardedRequestHandler).items()
            if callable(value) and not name.startswith("__")
        }
        overridden = {name for name in own if hasattr(web_protocol.RequestHandler, name)}
        documented = {name for name in overridden if hasattr(asyncio.Protocol, name)}
        assert documented == {"data_received", "connection_lost"}
        assert overridden - documented == set(OVERRIDDEN_METHODS)


def recording_app(seen: list[Any], **app_options: Any) -> web.Application:
    """An app whose connections are :class:`_Recording` protocols appending to ``seen``."""

    def factory(manager: web.Server, **kwargs: Any) -> web.RequestHandler:
        return _Recording(manager, seen=seen, **kwargs)

    app = web.Application(**app_options)
    assert install_request_handler(app, factory)
    return app


class TestInstalledRequestHandler:
    async def test_the_app_runner_builds_connections_with_the_factory(
        self, aiohttp_client: Any
    ) -> None:
        """An app with an installed factory is served (by aiohttp's test server, an
        AppRunner) with that factory's protocol, which gets the app's handler_args."""
        protocols: list[Any] = []

        async def handler(request: web.Request) -> web.Response:
            protocols.append(request.protocol)
            await request.read()
            return web.Response(text="ok")

        # A handler argument every aiohttp from the floor (3.10.6) on keeps as it is given
        # (max_line_size, say, is no attribute of 3.10.6's protocol).
        marker = logging.getLogger("rollout_server.test_aiohttp_private.marker")
        app = recording_app([], handler_args={"logger": marker})
        assert callable(getattr(app, MAKE_HANDLER))
        await _serve_one(aiohttp_client, handler, app)
        (protocol,) = protocols
        assert type(protocol) is _Recording
        assert protocol.logger is marker

    async def test_the_parsed_queue_shows_each_request_and_its_body(
        self, aiohttp_client: Any
    ) -> None:
        """As a request's bytes arrive, the parsed count grows by one once its headers are
        in, and the last parsed payload is that request's body stream."""
        seen: list[Any] = []
        bodies: list[StreamReader] = []

        async def handler(request: web.Request) -> web.Response:
            bodies.append(request.content)
            await request.read()
            return web.Response(text="ok")

        await _serve_one(aiohttp_client, handler, recording_app(seen))
        counts = [count for count, _payload in seen]
        assert all(isinstance(count, int) for count in counts)
        parsed = [payload for count, payload in seen if count]
        assert parsed, seen
        assert parsed[0] is bodies[0]
