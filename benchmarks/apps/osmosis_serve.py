"""Serve the benchmark workflow and grader on osmosis-ai 0.3.8 under uvicorn.

Run in the osmosis venv as ``python -m benchmarks.apps.osmosis_serve --port-file F``: it
binds 127.0.0.1 on a free port, writes the port to ``F`` once listening would succeed,
and serves the way osmosis-ai's own entrypoint does (``uvicorn.run(app,
timeout_keep_alive=2160)``: uvicorn defaults otherwise, so h11, the asyncio loop and the
access log at INFO). Stop it with SIGTERM.
"""

# mypy: disallow-subclassing-any=False

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from typing import Any

import uvicorn  # type: ignore[import-not-found,unused-ignore]
from osmosis_ai.rollout import (  # type: ignore[import-not-found,unused-ignore]
    AgentWorkflow,
    AgentWorkflowConfig,
    ConcurrencyConfig,
    Grader,
    LocalBackend,
)
from osmosis_ai.rollout.server import (  # type: ignore[import-not-found,unused-ignore]
    create_rollout_server,
)

from benchmarks.apps.behaviour import (
    FIXED_REWARD,
    fixed_messages,
    install_release_guard,
    wait_as_told,
)

__all__ = ["BenchGrader", "BenchWorkflow", "build_app", "main"]

KEEPALIVE_SEC = 2160
"""osmosis-ai's entrypoint keep-alive (it outlives a load balancer's 2100 s idle timeout)."""


class BenchWorkflow(AgentWorkflow):  # type: ignore[type-arg,unused-ignore]
    """Wait as the metadata says, then return the fixed conversation."""

    async def run(self, ctx: Any) -> list[dict[str, Any]]:
        await wait_as_told(ctx.metadata)
        return fixed_messages()


class BenchGrader(Grader):
    """Give every sample the fixed reward."""

    async def grade(self, ctx: Any) -> None:
        ctx.set_reward(FIXED_REWARD)


def build_app() -> Any:
    """The osmosis-ai FastAPI app over a LocalBackend without a slot limit."""
    backend = LocalBackend(
        workflow=BenchWorkflow,
        workflow_config=AgentWorkflowConfig(
            name="bench", concurrency=ConcurrencyConfig(max_concurrent=None)
        ),
        grader=BenchGrader,
    )
    return create_rollout_server(backend=backend)


def main() -> None:
    """Parse ``--port-file``, bind, publish the port and serve until SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port-file", type=Path, required=True)
    args = parser.parse_args()
    install_release_guard()
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP
    # (accepted ones inherit it), as uvicorn's own create_server(host, port) sockets do.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        build_app(), host="127.0.0.1", port=port, timeout_keep_alive=KEEPALIVE_SEC
    )
    server = uvicorn.Server(config)
    tmp = args.port_file.with_name(args.port_file.name + ".tmp")
    tmp.write_text(f"{port}\n", encoding="ascii")
    os.replace(tmp, args.port_file)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
