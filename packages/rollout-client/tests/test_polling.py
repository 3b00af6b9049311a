"""Result polling (``GET /rollout/{id}/result``): retries, lease fitting, bodies."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rollout_client import RetrySettings, RolloutProtocolError
from rollout_types import LEASE_HEADER, RolloutErrorCategory, RolloutStatus

from .conftest import EVENT_SEC, drop, init_body, json_response, result_body, scripted

MESSAGES = [{"role": "user", "content": "hi"}]
GATEWAY_DELAYS = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0]


def ok(status: str = "success", rollout_id: str = "r1", **fields: Any) -> Any:
    return lambda r: json_response(result_body(rollout_id, status, **fields))


def http(status: int) -> Any:
    return lambda r: json_response({"detail": "gateway"}, status)


async def polled(serve, *answers: Any, wait: float = 0.05, lease: float = 60.0, rid: str = "r1"):
    """A server that admits ``rid`` and answers its polls with ``answers`` in order."""
    return await serve(
        web.post("/rollout", lambda r: json_response(init_body(rid, wait=wait, lease=lease), 202)),
        web.get("/rollout/{rid}/result", scripted(*answers)),
    )


class TestPollRequests:
    async def test_lease_and_auth_on_every_get(self, serve, make_client):
        """Every result GET carries the lease token, the bearer key and no redirect."""
        server = await polled(serve, ok("running"), ok("grading"), ok())
        client = make_client(server.url, api_key="k")
        await client.run_rollout(MESSAGES, "u", "r1")
        gets = server.seen("GET")
        assert len(gets) == 3
        assert all(g.headers[LEASE_HEADER] == "tok-1" for g in gets)
        assert all(g.headers["Authorization"] == "Bearer k" for g in gets)

    @pytest.mark.parametrize(
        ("rollout_id", "raw"),
        [
            ("a b", "a%20b"),
            ("a?b#c", "a%3Fb%23c"),
            ("100%", "100%25"),
            ("é", "%C3%A9"),
            ("x:y.z-1_2", "x%3Ay.z-1_2"),
        ],
    )
    async def test_id_percent_encoded(self, serve, make_client, rollout_id, raw):
        """The rollout id is percent-encoded as one path segment."""
        server = await polled(serve, ok(rollout_id=rollout_id), rid=rollout_id)
        client = make_client(server.url)
        result = await client.run_rollout(MESSAGES, "u", rollout_id)
        assert result.rollout_id == rollout_id
        (get,) = server.seen("GET")
        assert get.raw_path == f"/rollout/{raw}/result"

    async def test_redirect_not_followed(self, serve, make_client):
        """A 302 on a poll fails at once and the target never sees the key."""
        target = await serve(web.get("/rollout/r1/result", ok()))
        location = {"Location": target.url + "/rollout/r1/result"}
        server = await polled(serve, lambda r: web.Response(status=302, headers=location))
        client = make_client(server.url, api_key="secret")
        with pytest.raises(RolloutProtocolError, match="returned 302") as e:
            await client.run_rollout(MESSAGES, "u", "r1")
        assert e.value.status_code == 302
        assert target.requests == []


class TestTransportRetries:
    async def test_two_drops_then_success(self, serve, make_client, fake_time):
        """Dropped connections are retried after 0.1 s and 0.5 s."""
        server = await polled(serve, drop, drop, ok())
        client = make_client(server.url)
        assert (await client.run_rollout(MESSAGES, "u", "r1")).status == "success"
        assert fake_time.sleeps == [0.1, 0.5]

    async def test_third_drop_raises(self, serve, make_client, fake_time):
        """A third consecutive transport failure propagates as the aiohttp error."""
        server = await polled(serve, drop)
        client = make_client(server.url)
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await client.run_rollout(MESSAGES, "u", "r1")
        assert fake_time.sleeps == [0.1, 0.5]
        assert len(server.seen("GET")) == 3

    async def test_read_timeout_retried(self, serve, make_client, fake_time):
        """A poll exceeding wait + grace is a retried read timeout."""
        calls = 0

        async def slow_once(request: web.Request) -> web.Response:
            nonlocal calls
            calls += 1
            if calls == 1:
                await server.hang()
            return json_response(result_body("r1"))

        server = await polled(serve, slow_once)
        client = make_client(server.url, timing={"result_read_grace_sec": 0.2})
        assert (await client.run_rollout(MESSAGES, "u", "r1")).status == "success"
        assert fake_time.sleeps == [0.1]

    async def test_read_timeout_is_wait_plus_grace(self, serve, make_client, fake_time):
        """A poll answered within wait + grace is not a timeout."""

        async def slowish(request: web.Request) -> web.Response:
            await asyncio.sleep(0.3)
            return json_response(result_body("r1"))

        server = await polled(serve, slowish, wait=0.25)
        client = make_client(server.url, timing={"result_read_grace_sec": 5.0})
        assert (await client.run_rollout(MESSAGES, "u", "r1")).status == "success"
        assert fake_time.sleeps == []

    async def test_broken_payload_retried(self, serve, make_client, fake_time):
        """A body cut short (payload error) is retried."""

        async def truncated(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Length": "100"})
            await response.prepare(request)
            await response.write(b'{"rollout_id":')
            assert request.transport is not None
            request.transport.close()
            return response

        server = await polled(serve, truncated, ok())
        client = make_client(server.url)
        assert (await client.run_rollout(MESSAGES, "u", "r1")).status == "success"
        assert fake_time.sleeps == [0.1]

    async def test_connection_refused_retried(self, serve, make_client, fake_time):
        """A refused connection is retried, then propagates after two retries."""

        def vanish(request: web.Request) -> web.Response:
            server.stop_listening()
            return drop(request)

        server = await polled(serve, vanish)
        client = make_client(server.url)
        with pytest.raises(aiohttp.ClientConnectorError):
            await client.run_rollout(MESSAGES, "u", "r1")
        assert fake_time.sleeps == [0.1, 0.5]

    async def test_connect_timeout_fatal(self, serve, make_client, fake_time, monkeypatch):
        """A connect (or pool) timeout on a poll propagates at once, unretried."""
        server = await polled(serve, ok())
        client = make_client(server.url)
        real_send = client._channel.transport.send
        attempts = 0

        async def send(method: str, url: Any, **kwargs: Any) -> Any:
            nonlocal attempts
            if method == "GET":
                attempts += 1
                raise aiohttp.ConnectionTimeoutError("Connection timeout to host")
            return await real_send(method, url, **kwargs)

        monkeypatch.setattr(client._channel.transport, "send", send)
        with pytest.raises(aiohttp.ConnectionTimeoutError):
            await client.run_rollout(MESSAGES, "u", "r1")
        assert attempts == 1
        assert fake_time.sleeps == []

    async def test_poll_timeouts(self, serve, make_client, monkeypatch):
        """Each poll reads for wait + 10 s and waits for a connection at most the lease left."""
        server = await polled(serve, ok(), wait=2.5, lease=100.0)
        client = make_client(server.url)
        real_send = client._channel.transport.send
        timeouts: list[aiohttp.ClientTimeout] = []

        async def send(method: str, url: Any, *, timeout: Any, **kwargs: Any) -> Any:
            if method == "GET":
                timeouts.append(timeout)
            return await real_send(method, url, timeout=timeout, **kwargs)

        monkeypatch.setattr(client._channel.transport, "send", send)
        await client.run_rollout(MESSAGES, "u", "r1")
        (timeout,) = timeouts
        assert timeout.total is None
        assert timeout.sock_read == 12.5
        assert timeout.sock_connect == 10.0
        assert timeout.connect is not None
        assert 10.0 < timeout.connect <= 100.0

    async def test_retry_logged(self, serve, make_client, caplog):
        """Each retry logs a WARNING naming the rollout, the cause and the delay."""
        server = await polled(serve, http(502), ok())
        client = make_client(server.url)
        with caplog.at_level(logging.WARNING, logger="rollout_client"):
            await client.run_rollout(MESSAGES, "u", "r1")
        assert (
            "Retrying result read for rollout r1 after HTTP 502 (attempt 1) in 0.25s"
            in caplog.messages
        )


class TestGatewayRetries:
    async def test_six_then_success(self, serve, make_client, fake_time):
        """502/503/504 are retried after 0.25, 0.5, 1, 2, 4 and 8 s."""
        server = await polled(
            serve, http(502), http(503), http(504), http(502), http(503), http(504), ok()
        )
        client = make_client(server.url)
        assert (await client.run_rollout(MESSAGES, "u", "r1")).status == "success"
        assert fake_time.sleeps == GATEWAY_DELAYS

    async def test_persistent_raises_last_status(self, serve, make_client, fake_time):
        """A seventh gateway error raises RolloutProtocolError with its status."""
        server = await polled(serve, *[http(502)] * 6, http(504))
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="returned 504") as e:
            await client.run_rollout(MESSAGES, "u", "r1")
        assert e.value.status_code == 504
        assert fake_time.sleeps == GATEWAY_DELAYS

    async def test_schedules_independent(self, serve, make_client, fake_time):
        """Transport and gateway retries count separately: 2 + 6 failures still succeed."""
        server = await polled(serve, drop, *[http(503)] * 6, drop, ok())
        client = make_client(server.url)
        assert (await client.run_rollout(MESSAGES, "u", "r1")).status == "success"
        assert fake_time.sleeps == [0.1, *GATEWAY_DELAYS, 0.5]

    async def test_schedules_reset_after_200(self, serve, make_client, fake_time):
        """Both schedules restart after every successful poll."""
        server = await polled(serve, drop, drop, ok("running"), drop, drop, ok())
        client = make_client(server.url)
        assert (await client.run_rollout(MESSAGES, "u", "r1")).status == "success"
        assert fake_time.sleeps == [0.1, 0.5, 0.1, 0.5]

    @pytest.mark.parametrize("status", [500, 400, 401, 403, 404, 409, 422, 429])
    async def test_other_statuses_fail_at_once(self, serve, make_client, fake_time, status):
        """500 and every 4xx raise at once, without retry."""
        server = await polled(serve, http(status), ok())
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match=f"GET /rollout/r1/result returned {status}"):
            await client.run_rollout(MESSAGES, "u", "r1")
        assert fake_time.sleeps == []
        assert len(server.seen("GET")) == 1

    async def test_never_replays_admission(self, serve, make_client):
        """Result retries repeat only the GET, never the POST."""
        server = await polled(serve, drop, http(502), ok())
        client = make_client(server.url)
        await client.run_rollout(MESSAGES, "u", "r1")
        assert len(server.seen("POST")) == 1


class TestLeaseFit:
    async def test_small_lease_disables_retries(self, serve, make_client, fake_time):
        """With a 1.2 s lease and 0.1 s wait, the first 502 is fatal."""
        server = await polled(serve, http(502), ok(), wait=0.1, lease=1.2)
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="returned 502"):
            await client.run_rollout(MESSAGES, "u", "r1")
        assert fake_time.sleeps == []

    async def test_failures_never_extend_deadline(self, serve, make_client, fake_time):
        """Retries stop once backoff plus a full poll would pass the last confirmed deadline."""
        # read timeout 0.05 + 1.0 = 1.05 s; lease 4 s from admission: 0.25, 0.5 and 1 s fit,
        # 2 s would end at 1.75 + 2 + 1.05 = 4.8 s.
        server = await polled(serve, http(502), lease=4.0)
        client = make_client(server.url, timing={"result_read_grace_sec": 1.0})
        with pytest.raises(RolloutProtocolError, match="returned 502"):
            await client.run_rollout(MESSAGES, "u", "r1")
        assert fake_time.sleeps == [0.25, 0.5, 1.0]

    async def test_success_confirms_new_deadline(self, serve, make_client, fake_time):
        """A successful poll moves the deadline to its send time plus the lease."""
        server = await polled(
            serve, http(502), http(502), http(502), ok("running"), http(502), http(502),
            http(502), ok(), lease=4.0,
        )  # fmt: skip
        client = make_client(server.url, timing={"result_read_grace_sec": 1.0})
        assert (await client.run_rollout(MESSAGES, "u", "r1")).status == "success"
        assert fake_time.sleeps == [0.25, 0.5, 1.0, 0.25, 0.5, 1.0]

    async def test_recheck_after_sleep(self, serve, make_client, fake_time):
        """A retry whose sleep overran the lease is abandoned after sleeping."""
        fake_time.extra = 100.0  # the loop "overslept" every backoff by 100 s
        server = await polled(serve, http(503), ok(), lease=60.0)
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="returned 503"):
            await client.run_rollout(MESSAGES, "u", "r1")
        assert fake_time.sleeps == [0.25]
        assert len(server.seen("GET")) == 1

    async def test_custom_schedule_exhausted(self, serve, make_client, fake_time):
        """A schedule given as data is followed exactly."""
        schedule = RetrySettings(gateway_delays_sec=(1.0, 1.0), gateway_statuses=frozenset({502}))
        server = await polled(serve, http(502))
        client = make_client(server.url, retry=schedule)
        with pytest.raises(RolloutProtocolError):
            await client.run_rollout(MESSAGES, "u", "r1")
        assert fake_time.sleeps == [1.0, 1.0]

    async def test_retried_request_bounded_by_lease(self, serve, make_client, fake_time):
        """A retried GET still running when the lease ends raises the previous error."""

        async def trickle(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Length": "1000"})
            await response.prepare(request)
            while not server.release.is_set():
                await response.write(b" ")
                await asyncio.sleep(0.02)
            return response

        server = await polled(serve, http(502), trickle, lease=1.5)
        client = make_client(server.url, timing={"result_read_grace_sec": 0.5})
        with pytest.raises(RolloutProtocolError, match="returned 502") as e:
            async with asyncio.timeout(EVENT_SEC):
                await client.run_rollout(MESSAGES, "u", "r1")
        assert isinstance(e.value.__cause__, TimeoutError)


class TestResultBodies:
    @pytest.mark.parametrize(
        "body",
        [b"{", b"[]", b'{"rollout_id": "r1"}', b'{"rollout_id": "r1", "status": 3}'],
    )
    async def test_invalid_body_fails(self, serve, make_client, fake_time, body):
        """An invalid 200 body raises RolloutProtocolError (200) without retry."""
        server = await polled(
            serve, lambda r: web.Response(body=body, content_type="application/json")
        )
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="returned an invalid response") as e:
            await client.run_rollout(MESSAGES, "u", "r1")
        assert e.value.status_code == 200
        assert fake_time.sleeps == []

    async def test_non_finite_reward_fails(self, serve, make_client):
        """A result whose reward is not finite is invalid."""
        body = b'{"rollout_id":"r1","status":"success","sample":{"reward":NaN}}'
        server = await polled(
            serve, lambda r: web.Response(body=body, content_type="application/json")
        )
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="invalid response"):
            await client.run_rollout(MESSAGES, "u", "r1")

    async def test_other_id_fails(self, serve, make_client):
        """A result for another rollout id raises RolloutProtocolError (200)."""
        server = await polled(serve, ok(rollout_id="r2"))
        client = make_client(server.url)
        with pytest.raises(RolloutProtocolError, match="different rollout_id") as e:
            await client.run_rollout(MESSAGES, "u", "r1")
        assert e.value.status_code == 200

    async def test_missing_optional_keys(self, serve, make_client):
        """sample, err_message and err_category may be missing; extra keys are ignored."""
        server = await polled(
            serve, lambda r: json_response({"rollout_id": "r1", "status": "failure", "new": 1})
        )
        client = make_client(server.url)
        result = await client.run_rollout(MESSAGES, "u", "r1")
        assert (result.status, result.sample, result.err_category) == ("failure", None, None)

    async def test_unknown_err_category_kept(self, serve, make_client):
        """An unknown err_category from a newer server keeps the finished result, raw."""
        server = await polled(
            serve, ok("failure", err_message="over quota", err_category="quota_exceeded")
        )
        client = make_client(server.url)
        result = await client.run_rollout(MESSAGES, "u", "r1")
        assert result.status == RolloutStatus.FAILURE
        assert result.err_category == "quota_exceeded"
        assert not isinstance(result.err_category, RolloutErrorCategory)

    async def test_unknown_status_keeps_polling(self, serve, make_client):
        """An unknown status is non-terminal and visible on the handle; polling goes on."""
        second_poll = asyncio.Event()
        go_on = asyncio.Event()

        async def then_success(request: web.Request) -> web.Response:
            second_poll.set()
            await go_on.wait()
            return json_response(result_body("r1"))

        server = await polled(serve, ok("paused"), then_success)
        client = make_client(server.url)
        handle = await client.run_rollout_async(MESSAGES, "u", "r1")
        async with asyncio.timeout(EVENT_SEC):
            await second_poll.wait()
        assert handle.status == "paused"
        assert handle.latest_result is not None
        assert handle.latest_result.status == "paused"
        assert not handle.done()
        go_on.set()
        assert (await handle).status == "success"

    async def test_repeated_unknown_status_paced(self, serve, make_client, fake_time):
        """The same unknown status twice in a row makes the next poll wait (no busy loop)."""
        server = await polled(serve, ok("paused"), ok("paused"), ok("paused"), ok(), lease=1.05)
        client = make_client(server.url)
        assert (await client.run_rollout(MESSAGES, "u", "r1")).status == "success"
        # min(1.0 s, (lease - wait) / 2) = 0.5 s, after the second and third "paused".
        assert fake_time.sleeps == pytest.approx([0.5, 0.5])
