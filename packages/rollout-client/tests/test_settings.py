"""``RetrySettings`` (``RolloutClient(retry=...)``) and ``rollout_client.testing``."""

from __future__ import annotations

import math
import time
from typing import Any

import aiohttp
import attrs
import pytest
from aiohttp import web

import rollout_client.testing
from rollout_client import RetrySettings, RolloutClient, RolloutClientPool, RolloutProtocolError
from rollout_client.testing import override_timing

from .conftest import drop, init_body, json_response, result_body, scripted

MESSAGES = [{"role": "user", "content": "hi"}]


def polled_routes(*answers: Any) -> list[web.RouteDef]:
    """A server that admits r1 and answers its polls with ``answers`` in order."""
    return [
        web.post("/rollout", lambda r: json_response(init_body("r1"), 202)),
        web.get("/rollout/r1/result", scripted(*answers)),
    ]


def short_lease_routes() -> list[web.RouteDef]:
    """A server granting a 1 s lease (wait 0.05 s) whose first poll is dropped."""
    return [
        web.post("/rollout", lambda r: json_response(init_body("r1", lease=1.0), 202)),
        web.get("/rollout/r1/result", scripted(drop, lambda r: json_response(result_body("r1")))),
    ]


class TestRetrySettingsValues:
    def test_sequences_become_tuples_of_floats(self):
        """Delays given as a list of ints are kept as a tuple of floats; statuses as a set."""
        retry = RetrySettings(transport_delays_sec=[1, 2], gateway_statuses=[502, 502])
        assert retry.transport_delays_sec == (1.0, 2.0)
        assert all(type(delay) is float for delay in retry.transport_delays_sec)
        assert retry.gateway_statuses == frozenset({502})

    def test_empty_schedules_are_allowed(self):
        """An empty schedule means no retry at all."""
        retry = RetrySettings(transport_delays_sec=(), gateway_delays_sec=())
        assert retry.transport_delays_sec == ()
        assert retry.gateway_delays_sec == ()

    def test_frozen(self):
        """A RetrySettings cannot be changed after creation; attrs.evolve makes a copy."""
        retry = RetrySettings()
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            retry.transport_delays_sec = ()  # type: ignore[misc]
        assert attrs.evolve(retry, retry_after_max_sec=5).retry_after_max_sec == 5.0

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"transport_delays_sec": (0.1, -1)}, "must be >= 0 seconds"),
            ({"gateway_delays_sec": (math.inf,)}, "finite"),
            ({"gateway_delays_sec": (math.nan,)}, "finite"),
            ({"retry_after_default_sec": -0.5}, "retry_after_default_sec"),
            ({"retry_after_min_sec": math.inf}, "retry_after_min_sec"),
            ({"retry_after_min_sec": 2.0, "retry_after_max_sec": 1.0}, "must not be below"),
            ({"gateway_statuses": {200}}, "400 to 599"),
            ({"gateway_statuses": {600}}, "400 to 599"),
        ],
    )
    def test_invalid_values_raise_value_error(self, kwargs, match):
        """Negative or non-finite seconds, non-error statuses and max < min are refused."""
        with pytest.raises(ValueError, match=match):
            RetrySettings(**kwargs)

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"transport_delays_sec": 0.5},
            {"transport_delays_sec": "0.1"},
            {"gateway_delays_sec": (True,)},
            {"gateway_delays_sec": ("1",)},
            {"gateway_statuses": 502},
            {"retry_after_max_sec": None},
        ],
    )
    def test_wrong_types_raise_type_error(self, kwargs):
        """A value that is not a number (or a sequence / set of them) raises TypeError."""
        with pytest.raises(TypeError):
            RetrySettings(**kwargs)

    def test_client_refuses_another_type(self):
        """RolloutClient(retry=...) accepts only a RetrySettings."""
        with pytest.raises(TypeError, match="RetrySettings"):
            RolloutClient(url="http://127.0.0.1:1", retry={"gateway_delays_sec": ()})  # type: ignore[arg-type]


class TestRetrySettingsInUse:
    async def test_transport_schedule(self, serve, make_client, fake_time):
        """A custom transport schedule sets the delays and the number of retries."""
        server = await serve(*polled_routes(drop))
        retry = RetrySettings(transport_delays_sec=(0.2, 0.3, 0.4))
        client = make_client(server.url, retry=retry)
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await client.run_rollout(MESSAGES, "u", "r1")
        assert fake_time.sleeps == [0.2, 0.3, 0.4]
        assert len(server.seen("GET")) == 4

    async def test_no_gateway_retries(self, serve, make_client, fake_time):
        """An empty gateway schedule makes the first 503 fatal."""
        server = await serve(*polled_routes(lambda r: json_response({}, 503)))
        client = make_client(server.url, retry=RetrySettings(gateway_delays_sec=()))
        with pytest.raises(RolloutProtocolError, match="returned 503"):
            await client.run_rollout(MESSAGES, "u", "r1")
        assert fake_time.sleeps == []

    async def test_status_outside_the_set_is_fatal(self, serve, make_client, fake_time):
        """A 504 is not retried when gateway_statuses leaves it out."""
        server = await serve(*polled_routes(lambda r: json_response({}, 504)))
        client = make_client(server.url, retry=RetrySettings(gateway_statuses={502}))
        with pytest.raises(RolloutProtocolError, match="returned 504"):
            await client.run_rollout(MESSAGES, "u", "r1")
        assert fake_time.sleeps == []

    @pytest.mark.parametrize(("retry_after", "expected"), [("30", 2.0), ("0", 0.5), ("x", 1.5)])
    async def test_retry_after_clamp(self, serve, make_client, fake_time, retry_after, expected):
        """The 429 backoff follows the configured clamp and default."""
        server = await serve(
            web.post(
                "/rollout",
                scripted(
                    lambda r: json_response({}, 429, **{"Retry-After": retry_after}),
                    lambda r: json_response(init_body("r1"), 202),
                ),
            ),
            web.get("/rollout/r1/result", lambda r: json_response(result_body("r1"))),
        )
        retry = RetrySettings(
            retry_after_min_sec=0.5, retry_after_max_sec=2.0, retry_after_default_sec=1.5
        )
        client = make_client(server.url, retry=retry)
        await client.run_rollout(MESSAGES, "u", "r1")
        assert fake_time.sleeps == [expected]


class TestOverrideTiming:
    def test_public_names(self):
        """rollout_client.testing exports exactly override_timing."""
        assert rollout_client.testing.__all__ == ["override_timing"]

    async def test_sleep_receives_every_backoff(self, serve):
        """The given sleep is awaited with each backoff instead of asyncio.sleep."""
        server = await serve(*polled_routes(drop, lambda r: json_response(result_body("r1"))))
        delays: list[float] = []

        async def sleep(delay: float) -> None:
            delays.append(delay)

        async with RolloutClient(url=server.url) as client:
            override_timing(client, sleep=sleep)
            assert (await client.run_rollout(MESSAGES, "u", "r1")).status == "success"
        assert delays == [0.1]

    async def test_clock_bounds_the_lease(self, serve):
        """The given clock decides the lease fit: a clock 1000 s ahead after admission
        leaves no lease time for a retry, so the first dropped poll is raised."""
        server = await serve(*polled_routes(drop, lambda r: json_response(result_body("r1"))))
        readings = 0

        def clock() -> float:
            nonlocal readings
            readings += 1
            return time.monotonic() + (0.0 if readings == 1 else 1000.0)

        async with RolloutClient(url=server.url) as client:
            override_timing(client, clock=clock)
            with pytest.raises(aiohttp.ServerDisconnectedError):
                await client.run_rollout(MESSAGES, "u", "r1")
        assert len(server.seen("GET")) == 1

    async def test_short_read_grace_lets_a_retry_fit(self, serve, make_client, fake_time):
        """With wait 0.05 s and a 1 s lease, a retry after 0.1 s fits a 0.5 s read grace."""
        server = await serve(*short_lease_routes())
        client = make_client(server.url, timing={"result_read_grace_sec": 0.5})
        assert (await client.run_rollout(MESSAGES, "u", "r1")).status == "success"
        assert fake_time.sleeps == [0.1]

    async def test_default_read_grace_leaves_no_retry(self, serve, make_client, fake_time):
        """The same lease leaves no room for a retry with the default 10 s read grace."""
        server = await serve(*short_lease_routes())
        client = make_client(server.url)
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await client.run_rollout(MESSAGES, "u", "r1")
        assert fake_time.sleeps == []

    @pytest.mark.parametrize(
        ("kwargs", "error"),
        [
            ({"sleep": 1.0}, TypeError),
            ({"clock": "monotonic"}, TypeError),
            ({"result_read_grace_sec": 0}, ValueError),
            ({"cancel_timeout_sec": math.inf}, ValueError),
            ({"cancel_timeout_sec": -1}, ValueError),
        ],
    )
    def test_invalid_arguments(self, kwargs, error):
        """Non-callable hooks and bounds that are not finite and > 0 are refused."""
        client = RolloutClient(url="http://127.0.0.1:1")
        with pytest.raises(error):
            override_timing(client, **kwargs)

    async def test_a_pool_changes_every_servers_client(self, serve):
        """On a RolloutClientPool the sleep reaches the client of each server: a rollout on
        each of two servers whose first poll is dropped backs off through it once."""
        health = web.get("/health", lambda r: json_response({"status": "ok"}))
        first = await serve(
            *polled_routes(drop, lambda r: json_response(result_body("r1"))), health
        )
        second = await serve(
            *polled_routes(drop, lambda r: json_response(result_body("r1"))), health
        )
        delays: list[float] = []

        async def sleep(delay: float) -> None:
            delays.append(delay)

        async with RolloutClientPool(urls=[first.url, second.url]) as pool:
            override_timing(pool, sleep=sleep)
            for _ in range(2):  # the second run goes to the other server (round-robin)
                assert (await pool.run_rollout(MESSAGES, "u", "r1")).status == "success"
        assert delays == [0.1, 0.1]
        assert len(first.seen("GET", "/rollout/")) == len(second.seen("GET", "/rollout/")) == 2

    def test_needs_a_client(self):
        """Only a RolloutClient or a RolloutClientPool can be configured."""
        with pytest.raises(TypeError, match="RolloutClient"):
            override_timing(object())  # type: ignore[arg-type]
