"""The backend ``test_pool.py`` serves with ``rollout-server serve pool_backend:backend``.

The workflow sleeps ``metadata["sleep_sec"]`` (default 0) and returns a fixed answer; the
grader gives reward 1.0. No slot limit, so the server never answers 429 on its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    ConcurrencyConfig,
    Grader,
    GraderContext,
    LocalBackend,
    WorkflowContext,
)


class SleepyWorkflow(AgentWorkflow):
    """Sleep as the metadata says, then answer 42."""

    async def run(self, ctx: WorkflowContext) -> list[dict[str, Any]]:
        await asyncio.sleep(float((ctx.metadata or {}).get("sleep_sec", 0.0)))
        return [*ctx.prompt, {"role": "assistant", "content": "42"}]


class FullMarks(Grader):
    """Reward every sample 1.0."""

    async def grade(self, ctx: GraderContext) -> None:
        ctx.set_reward(1.0)


backend = LocalBackend(
    workflow=SleepyWorkflow,
    workflow_config=AgentWorkflowConfig(
        name="pool", concurrency=ConcurrencyConfig(max_concurrent=None)
    ),
    grader=FullMarks,
)
