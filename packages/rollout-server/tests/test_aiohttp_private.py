"""The private attributes of aiohttp the server relies on still exist (see _aiohttp_private).

If one of these fails after an aiohttp upgrade, that release renamed or dropped an attribute:
the server still works (the code there is a no-op without it) but loses what it bought; find
the new attribute and update :mod:`rollout_server._aiohttp_private`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web, web_protocol

from rollout_server._aiohttp_private import (
    KEEPALIVE_HANDLE,
    PRIVATE_ATTRIBUTES,
    pause_keepalive_timer,
)


async def _serve_one(aiohttp_client: Any, handler: Any) -> None:
    app = web.Application()
    app.router.add_get("/", handler)
    client = await aiohttp_client(app)
    async with client.get("/") as response:
        assert response.status == 200
        await response.read()


class TestPrivateAttributes:
    async def test_each_one_exists_on_a_real_request_handler(self, aiohttp_client: Any) -> None:
        """After a real request, the connection's handler is aiohttp's RequestHandler and has
        every attribute listed in PRIVATE_ATTRIBUTES."""
        protocols: list[Any] = []

        async def handler(request: web.Request) -> web.Response:
            protocols.append(request.protocol)
            return web.Response(text="ok")

        await _serve_one(aiohttp_client, handler)
        (protocol,) = protocols
        assert set(PRIVATE_ATTRIBUTES) == {"RequestHandler"}
        assert isinstance(protocol, web_protocol.RequestHandler)
        for name in PRIVATE_ATTRIBUTES["RequestHandler"]:
            assert hasattr(protocol, name), f"aiohttp's RequestHandler has no {name} any more"

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
