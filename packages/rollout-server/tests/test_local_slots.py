"""LocalBackend.execute(): concurrency slots, backpressure (max_queued, Retry-After) and
cancellation in each phase, called directly (no HTTP)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollout_server import AgentWorkflowConfig
from rollout_types import RolloutStatus

from .local_backend_helpers import (
    CONVERSATION,
    GATES,
    STARTED,
    WAIT_SEC,
    AnswerWorkflow,
    BlockingGrader,
    BlockingWorkflow,
    HalfGrader,
    StatusLog,
    SwallowingWorkflow,
    backend_for,
    event,
    make_request,
    messages_of,
    read_trajectory,
    record_of,
    reset_tables,  # noqa: F401 - an autouse fixture
    until,
)


class TestConcurrency:
    async def test_default_limit_is_four(self, tmp_path: Path) -> None:
        """Without a config, four rollouts run and the fifth reports queued until a slot
        frees."""
        backend = backend_for(tmp_path, BlockingWorkflow)
        logs = {f"r{i}": StatusLog() for i in range(5)}
        tasks = [
            asyncio.create_task(backend.execute(make_request(rid, statuses=log, grade=False)))
            for rid, log in logs.items()
        ]
        for rid in ("r0", "r1", "r2", "r3"):
            await logs[rid].wait_for(RolloutStatus.RUNNING)
        await until(lambda: backend.health()["concurrency"]["queued"] == 1)
        assert backend.health()["concurrency"]["running"] == 4
        assert logs["r4"].seen == [RolloutStatus.QUEUED]
        assert backend.has_capacity()  # unbounded queue: always capacity
        event(GATES, "r0").set()
        await logs["r4"].wait_for(RolloutStatus.RUNNING)
        for rid in logs:
            event(GATES, rid).set()
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_SEC)
        assert backend.health()["concurrency"] | {"max_queued": None} == {
            "max_concurrent": 4,
            "queued": 0,
            "running": 0,
            "max_queued": None,
        }

    async def test_unlimited(self, tmp_path: Path) -> None:
        """A config whose max_concurrent is None runs every rollout at once."""
        backend = backend_for(
            tmp_path, BlockingWorkflow, workflow_config=AgentWorkflowConfig(name="free")
        )
        tasks = [
            asyncio.create_task(backend.execute(make_request(f"u{i}", grade=False)))
            for i in range(10)
        ]
        for i in range(10):
            async with asyncio.timeout(WAIT_SEC):
                await event(STARTED, f"u{i}").wait()
        assert backend.health()["concurrency"]["running"] == 10
        assert backend.health()["concurrency"]["queued"] == 0
        for i in range(10):
            event(GATES, f"u{i}").set()
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_SEC)

    async def test_slot_held_through_grading(self, tmp_path: Path) -> None:
        """A grading rollout keeps its slot: the next one stays queued until grading ends."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(
            tmp_path, AnswerWorkflow, workflow_config=config, grader=BlockingGrader
        )
        first_log, second_log = StatusLog(), StatusLog()
        first = asyncio.create_task(backend.execute(make_request("a", statuses=first_log)))
        await first_log.wait_for(RolloutStatus.GRADING)
        second = asyncio.create_task(
            backend.execute(make_request("b", statuses=second_log, grade=False))
        )
        await until(lambda: backend.health()["concurrency"]["queued"] == 1)
        assert second_log.seen == [RolloutStatus.QUEUED]
        event(GATES, "grader:a").set()
        await asyncio.wait_for(first, WAIT_SEC)
        await asyncio.wait_for(second, WAIT_SEC)
        assert second_log.seen == [RolloutStatus.QUEUED, RolloutStatus.RUNNING]


class TestBackpressure:
    async def test_capacity_and_retry_after(self, tmp_path: Path) -> None:
        """With max_queued=1, capacity ends when one rollout waits and returns when it starts."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(tmp_path, BlockingWorkflow, workflow_config=config, max_queued=1)
        assert backend.has_capacity()
        first = asyncio.create_task(backend.execute(make_request("a", grade=False)))
        await event(STARTED, "a").wait()
        assert backend.has_capacity()  # the queue is empty
        second = asyncio.create_task(backend.execute(make_request("b", grade=False)))
        await until(lambda: backend.health()["concurrency"]["queued"] == 1)
        assert not backend.has_capacity()
        # The caller would be second in line: (1 queued + 1) x 5 s assumed / 1 slot.
        assert backend.retry_after_sec() == 10.0
        event(GATES, "a").set()
        await event(STARTED, "b").wait()
        assert backend.has_capacity()
        event(GATES, "b").set()
        await asyncio.wait_for(asyncio.gather(first, second), WAIT_SEC)
        # Both finished quickly after their gates: the measured mean is well under 5 s.
        assert 1.0 <= backend.retry_after_sec() < 5.0

    async def test_zero_max_queued_refuses_when_slots_are_busy(self, tmp_path: Path) -> None:
        """max_queued=0 admits while a slot is free and refuses once all are busy."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(tmp_path, BlockingWorkflow, workflow_config=config, max_queued=0)
        assert backend.has_capacity()
        task = asyncio.create_task(backend.execute(make_request("a", grade=False)))
        await event(STARTED, "a").wait()
        assert not backend.has_capacity()
        event(GATES, "a").set()
        await asyncio.wait_for(task, WAIT_SEC)
        assert backend.has_capacity()

    async def test_retry_after_is_clamped(self, tmp_path: Path) -> None:
        """A long queue gives at most 60 s; no limit gives 1 s."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(tmp_path, BlockingWorkflow, workflow_config=config, max_queued=100)
        tasks = [
            asyncio.create_task(backend.execute(make_request(f"q{i}", grade=False)))
            for i in range(20)
        ]
        await until(lambda: backend.health()["concurrency"]["queued"] == 19)
        assert backend.retry_after_sec() == 60.0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert backend.health()["concurrency"]["running"] == 0
        unlimited = backend_for(tmp_path, AnswerWorkflow, workflow_config={"name": "free"})
        assert unlimited.retry_after_sec() == 1.0


class TestCancellation:
    async def test_cancel_while_queued(self, tmp_path: Path) -> None:
        """A queued rollout that is cancelled leaves the queue at once and never runs."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(tmp_path, BlockingWorkflow, workflow_config=config)
        first = asyncio.create_task(backend.execute(make_request("a", grade=False)))
        await event(STARTED, "a").wait()
        log = StatusLog()
        queued = asyncio.create_task(backend.execute(make_request("b", statuses=log)))
        await until(lambda: backend.health()["concurrency"]["queued"] == 1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert backend.health()["concurrency"]["queued"] == 0
        assert log.seen == [RolloutStatus.QUEUED]  # never running
        event(GATES, "a").set()
        await asyncio.wait_for(first, WAIT_SEC)
        assert "b" not in STARTED
        assert not (tmp_path / "b").exists()

    async def test_cancel_while_running_frees_the_slot(self, tmp_path: Path) -> None:
        """Cancelling a running rollout releases its slot to the next waiter at once."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(tmp_path, BlockingWorkflow, workflow_config=config)
        running = asyncio.create_task(backend.execute(make_request("a")))
        await event(STARTED, "a").wait()
        log = StatusLog()
        waiting = asyncio.create_task(backend.execute(make_request("b", statuses=log, grade=False)))
        await until(lambda: backend.health()["concurrency"]["queued"] == 1)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert backend.health()["concurrency"]["running"] == 1  # the slot went to "b"
        assert backend.health()["concurrency"]["queued"] == 0
        await log.wait_for(RolloutStatus.RUNNING)
        event(GATES, "b").set()
        await asyncio.wait_for(waiting, WAIT_SEC)
        assert backend.health()["concurrency"]["running"] == 0

    async def test_cancel_while_grading(self, tmp_path: Path) -> None:
        """Cancelling a grading rollout frees the slot and saves a cancelled trajectory."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=BlockingGrader)
        log = StatusLog()
        task = asyncio.create_task(backend.execute(make_request("g", statuses=log)))
        await log.wait_for(RolloutStatus.GRADING)
        await event(STARTED, "grader:g").wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert backend.health()["concurrency"]["running"] == 0
        await backend.shutdown()
        doc = read_trajectory(tmp_path, "g")
        record = record_of(doc)
        assert (record["status"], record["err_message"]) == ("cancelled", "cancelled")
        assert messages_of(doc) == CONVERSATION
        assert record["phases"]["workflow"]["status"] == "success"

    async def test_swallowed_task_cancellation_is_honoured(self, tmp_path: Path) -> None:
        """A workflow that swallows the task's cancellation ends the rollout as cancelled
        when it returns, and the trajectory is still saved."""
        backend = backend_for(tmp_path, SwallowingWorkflow, grader=HalfGrader)
        task = asyncio.create_task(backend.execute(make_request("s")))
        await event(STARTED, "s").wait()
        task.cancel()
        await asyncio.sleep(0)
        assert not task.done()  # the workflow is ignoring the cancellation
        event(GATES, "s").set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_SEC)
        assert backend.health()["concurrency"]["running"] == 0
        await backend.shutdown()
        doc = read_trajectory(tmp_path, "s")
        assert record_of(doc)["status"] == "cancelled"
        assert "reward" not in doc["extra"]["osmosis"]
        assert record_of(doc)["phases"]["grader"] is None
