"""The staged shutdown, in process: admissions close first, results stay collectable."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rollout_server import ExecutionOutcome, ExecutionResult, ShutdownTimeouts
from rollout_types import RolloutStatus

EVENT_SEC = 10.0
SHUTDOWN_MESSAGE = "rollout server shut down before the rollout finished"


def stages(**overrides: float) -> ShutdownTimeouts:
    """Short stage bounds; each test lengthens the stage it exercises."""
    values = {
        "drain_sec": 0.05,
        "cleanup_sec": 0.05,
        "force_sec": 0.05,
        "backend_sec": 0.2,
        "collect_sec": 0.0,
    }
    values.update(overrides)
    return ShutdownTimeouts(**values)


class TestStagedShutdown:
    async def test_admissions_close_while_polls_are_served(self, make_harness: Any) -> None:
        """During the drain, POST /rollout gets 503 while the running rollout can still be
        polled and its result, published during the drain, collected."""
        harness = await make_harness(shutdown_timeouts=stages(drain_sec=EVENT_SEC))
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        drain = asyncio.create_task(harness.server.drain())
        await harness.until(lambda: not harness.server.accepting_rollouts)
        reply = await harness.post_rollout()
        assert (reply.status, reply.json) == (503, {"detail": "rollout server is shutting down"})
        assert "Retry-After" not in reply.headers
        assert (await harness.poll("r1", token)).json["status"] == "running"
        run.succeed()
        result = await harness.poll_until("r1", token, "success")
        assert result.json["sample"]["reward"] == 0.5
        async with asyncio.timeout(EVENT_SEC):
            await drain
        assert harness.backend.shutdown_calls == 1
        assert not run.cancel_seen.is_set()

    async def test_backend_shutdown_runs_after_the_work_stopped(self, make_harness: Any) -> None:
        """backend.shutdown() is awaited only once no execution is active."""
        harness = await make_harness(shutdown_timeouts=stages(cleanup_sec=EVENT_SEC))
        active_at_shutdown: list[int] = []

        async def hook() -> None:
            active_at_shutdown.append(harness.server.registry.active)

        harness.backend.shutdown_hook = hook
        await harness.admit("r1")
        await harness.backend.started("r1")
        async with asyncio.timeout(EVENT_SEC):
            await harness.server.drain()
        assert active_at_shutdown == [0]

    async def test_remaining_work_is_cancelled_after_the_drain(
        self, make_harness: Any, caplog: Any
    ) -> None:
        """Work still running after drain_sec is cancelled (backend first, then the task) and
        its result is cancelled / "cancelled"."""
        harness = await make_harness(shutdown_timeouts=stages(cleanup_sec=EVENT_SEC))
        token = await harness.admit("r1")
        await harness.backend.started("r1")
        with caplog.at_level(logging.INFO, logger="rollout_server"):
            async with asyncio.timeout(EVENT_SEC):
                await harness.server.drain()
        assert harness.backend.cancel_calls == [["r1"]]
        assert "Draining 1 in-flight rollout(s)" in caplog.messages
        result = await harness.poll("r1", token)
        assert (result.json["status"], result.json["err_message"]) == ("cancelled", "cancelled")

    async def test_work_ignoring_the_first_cancel_is_force_cancelled(
        self, make_harness: Any, scripted: Any, caplog: Any
    ) -> None:
        """Work that swallows the cleanup cancellation is hard-cancelled in the next stage,
        with the protocol's 'cleanup is unconfirmed' warning."""
        harness = await make_harness(
            backend=scripted(ignore_cancel=1), shutdown_timeouts=stages(force_sec=EVENT_SEC)
        )
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        with caplog.at_level(logging.WARNING, logger="rollout_server"):
            async with asyncio.timeout(EVENT_SEC):
                await harness.server.drain()
        assert run.cancels_seen == 2
        assert any("cleanup is unconfirmed for 1 rollout(s)" in m for m in caplog.messages)
        assert (await harness.poll("r1", token)).json["status"] == "cancelled"
        assert harness.backend.shutdown_calls == 1

    async def test_work_ignoring_every_cancel_is_published_and_abandoned(
        self, make_harness: Any, scripted: Any
    ) -> None:
        """Work that swallows every cancellation cannot hold the shutdown: its rollout is
        published as cancelled and backend.shutdown() still runs."""
        harness = await make_harness(
            backend=scripted(ignore_cancel=True), shutdown_timeouts=stages()
        )
        token = await harness.admit("r1")
        await harness.backend.started("r1")
        async with asyncio.timeout(EVENT_SEC):
            await harness.server.drain()
        result = await harness.poll("r1", token)
        assert (result.json["status"], result.json["err_message"]) == (
            "cancelled",
            SHUTDOWN_MESSAGE,
        )
        assert harness.backend.shutdown_calls == 1
        assert harness.server.registry.active == 1

    async def test_backend_that_cancels_its_own_work(self, make_harness: Any) -> None:
        """A backend that handles the shutdown cancellation itself publishes its own result,
        and the server's task is not cancelled."""
        harness = await make_harness(shutdown_timeouts=stages(cleanup_sec=EVENT_SEC))
        harness.backend.cancel_answers = {"r1": "cancelled_running"}
        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        original = harness.backend.cancel_rollouts

        async def cancel_and_finish(**kwargs: Any) -> dict[str, str]:
            answers: dict[str, str] = await original(**kwargs)
            run.finish(ExecutionOutcome(workflow=ExecutionResult(status=RolloutStatus.CANCELLED)))
            return answers

        harness.backend.cancel_rollouts = cancel_and_finish
        async with asyncio.timeout(EVENT_SEC):
            await harness.server.drain()
        result = await harness.poll("r1", token)
        assert (result.json["status"], result.json["err_message"]) == ("cancelled", None)
        assert not run.cancel_seen.is_set()

    async def test_hanging_backend_calls_are_bounded(self, make_harness: Any) -> None:
        """A backend whose cancel_rollouts() and shutdown() never return cannot stall the
        shutdown: each is bounded by its stage."""
        harness = await make_harness(shutdown_timeouts=stages(cleanup_sec=0.2))
        never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        async def hang(**_kwargs: Any) -> Any:
            return await never

        async def hang_shutdown() -> None:
            await never

        harness.backend.cancel_rollouts = hang
        harness.backend.shutdown_hook = hang_shutdown
        token = await harness.admit("r1")
        await harness.backend.started("r1")
        async with asyncio.timeout(EVENT_SEC):
            await harness.server.drain()
        assert (await harness.poll("r1", token)).json["status"] == "cancelled"

    async def test_collect_window_ends_once_results_are_delivered(self, make_harness: Any) -> None:
        """The collect window (60 s here) ends as soon as every result published during the
        drain has been polled."""
        harness = await make_harness(shutdown_timeouts=stages(collect_sec=60.0))
        token = await harness.admit("r1")
        await harness.backend.started("r1")
        drain = asyncio.create_task(harness.server.drain())
        await harness.until(lambda: harness.server.registry.undelivered == 1)
        assert not drain.done()
        assert (await harness.poll("r1", token)).json["status"] == "cancelled"
        async with asyncio.timeout(EVENT_SEC):
            await drain

    async def test_results_published_before_shutdown_get_the_collect_window(
        self, make_harness: Any
    ) -> None:
        """Results finished and not yet delivered when shutdown begins count towards the
        collect window (60 s here): the drain waits until the last of them is polled, then
        ends at once; a result delivered before shutdown is not waited for."""
        harness = await make_harness(shutdown_timeouts=stages(collect_sec=60.0))
        tokens = {rollout_id: await harness.admit(rollout_id) for rollout_id in "abcd"}
        for rollout_id in tokens:
            (await harness.backend.started(rollout_id)).succeed()
        await harness.poll_until("d", tokens.pop("d"), "success")
        await harness.until(lambda: harness.server.registry.active == 0)
        drain = asyncio.create_task(harness.server.drain())
        await harness.until(lambda: harness.server.registry.undelivered == 3)
        for rollout_id in "ab":
            assert (await harness.poll(rollout_id, tokens[rollout_id])).json["status"] == "success"
        assert not drain.done()
        assert (await harness.poll("c", tokens["c"])).json["status"] == "success"
        async with asyncio.timeout(EVENT_SEC):
            await drain

    async def test_results_cancelled_by_request_get_no_collect_window(
        self, make_harness: Any, caplog: Any
    ) -> None:
        """An idle server whose only undelivered results are of rollouts the client cancelled
        ends its shutdown without holding the collect window (60 s here) for them."""
        harness = await make_harness(shutdown_timeouts=stages(collect_sec=60.0))
        for rollout_id in ("c1", "c2"):
            await harness.admit(rollout_id)
            await harness.backend.started(rollout_id)
        reply = await harness.cancel({"ids": ["c1", "c2"]})
        assert reply.status == 200
        await harness.until(lambda: harness.server.registry.undelivered == 2)
        await harness.until(lambda: harness.server.registry.active == 0)
        with caplog.at_level(logging.INFO, logger="rollout_server"):
            async with asyncio.timeout(EVENT_SEC):
                await harness.server.drain()
        assert "Not waiting for 2 result(s) of rollouts cancelled by request: c1, c2" in (
            caplog.messages
        )
        assert not [m for m in caplog.messages if m.startswith("Waiting up to")]

    async def test_the_collect_window_waits_only_for_results_not_cancelled_by_request(
        self, make_harness: Any
    ) -> None:
        """With a cancelled-by-request result and a finished one undelivered, the collect
        window (60 s here) ends once the finished one is polled."""
        harness = await make_harness(shutdown_timeouts=stages(collect_sec=60.0))
        token = await harness.admit("done")
        (await harness.backend.started("done")).succeed()
        await harness.admit("dropped")
        await harness.backend.started("dropped")
        assert (await harness.cancel({"ids": ["dropped"]})).status == 200
        await harness.until(lambda: harness.server.registry.undelivered == 2)
        await harness.until(lambda: harness.server.registry.active == 0)
        drain = asyncio.create_task(harness.server.drain())
        await harness.until(lambda: not harness.server.accepting_rollouts)
        assert not drain.done()
        assert (await harness.poll("done", token)).json["status"] == "success"
        async with asyncio.timeout(EVENT_SEC):
            await drain
        assert harness.server.registry.undelivered == 1

    async def test_second_signal_hurries_the_drain(self, make_harness: Any) -> None:
        """hurry() (a second SIGTERM) ends the remaining stage waits at once."""
        harness = await make_harness(
            shutdown_timeouts=stages(drain_sec=60.0, cleanup_sec=60.0, collect_sec=60.0)
        )
        await harness.admit("r1")
        await harness.backend.started("r1")
        drain = asyncio.create_task(harness.server.drain())
        await harness.until(lambda: not harness.server.accepting_rollouts)
        harness.server.hurry()
        async with asyncio.timeout(EVENT_SEC):
            await drain
        assert harness.backend.shutdown_calls == 1

    async def test_a_hurried_shutdown_abandons_work_without_an_error(
        self, make_harness: Any, scripted: Any, caplog: Any
    ) -> None:
        """Work still running when a second signal cuts the waits short is logged once as
        abandoned by the operator's cut, at WARNING, with its id; nothing at ERROR."""
        harness = await make_harness(
            backend=scripted(ignore_cancel=True),
            shutdown_timeouts=stages(drain_sec=60.0, backend_sec=60.0),
        )
        harness.backend.shutdown_hook = asyncio.get_running_loop().create_future
        await harness.admit("stuck")
        await harness.backend.started("stuck")
        with caplog.at_level(logging.INFO, logger="rollout_server"):
            drain = asyncio.create_task(harness.server.drain())
            await harness.until(lambda: not harness.server.accepting_rollouts)
            harness.server.hurry()
            async with asyncio.timeout(EVENT_SEC):
                await drain
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.messages
        abandoned = [m for m in caplog.messages if "abandoning" in m]
        assert abandoned == [
            "Shutdown waits cut short by a second signal; abandoning 1 rollout execution(s) "
            "still running: stuck"
        ]
        assert (
            "backend.shutdown() did not finish within 2.0s of the second signal; continuing"
        ) in caplog.messages

    async def test_drain_runs_once(self, make_harness: Any) -> None:
        """Concurrent and repeated drains share one run of the stages."""
        harness = await make_harness(shutdown_timeouts=stages())
        async with asyncio.timeout(EVENT_SEC):
            await asyncio.gather(harness.server.drain(), harness.server.drain())
            await harness.server.drain()
        assert harness.backend.shutdown_calls == 1


class TestCrash:
    async def test_base_exception_from_the_backend_is_internal_error(
        self, harness: Any, caplog: Any
    ) -> None:
        """A BaseException escaping execute() crashes the task: the result is failure /
        "rollout task crashed" / internal_error, logged with its traceback."""

        class Boom(BaseException):
            pass

        token = await harness.admit("r1")
        run = await harness.backend.started("r1")
        with caplog.at_level(logging.ERROR, logger="rollout_server"):
            run.raise_(Boom("kaboom"))
            result = await harness.poll_until("r1", token, "failure")
        assert result.json == {
            "rollout_id": "r1",
            "status": "failure",
            "sample": None,
            "err_message": "rollout task crashed",
            "err_category": "internal_error",
        }
        assert "Rollout task for r1 crashed" in caplog.messages
        assert (await harness.health()).json["lifecycle"]["active_rollouts"] == 0

    async def test_exception_from_the_backend_is_categorised(self, harness: Any) -> None:
        """An ordinary exception from execute() is a failure with its message and category."""
        token = await harness.admit("r1")
        (await harness.backend.started("r1")).raise_(ValueError("bad input"))
        result = await harness.poll_until("r1", token, "failure")
        assert (result.json["err_message"], result.json["err_category"]) == (
            "bad input",
            "validation_error",
        )

    async def test_non_outcome_return_is_a_failure(self, harness: Any) -> None:
        """execute() returning something other than an ExecutionOutcome is a failure that
        names the contract."""
        token = await harness.admit("r1")
        (await harness.backend.started("r1")).finish({"status": "success"})
        result = await harness.poll_until("r1", token, "failure")
        assert "ExecutionOutcome" in result.json["err_message"]
