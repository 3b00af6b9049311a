"""LocalBackend.execute(): agent and grader deadlines, queue time counted against the agent
budget, called directly (no HTTP)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

from rollout_server import (
    AgentWorkflowConfig,
    Grader,
    GraderContext,
)
from rollout_types import RolloutErrorCategory, RolloutStatus

from .local_backend_helpers import (
    GATES,
    RAN_FOR,
    STARTED,
    WAIT_SEC,
    AnswerWorkflow,
    BlockingGrader,
    BlockingWorkflow,
    HalfGrader,
    LoopBlockingWorkflow,
    StatusLog,
    SwallowingGrader,
    SwallowingWorkflow,
    assert_failure,
    backend_for,
    event,
    make_request,
    reset_tables,  # noqa: F401 - an autouse fixture
    until,
)


class TestDeadlines:
    async def test_agent_deadline(self, tmp_path: Path) -> None:
        """A workflow still running at its deadline fails as timeout with the spec message."""
        backend = backend_for(tmp_path, BlockingWorkflow, grader=HalfGrader)
        outcome = await backend.execute(make_request(agent_timeout_sec=0.5))
        assert_failure(
            outcome.workflow, "workflow exceeded its 0.5s deadline", RolloutErrorCategory.TIMEOUT
        )
        assert outcome.workflow.sample is None
        assert outcome.grader is None

    async def test_swallowed_cancellation_is_a_timeout(self, tmp_path: Path) -> None:
        """A workflow that swallows the deadline and answers later is a timeout, not a
        success."""
        GATES["r1"] = asyncio.Event()
        GATES["r1"].set()
        backend = backend_for(tmp_path, SwallowingWorkflow, grader=HalfGrader)
        outcome = await backend.execute(make_request(agent_timeout_sec=0.5))
        assert_failure(
            outcome.workflow, "workflow exceeded its 0.5s deadline", RolloutErrorCategory.TIMEOUT
        )
        assert outcome.workflow.sample is None

    async def test_loop_blocking_return_is_a_timeout(self, tmp_path: Path) -> None:
        """A workflow that blocks the loop past its budget and returns is a timeout."""
        backend = backend_for(tmp_path, LoopBlockingWorkflow)
        outcome = await backend.execute(make_request(agent_timeout_sec=0.1, grade=False))
        assert_failure(
            outcome.workflow, "workflow exceeded its 0.1s deadline", RolloutErrorCategory.TIMEOUT
        )

    @pytest.mark.parametrize(("timeout", "text"), [(-1, "-1.0"), (0, "0.0")])
    async def test_expired_budget(self, tmp_path: Path, timeout: float, text: str) -> None:
        """A budget of zero or less expires at once, printing the request value as a float."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=HalfGrader)
        outcome = await backend.execute(make_request(agent_timeout_sec=timeout))
        assert_failure(
            outcome.workflow,
            f"workflow exceeded its {text}s deadline",
            RolloutErrorCategory.TIMEOUT,
        )

    async def test_queue_time_counts_against_the_budget(self, tmp_path: Path) -> None:
        """A rollout that waited for a slot gets only what the queue left of its budget."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(tmp_path, BlockingWorkflow, workflow_config=config)
        first = asyncio.create_task(backend.execute(make_request("first", grade=False)))
        await event(STARTED, "first").wait()
        second = asyncio.create_task(
            backend.execute(make_request("second", grade=False, agent_timeout_sec=1.0))
        )
        await until(lambda: backend.health()["concurrency"]["queued"] == 1)
        await asyncio.sleep(0.3)  # queue time for "second", not a wait for an event
        GATES["first"] = event(GATES, "first")
        GATES["first"].set()
        await asyncio.wait_for(first, WAIT_SEC)
        outcome = await asyncio.wait_for(second, WAIT_SEC)
        message = outcome.workflow.err_message or ""
        assert re.fullmatch(
            r"workflow exceeded its 1\.0s deadline \((\d+\.\d)s of it spent queued\)", message
        ), message
        queued = float(re.findall(r"\((\d+\.\d)s", message)[0])
        assert queued >= 0.3
        # A deadline never fires early, so without the deduction it would have run >= 1 s.
        assert RAN_FOR["second"] < 1.0

    async def test_queue_time_counts_from_admission(self, tmp_path: Path) -> None:
        """Time between the server's admission stamp and execute() counts as queue time."""
        backend = backend_for(tmp_path, BlockingWorkflow)
        request = make_request(
            "late", grade=False, agent_timeout_sec=0.5, admitted_at=time.monotonic() - 1.2
        )
        outcome = await backend.execute(request)
        message = outcome.workflow.err_message or ""
        found = re.fullmatch(
            r"workflow exceeded its 0\.5s deadline \((\d+\.\d)s of it spent queued\)", message
        )
        assert found, message
        assert float(found.group(1)) >= 1.2
        assert "late" not in STARTED  # the budget was gone before it could run
        assert not (tmp_path / "late").exists()  # no conversation, no diagnostics: no files

    async def test_future_admission_stamp_is_ignored(self, tmp_path: Path) -> None:
        """An admission stamp in the future (a foreign clock) is not trusted: the clock
        starts at execute()."""
        backend = backend_for(tmp_path, AnswerWorkflow)
        request = make_request(
            "skew", grade=False, agent_timeout_sec=30.0, admitted_at=time.monotonic() + 1e6
        )
        outcome = await backend.execute(request)
        assert outcome.workflow.status == RolloutStatus.SUCCESS

    async def test_deadline_passing_in_the_queue(self, tmp_path: Path) -> None:
        """A rollout whose budget ends while queued fails without ever taking a slot."""
        config = AgentWorkflowConfig(name="one", concurrency={"max_concurrent": 1})
        backend = backend_for(tmp_path, BlockingWorkflow, workflow_config=config)
        first = asyncio.create_task(backend.execute(make_request("first", grade=False)))
        await event(STARTED, "first").wait()
        statuses = StatusLog()
        outcome = await backend.execute(
            make_request("late", statuses=statuses, grade=False, agent_timeout_sec=0.3)
        )
        assert outcome.workflow.err_category == RolloutErrorCategory.TIMEOUT
        message = outcome.workflow.err_message or ""
        found = re.fullmatch(
            r"workflow exceeded its 0\.3s deadline \((\d+\.\d)s of it spent queued\)", message
        )
        assert found, message
        assert float(found.group(1)) >= 0.3
        assert statuses.seen == [RolloutStatus.QUEUED]  # never running
        assert "late" not in STARTED
        assert backend.health()["concurrency"] | {"max_queued": None} == {
            "max_concurrent": 1,
            "queued": 0,
            "running": 1,
            "max_queued": None,
        }
        event(GATES, "first").set()
        await asyncio.wait_for(first, WAIT_SEC)
        assert not (tmp_path / "late").exists()  # no conversation, no diagnostics: no files

    async def test_grader_deadline(self, tmp_path: Path) -> None:
        """A grader past its deadline fails as timeout, keeping the sample (reward as set)."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=BlockingGrader)
        outcome = await backend.execute(make_request(grader_timeout_sec=0.5))
        result = outcome.reported()
        assert_failure(result, "grader exceeded its 0.5s deadline", RolloutErrorCategory.TIMEOUT)
        assert result.sample is not None
        assert result.sample.reward == 0.25

    async def test_grader_swallowing_its_deadline(self, tmp_path: Path) -> None:
        """A grader that swallows its deadline and returns is still a timeout."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=SwallowingGrader)
        result = (await backend.execute(make_request(grader_timeout_sec=0.3))).reported()
        assert_failure(result, "grader exceeded its 0.3s deadline", RolloutErrorCategory.TIMEOUT)

    async def test_expired_grader_budget(self, tmp_path: Path) -> None:
        """A grader budget of zero or less expires at once."""
        backend = backend_for(tmp_path, AnswerWorkflow, grader=HalfGrader)
        result = (await backend.execute(make_request(grader_timeout_sec=-1))).reported()
        assert_failure(result, "grader exceeded its -1.0s deadline", RolloutErrorCategory.TIMEOUT)

    async def test_no_deadline_makes_no_timeout_object(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A rollout without deadlines runs its workflow and grader without an
        asyncio.timeout (each would be held by every rollout in flight)."""
        made: list[float | None] = []
        real_timeout = asyncio.timeout

        def counting(delay: float | None) -> asyncio.Timeout:
            made.append(delay)
            return real_timeout(delay)

        monkeypatch.setattr(asyncio, "timeout", counting)
        backend = backend_for(tmp_path, AnswerWorkflow, grader=HalfGrader)
        outcome = await backend.execute(make_request())
        assert outcome.reported().status == RolloutStatus.SUCCESS
        assert made == []

    async def test_grader_budget_is_separate(self, tmp_path: Path) -> None:
        """The grader's deadline does not shrink by the workflow's or the queue's time."""

        class SlowGrader(Grader):
            async def grade(self, ctx: GraderContext) -> None:
                await asyncio.sleep(0.3)
                ctx.set_reward(1.0)

        backend = backend_for(tmp_path, AnswerWorkflow, grader=SlowGrader)
        result = (
            await backend.execute(make_request(agent_timeout_sec=0.2, grader_timeout_sec=5.0))
        ).reported()
        assert result.status == RolloutStatus.SUCCESS
