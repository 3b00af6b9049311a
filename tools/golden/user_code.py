"""The user code the recorded osmosis-ai servers serve: one workflow, one grader, and a
backend with test hooks, each choosing its behaviour from the request ``metadata``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

# Names that exist with the same meaning in osmosis-ai 0.3.2 and 0.3.8. Anything
# version-specific is imported inside the function that needs it.
from osmosis_ai.rollout import (
    AgentWorkflow,
    AgentWorkflowContext,
    AgentWorkflowOutput,
    Grader,
    GraderContext,
    LocalBackend,
    get_rollout_context,
)

from .inputs import LOGGER_NAME

log = logging.getLogger(LOGGER_NAME)


class GoldenCrash(BaseException):
    """Escapes ``except Exception`` in the server, so its execution task crashes."""


class GoldenWorkflow(AgentWorkflow):
    """Answers from the prompt; ``metadata["workflow"]`` selects a failure mode.

    Modes: ``echo`` (default), ``sleep`` (``metadata["seconds"]``), ``value_error``,
    ``runtime_error``.
    """

    async def run(self, ctx: AgentWorkflowContext) -> AgentWorkflowOutput:
        metadata = ctx.metadata or {}
        mode = metadata.get("workflow", "echo")
        rollout = get_rollout_context()
        log.debug(
            "workflow ctx: prompt=%r metadata=%r chat_url=%r api_key=%r",
            ctx.prompt,
            ctx.metadata,
            rollout.chat_completions_url if rollout else None,
            rollout.api_key if rollout else None,
        )
        if mode == "sleep":
            await asyncio.sleep(float(metadata.get("seconds", 30)))
        elif mode == "value_error":
            raise ValueError("golden workflow rejected its input")
        elif mode == "runtime_error":
            raise RuntimeError("golden workflow crashed")
        return AgentWorkflowOutput(
            messages=[*ctx.prompt, {"role": "assistant", "content": "6 * 7 = 42"}],
            metrics={"turns": 1.0},
        )


class GoldenGrader(Grader):
    """Sets reward 0.5; ``metadata["grader"]`` selects another behaviour.

    Modes: ``half`` (default), ``remove_sample`` (reward 0.7 and remove_sample),
    ``no_reward``, ``sleep`` (``metadata["seconds"]``, then reward 0.5).
    """

    async def grade(self, ctx: GraderContext) -> None:
        metadata = ctx.metadata or {}
        mode = metadata.get("grader", "half")
        if mode == "no_reward":
            return
        if mode == "sleep":
            await asyncio.sleep(float(metadata.get("seconds", 30)))
        ctx.set_reward(0.7 if mode == "remove_sample" else 0.5)
        if mode == "remove_sample" and ctx.sample is not None:
            ctx.sample.remove_sample = True


def make_backend(*, grader: bool = True, capacity: bool = True) -> Any:
    """A 0.3.8 LocalBackend with two test hooks: a fixed capacity and a crash mode."""
    from osmosis_ai.rollout import ExecutionOutcome, ExecutionRequest

    class GoldenBackend(LocalBackend):
        def has_capacity(self) -> bool:
            return capacity

        async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
            if (request.metadata or {}).get("workflow") == "crash":
                raise GoldenCrash("golden backend crash")
            return await super().execute(request)

    return GoldenBackend(workflow=GoldenWorkflow, grader=GoldenGrader if grader else None)
