"""Targets of the RayBackend workloads (``python -m benchmarks.ray_bench``).

``rollout-server serve benchmarks.apps.ray_app:backend`` builds, from the environment:

* ``BENCH_BACKEND``: ``local`` (a LocalBackend) or ``ray`` (a RayBackend on a local Ray
  cluster that the server starts, bound to 127.0.0.1);
* ``BENCH_WORKERS``: Ray workers (default 1);
* ``BENCH_SLOTS``: slots of the LocalBackend, or of each Ray worker (default 16).

The workflow (no grader) does what the request's ``metadata`` says, then returns a fixed
conversation: ``{"cpu_ms": n}`` computes for ``n`` ms of its thread's CPU time in pure
Python; ``{"sleep_sec": s}`` sleeps; either way the metric ``done_at`` is the wall-clock
time it finished (the notification workload compares it with the caller's receipt).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    ExecutionBackend,
    LocalBackend,
    RayBackend,
    WorkflowContext,
)

__all__ = ["BenchWorkflow", "backend"]

MESSAGES = [{"role": "user", "content": "What is 6 * 7?"}, {"role": "assistant", "content": "42"}]


def burn(cpu_ms: float) -> int:
    """Compute in pure Python until this thread has used ``cpu_ms`` ms of CPU."""
    end = time.thread_time() + cpu_ms / 1000.0
    total = 0
    while time.thread_time() < end:
        for number in range(2000):
            total += number * number
    return total


class BenchWorkflow(AgentWorkflow):
    """Compute or sleep as the metadata says, then return the fixed conversation."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        metadata: dict[str, Any] = ctx.metadata or {}
        if "cpu_ms" in metadata:
            burn(float(metadata["cpu_ms"]))
        if "sleep_sec" in metadata:
            await asyncio.sleep(float(metadata["sleep_sec"]))
        return AgentWorkflowOutput(messages=list(MESSAGES), metrics={"done_at": time.time()})


def backend() -> ExecutionBackend:
    """The backend the environment asks for (module docstring)."""
    kind = os.environ.get("BENCH_BACKEND", "local")
    slots = int(os.environ.get("BENCH_SLOTS", "16"))
    config = AgentWorkflowConfig(name="bench", concurrency={"max_concurrent": slots})
    if kind == "local":
        return LocalBackend(BenchWorkflow, workflow_config=config)
    root = str(Path(__file__).resolve().parents[2])
    return RayBackend(
        BenchWorkflow,
        workflow_config=config,
        num_workers=int(os.environ.get("BENCH_WORKERS", "1")),
        init_options={
            "include_dashboard": False,
            "runtime_env": {"env_vars": {"PYTHONPATH": root}},
        },
    )
