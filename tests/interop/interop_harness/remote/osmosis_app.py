"""Serve osmosis-ai's ``create_rollout_server(LocalBackend(...))`` with uvicorn (a peer).

Run by the osmosis-ai venv's interpreter (0.3.8, or 0.3.2 for the callback protocol)::

    python osmosis_app.py [--port 0] [--api-key-env NAME] [--backpressure]
                          [--result-wait-timeout-sec S] [--polling-lease-timeout-sec S]

It binds 127.0.0.1 itself, prints ``osmosis-server listening on http://127.0.0.1:PORT``
to stderr once the socket listens, and serves until SIGTERM/SIGINT (uvicorn's graceful
shutdown). The workflow and grader are :mod:`workflow_logic` on osmosis-ai's base classes.
``--backpressure`` gives one slot and no queue: the backend reports no capacity while a
rollout holds the slot, so the server answers 429 (osmosis-ai's ``has_capacity`` hook).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import socket
import sys
from typing import Any

import uvicorn
import workflow_logic
from osmosis_ai.rollout import (
    AgentWorkflow,
    AgentWorkflowConfig,
    ConcurrencyConfig,
    Grader,
    GraderContext,
    LocalBackend,
    get_rollout_context,
)
from osmosis_ai.rollout.server.app import create_rollout_server


class InteropWorkflow(AgentWorkflow):
    """One chat completion from the endpoint the request names, appended to the prompt."""

    async def run(self, ctx: Any) -> list[dict[str, Any]]:
        rollout = get_rollout_context()
        url = rollout.chat_completions_url if rollout is not None else ""
        key = rollout.api_key if rollout is not None else None
        return await workflow_logic.run_agent(ctx.prompt, ctx.metadata, url, key)


class InteropGrader(Grader):
    """Reward 1.0 when the answer equals the label, else 0.0."""

    async def grade(self, ctx: GraderContext) -> None:
        messages = ctx.sample.messages if ctx.sample is not None else []
        ctx.set_reward(await workflow_logic.grade(messages, ctx.label, ctx.metadata))


class BackpressureBackend(LocalBackend):
    """A LocalBackend with one slot that reports no capacity while the slot is taken."""

    def has_capacity(self) -> bool:
        snapshot = self.limiter.snapshot()
        return int(snapshot.get("running", 0)) + int(snapshot.get("queued", 0)) < 1


def build_app(args: argparse.Namespace) -> Any:
    """The FastAPI app of ``create_rollout_server`` for the parsed options."""
    if args.backpressure:
        backend: LocalBackend = BackpressureBackend(
            workflow=InteropWorkflow,
            workflow_config=AgentWorkflowConfig(
                name="interop", concurrency=ConcurrencyConfig(max_concurrent=1)
            ),
            grader=InteropGrader,
        )
    else:
        backend = LocalBackend(workflow=InteropWorkflow, grader=InteropGrader)
    accepted = inspect.signature(create_rollout_server).parameters
    options: dict[str, Any] = {}
    if args.api_key_env:
        options["api_key"] = os.environ[args.api_key_env]
    if args.result_wait_timeout_sec is not None:
        options["result_wait_timeout_sec"] = args.result_wait_timeout_sec
    if args.polling_lease_timeout_sec is not None:
        options["polling_lease_timeout_sec"] = args.polling_lease_timeout_sec
    unsupported = sorted(set(options) - set(accepted))
    if unsupported:
        sys.exit(f"this osmosis-ai version's create_rollout_server has no {unsupported}")
    return create_rollout_server(backend=backend, **options)


def main() -> None:
    """Parse the command line, bind, announce the port and serve."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--api-key-env", default=None)
    parser.add_argument("--backpressure", action="store_true")
    parser.add_argument("--result-wait-timeout-sec", type=float, default=None)
    parser.add_argument("--polling-lease-timeout-sec", type=float, default=None)
    args = parser.parse_args()
    app = build_app(args)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(2048)
    port = sock.getsockname()[1]
    print(f"osmosis-server listening on http://127.0.0.1:{port}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


if __name__ == "__main__":
    main()
