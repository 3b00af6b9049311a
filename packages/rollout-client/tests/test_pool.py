"""``RolloutClientPool`` against several fake rollout servers on 127.0.0.1.

Each fake server (:class:`FakeRollouts`) admits with 202 (or what a test scripts), answers
long polls with ``running`` until the test finishes the rollout, and reports a
``process_id`` the test can change (a restart). Backoff sleeps are instant (``FakeTime``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rollout_client import (
    PoolServerStatus,
    RetrySettings,
    RolloutAdmissionTimeoutError,
    RolloutClientPool,
    RolloutNotFoundError,
    RolloutProtocolError,
    RolloutServersUnavailableError,
)
from rollout_client.testing import override_timing
from rollout_types import CancelDisposition, RolloutStatus

from .conftest import EVENT_SEC, FakeServer, FakeTime, drop, init_body, json_response, result_body

MESSAGES = [{"role": "user", "content": "What is 6 * 7?"}]
CHAT = "http://127.0.0.1:9/v1"


class FakeRollouts:
    """The state behind one fake rollout server's routes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.process_id = f"{name}-pid-1"
        self.accepting = True
        self.admission: Callable[[web.Request], Any] | None = None
        """Answers POST /rollout instead of admitting (None: admit with 202)."""
        self.results: Callable[[web.Request], Any] | None = None
        """Answers result polls instead of the normal long poll (None: normal)."""
        self.health_status = 200
        self.done: dict[str, asyncio.Event] = {}
        self.server: FakeServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def admitted(self) -> list[str]:
        """Ids this server was asked to admit, in order."""
        assert self.server is not None
        return [
            json.loads(r.body)["rollout_id"]
            for r in self.server.seen("POST", "/rollout")
            if r.raw_path == "/rollout"
        ]

    def polled(self) -> set[str]:
        """Ids whose result this server was asked for."""
        assert self.server is not None
        return {r.raw_path.split("/")[2] for r in self.server.seen("GET", "/rollout/")}

    def finish(self, rollout_id: str) -> None:
        self.done.setdefault(rollout_id, asyncio.Event()).set()

    def routes(self) -> list[web.RouteDef]:
        async def admit(request: web.Request) -> web.StreamResponse:
            if self.admission is not None:
                answer = self.admission(request)
                return await answer if asyncio.iscoroutine(answer) else answer
            rollout_id = (await request.json())["rollout_id"]
            self.done.setdefault(rollout_id, asyncio.Event())
            return json_response(init_body(rollout_id, wait=0.05, lease=60.0), 202)

        async def result(request: web.Request) -> web.StreamResponse:
            if self.results is not None:
                answer = self.results(request)
                return await answer if asyncio.iscoroutine(answer) else answer
            rollout_id = request.match_info["rollout_id"]
            event = self.done.get(rollout_id)
            if event is None:
                return json_response({"detail": "not found"}, 404)
            try:
                async with asyncio.timeout(0.05):
                    await event.wait()
            except TimeoutError:
                return json_response(result_body(rollout_id, "running"))
            return json_response(result_body(rollout_id))

        async def health(request: web.Request) -> web.StreamResponse:
            active = sum(1 for event in self.done.values() if not event.is_set())
            return json_response(
                {
                    "status": "ok",
                    "process_id": self.process_id,
                    "instance_id": self.process_id,
                    "lifecycle": {"accepting_rollouts": self.accepting, "active_rollouts": active},
                },
                self.health_status,
            )

        async def cancel(request: web.Request) -> web.StreamResponse:
            ids = (await request.json())["ids"]
            return json_response({"dispositions": dict.fromkeys(ids, "cancelled_running")})

        return [
            web.post("/rollout", admit),
            web.get("/rollout/{rollout_id}/result", result),
            web.get("/health", health),
            web.post("/rollout/cancel", cancel),
        ]


Start = Callable[..., Awaitable[list[FakeRollouts]]]


@pytest.fixture
async def fakes(serve: Callable[..., Awaitable[FakeServer]]) -> Start:
    """Start ``n`` fake rollout servers: ``a, b, c = await fakes(3)``."""

    async def start(count: int) -> list[FakeRollouts]:
        started = []
        for index in range(count):
            fake = FakeRollouts("abcdefgh"[index])
            fake.server = await serve(*fake.routes())
            started.append(fake)
        return started

    return start


@pytest.fixture
async def make_pool(fake_time: FakeTime) -> AsyncIterator[Callable[..., RolloutClientPool]]:
    """Build pools with instant backoff sleeps (``FakeTime``); closed at teardown."""
    pools: list[RolloutClientPool] = []

    def build(urls: list[str], **kwargs: Any) -> RolloutClientPool:
        kwargs.setdefault("probe_interval_sec", 0.05)
        pool = RolloutClientPool(urls=urls, **kwargs)
        override_timing(pool, sleep=fake_time.sleep, clock=fake_time.clock)
        pools.append(pool)
        return pool

    yield build
    for pool in pools:
        await pool.aclose()


async def start_rollout(pool: RolloutClientPool, rollout_id: str) -> Any:
    return await pool.run_rollout_async(MESSAGES, CHAT, rollout_id)


async def settled(pool: RolloutClientPool, predicate: Callable[[], bool]) -> None:
    """Wait (bounded) until the pool's view satisfies ``predicate``."""
    async with asyncio.timeout(EVENT_SEC):
        await pool._wait_for(predicate)


def busy_once(fake: FakeRollouts, *, retry_after: str) -> None:
    """Make ``fake`` answer its next admission 429 with ``retry_after``, then admit again."""
    answers = [retry_after]

    async def answer(request: web.Request) -> web.StreamResponse:
        if answers:
            return json_response({"detail": "full"}, 429, **{"Retry-After": answers.pop()})
        rollout_id = (await request.json())["rollout_id"]
        fake.done.setdefault(rollout_id, asyncio.Event())
        return json_response(init_body(rollout_id), 202)

    fake.admission = answer


def shutting_down(_request: web.Request) -> web.StreamResponse:
    """A rollout server's answer to an admission once its shutdown has begun."""
    return json_response({"detail": "rollout server is shutting down"}, 503)


def status_of(pool: RolloutClientPool, url: str) -> PoolServerStatus:
    (status,) = [s for s in pool.servers() if s.url == url]
    return status


class TestConstruction:
    def test_rejects_bad_url_lists(self):
        """No URL, a single string, a duplicate or an invalid URL is refused up front."""
        with pytest.raises(ValueError, match="at least one"):
            RolloutClientPool(urls=[])
        with pytest.raises(TypeError, match="not a single string"):
            RolloutClientPool(urls="http://127.0.0.1:1")
        with pytest.raises(ValueError, match="twice"):
            RolloutClientPool(urls=["http://127.0.0.1:1", "http://127.0.0.1:1/"])
        with pytest.raises(ValueError, match="absolute"):
            RolloutClientPool(urls=["http://127.0.0.1:1", "127.0.0.1:2"])
        with pytest.raises(ValueError, match="probe_interval_sec"):
            RolloutClientPool(urls=["http://127.0.0.1:1"], probe_interval_sec=0)

    def test_view_before_use(self):
        """Before any request every server is in rotation with nothing outstanding."""
        pool = RolloutClientPool(urls=["http://127.0.0.1:1/", "http://127.0.0.1:2"])
        assert pool.urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")
        assert [(s.available, s.outstanding, s.process_id) for s in pool.servers()] == [
            (True, 0, None),
            (True, 0, None),
        ]


class TestRouting:
    async def test_least_outstanding_then_round_robin(self, fakes, make_pool):
        """Admissions go round-robin over idle servers, then to the one with fewest in flight."""
        a, b, c = await fakes(3)
        pool = make_pool([a.url, b.url, c.url])
        handles = [await start_rollout(pool, f"r{i}") for i in range(6)]
        assert (a.admitted(), b.admitted(), c.admitted()) == (
            ["r0", "r3"],
            ["r1", "r4"],
            ["r2", "r5"],
        )
        b.finish("r1")
        assert await handles[1] is not None
        await start_rollout(pool, "r6")
        assert b.admitted() == ["r1", "r4", "r6"]
        assert [s.outstanding for s in pool.servers()] == [2, 2, 2]

    async def test_polls_stay_on_the_admitting_server(self, fakes, make_pool):
        """Every result poll of a rollout goes to the server that admitted it."""
        fleet = await fakes(3)
        pool = make_pool([f.url for f in fleet])
        handles = [await start_rollout(pool, f"r{i}") for i in range(6)]
        for fake in fleet:
            for rollout_id in fake.admitted():
                fake.finish(rollout_id)
        results = [await handle for handle in handles]
        assert {r.status for r in results} == {RolloutStatus.SUCCESS}
        for fake in fleet:
            assert fake.polled() == set(fake.admitted())

    async def test_429_skips_the_server_until_retry_after(self, fakes, make_pool, fake_time):
        """A 429 sends the rollout to another server and keeps the busy one out of routing."""
        a, b = await fakes(2)
        a.admission = lambda r: json_response({"detail": "full"}, 429, **{"Retry-After": "30"})
        pool = make_pool([a.url, b.url])
        for i in range(3):
            await start_rollout(pool, f"r{i}")
        assert (a.admitted(), b.admitted()) == (["r0"], ["r0", "r1", "r2"])
        assert fake_time.sleeps == []
        assert status_of(pool, a.url).available

    async def test_every_server_busy_waits_for_the_first_free(self, fakes, make_pool, fake_time):
        """When every server answers 429, the pool waits for the shortest Retry-After."""
        a, b = await fakes(2)
        busy_once(a, retry_after="5")
        busy_once(b, retry_after="2")
        pool = make_pool([a.url, b.url])
        await start_rollout(pool, "r0")
        (slept,) = fake_time.sleeps
        assert 0.0 <= slept <= 2.0  # until b's Retry-After (2 s) ends, not a's (5 s)
        assert (a.admitted(), b.admitted()) == (["r0"], ["r0", "r0"])

    async def test_503_takes_the_server_out_and_tries_the_next(self, fakes, make_pool):
        """A server shutting down (503) leaves the rotation; the rollout goes elsewhere."""
        a, b = await fakes(2)
        a.admission = lambda r: json_response({"detail": "rollout server is shutting down"}, 503)
        a.accepting = False
        pool = make_pool([a.url, b.url], probe_interval_sec=60)
        handle = await start_rollout(pool, "r0")
        assert b.admitted() == ["r0"]
        assert handle.rollout_id == "r0"
        status = status_of(pool, a.url)
        assert not status.available
        assert "503" in (status.reason or "") or "shutting down" in (status.reason or "")
        await start_rollout(pool, "r1")
        assert a.admitted() == ["r0"]

    async def test_refused_connection_takes_the_server_out(self, fakes, make_pool):
        """A server that refuses connections is out of rotation and the next server admits."""
        a, b = await fakes(2)
        assert a.server is not None
        a.server.stop_listening()
        pool = make_pool([a.url, b.url], probe_interval_sec=60)
        await start_rollout(pool, "r0")
        await start_rollout(pool, "r1")
        assert b.admitted() == ["r0", "r1"]
        status = status_of(pool, a.url)
        assert not status.available
        assert "ClientConnectorError" in (status.reason or "")

    async def test_every_server_unavailable_names_each(self, fakes, make_pool):
        """When no server can take a rollout, the error says which and why."""
        a, b = await fakes(2)
        a.admission = lambda r: json_response({"detail": "shutting down"}, 503)
        a.accepting = False
        assert b.server is not None
        b.server.stop_listening()
        pool = make_pool([a.url, b.url], probe_interval_sec=60)
        with pytest.raises(RolloutServersUnavailableError) as error:
            await start_rollout(pool, "r0")
        assert set(error.value.reasons) == {a.url, b.url}
        assert "503" in error.value.reasons[a.url] or "shutting" in error.value.reasons[a.url]
        assert "ClientConnectorError" in error.value.reasons[b.url]
        assert a.url in str(error.value)
        assert b.url in str(error.value)
        assert error.value.rollout_id == "r0"

    async def test_unavailable_error_tells_servers_shutting_down_from_gateways(
        self, fakes, make_pool
    ):
        """Only a 503 with the shutting-down detail marks a server as shutting down; a
        gateway's 503 and a refused connection leave it out of ``shutting_down``."""
        a, b, c = await fakes(3)
        a.admission = shutting_down
        b.admission = lambda r: web.Response(status=503, text="<html>Service Unavailable</html>")
        assert c.server is not None
        c.server.stop_listening()
        pool = make_pool([a.url, b.url, c.url], probe_interval_sec=60)
        with pytest.raises(RolloutServersUnavailableError) as error:
            await start_rollout(pool, "r0")
        assert error.value.shutting_down == frozenset({a.url})
        assert error.value.reasons[a.url] == "POST /rollout answered 503 (shutting down)"
        assert error.value.reasons[b.url] == "POST /rollout answered 503 (gateway)"

    async def test_a_server_probed_as_shutting_down_counts_as_shutting_down(self, fakes, make_pool):
        """A server out of rotation whose probe (made before the pool gives up) says
        accepting_rollouts is false is named in ``shutting_down`` next to one that answered
        503 "shutting down" just now."""
        a, b = await fakes(2)
        a.admission = shutting_down
        a.accepting = False
        pool = make_pool([a.url, b.url], probe_interval_sec=60)
        await start_rollout(pool, "r0")
        assert b.admitted() == ["r0"]
        b.admission = shutting_down
        b.accepting = False
        with pytest.raises(RolloutServersUnavailableError) as error:
            await start_rollout(pool, "r1")
        assert error.value.shutting_down == frozenset({a.url, b.url})
        assert error.value.reasons == {
            a.url: "shutting down (GET /health: accepting_rollouts is false)",
            b.url: "POST /rollout answered 503 (shutting down)",
        }

    async def test_a_server_out_is_probed_when_no_other_is_left(self, fakes, make_pool):
        """With every other server gone, a server taken out earlier is probed at once and
        admits again when healthy."""
        a, b = await fakes(2)
        a.admission = lambda r: json_response({"detail": "shutting down"}, 503)
        pool = make_pool([a.url, b.url], probe_interval_sec=60)
        await start_rollout(pool, "r0")
        assert not status_of(pool, a.url).available
        a.admission = None  # restarted: admits again
        b.admission = lambda r: json_response({"detail": "shutting down"}, 503)
        await start_rollout(pool, "r1")
        assert (a.admitted(), b.admitted()) == (["r0", "r1"], ["r0", "r1"])
        assert [s.available for s in pool.servers()] == [True, False]

    async def test_other_admission_errors_are_raised(self, fakes, make_pool):
        """A 401 is the caller's problem: raised as by RolloutClient, no other server tried."""
        a, b = await fakes(2)
        a.admission = b.admission = lambda r: json_response({"detail": "unauthorized"}, 401)
        pool = make_pool([a.url, b.url])
        with pytest.raises(RolloutProtocolError, match="401") as error:
            await start_rollout(pool, "r0")
        assert error.value.status_code == 401
        assert len(a.admitted()) + len(b.admitted()) == 1
        assert [s.available for s in pool.servers()] == [True, True]

    async def test_an_id_in_flight_is_refused_before_any_request(self, fakes, make_pool):
        """Re-using an id the pool has in flight raises ValueError without a request."""
        (a,) = await fakes(1)
        pool = make_pool([a.url])
        await start_rollout(pool, "r0")
        with pytest.raises(ValueError, match="in flight through this pool"):
            await start_rollout(pool, "r0")
        assert a.admitted() == ["r0"]

    async def test_zero_admission_timeout_expires_at_once(self, fakes, make_pool):
        """admission_timeout_sec=0 raises RolloutAdmissionTimeoutError without a request."""
        (a,) = await fakes(1)
        pool = make_pool([a.url], admission_timeout_sec=0)
        with pytest.raises(RolloutAdmissionTimeoutError) as error:
            await start_rollout(pool, "r0")
        assert error.value.may_have_succeeded is False
        assert a.admitted() == []

    async def test_admission_deadline_names_a_post_in_flight(self, fakes, make_pool):
        """When admission_timeout_sec ends during a POST, the error says the rollout may
        have been admitted."""
        (a,) = await fakes(1)

        async def hang(request: web.Request) -> web.StreamResponse:
            assert a.server is not None
            await a.server.hang()
            return json_response({"detail": "too late"}, 503)

        a.admission = hang
        pool = make_pool([a.url], admission_timeout_sec=0.2)
        with pytest.raises(RolloutAdmissionTimeoutError, match="may have succeeded") as error:
            await start_rollout(pool, "r0")
        assert error.value.may_have_succeeded is True
        assert pool.servers()[0].outstanding == 0


class TestRetrySettings:
    async def test_429_wait_uses_the_pools_retry_after_clamp(self, fakes, make_pool, fake_time):
        """RolloutClientPool(retry=...) clamps a 429's Retry-After: with every server busy for
        30 s and 40 s and a 3 s maximum, the pool waits at most 3 s before trying again."""
        a, b = await fakes(2)
        busy_once(a, retry_after="30")
        busy_once(b, retry_after="40")
        pool = make_pool([a.url, b.url], retry=RetrySettings(retry_after_max_sec=3.0))
        await start_rollout(pool, "r0")
        (slept,) = fake_time.sleeps
        assert 0.0 < slept <= 3.0
        assert (a.admitted(), b.admitted()) == (["r0", "r0"], ["r0"])

    async def test_result_polls_use_the_pools_gateway_schedule(self, fakes, make_pool, fake_time):
        """Each server's client polls with the pool's RetrySettings: one gateway retry after
        0.5 s, then the 502 is raised (the default schedule would retry 6 times)."""
        (a,) = await fakes(1)
        a.results = lambda r: json_response({"detail": "bad gateway"}, 502)
        pool = make_pool([a.url], retry=RetrySettings(gateway_delays_sec=(0.5,)))
        handle = await start_rollout(pool, "r0")
        with pytest.raises(RolloutProtocolError, match="502"):
            await handle
        assert fake_time.sleeps == [0.5]
        assert a.polled() == {"r0"}
        assert a.server is not None
        assert len(a.server.seen("GET", "/rollout/")) == 2

    def test_refuses_another_type(self):
        """RolloutClientPool(retry=...) accepts only a RetrySettings."""
        with pytest.raises(TypeError, match="RetrySettings"):
            RolloutClientPool(urls=["http://127.0.0.1:1"], retry={"gateway_delays_sec": ()})  # type: ignore[arg-type]


class TestRotation:
    async def test_failed_polls_take_the_server_out_and_a_probe_brings_it_back(
        self, fakes, make_pool
    ):
        """A rollout whose polls fail on the transport takes its server out; the periodic
        probe brings the server back once /health answers."""
        a, b = await fakes(2)
        pool = make_pool([a.url, b.url])
        await pool.health()
        a.results = drop
        a.health_status = 500
        handle = await start_rollout(pool, "r0")
        with pytest.raises(aiohttp.ClientError):
            await handle
        assert not status_of(pool, a.url).available
        assert "result poll of r0 failed" in (status_of(pool, a.url).reason or "")
        a.health_status = 200
        await settled(pool, lambda: status_of(pool, a.url).available)
        assert status_of(pool, a.url).reason is None

    async def test_a_changed_process_id_counts_as_a_restart(self, fakes, make_pool):
        """A new process_id in a server's /health is recorded as a restart of that server."""
        a, b = await fakes(2)
        pool = make_pool([a.url, b.url])
        first = await pool.health()
        assert [s.process_id for s in first.values()] == ["a-pid-1", "b-pid-1"]
        a.process_id = "a-pid-2"
        second = await pool.health()
        assert (second[a.url].restarts, second[a.url].process_id) == (1, "a-pid-2")
        assert (second[b.url].restarts, second[b.url].process_id) == (0, "b-pid-1")
        assert second[a.url].health is not None
        assert second[a.url].health["process_id"] == "a-pid-2"

    async def test_health_reports_each_server_without_raising(self, fakes, make_pool):
        """health() gives every server's status; a failing one is out with its reason."""
        a, b = await fakes(2)
        b.health_status = 401
        pool = make_pool([a.url, b.url], probe_interval_sec=60)
        report = await pool.health()
        assert list(report) == [a.url, b.url]
        assert report[a.url].available
        assert report[a.url].health is not None
        assert not report[b.url].available
        assert report[b.url].health is None
        assert "401" in (report[b.url].reason or "")

    async def test_a_draining_server_stays_out(self, fakes, make_pool):
        """A server whose /health says it no longer accepts rollouts is out of rotation."""
        a, b = await fakes(2)
        a.accepting = False
        pool = make_pool([a.url, b.url], probe_interval_sec=60)
        report = await pool.health()
        assert not report[a.url].available
        assert "accepting_rollouts is false" in (report[a.url].reason or "")
        await start_rollout(pool, "r0")
        await start_rollout(pool, "r1")
        assert (a.admitted(), b.admitted()) == ([], ["r0", "r1"])


class TestCancelAndIdle:
    async def test_cancel_goes_to_the_admitting_server(self, fakes, make_pool):
        """cancel_rollout() is sent to the server that admitted the rollout, also after the
        local handle was cancelled."""
        a, b = await fakes(2)
        pool = make_pool([a.url, b.url])
        first, second = await start_rollout(pool, "r0"), await start_rollout(pool, "r1")
        second.cancel()
        for rollout_id in ("r0", "r1"):
            response = await pool.cancel_rollout(rollout_id)
            assert response.dispositions == {rollout_id: CancelDisposition.CANCELLED_RUNNING}
        assert a.server is not None
        assert b.server is not None
        assert [json.loads(r.body)["ids"] for r in a.server.seen("POST", "/rollout/cancel")] == [
            ["r0"]
        ]
        assert [json.loads(r.body)["ids"] for r in b.server.seen("POST", "/rollout/cancel")] == [
            ["r1"]
        ]
        first.cancel()

    async def test_cancel_of_an_unknown_id_is_refused(self, fakes, make_pool):
        """An id this pool never admitted raises RolloutNotFoundError without a request."""
        (a,) = await fakes(1)
        pool = make_pool([a.url])
        with pytest.raises(RolloutNotFoundError, match="not admitted through this pool"):
            await pool.cancel_rollout("nope")
        assert a.server is not None
        assert a.server.seen("POST", "/rollout/cancel") == []

    async def test_wait_idle_waits_for_every_server(self, fakes, make_pool):
        """wait_idle() returns each server's idle health once all of them are idle."""
        a, b = await fakes(2)
        pool = make_pool([a.url, b.url])
        handles = [await start_rollout(pool, f"r{i}") for i in range(2)]
        waiting = asyncio.ensure_future(
            pool.wait_idle(timeout_sec=EVENT_SEC, poll_interval_sec=0.01)
        )
        a.finish("r0")
        await handles[0]
        assert not waiting.done()
        b.finish("r1")
        idle = await waiting
        assert {url: h["lifecycle"]["active_rollouts"] for url, h in idle.items()} == {
            a.url: 0,
            b.url: 0,
        }

    async def test_wait_idle_names_a_restarted_server(self, fakes, make_pool):
        """A server whose process_id changed since the pool saw it makes wait_idle raise,
        naming that server."""
        a, b = await fakes(2)
        pool = make_pool([a.url, b.url])
        await pool.health()
        b.process_id = "b-pid-2"
        with pytest.raises(RolloutProtocolError, match="restarted") as error:
            await pool.wait_idle(timeout_sec=EVENT_SEC, poll_interval_sec=0.01)
        assert b.url in str(error.value)

    async def test_wait_idle_rejects_unknown_pins(self, fakes, make_pool):
        """process_ids naming a server outside the pool is a ValueError."""
        (a,) = await fakes(1)
        pool = make_pool([a.url])
        with pytest.raises(ValueError, match="not servers of this pool"):
            await pool.wait_idle(process_ids={"http://127.0.0.1:1": "p"})

    async def test_closed_pool_refuses_work(self, fakes, make_pool):
        """After aclose() every request raises RuntimeError; closing twice is harmless."""
        (a,) = await fakes(1)
        pool = make_pool([a.url])
        handle = await start_rollout(pool, "r0")
        await pool.aclose()
        await pool.aclose()
        assert handle.done()
        with pytest.raises(RuntimeError, match="closed"):
            await start_rollout(pool, "r1")
