"""``cancel_rollout()``, ``health()`` and ``wait_idle()`` against fake servers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rollout_client import RolloutClient, RolloutProtocolError
from rollout_client.testing import override_timing
from rollout_types import CancelDisposition, CancelRolloutsResponse

from .conftest import EVENT_SEC, drop, json_response, scripted

PID = "1ea4b315-cd63-4855-8d5a-4828dd319e9d"


def health(active: int = 0, process_id: str | None = PID, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "status": "ok",
        "instance_id": PID,
        "lifecycle": {"accepting_rollouts": True, "active_rollouts": active},
        **extra,
    }
    if process_id is not None:
        body["process_id"] = process_id
    return body


def answer(body: Any, status: int = 200) -> Any:
    return lambda r: json_response(body, status)


class TestCancelRollout:
    async def test_request_body(self, serve, make_client):
        """The cancel body selects exactly the id, with explicit null and false."""
        server = await serve(
            web.post(
                "/rollout/cancel",
                answer({"dispositions": {"r 1": "cancelled_running"}}),
            )
        )
        client = make_client(server.url, api_key="k")
        response = await client.cancel_rollout("r 1")
        assert response == CancelRolloutsResponse(
            dispositions={"r 1": CancelDisposition.CANCELLED_RUNNING}
        )
        (post,) = server.requests
        assert json.loads(post.body) == {"ids": ["r 1"], "prefix": None, "all": False}
        assert post.headers["Authorization"] == "Bearer k"

    async def test_unknown_disposition_kept(self, serve, make_client):
        """A disposition string this client does not know is kept raw."""
        server = await serve(web.post("/rollout/cancel", answer({"dispositions": {"r1": "x"}})))
        client = make_client(server.url)
        assert (await client.cancel_rollout("r1")).dispositions == {"r1": "x"}

    @pytest.mark.parametrize("status", [401, 422, 500, 503, 307])
    async def test_non_200_fails(self, serve, make_client, status):
        """Any status but 200 raises RolloutProtocolError once."""
        server = await serve(web.post("/rollout/cancel", answer({"detail": "no"}, status)))
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match=f"POST /rollout/cancel returned {status}"):
            await client.cancel_rollout("r1")
        assert len(server.requests) == 1

    async def test_invalid_body(self, serve, make_client):
        """An invalid 200 body raises RolloutProtocolError (200)."""
        server = await serve(web.post("/rollout/cancel", answer({"dispositions": [1]})))
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="invalid response") as e:
            await client.cancel_rollout("r1")
        assert e.value.status_code == 200

    async def test_bounded(self, serve, make_client):
        """A server that never answers makes cancel_rollout raise TimeoutError at the bound."""

        async def hang(request: web.Request) -> web.Response:
            await server.hang()
            return json_response({"dispositions": {}})

        server = await serve(web.post("/rollout/cancel", hang))
        client = make_client(server.url, timing={"cancel_timeout_sec": 0.2})
        with pytest.raises(TimeoutError, match=r"did not finish within 0\.2 seconds"):
            await client.cancel_rollout("r1")

    async def test_bound_includes_pool_wait(self, serve):
        """Waiting for a pooled connection counts against the cancel bound."""
        entered = asyncio.Event()

        async def hang(request: web.Request) -> web.Response:
            entered.set()
            await server.hang()
            return json_response({})

        server = await serve(
            web.get("/health", hang),
            web.post("/rollout/cancel", answer({"dispositions": {}})),
        )
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            client = RolloutClient(url=server.url, http_client=session)
            override_timing(client, cancel_timeout_sec=0.2)
            blocker = asyncio.create_task(client.health())
            async with asyncio.timeout(EVENT_SEC):
                await entered.wait()
            with pytest.raises(TimeoutError, match="did not finish within"):
                await client.cancel_rollout("r1")
            blocker.cancel()
            with pytest.raises(asyncio.CancelledError):
                await blocker
        assert server.seen("POST", "/rollout/cancel") == []

    async def test_not_retried(self, serve, make_client):
        """A dropped cancel request propagates and is not replayed."""
        server = await serve(web.post("/rollout/cancel", drop))
        client = make_client(server.url)
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await client.cancel_rollout("r1")
        assert len(server.requests) == 1


class TestHealth:
    async def test_returns_payload(self, serve, make_client):
        """health() returns the JSON object as sent, backend keys included."""
        body = health(concurrency={"max_concurrent": 4, "queued": 0, "running": 0})
        server = await serve(web.get("/health", answer(body)))
        client = make_client(server.url, api_key="k")
        assert await client.health() == body
        assert server.requests[0].headers["Authorization"] == "Bearer k"

    @pytest.mark.parametrize("status", [401, 404, 500, 503])
    async def test_non_200(self, serve, make_client, status):
        """A non-200 answer raises 'GET /health failed' with the status."""
        server = await serve(web.get("/health", answer({"detail": "x"}, status)))
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="GET /health failed") as e:
            await client.health()
        assert e.value.status_code == status

    @pytest.mark.parametrize("body", [b"{nope", b"[1, 2]", b'"ok"'])
    async def test_invalid_json(self, serve, make_client, body):
        """A body that is not a JSON object raises 'GET /health returned invalid JSON'."""
        server = await serve(
            web.get("/health", lambda r: web.Response(body=body, content_type="application/json"))
        )
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="GET /health returned invalid JSON") as e:
            await client.health()
        assert e.value.status_code == 200


class TestWaitIdle:
    async def test_returns_when_idle(self, serve, make_client, fake_time):
        """wait_idle() polls until active_rollouts is 0 and returns that payload."""
        server = await serve(
            web.get("/health", scripted(answer(health(2)), answer(health(1)), answer(health(0))))
        )
        client = make_client(server.url)
        result = await client.wait_idle(timeout_sec=5, poll_interval_sec=0.5)
        assert result["lifecycle"]["active_rollouts"] == 0
        assert fake_time.sleeps == [0.5, 0.5]

    async def test_idle_while_not_accepting(self, serve, make_client):
        """Idle is idle whatever accepting_rollouts says."""
        body = health(0)
        body["lifecycle"]["accepting_rollouts"] = False
        server = await serve(web.get("/health", answer(body)))
        client = make_client(server.url)
        assert (await client.wait_idle())["lifecycle"]["accepting_rollouts"] is False

    @pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
    async def test_retries_statuses(self, serve, make_client, fake_time, status):
        """408, 429, 500, 502, 503 and 504 are waited out."""
        server = await serve(
            web.get("/health", scripted(answer({"detail": "x"}, status), answer(health(0))))
        )
        client = make_client(server.url)
        await client.wait_idle(timeout_sec=5, poll_interval_sec=0.25)
        assert fake_time.sleeps == [0.25]

    async def test_retries_transport_errors(self, serve, make_client, fake_time):
        """A dropped connection is waited out."""
        server = await serve(web.get("/health", scripted(drop, answer(health(0)))))
        client = make_client(server.url)
        await client.wait_idle(timeout_sec=5, poll_interval_sec=0.25)
        assert fake_time.sleeps == [0.25]

    @pytest.mark.parametrize("status", [401, 403, 404, 422])
    async def test_other_status_raises(self, serve, make_client, status):
        """Other failing statuses raise at once."""
        server = await serve(web.get("/health", answer({"detail": "x"}, status)))
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError) as e:
            await client.wait_idle()
        assert e.value.status_code == status

    async def test_invalid_json_raises(self, serve, make_client):
        """An invalid health body raises at once."""
        server = await serve(
            web.get("/health", lambda r: web.Response(body=b"{", content_type="application/json"))
        )
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="invalid JSON"):
            await client.wait_idle()

    @pytest.mark.parametrize("process_id", [None, "", 7])
    async def test_no_identity(self, serve, make_client, process_id):
        """A server without a process_id (pre-0.3.5) has no lifecycle identity."""
        body = health(0, process_id=None)
        if process_id is not None:
            body["process_id"] = process_id
        server = await serve(web.get("/health", answer(body)))
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="Server has no lifecycle identity") as e:
            await client.wait_idle()
        assert e.value.status_code == 200

    @pytest.mark.parametrize(
        "lifecycle",
        [None, {}, {"accepting_rollouts": True}, {"accepting_rollouts": 1, "active_rollouts": 0},
         {"accepting_rollouts": True, "active_rollouts": -1}, "idle"],
    )  # fmt: skip
    async def test_invalid_lifecycle(self, serve, make_client, lifecycle):
        """A missing or malformed lifecycle raises 'Server has no valid lifecycle state'."""
        body = health(0)
        body["lifecycle"] = lifecycle
        server = await serve(web.get("/health", answer(body)))
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="Server has no valid lifecycle state"):
            await client.wait_idle()

    async def test_restart_while_waiting(self, serve, make_client):
        """A process_id change between polls raises 'Server restarted while waiting'."""
        server = await serve(
            web.get("/health", scripted(answer(health(1)), answer(health(0, process_id="new"))))
        )
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="Server restarted while waiting"):
            await client.wait_idle()

    async def test_pinned_process_differs(self, serve, make_client):
        """A process_id other than the pinned one raises even when idle."""
        server = await serve(web.get("/health", answer(health(0))))
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="Server restarted while waiting"):
            await client.wait_idle(process_id="other")

    async def test_pinned_process_matches(self, serve, make_client):
        """The pinned process_id from a health check is accepted."""
        server = await serve(web.get("/health", answer(health(0))))
        client = make_client(server.url)
        pid = (await client.health())["process_id"]
        assert (await client.wait_idle(timeout_sec=5, process_id=pid))["process_id"] == PID

    async def test_times_out(self, serve, make_client):
        """A server that stays busy makes wait_idle raise TimeoutError at timeout_sec."""
        server = await serve(web.get("/health", answer(health(3))))
        client = make_client(server.url, real_time=True)
        with pytest.raises(TimeoutError, match=r"did not become idle within 0\.2 seconds") as e:
            await client.wait_idle(timeout_sec=0.2, poll_interval_sec=0.05)
        assert "active_rollouts=3" in str(e.value)
        assert not isinstance(e.value, RolloutProtocolError)

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"timeout_sec": 0},
            {"timeout_sec": -1},
            {"timeout_sec": float("inf")},
            {"timeout_sec": float("nan")},
            {"poll_interval_sec": 0},
            {"poll_interval_sec": float("inf")},
            {"process_id": ""},
        ],
    )
    async def test_invalid_arguments(self, serve, make_client, kwargs):
        """Non-positive or non-finite durations and an empty process_id raise ValueError."""
        server = await serve(web.get("/health", answer(health(0))))
        client = make_client(server.url)
        with pytest.raises(ValueError):
            await client.wait_idle(**kwargs)
        assert server.requests == []
