"""The gateway benchmark's backend: a workflow of two model calls through the rollout's
base URL (the gateway's route with ``--gateway``, else the stand-in itself).

Each call is a non-streamed chat completion of the arithmetic question with the calculator
tool offered (the chat stand-in answers a tool call, then the final answer); the workflow
asks for token ids and logprobs itself (so the stand-in's work is the same with and without
the gateway, which then adds nothing to the request), times each call on its side and
reports the times in the sample's metrics
(``call0_ms``, ``call1_ms``). One aiohttp session per process serves every rollout (a
session per rollout would cost more than the calls). ``BENCH_SLOTS`` sets the
LocalBackend's slots (default 256: never the bottleneck at C=64).
"""

from __future__ import annotations

import os
import time
from typing import Any, Final

import aiohttp

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    LocalBackend,
    WorkflowContext,
)

__all__ = ["backend"]

TOOLS: Final = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]

_session: aiohttp.ClientSession | None = None


def _shared_session() -> aiohttp.ClientSession:
    global _session
    if _session is None or _session.closed:
        _session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    return _session


class TwoCalls(AgentWorkflow):
    """Two chat completions: the tool call, then (after a fake tool result) the answer."""

    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        session = _shared_session()
        messages: list[dict[str, Any]] = list(ctx.prompt)
        metrics: dict[str, float] = {}
        for call in range(2):
            began = time.perf_counter()
            async with session.post(
                f"{ctx.base_url}/chat/completions",
                json={
                    "model": "chat-standin",
                    "messages": messages,
                    "tools": TOOLS,
                    # Asked for in both configurations, so that the stand-in does the same
                    # work whether the gateway runs or not (a real inference server returns
                    # them at no cost; the stand-in hashes each token).
                    "logprobs": True,
                    "return_token_ids": True,
                },
            ) as response:
                response.raise_for_status()
                reply = (await response.json())["choices"][0]["message"]
            metrics[f"call{call}_ms"] = (time.perf_counter() - began) * 1000
            messages.append(reply)
            for tool_call in reply.get("tool_calls") or ():
                messages.append({"role": "tool", "tool_call_id": tool_call["id"], "content": "42"})
        return AgentWorkflowOutput(messages=messages, metrics=metrics)


def backend() -> LocalBackend:
    """The benchmark's LocalBackend (no grader: rollouts are ungraded)."""
    return LocalBackend(
        TwoCalls,
        workflow_config=AgentWorkflowConfig(
            name="gateway-bench",
            concurrency={"max_concurrent": int(os.environ.get("BENCH_SLOTS", "256"))},
        ),
    )
