"""The HTTP floor: bare aiohttp on uvloop, answering our client's admission and long poll.

Run in our venv as ``python -m benchmarks.apps.floor_app --port-file F``: it binds
127.0.0.1 on a free port, writes the port to ``F`` once it listens, and stops on SIGTERM.

It is not a rollout server. It has no registry, lease, deadline, backend, workflow task or
middleware, and it validates nothing the client does not need. Per rollout it keeps only
the request's ``metadata`` until the first poll takes it. That poll then waits as the
metadata says (:func:`~benchmarks.apps.behaviour.wait_as_told`, the wait both stacks'
workflows use) and answers a successful result. The in-flight workload drives it with our
client. The RSS it grows per held rollout is about what aiohttp and uvloop alone hold for
one admitted rollout whose long poll waits (plus the floor's own handler frame, wait and
stored metadata); our server's figure minus this one is what our server adds.

It serves the way ``rollout-server serve`` does: uvloop, no access log, the same listen
backlog, port file and tuning of the cyclic collector.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import signal
from pathlib import Path
from typing import Any, Final

import uvloop
from aiohttp import web

from benchmarks.apps.behaviour import (
    FIXED_REWARD,
    HOLD_LIMIT_SEC,
    fixed_messages,
    install_release_guard,
    wait_as_told,
)
from rollout_server.cli._serve import LISTEN_BACKLOG, tune_collector, write_port_file

__all__ = ["build_app", "main"]

RESULT_WAIT_SEC: Final = HOLD_LIMIT_SEC + 60.0
"""The ``result_wait_timeout_sec`` the floor announces: longer than any hold, so the
client's poll waits for the release and never re-polls."""

_JSON: Final = "application/json"
_PENDING: Final = web.AppKey("pending", dict[str, Any])


def _json(status: int, document: Any) -> web.Response:
    return web.Response(status=status, body=json.dumps(document).encode(), content_type=_JSON)


async def _health(_request: web.Request) -> web.Response:
    return _json(200, {"status": "ok"})


async def _admit(request: web.Request) -> web.Response:
    init = json.loads(await request.read())
    rollout_id = init["rollout_id"]
    request.app[_PENDING][rollout_id] = init.get("metadata")
    return _json(
        202,
        {
            "rollout_id": rollout_id,
            "status": "queued",
            # As long as our server's tokens, so the lease header costs both the same.
            "polling_lease_token": secrets.token_urlsafe(32),
            "result_wait_timeout_sec": RESULT_WAIT_SEC,
            "polling_lease_timeout_sec": 2 * RESULT_WAIT_SEC,
        },
    )


async def _result(request: web.Request) -> web.Response:
    rollout_id = request.match_info["rollout_id"]
    pending = request.app[_PENDING]
    if rollout_id not in pending:
        return _json(404, {"detail": "unknown rollout_id"})
    await wait_as_told(pending.pop(rollout_id))
    sample = {"messages": fixed_messages(), "reward": FIXED_REWARD}
    return _json(200, {"rollout_id": rollout_id, "status": "success", "sample": sample})


def build_app() -> web.Application:
    """The floor's routes: ``GET /health``, ``POST /rollout``, ``GET /rollout/{id}/result``."""
    app = web.Application()
    app[_PENDING] = {}
    app.add_routes(
        [
            web.get("/health", _health, allow_head=False),
            web.post("/rollout", _admit),
            web.get("/rollout/{rollout_id:[^/]+}/result", _result, allow_head=False),
        ]
    )
    return app


async def _serve(port_file: Path) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    runner = web.AppRunner(build_app(), handle_signals=False, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0, backlog=LISTEN_BACKLOG).start()
        port = runner.addresses[0][1]
        tune_collector()
        write_port_file(port_file, port)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    """Serve the floor until SIGTERM (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.apps.floor_app")
    parser.add_argument("--port-file", type=Path, required=True, help="where the port goes")
    args = parser.parse_args(argv)
    install_release_guard()
    uvloop.run(_serve(args.port_file))


if __name__ == "__main__":
    main()
