"""The private aiohttp attributes the client relies on (``rollout_client._aiohttp_private``).

These tests fail when an aiohttp release drops or renames an attribute the client sets:
the client would silently fall back to aiohttp's own behaviour otherwise.
"""

from __future__ import annotations

import aiohttp

from rollout_client._aiohttp_private import disable_idempotent_replay
from rollout_client._transport import make_session


class TestRetryConnection:
    async def test_attribute_exists(self):
        """Every supported aiohttp has ClientSession._retry_connection, True by default."""
        async with aiohttp.ClientSession() as session:
            assert getattr(session, "_retry_connection", None) is True, (
                f"aiohttp {aiohttp.__version__} has no ClientSession._retry_connection: "
                "update rollout_client._aiohttp_private (the client's own session would "
                "replay result polls outside the protocol's retry schedule)"
            )

    async def test_disable_idempotent_replay(self):
        """The switch is flipped off."""
        async with aiohttp.ClientSession() as session:
            disable_idempotent_replay(session)
            assert session._retry_connection is False

    async def test_client_session_has_replay_off(self):
        """The session a RolloutClient creates does not replay idempotent requests."""
        session = make_session()
        try:
            assert session._retry_connection is False
        finally:
            await session.close()
