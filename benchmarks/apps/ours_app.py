"""The benchmark workflow and grader on our stack: serve ``benchmarks.apps.ours_app:backend``."""

from __future__ import annotations

from typing import Any

from benchmarks.apps.behaviour import (
    FIXED_REWARD,
    fixed_messages,
    install_release_guard,
    wait_as_told,
)
from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    ConcurrencyConfig,
    Grader,
    GraderContext,
    LocalBackend,
    WorkflowContext,
)

__all__ = ["BenchGrader", "BenchWorkflow", "backend"]


class BenchWorkflow(AgentWorkflow):
    """Wait as the metadata says, then return the fixed conversation."""

    async def run(self, ctx: WorkflowContext) -> list[dict[str, Any]]:
        await wait_as_told(ctx.metadata)
        return fixed_messages()


class BenchGrader(Grader):
    """Give every sample the fixed reward."""

    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(FIXED_REWARD)


install_release_guard()

backend = LocalBackend(
    workflow=BenchWorkflow,
    # No slot limit: the server's concurrency must never be what binds.
    workflow_config=AgentWorkflowConfig(
        name="bench", concurrency=ConcurrencyConfig(max_concurrent=None)
    ),
    grader=BenchGrader,
)
