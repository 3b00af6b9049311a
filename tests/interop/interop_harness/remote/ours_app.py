"""Targets for ``rollout-server serve ours_app:ATTR`` (run in the server side's venv).

The workflow and grader are :mod:`workflow_logic` on ``rollout_server``'s base classes:

* ``backend``: a LocalBackend with the interop workflow and grader (4 slots);
* ``backpressure_backend``: one slot and no queue (``max_queued=0``), so a second
  admission while a rollout runs gets 429 with ``Retry-After``.
"""

from __future__ import annotations

from typing import Any

import workflow_logic

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    Grader,
    GraderContext,
    LocalBackend,
    WorkflowContext,
    get_rollout_context,
)


class InteropWorkflow(AgentWorkflow):
    """One chat completion from the endpoint the request names, appended to the prompt."""

    async def run(self, ctx: WorkflowContext) -> list[dict[str, Any]]:
        rollout = get_rollout_context()
        return await workflow_logic.run_agent(
            ctx.prompt, ctx.metadata, rollout.chat_completions_url, rollout.api_key
        )


class InteropGrader(Grader):
    """Reward 1.0 when the answer equals the label, else 0.0."""

    async def grade(self, ctx: GraderContext) -> None:
        messages = ctx.sample.messages if ctx.sample is not None else []
        ctx.set_reward(await workflow_logic.grade(messages, ctx.label, ctx.metadata))


def backend() -> LocalBackend:
    """The default interop backend (4 slots, unbounded queue)."""
    return LocalBackend(InteropWorkflow, grader=InteropGrader)


def backpressure_backend() -> LocalBackend:
    """One slot and no queue: a second concurrent admission is refused with 429."""
    return LocalBackend(
        InteropWorkflow,
        workflow_config=AgentWorkflowConfig(name="interop", concurrency={"max_concurrent": 1}),
        grader=InteropGrader,
        max_queued=0,
    )
