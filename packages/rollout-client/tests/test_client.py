"""``RolloutClient`` construction, sessions and closing."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from rollout_client import RolloutClient
from rollout_client._transport import make_session

from .conftest import EVENT_SEC, init_body, json_response, result_body

MESSAGES = [{"role": "user", "content": "hi"}]


class TestConstructor:
    @pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), "5", True])
    def test_admission_timeout_must_be_finite(self, value):
        """A non-finite (or non-numeric) admission_timeout_sec raises ValueError."""
        with pytest.raises(ValueError, match="admission_timeout_sec"):
            RolloutClient(url="http://127.0.0.1:1", admission_timeout_sec=value)

    @pytest.mark.parametrize("value", [0, -3, 0.5, 60])
    def test_admission_timeout_accepts_finite(self, value):
        """Finite values, zero and negative included, are accepted."""
        RolloutClient(url="http://127.0.0.1:1", admission_timeout_sec=value)

    @pytest.mark.parametrize("key", ["", "   ", "\t\n", "a\nb", 5])
    def test_api_key_rejected(self, key):
        """An empty, whitespace-only or control-character api_key raises ValueError."""
        with pytest.raises(ValueError, match="api_key"):
            RolloutClient(url="http://127.0.0.1:1", api_key=key)

    @pytest.mark.parametrize(
        "url", ["", "127.0.0.1:8000", "ftp://host", "http://", "http://h/?q=1", "/rollout"]
    )
    def test_bad_url(self, url):
        """A URL that is not an absolute http(s) base raises ValueError."""
        with pytest.raises(ValueError, match="url"):
            RolloutClient(url=url)

    def test_http_client_type(self):
        """http_client must be an aiohttp.ClientSession."""
        with pytest.raises(TypeError, match=r"aiohttp\.ClientSession"):
            RolloutClient(url="http://127.0.0.1:1", http_client=object())  # type: ignore[arg-type]

    def test_constructed_outside_a_loop(self):
        """The client can be built at import time, with no running loop."""
        client = RolloutClient(url="http://127.0.0.1:8000/", api_key=" k ")
        assert client.url == "http://127.0.0.1:8000"

    def test_keyword_only(self):
        """Constructor arguments are keyword-only."""
        with pytest.raises(TypeError):
            RolloutClient("http://127.0.0.1:1")  # type: ignore[misc]


class TestSessions:
    async def test_key_sent_untrimmed(self, serve, make_client):
        """The bearer key is sent as given, untrimmed."""
        server = await serve(web.get("/health", lambda r: json_response({})))
        client = make_client(server.url, api_key=" k")
        await client.health()
        assert server.requests[0].headers["Authorization"] == "Bearer  k"

    async def test_caller_session_used_and_kept_open(self, serve):
        """A caller's session carries the requests and stays open after aclose()."""
        server = await serve(web.get("/health", lambda r: json_response({"ok": 1})))
        async with aiohttp.ClientSession(headers={"X-Caller": "yes"}) as session:
            client = RolloutClient(url=server.url, http_client=session)
            assert await client.health() == {"ok": 1}
            await client.aclose()
            assert not session.closed
        assert server.requests[0].headers["X-Caller"] == "yes"

    async def test_owned_session_closed(self, serve):
        """The client's own session is created on use and closed by aclose()."""
        server = await serve(web.get("/health", lambda r: json_response({})))
        client = RolloutClient(url=server.url)
        await client.health()
        session = client._channel.transport._session
        assert session is not None
        await client.aclose()
        assert session.closed
        with pytest.raises(RuntimeError, match="closed"):
            await client.health()
        await client.aclose()

    async def test_async_with(self, serve):
        """``async with RolloutClient(...)`` closes the owned session on exit."""
        server = await serve(web.get("/health", lambda r: json_response({})))
        async with RolloutClient(url=server.url) as client:
            await client.health()
            session = client._channel.transport._session
        assert session is not None
        assert session.closed

    async def test_aclose_stops_polling(self, serve):
        """aclose() cancels unfinished handles instead of leaving tasks behind."""
        polled = asyncio.Event()

        async def result(request: web.Request) -> web.Response:
            polled.set()
            await server.hang()
            return json_response(result_body("r1"))

        server = await serve(
            web.post("/rollout", lambda r: json_response(init_body("r1", wait=5), 202)),
            web.get("/rollout/r1/result", result),
        )
        client = RolloutClient(url=server.url)
        handle = await client.run_rollout_async(MESSAGES, "u", "r1")
        async with asyncio.timeout(EVENT_SEC):
            await polled.wait()
        await client.aclose()
        assert handle.done()
        with pytest.raises(asyncio.CancelledError):
            await handle

    async def test_owned_connector_unbounded(self):
        """The owned session's pool has no connection limit and no total timeout."""
        session = make_session()
        try:
            connector = session.connector
            assert isinstance(connector, aiohttp.TCPConnector)
            assert connector.limit == 0
            assert connector.limit_per_host == 0
            assert session.timeout.total is None
        finally:
            await session.close()

    async def test_many_concurrent_polls_one_session(self, serve):
        """More concurrent long polls than aiohttp's default pool size all complete."""
        count = 150
        arrived = 0
        all_arrived = asyncio.Event()

        async def result(request: web.Request) -> web.Response:
            nonlocal arrived
            arrived += 1
            if arrived >= count:
                all_arrived.set()
            await all_arrived.wait()
            return json_response(result_body(request.match_info["rid"]))

        server = await serve(
            web.post("/rollout", _admit),
            web.get("/rollout/{rid}/result", result),
        )
        async with RolloutClient(url=server.url) as client:
            async with asyncio.timeout(EVENT_SEC * 3):
                results = await asyncio.gather(
                    *(client.run_rollout(MESSAGES, "u", f"r{i}") for i in range(count))
                )
        assert {r.rollout_id for r in results} == {f"r{i}" for i in range(count)}


async def _admit(request: web.Request) -> web.Response:
    body = await request.json()
    return json_response(init_body(body["rollout_id"], wait=30.0, lease=120.0), 202)
