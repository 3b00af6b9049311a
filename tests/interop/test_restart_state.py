"""A restart loses nothing, through osmosis-ai 0.3.8's client (issue 28).

osmosis-ai 0.3.8's ``RolloutClient`` admits 50 rollouts that finish and 20 that the chat
stand-in holds, on this checkout's ``rollout-server serve --state sqlite:///...``; the client
stops polling (so the 50 results are published but never collected), the server is
SIGKILLed by its PID and started again on the same file and port. With the lease tokens
its 202s carried, the osmosis client's HTTP client collects 50 successes and 20
``failure`` / ``internal_error`` results naming the killed process; its ``health()`` and
``wait_idle()`` accept the new ``state`` fields of ``/health``; re-admitting a recovered id
is refused with 409, as osmosis-ai expects of a duplicate.

(osmosis-ai's handles cannot poll across the restart itself: they retry a refused
connection twice, 0.6 s in all, and a server start takes longer.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from typing import Any, Final

import pytest
from interop_harness import OSMOSIS, OURS_SERVER, ChatStandIn, DriverError, Pair, ServerProcess
from interop_harness.peers import REMOTE_DIR, python_of

pytestmark = pytest.mark.osmosis

FINISHED: Final = 50
IN_FLIGHT: Final = 20
EVENT_SEC: Final = 60.0
PAIR: Final = Pair(client=OSMOSIS, server=OURS_SERVER)


def stateful_server(state: str) -> ServerProcess:
    """Our ``rollout-server serve ours_app:backend`` keeping its state in ``state``."""
    python = python_of(OURS_SERVER)

    def argv(port: int) -> list[str]:
        return [
            python, "-m", "rollout_server", "serve", "ours_app:backend",
            "--app-dir", str(REMOTE_DIR), "--host", "127.0.0.1", "--port", str(port),
            "--result-wait-timeout-sec", "0.5", "--state", state,
        ]  # fmt: skip

    return ServerProcess(argv, label="rollout-server --state")


def rollout(standin: ChatStandIn, rollout_id: str) -> dict[str, Any]:
    return {
        "initial_messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "chat_completions_url": standin.url_for(rollout_id),
        "rollout_id": rollout_id,
        "label": "4",
    }


async def test_osmosis_client_collects_across_a_sigkill_restart(
    standin: ChatStandIn, own_server: list[ServerProcess], open_client: Any, tmp_path: Any
) -> None:
    python_of(OSMOSIS)  # skip (or fail under ROLLOUT_INTEROP_REQUIRE=1) without osmosis-ai
    state = f"sqlite://{tmp_path / 'state.db'}"
    server = stateful_server(state).start()
    own_server.append(server)
    client = await open_client(PAIR, server.url)
    done = [f"done-{uuid.uuid4().hex}" for _ in range(FINISHED)]
    flying = [f"fly-{uuid.uuid4().hex}" for _ in range(IN_FLIGHT)]
    for rid in done + flying:
        standin.hold("chat", rid)
        await client.call("start", **rollout(standin, rid))
        await client.call("stop_polling", rollout_id=rid)
    for rid in done:
        standin.release("chat", rid)
    # Published means durable: wait until the store has committed every admission and
    # every finished result (health through the osmosis client, which keeps unknown keys).
    # The 20 held ones are in flight: 4 in the backend's slots, the rest queued behind them.
    async with asyncio.timeout(EVENT_SEC):
        while True:
            health = await client.call("health")
            if (
                health["state"]["writes"] >= len(done) * 2 + len(flying)
                and health["lifecycle"]["active_rollouts"] == IN_FLIGHT
            ):
                break
            await asyncio.sleep(0.1)
    killed = health["process_id"]
    os.kill(server.pid, signal.SIGKILL)
    assert server.stop() == -signal.SIGKILL
    server.start()  # the same port, the same state file

    health = await client.call("health")
    assert health["process_id"] != killed
    assert health["state"]["recovered_rollouts"] == FINISHED
    assert health["state"]["failed_by_restart"] == IN_FLIGHT
    idle = await client.call("wait_idle", timeout_sec=EVENT_SEC)
    assert idle["lifecycle"] == {"accepting_rollouts": True, "active_rollouts": 0}
    for rid in done:
        answer = await client.call("peek", rollout_id=rid)
        assert answer["http_status"] == 200
        assert answer["body"]["status"] == "success"
        assert answer["body"]["sample"]["reward"] == 1.0
    for rid in flying:
        answer = await client.call("peek", rollout_id=rid)
        assert answer == {
            "http_status": 200,
            "body": {
                "rollout_id": rid,
                "status": "failure",
                "sample": None,
                "err_message": f"the server process {killed} ended before the rollout finished",
                "err_category": "internal_error",
            },
        }
    with pytest.raises(DriverError) as caught:
        await client.call("run_rollout", **rollout(standin, done[0]))
    assert caught.value.status_code == 409
    assert "Server restarted" not in server.log()
    assert f"recovered {FINISHED} rollout result(s); {IN_FLIGHT} rollout(s)" in server.log()
