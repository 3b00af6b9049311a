"""The server core's classes one by one: the routes, the staged shutdown on its protocol,
the cancellation policy, the long-poll waits and the registry's end of a task."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Coroutine, Mapping
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request

from rollout_server import ROLLOUT_SERVER_KEY, ExecutionBackend, create_rollout_server
from rollout_server.http._middleware import make_protocol_middleware
from rollout_server.http._routes import Routes
from rollout_server.protocol._cancellation import Cancellation
from rollout_server.protocol._shutdown import (
    DeliveryWatch,
    ShutdownTarget,
    ShutdownTimeouts,
    run_staged_shutdown,
)
from rollout_server.state._deadlines import DeadlineQueue, due_at
from rollout_server.state._record import ResultFields, RolloutRecord
from rollout_server.state._registry import TOKEN_BYTES, RolloutRegistry
from rollout_server.state._waiting import LongPollWaits
from rollout_types import (
    PROTOCOL_VERSION,
    PROTOCOL_VERSION_HEADER,
    CancelDisposition,
    CancelRolloutsRequest,
    RolloutStatus,
)

EVENT_SEC = 10.0


class _Held:
    """A registry whose rollouts run until the test releases them (``gate``)."""

    def __init__(self, **registry_kwargs: Any) -> None:
        self.loop = asyncio.get_running_loop()
        registry_kwargs.setdefault("polling_lease_timeout_sec", 60.0)
        registry_kwargs.setdefault("result_retention_sec", 60.0)
        self.registry = RolloutRegistry(**registry_kwargs)
        self.gate: asyncio.Future[Any] = self.loop.create_future()

    def admit(self, rollout_id: str) -> tuple[RolloutRecord, str]:
        async def body() -> Any:
            return await self.gate

        return self.registry.register(rollout_id, lambda _record: self.loop.create_task(body()))

    async def idle(self) -> None:
        async with asyncio.timeout(EVENT_SEC):
            await self.registry.idle_future()

    async def finish(self) -> None:
        if not self.gate.done():
            self.gate.set_result(None)
        await self.idle()
        self.registry.close()


def _published(record: RolloutRecord) -> dict[str, Any]:
    assert record.body is not None
    document: dict[str, Any] = json.loads(record.body)
    return document


class TestRoutes:
    @staticmethod
    def _routes(scripted: Any) -> Routes:
        app = create_rollout_server(backend=scripted())
        return Routes(app[ROLLOUT_SERVER_KEY])

    async def test_health_is_a_handler_of_its_own(self, scripted: Any) -> None:
        """The health handler answers a request on its own: 200 and the health document."""
        response = await self._routes(scripted).health(make_mocked_request("GET", "/health"))
        assert response.status == 200
        assert isinstance(response.body, bytes)
        document = json.loads(response.body)
        assert document["lifecycle"] == {"accepting_rollouts": True, "active_rollouts": 0}

    async def test_a_poll_without_a_lease_is_422_with_the_protocol_header(
        self, scripted: Any
    ) -> None:
        """The result handler on its own answers a poll without a lease header with 422 and
        sets the protocol header itself (it is self-guarded)."""
        request = make_mocked_request("GET", "/rollout/r1/result", match_info={"rollout_id": "r1"})
        response = await self._routes(scripted).result(request)
        assert response.status == 422
        assert response.headers[PROTOCOL_VERSION_HEADER] == PROTOCOL_VERSION

    async def test_only_the_result_route_runs_without_a_middleware_frame(
        self, scripted: Any
    ) -> None:
        """Of the table's bound handlers, the middleware hands the result handler's own
        coroutine to aiohttp and wraps every other one."""
        routes = self._routes(scripted)
        middleware = make_protocol_middleware(None)
        request = make_mocked_request("GET", "/x")
        own: dict[str, bool] = {}
        for route in routes.table():
            handler = route.handler
            awaitable = middleware(request, handler)
            code = getattr(awaitable, "cr_code", None)
            own[route.path] = code is getattr(handler, "__func__", handler).__code__
            getattr(awaitable, "close", lambda: None)()
        assert own == {
            "/health": False,
            "/rollout": False,
            "/rollout/{rollout_id:[^/]+}/result": True,
            "/rollout/cancel": False,
            "/metrics": False,
        }


class _Target:
    """A :class:`ShutdownTarget` that records what the stages ask of it."""

    def __init__(self, registry: RolloutRegistry, backend: ExecutionBackend) -> None:
        self.registry = registry
        self.backend = backend
        self.deliveries = DeliveryWatch()
        self.calls: list[str] = []

    def begin_shutdown(self) -> None:
        self.calls.append("begin_shutdown")

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        self.calls.append("spawn")
        return asyncio.get_running_loop().create_task(coro)

    async def cancel_everything(self) -> Mapping[str, CancelDisposition]:
        self.calls.append("cancel_everything")
        for rollout_id in self.registry.ids():
            record = self.registry.get(rollout_id)
            assert record is not None
            self.registry.cancel_task(record)
        return {}

    async def close(self) -> None:
        self.calls.append("close")
        self.registry.close()


_QUICK = ShutdownTimeouts(
    drain_sec=0.0, cleanup_sec=EVENT_SEC, force_sec=EVENT_SEC, backend_sec=EVENT_SEC, collect_sec=0
)


class TestStagedShutdown:
    async def _run(self, target: ShutdownTarget) -> None:
        hurry: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        async with asyncio.timeout(EVENT_SEC):
            await run_staged_shutdown(target, _QUICK, collect=True, hurry=hurry)

    async def test_an_idle_server_closes_admissions_stops_the_backend_and_closes(
        self, scripted: Any
    ) -> None:
        """With nothing running, the stages close admissions, await backend.shutdown() and
        close, and cancel nothing."""
        held = _Held()
        backend = scripted()
        target = _Target(held.registry, backend)
        await self._run(target)
        assert target.calls == ["begin_shutdown", "close"]
        assert backend.shutdown_calls == 1

    async def test_work_still_running_is_cancelled_through_the_target(self, scripted: Any) -> None:
        """A rollout still running after the drain is cancelled through the target's
        cancel_everything(), run as a side task, and published as cancelled."""
        held = _Held()
        record, _token = held.admit("r1")
        target = _Target(held.registry, scripted())
        await self._run(target)
        assert target.calls == ["begin_shutdown", "spawn", "cancel_everything", "close"]
        assert _published(record)["status"] == "cancelled"


class TestCancellation:
    @staticmethod
    def _policy(held: _Held, backend: Any, tasks: list[asyncio.Task[Any]]) -> Cancellation:
        def spawn(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
            task = held.loop.create_task(coro)
            tasks.append(task)
            return task

        return Cancellation(registry=held.registry, backend=backend, spawn=spawn)

    async def test_the_backend_is_asked_first_and_its_disposition_kept(self, scripted: Any) -> None:
        """A disposition the backend reports is answered (now and on a repeat) and the
        server's own task is left alone; an unknown id is not_found."""
        held = _Held()
        record, _token = held.admit("r1")
        backend = scripted()
        backend.cancel_answers = {"r1": "cancelled_running"}
        policy = self._policy(held, backend, [])
        first = await policy.cancel(CancelRolloutsRequest(ids=["r1", "nope"]))
        again = await policy.cancel(CancelRolloutsRequest(ids=["r1"]))
        assert first == {
            "r1": CancelDisposition.CANCELLED_RUNNING,
            "nope": CancelDisposition.NOT_FOUND,
        }
        assert again == {"r1": CancelDisposition.CANCELLED_RUNNING}
        assert backend.cancel_calls == [["r1"]]
        assert record.task is not None
        assert not record.task.cancelling()
        await held.finish()

    async def test_the_server_task_is_the_fallback(self, scripted: Any) -> None:
        """When the backend fails, the rollout's own task is cancelled and the disposition
        follows its status (queued)."""
        held = _Held()
        record, _token = held.admit("r1")
        backend = scripted()
        backend.cancel_answers = RuntimeError("backend down")
        answer = await self._policy(held, backend, []).cancel(CancelRolloutsRequest(all=True))
        assert answer == {"r1": CancelDisposition.CANCELLED_QUEUED}
        await held.idle()
        assert _published(record)["status"] == "cancelled"
        held.registry.close()

    async def test_lease_expiries_of_one_turn_are_one_backend_request(self, scripted: Any) -> None:
        """Two expiries reported in the same loop turn reach the backend as one request."""
        held = _Held()
        first, _ = held.admit("r1")
        second, _ = held.admit("r2")
        backend = scripted()
        backend.cancel_answers = {"r1": "cancelled_running", "r2": "cancelled_running"}
        tasks: list[asyncio.Task[Any]] = []
        policy = self._policy(held, backend, tasks)
        policy.lease_expired(first)
        policy.lease_expired(second)
        async with asyncio.timeout(EVENT_SEC):
            while not tasks:  # noqa: ASYNC110 - the flush is one loop callback away
                await asyncio.sleep(0)
            await asyncio.gather(*tasks)
        assert backend.cancel_calls == [["r1", "r2"]]
        await held.finish()


class TestLongPollWaits:
    @staticmethod
    def _record(loop: asyncio.AbstractEventLoop) -> RolloutRecord:
        return RolloutRecord("r1", b"", loop.time() + 60.0)

    @staticmethod
    def _deadline(record: RolloutRecord) -> float:
        """The loop time the one waiting poll of ``record`` is due at (its grace or wait)."""
        entry = record.poll_entries
        assert isinstance(entry, list)
        return due_at(entry)

    async def test_wake_ends_every_wait_and_leaves_no_deadline(self) -> None:
        """Two waits on one record end together on wake(); the record lists none and the
        queue holds no deadline; end() afterwards changes nothing."""
        loop = asyncio.get_running_loop()
        deadlines = DeadlineQueue()
        waits = LongPollWaits(deadlines)
        record = self._record(loop)
        first = waits.begin(record, EVENT_SEC)
        second = waits.begin(record, EVENT_SEC)
        assert first is not None
        assert second is not None
        assert record.waiting == 2
        waits.wake(record)
        assert first.done()
        assert second.done()
        waits.end(record, first)
        waits.end(record, second)
        assert (record.waiting, len(deadlines)) == (0, 0)

    async def test_closed_waits_refuse_new_ones(self) -> None:
        """After close(), begin() has nothing to wait for."""
        loop = asyncio.get_running_loop()
        waits = LongPollWaits(DeadlineQueue())
        record = self._record(loop)
        waits.close()
        assert waits.closed
        assert waits.begin(record, EVENT_SEC) is None
        assert record.waiting == 0

    async def test_a_change_without_grace_ends_the_wait_at_once(self) -> None:
        """With a grace of 0, status_changed() ends the waits there and then."""
        loop = asyncio.get_running_loop()
        waits = LongPollWaits(DeadlineQueue(), status_change_grace_sec=0.0)
        record = self._record(loop)
        wait = waits.begin(record, EVENT_SEC)
        assert wait is not None
        waits.status_changed(record)
        assert wait.done()
        assert record.waiting == 0

    async def test_the_status_last_answered_is_waited_on_for_the_whole_wait(self) -> None:
        """A poll that finds the status last answered to the caller (queued, from the
        admission) waits for a change, up to its own wait: no grace is set."""
        loop = asyncio.get_running_loop()
        waits = LongPollWaits(DeadlineQueue(), status_change_grace_sec=1.0)
        record = self._record(loop)
        before = loop.time()
        wait = waits.begin(record, 3 * EVENT_SEC)
        assert wait is not None
        assert self._deadline(record) >= before + 3 * EVENT_SEC
        waits.end(record, wait)

    async def test_a_status_not_yet_answered_is_answered_within_the_grace(self) -> None:
        """A poll that arrives after queued → running (nobody was waiting) is due a grace
        after its arrival, not at its own wait, and ends unwoken at that deadline."""
        loop = asyncio.get_running_loop()
        waits = LongPollWaits(DeadlineQueue(), status_change_grace_sec=0.05)
        record = self._record(loop)
        record.status = RolloutStatus.RUNNING
        before = loop.time()
        wait = waits.begin(record, 3 * EVENT_SEC)
        after = loop.time()
        assert wait is not None
        assert before + 0.05 <= self._deadline(record) <= after + 0.05
        async with asyncio.timeout(EVENT_SEC):
            await wait
        waits.end(record, wait)
        assert record.waiting == 0

    async def test_a_result_within_that_grace_ends_the_wait_at_once(self) -> None:
        """The grace of a status not yet answered ends at once when the result is
        published (the poll then answers the result: one round trip)."""
        loop = asyncio.get_running_loop()
        waits = LongPollWaits(DeadlineQueue(), status_change_grace_sec=EVENT_SEC)
        record = self._record(loop)
        record.status = RolloutStatus.RUNNING
        wait = waits.begin(record, 3 * EVENT_SEC)
        assert wait is not None
        waits.status_changed(record)  # running → grading: the grace stays where it was
        assert not wait.done()
        waits.wake(record)
        assert wait.done()
        waits.end(record, wait)

    async def test_a_status_answered_is_no_longer_graced(self) -> None:
        """Once a poll has answered running (registry.deliver_status), the next poll
        waits for a change again."""
        loop = asyncio.get_running_loop()
        held = _Held(status_change_grace_sec=1.0)
        record, _token = held.admit("r1")
        held.registry.set_status(record, RolloutStatus.RUNNING)
        waits = held.registry.waits
        first = waits.begin(record, 3 * EVENT_SEC)
        assert first is not None
        assert self._deadline(record) < loop.time() + 2 * EVENT_SEC  # the grace
        waits.end(record, first)
        assert held.registry.deliver_status(record) is RolloutStatus.RUNNING
        before = loop.time()
        second = waits.begin(record, 3 * EVENT_SEC)
        assert second is not None
        assert self._deadline(record) >= before + 3 * EVENT_SEC  # the whole wait
        waits.end(record, second)
        await held.finish()

    async def test_without_a_grace_a_status_not_yet_answered_is_answered_at_once(
        self,
    ) -> None:
        """With a grace of 0 there is nothing to wait for when the status differs from
        the one last answered."""
        loop = asyncio.get_running_loop()
        waits = LongPollWaits(DeadlineQueue(), status_change_grace_sec=0.0)
        record = self._record(loop)
        record.status = RolloutStatus.GRADING
        assert waits.begin(record, EVENT_SEC) is None
        assert record.waiting == 0

    async def test_a_grace_longer_than_the_wait_ends_at_the_wait(self) -> None:
        """A status not yet answered, with a grace longer than the poll's wait: the wait
        is due at its own deadline (never beyond)."""
        loop = asyncio.get_running_loop()
        waits = LongPollWaits(DeadlineQueue(), status_change_grace_sec=3 * EVENT_SEC)
        record = self._record(loop)
        record.status = RolloutStatus.RUNNING
        wait = waits.begin(record, 0.05)
        after = loop.time()
        assert wait is not None
        assert self._deadline(record) <= after + 0.05
        async with asyncio.timeout(EVENT_SEC):
            await wait
        waits.end(record, wait)


class TestTaskEnd:
    async def test_an_outcome_is_asked_for_once_and_published(self) -> None:
        """A task that returns gets its result from outcome_of (called once, with the id
        and the task) and the registry publishes it."""
        calls: list[tuple[str, asyncio.Task[Any]]] = []

        def outcome_of(rollout_id: str, task: asyncio.Task[Any]) -> ResultFields:
            calls.append((rollout_id, task))
            return ResultFields(status=RolloutStatus.SUCCESS)

        held = _Held(outcome_of=outcome_of)
        record, _token = held.admit("r1")
        task = record.task
        await held.finish()
        assert calls == [("r1", task)]
        assert _published(record)["status"] == "success"
        assert record.finished
        assert record.task is None

    async def test_no_outcome_is_a_crash(self) -> None:
        """A task that ends without a result is published as failure / internal_error."""
        held = _Held()
        record, _token = held.admit("r1")
        await held.finish()
        document = _published(record)
        assert (document["status"], document["err_category"]) == ("failure", "internal_error")
        assert document["err_message"] == "rollout task crashed"

    async def test_a_base_exception_is_a_crash_without_asking(self) -> None:
        """A task that dies of a BaseException is a crash; outcome_of is not asked."""

        class Boom(BaseException):
            pass

        asked: list[str] = []

        def outcome_of(rollout_id: str, _task: asyncio.Task[Any]) -> ResultFields:
            asked.append(rollout_id)
            return ResultFields(status=RolloutStatus.SUCCESS)

        held = _Held(outcome_of=outcome_of)
        record, _token = held.admit("r1")
        held.gate.set_exception(Boom())
        await held.idle()
        assert asked == []
        assert _published(record)["err_category"] == "internal_error"
        held.registry.close()

    async def test_an_exception_from_execute_is_logged_once(
        self, harness: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An exception raised by execute() is a reported failure: its traceback once at
        DEBUG, the one INFO "finished" line with category and message, and no ERROR."""
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        with caplog.at_level(logging.DEBUG, logger="rollout_server"):
            run.raise_(ValueError("bad input"))
            await harness.poll_until("r1", token, "failure")
        assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
        (traceback,) = [r for r in caplog.records if r.exc_info is not None]
        assert (traceback.levelno, traceback.getMessage()) == (
            logging.DEBUG,
            "Rollout r1: execute() raised",
        )
        (finished,) = [r for r in caplog.records if "finished" in r.getMessage()]
        assert finished.levelno == logging.INFO
        assert finished.getMessage().startswith(
            "Rollout r1 finished: status=failure err_category=validation_error duration="
        )
        assert finished.getMessage().endswith(" reward=None err_message=bad input")

    @pytest.mark.parametrize("started", [False, True])
    async def test_a_cancelled_task_is_cancelled_with_a_message_once_started(
        self, started: bool
    ) -> None:
        """A cancelled task publishes cancelled; its message is "cancelled" only once the
        task had started (mark_started)."""
        held = _Held()
        record, _token = held.admit("r1")
        if started:
            assert held.registry.mark_started(record)
        assert held.registry.cancel_task(record)
        assert not held.registry.mark_started(record)  # a cancelling task does not start
        await held.idle()
        document = _published(record)
        assert (document["status"], document["err_message"]) == (
            "cancelled",
            "cancelled" if started else None,
        )
        assert record.started is started
        held.registry.close()

    async def test_a_disposition_is_kept_until_publication_only(self) -> None:
        """record_disposition() keeps a disposition for an unpublished rollout and ignores
        one that comes after the result."""
        held = _Held()
        record, _token = held.admit("r1")
        held.registry.record_disposition(record, CancelDisposition.CANCELLED_QUEUED)
        assert record.disposition is CancelDisposition.CANCELLED_QUEUED
        held.registry.publish(record, status=RolloutStatus.SUCCESS)
        held.registry.record_disposition(record, CancelDisposition.CANCELLED_RUNNING)
        assert record.disposition is CancelDisposition.CANCELLED_QUEUED
        await held.finish()


class TestLeaseTokens:
    async def test_tokens_are_43_char_base64url_and_distinct(self) -> None:
        """Tokens are ``secrets.token_urlsafe(32)``: 43 characters of base64url for 32 random
        bytes, never repeated, and each one opens only its own record."""
        held = _Held()
        admitted = [held.admit(f"r{index}") for index in range(200)]
        tokens = [token for _record, token in admitted]
        assert len(set(tokens)) == len(tokens)
        for token in tokens:
            assert len(token) == 43
            assert len(base64.urlsafe_b64decode(token + "=")) == TOKEN_BYTES
        (first, first_token), (second, _) = admitted[:2]
        assert first.check_token(first_token)
        assert not second.check_token(first_token)
        await held.finish()
