"""The model gateway: routing (consistent hashing with bounded loads), reading answers into
turns, and forwarding through real listeners to the chat stand-in and to small apps that
misbehave on purpose (no token ids, malformed logprobs, dropped streams, huge answers)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rollout_server import ModelGateway, ServerConfigError
from rollout_server.gateway._capture import StreamReader, read_completion
from rollout_server.gateway._ring import EndpointRing
from rollout_types import TurnFlag

from .standin_loader import load_standin

EVENT_SEC = 20.0


STANDIN = load_standin()
QUESTION = [{"role": "user", "content": "What is 17 * 23?"}]
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]  # fmt: skip


# -- routing --------------------------------------------------------------------------------


class TestEndpointRing:
    ENDPOINTS = ("http://a/v1", "http://b/v1", "http://c/v1")

    def test_a_key_has_a_home(self) -> None:
        """With no load, a key always lands on the same endpoint (its prefix cache)."""
        ring = EndpointRing(self.ENDPOINTS)
        first = ring.acquire("g:42")
        ring.release("g:42")
        assert all(ring.acquire("g:42") == first and ring.release("g:42") is None for _ in range(5))

    def test_a_pinned_key_stays_whatever_the_load(self) -> None:
        """Siblings of a group admitted while it is in flight all go to its endpoint."""
        ring = EndpointRing(self.ENDPOINTS)
        home = ring.acquire("g:group")
        assert {ring.acquire("g:group") for _ in range(20)} == {home}
        assert ring.load(home) == 21

    def test_load_is_bounded(self) -> None:
        """No endpoint holds more than ceil(1.25 * mean) of distinct keys."""
        ring = EndpointRing(self.ENDPOINTS, load_factor=1.25)
        for k in range(300):
            ring.acquire(f"r:{k}")
        loads = [ring.load(endpoint) for endpoint in self.ENDPOINTS]
        assert sum(loads) == 300
        assert max(loads) <= -(-1.25 * 300 // 3)

    def test_release_unpins(self) -> None:
        """Once a key's rollouts are done its load is gone and it may move."""
        ring = EndpointRing(self.ENDPOINTS)
        home = ring.acquire("r:x")
        ring.acquire("r:x")
        ring.release("r:x")
        ring.release("r:x")
        ring.release("r:x")  # more releases than acquires: ignored
        assert ring.load(home) == 0

    @pytest.mark.parametrize(
        ("endpoints", "factor"), [((), 1.25), (("http://a", "http://a"), 1.25), (("x",), 1.0)]
    )
    def test_bad_arguments(self, endpoints: tuple[str, ...], factor: float) -> None:
        """No endpoint, a duplicate, or a bound of 1 is refused."""
        with pytest.raises(ValueError):
            EndpointRing(endpoints, load_factor=factor)

    def test_gateway_refuses_a_non_http_endpoint(self) -> None:
        """--model-endpoint must be an http(s) URL."""
        with pytest.raises(ServerConfigError, match="not an http"):
            ModelGateway(endpoints=["localhost:8000"])


# -- reading answers ------------------------------------------------------------------------


def completion(**choice: Any) -> bytes:
    document: dict[str, Any] = {"id": "c", "choices": [{"index": 0, **choice}]}
    extra = choice.pop("_top", None)
    if extra:
        document["choices"][0].pop("_top")
        document.update(extra)
    return json.dumps(document).encode()


def entries(*pairs: tuple[str, float]) -> dict[str, Any]:
    return {"content": [{"token": t, "logprob": lp, "top_logprobs": []} for t, lp in pairs]}


class TestReadCompletion:
    def test_vllm_fields(self) -> None:
        """prompt_token_ids at the top, token_ids and logprobs on the choice."""
        parts = read_completion(
            completion(
                message={"role": "assistant", "content": "hi"},
                finish_reason="stop",
                token_ids=[5, 6],
                logprobs=entries(("h", -0.5), ("i", -0.25)),
                _top={"prompt_token_ids": [1, 2, 3], "metadata": {"weight_version": "w9"}},
            )
        )
        assert parts.prompt_token_ids == [1, 2, 3]
        assert parts.completion_token_ids == [5, 6]
        assert parts.logprobs == [-0.5, -0.25]
        assert parts.weight_version == "w9"
        assert parts.response_message == {"role": "assistant", "content": "hi"}
        assert parts.flags == []

    def test_ids_from_token_id_strings(self) -> None:
        """With return_tokens_as_token_ids, the ids come from the logprob tokens."""
        parts = read_completion(
            completion(
                message={"role": "assistant", "content": "x"},
                logprobs=entries(("token_id:7", -1.0), ("token_id:8", -2.0)),
            )
        )
        assert parts.completion_token_ids == [7, 8]
        assert parts.flags == [TurnFlag.NO_PROMPT_TOKEN_IDS]

    def test_no_token_fields(self) -> None:
        """A plain OpenAI answer: the message, and a flag per missing field."""
        parts = read_completion(completion(message={"role": "assistant", "content": "x"}))
        assert parts.response_message == {"role": "assistant", "content": "x"}
        assert parts.flags == [
            TurnFlag.NO_PROMPT_TOKEN_IDS,
            TurnFlag.NO_COMPLETION_TOKEN_IDS,
            TurnFlag.NO_LOGPROBS,
        ]

    @pytest.mark.parametrize(
        "logprobs",
        [
            {"content": [{"token": "a", "logprob": "high"}]},
            {"content": [{"token": "a", "logprob": 0.5}]},
            {"content": "nope"},
            [1, 2],
            {"content": [{"token": "a", "logprob": -1.0}, {"token": "b", "logprob": -1.0}]},
            {"content": [{"token": "a", "logprob": True}]},
            {"content": [{"token": "a", "logprob": float("nan")}]},
            {"content": [{"token": "a", "logprob": float("-inf")}]},
            {"content": [{"token": "a", "logprob": -(10**400)}]},
            {"content": [{"token": "a"}]},
            {"content": ["a"]},
        ],
    )
    def test_malformed_logprobs_are_dropped(self, logprobs: Any) -> None:
        """Non-numbers (booleans too), positive, NaN, infinite or out-of-range values, a
        missing value, wrong shapes or a count that does not match the token ids: no
        logprobs, flagged; the token ids stay."""
        parts = read_completion(
            completion(
                message={"role": "assistant", "content": "a"}, token_ids=[1], logprobs=logprobs
            )
        )
        assert parts.logprobs is None
        assert TurnFlag.MALFORMED_LOGPROBS in parts.flags
        assert parts.completion_token_ids == [1]

    def test_integer_and_huge_logprobs_are_numbers(self) -> None:
        """An integer logprob reads as a float; values whose sum overflows still count."""
        parts = read_completion(
            completion(
                message={"role": "assistant", "content": "ab"},
                token_ids=[1, 2, 3],
                logprobs=entries(("a", 0), ("b", -1e308), ("c", -1e308)),
            )
        )
        assert parts.logprobs == [0.0, -1e308, -1e308]
        assert TurnFlag.MALFORMED_LOGPROBS not in parts.flags

    @pytest.mark.parametrize("ids", [[1, -2], ["1"], [True], "1 2", [1.5]])
    def test_malformed_token_ids(self, ids: Any) -> None:
        """Token ids must be non-negative integers."""
        parts = read_completion(completion(message={"role": "assistant"}, token_ids=ids))
        assert parts.completion_token_ids is None
        assert TurnFlag.MALFORMED_TOKEN_IDS in parts.flags

    @pytest.mark.parametrize("body", [b"<html>", b"[]", b'{"choices": []}', b'{"choices": [1]}'])
    def test_not_a_completion(self, body: bytes) -> None:
        """An answer that is not a chat completion is flagged, not raised."""
        assert TurnFlag.NOT_A_COMPLETION in read_completion(body).flags


def sse(*events: Any, done: bool = True) -> bytes:
    text = "".join(f"data: {json.dumps(event)}\n\n" for event in events)
    return (text + ("data: [DONE]\n\n" if done else "")).encode()


class TestStreamReader:
    EVENTS = (
        {"prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"role": "assistant",
            "content": ""}, "token_ids": []}]},
        {"choices": [{"index": 0, "delta": {"content": "The "}, "token_ids": [10],
            "logprobs": entries(("The ", -0.1))}]},
        {"choices": [{"index": 0, "delta": {"content": "end"}, "token_ids": [11],
            "logprobs": entries(("end", -0.2))}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    )  # fmt: skip

    def test_assembles_across_arbitrary_chunk_boundaries(self) -> None:
        """Bytes split anywhere (mid-line, mid-JSON) give the same turn."""
        data = sse(*self.EVENTS)
        for size in (1, 7, 64, len(data)):
            reader = StreamReader(1 << 20)
            for start in range(0, len(data), size):
                reader.feed(data[start : start + size])
            parts = reader.finish(broken=False)
            assert parts.response_message == {"role": "assistant", "content": "The end"}
            assert parts.prompt_token_ids == [1, 2]
            assert parts.completion_token_ids == [10, 11]
            assert parts.logprobs == [-0.1, -0.2]
            assert parts.finish_reason == "stop"
            assert parts.flags == []

    def test_tool_calls(self) -> None:
        """Tool call deltas are joined by index."""
        reader = StreamReader(1 << 20)
        reader.feed(sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [{"index": 0,
                "id": "call_1", "type": "function", "function": {"name": "calc",
                "arguments": ""}}]}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
                "arguments": '{"x": 1}'}}]}, "finish_reason": "tool_calls"}]},
        ))  # fmt: skip
        message = reader.finish(broken=False).response_message
        assert message is not None
        assert message["tool_calls"] == [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "calc", "arguments": '{"x": 1}'},
            }
        ]

    def test_broken_stream_keeps_what_came(self) -> None:
        """A stream cut short: what arrived, flagged disconnected."""
        reader = StreamReader(1 << 20)
        reader.feed(sse(*self.EVENTS[:2], done=False))
        parts = reader.finish(broken=True)
        assert parts.response_message == {"role": "assistant", "content": "The "}
        assert parts.completion_token_ids == [10]
        assert TurnFlag.DISCONNECTED in parts.flags

    def test_stream_without_end_counts_as_disconnected(self) -> None:
        """No [DONE] and no finish reason: it did not end properly."""
        reader = StreamReader(1 << 20)
        reader.feed(sse(*self.EVENTS[:2], done=False))
        assert TurnFlag.DISCONNECTED in reader.finish(broken=False).flags

    def test_too_large(self) -> None:
        """Past the limit, nothing is kept but the flag."""
        reader = StreamReader(100)
        reader.feed(sse(*self.EVENTS))
        parts = reader.finish(broken=False)
        assert parts.flags == [TurnFlag.TOO_LARGE]
        assert parts.response_message is None

    def test_error_event_and_garbage(self) -> None:
        """An error event and a line that is not JSON are flagged."""
        reader = StreamReader(1 << 20)
        reader.feed(b'data: {"error": {"message": "boom"}}\n\ndata: {nope\n\n')
        flags = reader.finish(broken=False).flags
        assert TurnFlag.UPSTREAM_ERROR in flags
        assert TurnFlag.NOT_A_COMPLETION in flags


# -- forwarding -----------------------------------------------------------------------------

Serve = Callable[[web.Application], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Serve an aiohttp app on 127.0.0.1; returns its base URL."""
    servers: list[TestServer] = []

    async def start(app: web.Application) -> str:
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def gateway() -> AsyncIterator[Callable[..., Awaitable[ModelGateway]]]:
    """Start gateways: ``await gateway(**options)``; stopped at teardown."""
    started: list[ModelGateway] = []

    async def start(**options: Any) -> ModelGateway:
        made = ModelGateway(**options)
        await made.start()
        started.append(made)
        return made

    yield start
    for made in started:
        await made.stop()


async def post(url: str, body: Any) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers={"Authorization": "Bearer k"}) as response,
    ):
        return response.status, dict(response.headers), await response.read()


class TestForwarding:
    async def test_a_completion_is_captured_as_the_standin_made_it(
        self, serve: Serve, gateway: Any
    ) -> None:
        """Token ids and logprobs are asked for and recorded exactly; the workflow gets the
        stand-in's answer."""
        app = STANDIN.create_app(STANDIN.StandinConfig(seed=3))
        upstream = await serve(app)
        gw = await gateway()
        route = gw.open_route(
            rollout_id="r1", chat_completions_url=f"{upstream}/v1", weight_version="7"
        )
        status, _, data = await post(
            f"{route.base_url}/chat/completions",
            {"model": "m", "messages": QUESTION, "tools": TOOLS},
        )
        assert status == 200
        answer = json.loads(data)
        made = STANDIN.produced(app)
        assert len(made) == 1
        assert answer["id"] == made[0]["id"]
        (turn,) = route.turns
        assert turn.prompt_token_ids == made[0]["prompt_token_ids"]
        assert turn.completion_token_ids == made[0]["completion_token_ids"]
        assert turn.logprobs == made[0]["logprobs"]
        assert turn.response_message == answer["choices"][0]["message"]
        assert turn.request_messages == QUESTION
        assert turn.weight_version == "7"
        assert turn.status_code == 200
        assert turn.endpoint == f"{upstream}/v1"
        assert turn.flags == []
        assert turn.latency_sec > 0

    async def test_a_stream_passes_byte_for_byte(self, serve: Serve, gateway: Any) -> None:
        """The workflow receives the stand-in's stream unchanged; the turn is assembled."""
        app = STANDIN.create_app(STANDIN.StandinConfig(weight_version="w2"))
        upstream = await serve(app)
        gw = await gateway()
        route = gw.open_route(rollout_id="r1", chat_completions_url=f"{upstream}/v1/")
        body = {"messages": QUESTION, "stream": True, "logprobs": True, "return_token_ids": True}
        status, headers, via_gateway = await post(f"{route.base_url}/chat/completions", body)
        _, _, direct = await post(f"{upstream}/v1/chat/completions", body)
        assert status == 200
        assert headers["Content-Type"] == "text/event-stream"
        made = STANDIN.produced(app)
        # Same stream but for the completion id and timestamp of each chunk.
        first_id, second_id = made[0]["id"], made[1]["id"]
        assert (
            via_gateway.replace(first_id.encode(), second_id.encode()).split(b'"created"')[0]
            == (direct.split(b'"created"')[0])
        )
        (turn,) = route.turns
        assert turn.completion_token_ids == made[0]["completion_token_ids"]
        assert turn.logprobs == made[0]["logprobs"]
        assert turn.prompt_token_ids == made[0]["prompt_token_ids"]
        assert turn.weight_version == "w2"  # the endpoint's own report wins
        assert turn.response_message is not None
        assert turn.response_message["content"] == "The answer is 391."
        assert turn.flags == []

    async def test_the_workflows_own_choice_is_kept(self, serve: Serve, gateway: Any) -> None:
        """A request that says ``logprobs: false`` is not overridden; no token knobs when
        the gateway is told not to ask."""
        app = STANDIN.create_app()
        upstream = await serve(app)
        gw = await gateway(request_token_ids=False)
        route = gw.open_route(rollout_id="r", chat_completions_url=upstream)
        status, _, data = await post(
            f"{route.base_url}/v1/chat/completions", {"messages": QUESTION}
        )
        assert status == 200
        assert "prompt_token_ids" not in json.loads(data)
        assert STANDIN.produced(app) == []
        assert set(route.turns[0].flags) == {
            TurnFlag.NO_PROMPT_TOKEN_IDS,
            TurnFlag.NO_COMPLETION_TOKEN_IDS,
            TurnFlag.NO_LOGPROBS,
        }

    async def test_other_paths_pass_uncaptured(self, serve: Serve, gateway: Any) -> None:
        """GET /models goes through; it is not a turn."""
        upstream = await serve(STANDIN.create_app())
        gw = await gateway()
        route = gw.open_route(rollout_id="r", chat_completions_url=f"{upstream}/v1")
        async with aiohttp.ClientSession() as session, session.get(f"{route.base_url}/models") as r:
            assert r.status == 200
            assert (await r.json())["data"][0]["id"] == STANDIN.MODEL_ID
        assert route.turns == []

    @pytest.mark.parametrize("path", ["/", "/r/", "/r/token", "/r/a{b}/chat/completions", "/x/y"])
    async def test_paths_outside_a_route_are_plain_404s(self, gateway: Any, path: str) -> None:
        """A path that is not ``/r/<token>/<path>`` gets aiohttp's plain 404, as a router
        would give it."""
        gw = await gateway()
        async with aiohttp.ClientSession() as session, session.get(f"{gw.url}{path}") as r:
            assert r.status == 404
            assert await r.text() == "404: Not Found"

    async def test_expect_100_continue(self, serve: Serve, gateway: Any) -> None:
        """A workflow that sends ``Expect: 100-continue`` is told to go on and is answered;
        any other expectation gets 417."""
        upstream = await serve(STANDIN.create_app())
        gw = await gateway()
        route = gw.open_route(rollout_id="r", chat_completions_url=f"{upstream}/v1")
        url = f"{route.base_url}/chat/completions"
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json={"messages": QUESTION}, expect100=True) as r:
                assert r.status == 200
                answer = (await r.json())["choices"][0]["message"]
                assert answer["content"] == "The answer is 391."
            async with session.post(url, data=b"{}", headers={"Expect": "later"}) as r:
                assert r.status == 417
        assert len(route.turns) == 1

    async def test_no_cookie_is_kept_between_calls(self, serve: Serve, gateway: Any) -> None:
        """An endpoint's Set-Cookie reaches the workflow, and is not sent on the next call
        (which may be another rollout's)."""
        seen: list[str | None] = []

        async def handler(request: web.Request) -> web.Response:
            seen.append(request.headers.get("Cookie"))
            response = web.json_response({"ok": True})
            response.set_cookie("session", "one")
            return response

        app = web.Application()
        app.router.add_get("/v1/models", handler)
        # A host name: aiohttp's cookie jar ignores the cookies of IP addresses.
        upstream = (await serve(app)).replace("127.0.0.1", "localhost")
        gw = await gateway()
        route = gw.open_route(rollout_id="r", chat_completions_url=f"{upstream}/v1")
        for _ in range(2):
            async with (
                aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session,
                session.get(f"{route.base_url}/models") as r,
            ):
                assert r.status == 200
                assert "session=one" in r.headers["Set-Cookie"]
        assert seen == [None, None]

    async def test_http_errors_pass_unchanged(self, serve: Serve, gateway: Any) -> None:
        """A 429 with Retry-After reaches the workflow as it was; the turn is flagged."""
        upstream = await serve(STANDIN.create_app(STANDIN.StandinConfig(http_429_rate=1.0)))
        gw = await gateway()
        route = gw.open_route(rollout_id="r", chat_completions_url=f"{upstream}/v1")
        status, headers, data = await post(
            f"{route.base_url}/chat/completions", {"messages": QUESTION}
        )
        assert status == 429
        assert headers["Retry-After"] == "1"
        assert json.loads(data)["error"]["type"] == "rate_limit_error"
        (turn,) = route.turns
        assert turn.status_code == 429
        assert TurnFlag.UPSTREAM_ERROR in turn.flags
        assert turn.response_message is None

    async def test_unreachable_endpoint(self, gateway: Any) -> None:
        """No endpoint listening: 502 gateway_error; the turn says unreachable."""
        gw = await gateway()
        port = closed_port()
        route = gw.open_route(rollout_id="r", chat_completions_url=f"http://127.0.0.1:{port}/v1")
        status, _, data = await post(f"{route.base_url}/chat/completions", {"messages": QUESTION})
        assert status == 502
        assert json.loads(data)["error"]["type"] == "gateway_error"
        (turn,) = route.turns
        assert turn.status_code is None
        assert TurnFlag.UNREACHABLE in turn.flags

    async def test_closed_route_is_404(self, serve: Serve, gateway: Any) -> None:
        """After its rollout, a route answers 404."""
        upstream = await serve(STANDIN.create_app())
        gw = await gateway()
        route = gw.open_route(rollout_id="r", chat_completions_url=upstream)
        gw.close_route(route)
        status, _, data = await post(
            f"{route.base_url}/v1/chat/completions", {"messages": QUESTION}
        )
        assert status == 404
        assert json.loads(data)["error"]["code"] == "route_not_found"
        assert gw.open_routes == 0

    async def test_routes_of_a_group_share_an_endpoint(self, serve: Serve, gateway: Any) -> None:
        """With --model-endpoint URLs, each group is pinned to one endpoint; the request's
        own URL is not used."""
        urls = [await serve(STANDIN.create_app()) for _ in range(3)]
        gw = await gateway(endpoints=[f"{url}/v1" for url in urls])
        homes = {}
        for group in range(12):
            routes = [
                gw.open_route(rollout_id=f"g{group}-{k}", chat_completions_url="http://ignored",
                              group_id=f"g{group}")
                for k in range(4)
            ]  # fmt: skip
            homes[group] = {gw.endpoint_of(route) for route in routes}
        assert all(len(endpoints) == 1 for endpoints in homes.values())
        assert len(set().union(*homes.values())) > 1  # groups spread over endpoints


def closed_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- misbehaving endpoints --------------------------------------------------------------------


def misbehaving(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    return app


class TestBadAnswers:
    async def test_stream_dropped_midway(self, serve: Serve, gateway: Any) -> None:
        """The endpoint drops the connection mid-stream: the workflow's stream breaks too;
        the turn keeps what arrived, flagged disconnected; the gateway serves on."""
        sent = asyncio.Event()

        async def drop(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(sse(*TestStreamReader.EVENTS[:2], done=False))
            sent.set()
            assert request.transport is not None
            request.transport.close()
            return response

        upstream = await serve(misbehaving(drop))
        gw = await gateway()
        route = gw.open_route(rollout_id="r", chat_completions_url=f"{upstream}/v1")
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{route.base_url}/chat/completions", json={"messages": QUESTION, "stream": True}
            ) as response,
        ):
            assert response.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await response.read()
        assert sent.is_set()
        (turn,) = route.turns  # recorded before the workflow's connection was cut
        assert TurnFlag.DISCONNECTED in turn.flags
        assert turn.completion_token_ids == [10]
        assert turn.response_message == {"role": "assistant", "content": "The "}
        # The gateway serves on.
        healthy = await serve(STANDIN.create_app())
        other = gw.open_route(rollout_id="r2", chat_completions_url=f"{healthy}/v1")
        status, _, _ = await post(f"{other.base_url}/chat/completions", {"messages": QUESTION})
        assert status == 200

    async def test_body_dropped_midway(self, serve: Serve, gateway: Any) -> None:
        """A whole answer that breaks off: 502 to the workflow, the turn flagged."""

        async def drop(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            response.content_length = 1000
            await response.prepare(request)
            await response.write(b'{"choices": [')
            assert request.transport is not None
            request.transport.close()
            return response

        upstream = await serve(misbehaving(drop))
        gw = await gateway()
        route = gw.open_route(rollout_id="r", chat_completions_url=f"{upstream}/v1")
        status, _, data = await post(f"{route.base_url}/chat/completions", {"messages": QUESTION})
        assert status == 502
        assert json.loads(data)["error"]["code"] == "upstream_disconnected"
        assert TurnFlag.DISCONNECTED in route.turns[0].flags

    async def test_enormous_answer_passes_unrecorded(self, serve: Serve, gateway: Any) -> None:
        """An answer above the capture limit reaches the workflow whole; the turn says
        too_large and holds no answer."""
        big = json.dumps(
            {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * 300_000}}]}
        ).encode()

        async def huge(_request: web.Request) -> web.Response:
            return web.Response(body=big, content_type="application/json")

        upstream = await serve(misbehaving(huge))
        gw = await gateway(max_capture_bytes=100_000)
        route = gw.open_route(rollout_id="r", chat_completions_url=f"{upstream}/v1")
        status, _, data = await post(f"{route.base_url}/chat/completions", {"messages": QUESTION})
        assert status == 200
        assert data == big
        (turn,) = route.turns
        assert TurnFlag.TOO_LARGE in turn.flags
        assert turn.response_message is None

    async def test_malformed_logprobs_from_an_endpoint(self, serve: Serve, gateway: Any) -> None:
        """Logprobs that are not numbers: dropped and flagged; the rest is kept."""

        async def bad(_request: web.Request) -> web.Response:
            return web.json_response({"prompt_token_ids": [1], "choices": [{"index": 0,
                "message": {"role": "assistant", "content": "a"}, "token_ids": [4],
                "logprobs": {"content": [{"token": "a", "logprob": "NaN"}]}}]})  # fmt: skip

        upstream = await serve(misbehaving(bad))
        gw = await gateway()
        route = gw.open_route(rollout_id="r", chat_completions_url=f"{upstream}/v1")
        status, _, _ = await post(f"{route.base_url}/chat/completions", {"messages": QUESTION})
        assert status == 200
        (turn,) = route.turns
        assert turn.logprobs is None
        assert turn.prompt_token_ids == [1]
        assert turn.completion_token_ids == [4]
        assert turn.flags == [TurnFlag.MALFORMED_LOGPROBS, TurnFlag.NO_LOGPROBS]

    async def test_request_that_is_not_json_is_forwarded(self, serve: Serve, gateway: Any) -> None:
        """A body the gateway cannot read goes on as is; the endpoint's 400 comes back."""
        upstream = await serve(STANDIN.create_app())
        gw = await gateway()
        route = gw.open_route(rollout_id="r", chat_completions_url=f"{upstream}/v1")
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{route.base_url}/chat/completions", data=b"not json") as response,
        ):
            assert response.status == 400
        assert set(route.turns[0].flags) >= {TurnFlag.UNPARSED_REQUEST, TurnFlag.UPSTREAM_ERROR}


class TestAskingForTokens:
    def draft(self) -> Any:
        from rollout_server.execution._turns import ModelRoute
        from rollout_server.gateway._draft import RouteState, TurnDraft

        state = RouteState(
            route=ModelRoute(rollout_id="r", base_url="http://g/r/t"),
            endpoint="http://m/v1",
            ring_key=None,
            weight_version=None,
        )
        return TurnDraft(state=state, index=0, started=0.0)

    @pytest.mark.parametrize(
        ("body", "expected"),
        [
            (b"{}", {"logprobs": True, "return_token_ids": True}),
            (b' {"messages": []}', {"logprobs": True, "return_token_ids": True, "messages": []}),
            (b'{"logprobs": false}', {"logprobs": False, "return_token_ids": True}),
            ('{"m": "é"}'.encode("utf-16"), {"m": "é", "logprobs": True, "return_token_ids": True}),
        ],
    )
    def test_missing_knobs_are_added(self, body: bytes, expected: dict[str, Any]) -> None:
        """Only the knobs the request lacks are added; the rest is kept as sent."""
        sent = self.draft().read_request(body, ask_tokens=True)
        assert json.loads(sent) == expected

    def test_a_request_that_says_everything_goes_unchanged(self) -> None:
        """Nothing to add: the very same bytes."""
        body = b'{"messages": [], "logprobs": true, "return_token_ids": false}'
        assert self.draft().read_request(body, ask_tokens=True) is body
