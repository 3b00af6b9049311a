"""Our client and server with different protocol majors fail at the first request.

No release of ours speaks another protocol yet, so one side runs with an overlay of
``rollout_types`` whose ``PROTOCOL_VERSION`` is the next major: a copy of that side's
installed package, first on its ``PYTHONPATH``. Either way round the first admission must
fail within ``FAIL_FAST_SEC`` with the client's ``RolloutProtocolVersionError`` naming
both versions and saying to upgrade client and server together, and nothing may run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from interop_harness import OURS_CLIENT, OURS_SERVER, ChatStandIn, DriverError, Pair, python_of
from interop_harness.processes import ServerProcess

FAIL_FAST_SEC = 10.0
"""Bound on the expected failure (the driver reports DriverTimeout past it)."""
_CONSTANT = re.compile(r'^PROTOCOL_VERSION: Final = "(\d+)\.(\d+)"', re.MULTILINE)


def future_protocol(python: str, where: Path) -> tuple[dict[str, str], str, str]:
    """An overlay of ``python``'s rollout_types speaking the next protocol major.

    Returns:
        The environment that puts the overlay first, the installed protocol version and
        the overlay's.
    """
    location = subprocess.run(
        [python, "-c", "import os, rollout_types; print(os.path.dirname(rollout_types.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    target = where / "overlay" / "rollout_types"
    shutil.copytree(location, target, ignore=shutil.ignore_patterns("__pycache__"))
    constants = target / "_constants.py"
    if not constants.exists():  # rollout-types 0.1.0 named it constants.py
        constants = target / "constants.py"
    text = constants.read_text("utf-8")
    match = _CONSTANT.search(text)
    assert match is not None, f"{constants} has no PROTOCOL_VERSION constant"
    current = f"{match.group(1)}.{match.group(2)}"
    future = f"{int(match.group(1)) + 1}.0"
    constants.write_text(_CONSTANT.sub(f'PROTOCOL_VERSION: Final = "{future}"', text), "utf-8")
    return {"PYTHONPATH": str(where / "overlay")}, current, future


def rollout(standin: ChatStandIn) -> dict[str, Any]:
    """Keyword arguments of ``run_rollout`` for one question."""
    rid = uuid.uuid4().hex
    return {
        "initial_messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "chat_completions_url": standin.url_for(rid),
        "rollout_id": rid,
        "label": "4",
    }


def assert_version_error(error: DriverError, ours: str, theirs: str) -> None:
    """The client's typed version error, naming both versions and saying what to do."""
    assert error.type == "RolloutProtocolVersionError", error
    assert "RolloutProtocolError" in error.mro
    assert error.status_code == 426, error
    assert ours in error.message, error
    assert theirs in error.message, error
    assert "upgrade" in error.message, error
    assert "together" in error.message, error


async def active_rollouts(server: ServerProcess) -> int:
    """``lifecycle.active_rollouts`` of the server's /health (no version header sent)."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{server.url}/health") as response,
    ):
        health = await response.json()
    return int(health["lifecycle"]["active_rollouts"])


class TestProtocolMajorMismatch:
    """A client and a server of different protocol majors refuse each other at once."""

    async def test_client_against_newer_server(
        self,
        tmp_path: Path,
        own_server: list[ServerProcess],
        standin: ChatStandIn,
        open_client: Any,
    ) -> None:
        """Our client meets a server of the next major: version error, nothing admitted."""
        pair = Pair(client=OURS_CLIENT, server=OURS_SERVER)
        env, current, future = future_protocol(python_of(OURS_SERVER), tmp_path)
        process = pair.make_server(env=env).start()
        own_server.append(process)
        client = await open_client(pair, process.url)
        with pytest.raises(DriverError) as caught:
            await client.call("run_rollout", timeout_sec=FAIL_FAST_SEC, **rollout(standin))
        assert_version_error(caught.value, current, future)
        assert client.responses("POST", "/rollout") == [426]
        assert await active_rollouts(process) == 0
        assert standin.requests == []

    async def test_newer_client_against_server(
        self,
        tmp_path: Path,
        own_server: list[ServerProcess],
        standin: ChatStandIn,
        open_client: Any,
    ) -> None:
        """A client of the next major meets our server: version error, nothing admitted."""
        pair = Pair(client=OURS_CLIENT, server=OURS_SERVER)
        env, current, future = future_protocol(python_of(OURS_CLIENT), tmp_path)
        process = pair.make_server().start()
        own_server.append(process)
        client = await open_client(pair, process.url, env=env)
        with pytest.raises(DriverError) as caught:
            await client.call("run_rollout", timeout_sec=FAIL_FAST_SEC, **rollout(standin))
        assert_version_error(caught.value, future, current)
        assert client.responses("POST", "/rollout") == [426]
        assert await active_rollouts(process) == 0
        assert standin.requests == []
