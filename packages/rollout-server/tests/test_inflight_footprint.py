"""What keeps a waiting rollout small: the self-guarded long poll, the dropped keep-alive
timer, frame-free waits, an execution task that runs ``backend.execute()`` itself,
responses that let go of their bodies once sent, and per-rollout objects without an
instance dict."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from rollout_server.execution._lazydir import LazyDirectory
from rollout_server.http._aiohttp_private import pause_keepalive_timer
from rollout_server.http._middleware import make_protocol_middleware, self_guarded
from rollout_server.http._responses import json_response
from rollout_server.state._record import RolloutRecord
from rollout_server.state._registry import RolloutRegistry
from rollout_types import PROTOCOL_VERSION, PROTOCOL_VERSION_HEADER, RolloutStatus

EVENT_SEC = 10.0


async def _ok(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


class TestSelfGuardedHandlers:
    async def test_a_self_guarded_handler_runs_without_a_middleware_frame(self) -> None:
        """For a self-guarded handler the middleware returns the handler's own coroutine; any
        other handler gets a guarding coroutine around it."""
        middleware = make_protocol_middleware(None)

        async def guarded(_request: web.Request) -> web.Response:
            return web.Response(text="guarded")

        self_guarded(guarded)
        request = make_mocked_request("GET", "/x")
        own = middleware(request, guarded)
        other = middleware(request, _ok)
        try:
            assert getattr(own, "cr_code", None) is guarded.__code__
            assert getattr(other, "cr_code", None) is not _ok.__code__
        finally:
            for awaitable in (own, other):
                close = getattr(awaitable, "close", None)
                if close is not None:
                    close()

    async def test_the_checks_still_come_before_a_self_guarded_handler(self) -> None:
        """A request without the right bearer token gets 401 with the protocol header, and
        the self-guarded handler is never called."""
        middleware = make_protocol_middleware("secret")
        called: list[bool] = []

        async def guarded(_request: web.Request) -> web.Response:
            called.append(True)
            return web.Response(text="guarded")

        self_guarded(guarded)
        response = await middleware(make_mocked_request("GET", "/x"), guarded)
        assert response.status == 401
        assert response.headers[PROTOCOL_VERSION_HEADER] == PROTOCOL_VERSION
        assert called == []

    async def test_an_error_in_the_result_route_is_a_logged_json_500(
        self, harness: Any, caplog: Any
    ) -> None:
        """An unexpected exception while answering a poll gives the opaque JSON 500 with the
        protocol header, and is logged with the request line."""
        token = await harness.admit("r1")
        registry = harness.server.registry

        def broken(_rollout_id: str) -> RolloutRecord | None:
            raise RuntimeError("registry broke")

        registry.get = broken
        with caplog.at_level(logging.ERROR, logger="rollout_server"):
            reply = await harness.poll("r1", token)
        assert reply.status == 500
        assert set(reply.json) == {"detail"}
        assert "registry broke" not in reply.raw.decode()
        assert reply.headers[PROTOCOL_VERSION_HEADER] == PROTOCOL_VERSION
        assert "Unhandled error serving GET /rollout/r1/result" in caplog.messages


class TestSentResponses:
    async def test_a_sent_response_lets_go_of_its_body(self) -> None:
        """Once json_response()'s body is written the response no longer holds it (aiohttp
        keeps a connection's last response until the next request on it is answered)."""
        body = b'{"status":"success"}'
        writer = mock.Mock(output_size=len(body))
        for name in ("write_headers", "write", "write_eof", "drain"):
            setattr(writer, name, mock.AsyncMock(return_value=None))
        response = json_response(200, body)
        await response.prepare(make_mocked_request("GET", "/x", writer=writer))
        assert response.body == body
        await response.write_eof()
        writer.write_eof.assert_awaited_once_with(body)
        assert response.body is None
        assert response.body_length == len(body)

    async def test_the_access_log_still_has_each_body_length(
        self, make_harness: Any, caplog: Any
    ) -> None:
        """The access log, written after the body is sent, still gets the size of each
        answer (aiohttp logs the bytes written, head and body: more than the body)."""
        harness = await make_harness(access_log=True)
        with caplog.at_level(logging.INFO, logger="rollout_server.access"):
            admitted = await harness.post_rollout()
            polled = await harness.poll("r1", admitted.json["polling_lease_token"])
            missing = await harness.request("GET", "/nothing")
        lines = [r.getMessage() for r in caplog.records if r.name == "rollout_server.access"]
        assert len(lines) == 3
        for line, reply in zip(lines, (admitted, polled, missing), strict=True):
            logged = re.search(rf'" {reply.status} (\d+) "', line)
            assert logged is not None, line
            assert int(logged.group(1)) > len(reply.raw) > 0, (line, reply)


class _Protocol:
    """Stands in for aiohttp's request handler (only the keep-alive timer matters)."""

    def __init__(self, handle: Any) -> None:
        self._keepalive_handle = handle


class _Request:
    """Stands in for a request (only its protocol matters)."""

    def __init__(self, protocol: Any) -> None:
        self.protocol = protocol


class TestKeepaliveTimer:
    async def test_pausing_cancels_and_forgets_the_timer(self) -> None:
        """pause_keepalive_timer() cancels the connection's keep-alive timer and clears it."""
        handle = asyncio.get_running_loop().call_later(3600, lambda: None)
        protocol = _Protocol(handle)
        pause_keepalive_timer(_Request(protocol))  # type: ignore[arg-type]
        assert handle.cancelled()
        assert protocol._keepalive_handle is None

    async def test_pausing_without_a_timer_does_nothing(self) -> None:
        """A connection without a keep-alive timer (or an aiohttp without one) is left as is."""
        protocol = _Protocol(None)
        pause_keepalive_timer(_Request(protocol))  # type: ignore[arg-type]
        assert protocol._keepalive_handle is None
        pause_keepalive_timer(_Request(object()))  # type: ignore[arg-type]

    async def test_a_waiting_poll_holds_no_timer_and_the_connection_gets_it_back(
        self, make_harness: Any
    ) -> None:
        """While a long poll waits, its connection has no keep-alive timer; once the poll is
        answered the timer is armed again and the connection serves the next request."""
        harness = await make_harness(
            result_wait_timeout_sec=EVENT_SEC, polling_lease_timeout_sec=2 * EVENT_SEC
        )
        token = await harness.admit("r1")
        record = harness.server.registry.get("r1")
        poll = asyncio.create_task(harness.poll("r1", token))
        await harness.until(lambda: record.waiting == 1)
        server = harness.client.server.runner.server
        busy = [c for c in server.connections if getattr(c, "_request_in_progress", False)]
        assert busy
        assert all(getattr(c, "_keepalive_handle", None) is None for c in busy)
        (await harness.backend.started("r1")).succeed()
        async with asyncio.timeout(EVENT_SEC):
            reply = await poll
        assert reply.json["status"] == "success"
        await harness.until(
            lambda: all(getattr(c, "_keepalive_handle", None) is not None for c in busy)
        )
        assert (await harness.health()).status == 200


class TestFrameFreeWait:
    @staticmethod
    def _registry_with(
        rollout_id: str, grace_sec: float = 0.0
    ) -> tuple[RolloutRegistry, RolloutRecord, Any]:
        registry = RolloutRegistry(
            polling_lease_timeout_sec=60.0,
            result_retention_sec=60.0,
            status_change_grace_sec=grace_sec,
        )
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def body() -> None:
            await gate

        record, _token = registry.register(
            rollout_id, lambda _record: asyncio.get_running_loop().create_task(body())
        )
        return registry, record, gate

    async def test_nothing_to_wait_for_gives_none(self) -> None:
        """waits.begin() returns None when, without a grace, the status differs already
        from the one last answered, when the result is published, or when the registry
        is closed."""
        registry, record, gate = self._registry_with("r1")
        registry.set_status(record, RolloutStatus.RUNNING)
        assert registry.waits.begin(record, 5.0) is None
        registry.deliver_status(record)
        registry.close()
        assert registry.waits.begin(record, 5.0) is None
        gate.set_result(None)
        registry2, record2, gate2 = self._registry_with("r2")
        registry2.publish(record2, status=RolloutStatus.SUCCESS)
        assert registry2.waits.begin(record2, 5.0) is None
        gate2.set_result(None)
        registry2.close()

    def _change_under_a_wait(
        self, grace_sec: float
    ) -> tuple[RolloutRegistry, RolloutRecord, Any, asyncio.Future[None]]:
        """A registry with that grace, one rollout, a 30 s wait on it, then queued → running."""
        registry, record, gate = self._registry_with("r1", grace_sec=grace_sec)
        wait = registry.waits.begin(record, 3 * EVENT_SEC)
        assert wait is not None
        registry.set_status(record, RolloutStatus.RUNNING)
        return registry, record, gate, wait

    @staticmethod
    def _finish(registry: RolloutRegistry, record: RolloutRecord, gate: Any, wait: Any) -> None:
        registry.waits.end(record, wait)
        assert record.waiting == 0
        gate.set_result(None)
        registry.close()

    async def test_a_result_within_the_grace_ends_the_wait_at_once(self) -> None:
        """A non-terminal change leaves the wait listed and pending; a publication within
        the grace ends it at once."""
        registry, record, gate, wait = self._change_under_a_wait(EVENT_SEC)
        assert not wait.done()
        assert record.waiting == 1
        registry.publish(record, status=RolloutStatus.SUCCESS)
        assert wait.done()
        self._finish(registry, record, gate, wait)

    async def test_a_change_ends_the_wait_by_the_grace(self) -> None:
        """Without a result, the wait ends at the grace (0.05 s), not at its own 30 s."""
        registry, record, gate, wait = self._change_under_a_wait(0.05)
        async with asyncio.timeout(EVENT_SEC):
            await wait
        self._finish(registry, record, gate, wait)

    async def test_without_a_grace_a_change_ends_the_wait_at_once(self) -> None:
        """With a grace of 0 (osmosis-ai's timing) the change itself ends the wait."""
        registry, record, gate, wait = self._change_under_a_wait(0.0)
        assert wait.done()
        assert record.waiting == 0
        self._finish(registry, record, gate, wait)

    def test_a_negative_grace_is_refused(self) -> None:
        """status_change_grace_sec below 0 (or NaN) is a ValueError naming it."""
        for bad in (-1.0, math.nan):
            with pytest.raises(ValueError, match="status_change_grace_sec"):
                RolloutRegistry(
                    polling_lease_timeout_sec=60.0,
                    result_retention_sec=60.0,
                    status_change_grace_sec=bad,
                )

    async def test_a_status_change_ends_the_wait_and_end_wait_unlists_it(self) -> None:
        """The future of waits.begin() is done on a status change; a timed-out wait is
        removed from the record by waits.end()."""
        registry, record, gate = self._registry_with("r1")
        wait = registry.waits.begin(record, EVENT_SEC)
        assert wait is not None
        assert record.waiting == 1
        registry.set_status(record, RolloutStatus.RUNNING)
        async with asyncio.timeout(EVENT_SEC):
            await wait
        registry.waits.end(record, wait)
        assert record.waiting == 0
        registry.deliver_status(record)  # the poll answered running
        short = registry.waits.begin(record, 0.01)
        assert short is not None
        async with asyncio.timeout(EVENT_SEC):
            await short  # done by its deadline
        assert record.waiting == 1
        registry.waits.end(record, short)
        assert record.waiting == 0
        gate.set_result(None)
        registry.close()

    async def test_several_waits_on_one_rollout_are_each_woken_and_unlisted(self) -> None:
        """Two polls of one rollout wait together: ending one leaves the other waiting, a
        status change wakes the other, and no wait deadline is left behind."""
        registry, record, gate = self._registry_with("r1")
        first = registry.waits.begin(record, EVENT_SEC)
        second = registry.waits.begin(record, EVENT_SEC)
        assert first is not None
        assert second is not None
        assert record.waiting == 2
        registry.waits.end(record, first)  # that poll went away (its client disconnected)
        assert first.cancelled()
        assert record.waiting == 1
        assert not second.done()
        registry.set_status(record, RolloutStatus.RUNNING)
        async with asyncio.timeout(EVENT_SEC):
            await second
        registry.waits.end(record, second)
        assert record.waiting == 0
        assert len(registry._deadlines) == 1  # only the lease deadline is left
        gate.set_result(None)
        registry.close()


class TestExecutionTask:
    async def test_the_task_runs_execute_itself_with_the_context_bound(self, harness: Any) -> None:
        """The execution task's coroutine is backend.execute() (no wrapper frame), and the
        ambient rollout context is bound inside it."""
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        task = harness.server.registry.get("r1").task
        assert task.get_coro().__qualname__.endswith(".execute")
        assert run.context is not None
        assert run.context.rollout_id == "r1"
        assert run.context.process_id == harness.server.process_id
        run.succeed()
        reply = await harness.poll_until("r1", token, "success")
        assert reply.json["sample"]["reward"] == 0.5

    async def test_a_failing_outcome_hook_is_published_as_a_crash(self, caplog: Any) -> None:
        """When the outcome hook raises, the error is logged and the rollout is published as
        failure / internal_error."""

        def hook(_rollout_id: str, _task: asyncio.Task[Any]) -> None:
            raise RuntimeError("hook broke")

        registry = RolloutRegistry(
            polling_lease_timeout_sec=60.0, result_retention_sec=60.0, outcome_of=hook
        )

        async def body() -> None:
            return None

        with caplog.at_level(logging.ERROR, logger="rollout_server"):
            record, _token = registry.register(
                "r1", lambda _record: asyncio.get_running_loop().create_task(body())
            )
            async with asyncio.timeout(EVENT_SEC):
                await registry.idle_future()
        assert record.body is not None
        published = json.loads(record.body)
        assert (published["status"], published["err_category"]) == ("failure", "internal_error")
        assert "Publishing the outcome of rollout r1 failed" in caplog.messages
        registry.close()


class TestPerRolloutObjects:
    def test_a_record_has_slots_only(self) -> None:
        """A rollout's record has no instance dict (one is kept per rollout in flight or
        retained)."""
        record = RolloutRecord("r1", b"digest", lease_deadline=0.0)
        assert not hasattr(record, "__dict__")

    def test_a_lazy_directory_keeps_a_string(self, tmp_path: Path) -> None:
        """A LazyDirectory made from a Path keeps its path as a string (a Path object costs
        about 250 bytes per rollout in flight) and has no instance dict."""
        directory = LazyDirectory(tmp_path / "r1" / "artifacts")
        assert type(directory._path) is str
        assert not hasattr(directory, "__dict__")
        assert directory.path == tmp_path / "r1" / "artifacts"
