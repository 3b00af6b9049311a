"""Targets for ``rollout-server serve ours_app:ATTR`` (run in the server side's venv).

The workflow and grader are :mod:`workflow_logic` on ``rollout_server``'s base classes:

* ``backend``: a LocalBackend with the interop workflow and grader (4 slots);
* ``backpressure_backend``: one slot and no queue (``max_queued=0``), so a second
  admission while a rollout runs gets 429 with ``Retry-After``.

With ``ROLLOUT_INTEROP_OURS_BACKEND=ray`` (the ``ray`` nox session) each target is a
RayBackend with the same workflow, grader and slots instead: one worker on a local Ray
cluster (on 127.0.0.1) that the server starts and stops.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import workflow_logic

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    ExecutionBackend,
    Grader,
    GraderContext,
    LocalBackend,
    WorkflowContext,
    get_rollout_context,
)

BACKEND_ENV = "ROLLOUT_INTEROP_OURS_BACKEND"


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


def _make(**kwargs: Any) -> ExecutionBackend:
    if os.environ.get(BACKEND_ENV, "local") != "ray":
        return LocalBackend(InteropWorkflow, **kwargs)
    # Imported here: released servers under test (0.1.0) have no RayBackend.
    from rollout_server import RayBackend

    # The worker imports this module and workflow_logic by name, from this folder.
    here = str(Path(__file__).resolve().parent)
    return RayBackend(
        InteropWorkflow,
        num_workers=1,
        init_options={
            "num_cpus": 1,
            "include_dashboard": False,
            "runtime_env": {"env_vars": {"PYTHONPATH": here}},
        },
        **kwargs,
    )


def backend() -> ExecutionBackend:
    """The default interop backend (4 slots, unbounded queue)."""
    return _make(grader=InteropGrader)


def backpressure_backend() -> ExecutionBackend:
    """One slot and no queue: a second concurrent admission is refused with 429."""
    return _make(
        workflow_config=AgentWorkflowConfig(name="interop", concurrency={"max_concurrent": 1}),
        grader=InteropGrader,
        max_queued=0,
    )
