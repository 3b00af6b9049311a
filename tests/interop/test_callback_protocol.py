"""osmosis-ai 0.3.2 (the pre-0.3.3 callback protocol) against this checkout, both directions.

The 0.3.2 -> 0.3.3 boundary is a hard break (wire-protocol section 8). Each direction must
fail at admission, fast and with an error that says what to do, never with a silent
202 that expires minutes later.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import aiohttp
import pytest
from interop_harness import (
    OSMOSIS_032,
    OURS_CLIENT,
    OURS_SERVER,
    ChatStandIn,
    DriverError,
    Pair,
    ServerProcess,
)

pytestmark = pytest.mark.osmosis

FAIL_FAST_SEC = 10.0
"""The failure must arrive within this bound (the driver reports DriverTimeout otherwise)."""


class TestCallbackProtocolPeers:
    """Admission between the callback protocol and the pull protocol fails fast and clearly."""

    async def test_our_client_against_osmosis_032_server(
        self, own_server: list[ServerProcess], standin: ChatStandIn, open_client: Any
    ) -> None:
        """Our client gets the version error saying the server is too old: upgrade together."""
        pair = Pair(client=OURS_CLIENT, server=OSMOSIS_032)
        process = pair.make_server().start()
        own_server.append(process)
        client = await open_client(pair, process.url)
        rid = uuid.uuid4().hex
        with pytest.raises(DriverError) as caught:
            await client.call(
                "run_rollout",
                timeout_sec=FAIL_FAST_SEC,
                initial_messages=[{"role": "user", "content": "What is 2 + 2?"}],
                chat_completions_url=standin.url_for(rid),
                rollout_id=rid,
                label="4",
            )
        error = caught.value
        assert error.type == "RolloutProtocolVersionError", error
        assert "RolloutProtocolError" in error.mro
        assert error.status_code == 422
        assert "too old" in error.message
        assert "callback protocol" in error.message
        assert "upgrade" in error.message
        assert "together" in error.message
        assert client.responses("POST", "/rollout") == [422]
        assert standin.requests == []

    async def test_osmosis_032_caller_against_our_server(
        self, own_server: list[ServerProcess], standin: ChatStandIn, open_client: Any
    ) -> None:
        """The 0.3.2 caller's admission gets a 400 that says to upgrade, and nothing runs."""
        pair = Pair(client=OSMOSIS_032, server=OURS_SERVER)
        process = pair.make_server().start()
        own_server.append(process)
        client = await open_client(pair, process.url)
        with pytest.raises(DriverError) as caught:
            await client.call(
                "run_rollout",
                timeout_sec=FAIL_FAST_SEC,
                rollout_id=uuid.uuid4().hex,
                initial_messages=[{"role": "user", "content": "What is 2 + 2?"}],
                label="4",
            )
        error = caught.value
        assert error.type == "RolloutProtocolError", error
        assert error.module.startswith("osmosis_ai")
        assert error.status_code == 400
        assert error.message == "POST /rollout returned 400; only 202 and 429 are accepted"
        detail = json.loads(error.error["response_body"])["detail"]
        assert "pre-0.3.3 callback protocol" in detail
        assert "upgrade the caller (client) and the rollout server together" in detail
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{process.url}/health") as response,
        ):
            health = await response.json()
        assert health["lifecycle"]["active_rollouts"] == 0
        assert standin.requests == []
