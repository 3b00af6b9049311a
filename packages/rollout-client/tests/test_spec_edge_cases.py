"""Edge cases of wire-protocol section 9 that the other client suites leave unproven.

Each class names the section 9 item it pins down; ``tests/SPEC_COVERAGE.md`` maps every
item to its tests.
"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from rollout_client import RolloutProtocolError

from .conftest import init_body, json_response, result_body

MESSAGES = [{"role": "user", "content": "hi"}]


class TestItem44ReadTimeouts:
    async def test_third_read_timeout_propagates(self, serve, make_client, fake_time):
        """A poll exceeding wait + grace is retried after 0.1 s and 0.5 s; the third one in a
        row propagates as aiohttp's read timeout, and nothing else is sent."""

        async def never(request: web.Request) -> web.Response:
            await server.hang()
            return json_response(result_body("r1"))

        server = await serve(
            web.post("/rollout", lambda r: json_response(init_body("r1", wait=0.05), 202)),
            web.get("/rollout/r1/result", never),
        )
        client = make_client(server.url, timing={"result_read_grace_sec": 0.1})
        with pytest.raises(aiohttp.ServerTimeoutError):
            await client.run_rollout(MESSAGES, "u", "r1")
        assert fake_time.sleeps == [0.1, 0.5]
        assert len(server.seen("GET")) == 3
        assert len(server.seen("POST")) == 1

    async def test_read_timeouts_and_gateway_errors_use_separate_schedules(
        self, serve, make_client, fake_time
    ):
        """Two read timeouts do not use up the gateway schedule: a 502 after them still gets
        its 0.25 s retry, and the poll then succeeds."""
        calls = 0

        async def answer(request: web.Request) -> web.Response:
            nonlocal calls
            calls += 1
            if calls <= 2:
                await server.hang()
            if calls == 3:
                return json_response({"detail": "gateway"}, 502)
            return json_response(result_body("r1"))

        server = await serve(
            web.post("/rollout", lambda r: json_response(init_body("r1", wait=0.05), 202)),
            web.get("/rollout/r1/result", answer),
        )
        client = make_client(server.url, timing={"result_read_grace_sec": 0.1})
        assert (await client.run_rollout(MESSAGES, "u", "r1")).status == "success"
        assert fake_time.sleeps == [0.1, 0.5, 0.25]


class TestItem42ServerErrorOnResult:
    async def test_500_after_a_retried_502_is_fatal(self, serve, make_client, fake_time):
        """A 500 on a result read is never retried, even right after a retried 502."""
        answers = iter([502, 500])

        def answer(request: web.Request) -> web.Response:
            return json_response({"detail": "x"}, next(answers, 500))

        server = await serve(
            web.post("/rollout", lambda r: json_response(init_body("r1"), 202)),
            web.get("/rollout/r1/result", answer),
        )
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="returned 500") as e:
            await client.run_rollout(MESSAGES, "u", "r1")
        assert e.value.status_code == 500
        assert fake_time.sleeps == [0.25]
        assert len(server.seen("GET")) == 2


class TestItem47WaitIdleIdentity:
    async def test_server_without_process_id_fails_on_the_first_answer(
        self, serve, make_client, fake_time
    ):
        """Against a busy server whose health has no process_id (pre-0.3.5), wait_idle()
        raises after one request instead of polling until its timeout."""
        health = {"status": "ok", "lifecycle": {"accepting_rollouts": True, "active_rollouts": 3}}
        server = await serve(web.get("/health", lambda r: json_response(health)))
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="Server has no lifecycle identity") as e:
            await client.wait_idle(timeout_sec=60.0, poll_interval_sec=0.01)
        assert e.value.status_code == 200
        assert len(server.seen("GET", "/health")) == 1
        assert fake_time.sleeps == []
