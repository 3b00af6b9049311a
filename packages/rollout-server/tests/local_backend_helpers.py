"""Workflows, graders and helpers that the LocalBackend test modules share
(``test_local_*.py``: LocalBackend.execute() called directly, no HTTP).

The blocking workflows and graders wait on per-rollout gates (:data:`GATES`) and say
they started (:data:`STARTED`); :func:`reset_tables` (autouse in each module that
imports it) clears them between tests.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from pathlib import Path
from typing import Any, ClassVar

import atif
import pytest

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowOutput,
    ExecutionRequest,
    Grader,
    GraderContext,
    LocalBackend,
    Sample,
    WorkflowContext,
    current_rollout_context,
    get_rollout_context,
)
from rollout_types import RolloutErrorCategory, RolloutStatus

WAIT_SEC = 5.0
PROMPT = [{"role": "user", "content": "What is 6*7?"}]
ANSWER = {"role": "assistant", "content": "42"}

# Per-rollout gates the blocking workflows and graders wait on (keyed by rollout id).
GATES: dict[str, asyncio.Event] = {}
STARTED: dict[str, asyncio.Event] = {}
RAN_FOR: dict[str, float] = {}


def event(table: dict[str, asyncio.Event], key: str) -> asyncio.Event:
    return table.setdefault(key, asyncio.Event())


class StatusLog:
    """Records the statuses a backend reports and lets a test wait for one."""

    def __init__(self) -> None:
        self.seen: list[RolloutStatus] = []
        self._events: collections.defaultdict[RolloutStatus, asyncio.Event] = (
            collections.defaultdict(asyncio.Event)
        )

    def __call__(self, status: RolloutStatus) -> None:
        self.seen.append(status)
        self._events[status].set()

    async def wait_for(self, status: RolloutStatus) -> None:
        async with asyncio.timeout(WAIT_SEC):
            await self._events[status].wait()


def make_request(
    rollout_id: str = "r1", statuses: StatusLog | None = None, **kwargs: Any
) -> ExecutionRequest:
    kwargs.setdefault("label", "42")
    return ExecutionRequest(
        id=rollout_id,
        prompt=[dict(message) for message in PROMPT],
        chat_completions_url="http://127.0.0.1:9/v1",
        llm_api_key="sk-test",
        on_status=statuses if statuses is not None else StatusLog(),
        **kwargs,
    )


def read_trajectory(root: Path, rollout_id: str) -> dict[str, Any]:
    """The rollout's ``trajectory.json``, checked against the ATIF models."""
    data: dict[str, Any] = json.loads((root / rollout_id / "trajectory.json").read_text())
    atif.Trajectory.model_validate(data, strict=True)
    return data


def record_of(document: dict[str, Any]) -> dict[str, Any]:
    """What the trajectory document records about the rollout beyond its conversation."""
    record: dict[str, Any] = document["extra"]["rollout_server"]
    return record


def messages_of(document: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(source, message)`` of each step of a trajectory document."""
    return [(step["source"], step["message"]) for step in document["steps"]]


CONVERSATION = [("user", PROMPT[0]["content"]), ("agent", ANSWER["content"])]
"""``messages_of`` a trajectory of ``[*PROMPT, ANSWER]``."""


def listing(path: Path) -> list[str]:
    return sorted(child.name for child in path.iterdir())


async def until(predicate: Any) -> None:
    """Yield to the loop until ``predicate()`` holds (bounded).

    The backend's queue counts have no event to wait on; this only yields, it never sleeps.
    """
    async with asyncio.timeout(WAIT_SEC):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0)


# -- workflows -------------------------------------------------------------------------


class AnswerWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        return AgentWorkflowOutput(
            messages=[*ctx.prompt, ANSWER], metrics={"turns": 1.0}, info={"note": "done"}
        )


class ListWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> list[dict[str, Any]]:
        return [*ctx.prompt, ANSWER]


class NoneWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> None:
        return None


class NoMessagesWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        return AgentWorkflowOutput(messages=None)


class SourceWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> None:
        sample = Sample(messages=[*ctx.prompt, ANSWER], metrics={"from": "source"})
        get_rollout_context().register_sample_source(lambda: sample)


class BadReturnWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> Any:
        return {"messages": []}


class BadListWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> Any:
        return [ANSWER, "not a message"]


class RaisingWorkflow(AgentWorkflow):
    errors: ClassVar[dict[str, BaseException]] = {}

    async def run(self, ctx: WorkflowContext) -> Any:
        raise self.errors[ctx.rollout_id]


class BlockingWorkflow(AgentWorkflow):
    """Waits for its rollout's gate, then answers."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        event(STARTED, ctx.rollout_id).set()
        start = time.monotonic()
        try:
            await event(GATES, ctx.rollout_id).wait()
        finally:
            RAN_FOR[ctx.rollout_id] = time.monotonic() - start
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


class SwallowingWorkflow(AgentWorkflow):
    """Ignores the first cancellation, then waits for its gate and answers."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        event(STARTED, ctx.rollout_id).set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await event(GATES, ctx.rollout_id).wait()
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


class LoopBlockingWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        time.sleep(0.3)  # noqa: ASYNC251 - blocks the loop on purpose
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


class ContextWorkflow(AgentWorkflow):
    seen: ClassVar[dict[str, Any]] = {}

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        ambient = get_rollout_context()
        self.seen[ctx.rollout_id] = {
            "url": ambient.chat_completions_url,
            "key": ambient.api_key,
            "rollout_id": ambient.rollout_id,
            "process_id": ambient.process_id,
            "config": ctx.config,
            "metadata": ctx.metadata,
            "artifacts_dir": ctx.artifacts_dir,
            "own_config": self.config,
        }
        assert ctx.artifacts_dir is not None
        (ctx.artifacts_dir / "note.txt").write_text("kept")
        ctx.prompt.append({"role": "user", "content": "mutated"})
        if ctx.metadata is not None:
            ctx.metadata["mutated"] = True
        return AgentWorkflowOutput(messages=[*ctx.prompt, ANSWER])


# -- graders ---------------------------------------------------------------------------


class HalfGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(0.5)


class RemovingGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(0.7)
        ctx.set_remove_sample()


class SilentGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        return None


class MutatingGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        assert ctx.sample is not None
        ctx.sample.messages.append({"role": "grader", "content": "note"})
        ctx.set_reward(1.0)


class BlockingGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(0.25)
        event(STARTED, f"grader:{ctx.rollout_id}").set()
        await event(GATES, f"grader:{ctx.rollout_id}").wait()


class SwallowingGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(0.9)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass


class RaisingGrader(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        raise RuntimeError("grader broke")


class ContextGrader(Grader):
    seen: ClassVar[dict[str, Any]] = {}

    async def grade(self, ctx: GraderContext) -> None:
        self.seen[ctx.rollout_id] = {
            "label": ctx.label,
            "metadata": ctx.metadata,
            "artifacts_dir": ctx.artifacts_dir,
            "config": self.config,
            "ambient": current_rollout_context(),
        }
        ctx.set_reward(1.0)


@pytest.fixture(autouse=True)
def reset_tables() -> None:
    GATES.clear()
    STARTED.clear()
    RAN_FOR.clear()


def backend_for(tmp_path: Path, workflow: Any, **kwargs: Any) -> LocalBackend:
    return LocalBackend(workflow, artifact_root=tmp_path, **kwargs)


def assert_failure(result: Any, message: str | None, category: RolloutErrorCategory | None) -> None:
    assert result.status == RolloutStatus.FAILURE
    assert result.err_message == message
    assert result.err_category == category
