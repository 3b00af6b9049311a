"""``RolloutHandle``: awaiting, status, milestones and local cancellation."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from rollout_client import RolloutHandle, RolloutProtocolError
from rollout_types import RolloutStatus

from .conftest import EVENT_SEC, init_body, json_response, result_body

MESSAGES = [{"role": "user", "content": "hi"}]


class Stepper:
    """A result route the test drives: each poll waits for the next status the test sends."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[int, dict[str, Any]]] = asyncio.Queue()
        self.polls = 0
        self.polled = asyncio.Condition()

    def send(self, status: str, code: int = 200) -> None:
        self.queue.put_nowait((code, result_body("r1", status)))

    async def handler(self, request: web.Request) -> web.Response:
        async with self.polled:
            self.polls += 1
            self.polled.notify_all()
        code, body = await self.queue.get()
        return json_response(body, code)

    async def until_polls(self, count: int) -> None:
        """Wait until the client has sent ``count`` polls (so it handled ``count - 1``)."""
        async with asyncio.timeout(EVENT_SEC), self.polled:
            await self.polled.wait_for(lambda: self.polls >= count)


@pytest.fixture
async def stepped(serve, make_client):
    """A handle whose poll answers the test sends one by one."""
    stepper = Stepper()
    server = await serve(
        web.post("/rollout", lambda r: json_response(init_body("r1", wait=5.0), 202)),
        web.get("/rollout/r1/result", stepper.handler),
        web.post("/rollout/cancel", lambda r: json_response({"dispositions": {}})),
    )
    client = make_client(server.url)
    handle = await client.run_rollout_async(MESSAGES, "u", "r1")
    return stepper, handle, server, client


class TestHandleState:
    async def test_initial_state(self, stepped):
        """Before the first poll answers: admission status, no result, not done."""
        stepper, handle, _server, _client = stepped
        await stepper.until_polls(1)
        assert isinstance(handle, RolloutHandle)
        assert handle.rollout_id == "r1"
        assert handle.status == RolloutStatus.QUEUED
        assert handle.latest_result is None
        assert not handle.done()
        stepper.send("success")
        await handle

    async def test_updates_after_each_poll(self, stepped):
        """status and latest_result follow every 200 answer."""
        stepper, handle, _server, _client = stepped
        stepper.send("running")
        await stepper.until_polls(2)
        assert handle.status == RolloutStatus.RUNNING
        assert handle.latest_result is not None
        assert handle.latest_result.status == "running"
        stepper.send("success")
        result = await handle
        assert handle.done()
        assert handle.latest_result is result
        assert handle.status == RolloutStatus.SUCCESS

    async def test_await_twice_and_completion(self, stepped):
        """Awaiting twice and wait_for_completion() give the same terminal result."""
        stepper, handle, _server, _client = stepped
        stepper.send("failure")
        first = await handle
        assert await handle is first
        assert await handle.wait_for_completion() is first

    async def test_error_reraised_to_every_awaiter(self, stepped):
        """The exception that ended polling is raised by await and by the milestone waits."""
        stepper, handle, _server, _client = stepped
        stepper.send("running", code=404)
        with pytest.raises(RolloutProtocolError, match="returned 404"):
            await handle
        with pytest.raises(RolloutProtocolError):
            await handle.wait_for_grading()
        assert handle.done()

    async def test_waiter_timeout_does_not_stop_polling(self, stepped):
        """A timeout around ``await handle`` leaves the background polling running."""
        stepper, handle, _server, _client = stepped
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await handle
        assert not handle.done()
        stepper.send("success")
        assert (await handle).status == "success"


class TestHandleCancel:
    async def test_cancel_is_local(self, stepped):
        """cancel() stops polling, never contacts the server; awaiting raises CancelledError."""
        stepper, handle, server, _client = stepped
        await stepper.until_polls(1)
        assert handle.cancel() is True
        with pytest.raises(asyncio.CancelledError):
            await handle
        assert handle.done()
        assert server.seen("POST", "/rollout/cancel") == []
        assert handle.cancel() is False

    async def test_milestone_wait_after_cancel(self, stepped):
        """A milestone wait on a cancelled handle raises CancelledError."""
        stepper, handle, _server, _client = stepped
        await stepper.until_polls(1)
        handle.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handle.wait_for_running()

    async def test_run_rollout_cancellation_propagates(self, serve, make_client):
        """Cancelling the task in run_rollout() cancels it and stops polling."""
        stepper = Stepper()
        server = await serve(
            web.post("/rollout", lambda r: json_response(init_body("r1", wait=5.0), 202)),
            web.get("/rollout/r1/result", stepper.handler),
        )
        client = make_client(server.url)
        task = asyncio.create_task(client.run_rollout(MESSAGES, "u", "r1"))
        await stepper.until_polls(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert all(task.done() for task in client._channel.polling())


class TestMilestones:
    async def test_running_returns_when_running(self, stepped):
        """wait_for_running() returns 'running' once a poll reports it; polling goes on."""
        stepper, handle, _server, _client = stepped
        waiter = asyncio.create_task(handle.wait_for_running())
        stepper.send("running")
        assert await waiter == RolloutStatus.RUNNING
        assert not handle.done()
        stepper.send("success")
        await handle

    async def test_running_may_return_grading(self, stepped):
        """wait_for_running() returns 'grading' when polling never saw 'running'."""
        stepper, handle, _server, _client = stepped
        waiter = asyncio.create_task(handle.wait_for_running())
        stepper.send("grading")
        assert await waiter == RolloutStatus.GRADING
        stepper.send("success")
        await handle

    async def test_grading_skipped_returns_terminal(self, stepped):
        """wait_for_grading() on a rollout that is never graded returns its terminal status."""
        stepper, handle, _server, _client = stepped
        waiter = asyncio.create_task(handle.wait_for_grading())
        stepper.send("running")
        await stepper.until_polls(2)
        assert not waiter.done()
        stepper.send("failure")
        assert await waiter == RolloutStatus.FAILURE

    async def test_unknown_status_is_no_milestone(self, stepped):
        """'unknown' and unknown strings do not count as reaching a milestone."""
        stepper, handle, _server, _client = stepped
        waiter = asyncio.create_task(handle.wait_for_running())
        stepper.send("unknown")
        await stepper.until_polls(2)
        stepper.send("paused")
        await stepper.until_polls(3)
        assert not waiter.done()
        stepper.send("cancelled")
        assert await waiter == RolloutStatus.CANCELLED

    async def test_already_reached(self, stepped):
        """A milestone already passed returns the latest status at once."""
        stepper, handle, _server, _client = stepped
        stepper.send("success")
        await handle
        assert await handle.wait_for_running() == RolloutStatus.SUCCESS
        assert await handle.wait_for_grading() == RolloutStatus.SUCCESS

    async def test_many_waiters(self, stepped):
        """Many concurrent waiters all wake on the same change."""
        stepper, handle, _server, _client = stepped
        waiters = [asyncio.create_task(handle.wait_for_running()) for _ in range(50)]
        stepper.send("running")
        assert set(await asyncio.gather(*waiters)) == {RolloutStatus.RUNNING}
        stepper.send("success")
        await handle
