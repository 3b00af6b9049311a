"""The private aiohttp attributes the client relies on (``rollout_client._aiohttp_private``).

These tests fail when an aiohttp release drops or renames an attribute the client sets:
the client would silently fall back to aiohttp's own behaviour otherwise.
"""

from __future__ import annotations

import re

import aiohttp

from rollout_client._aiohttp_private import RETRY_CONNECTION_SINCE, disable_idempotent_replay
from rollout_client._transport import make_session


def _aiohttp_version() -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", aiohttp.__version__)
    assert match is not None, aiohttp.__version__
    return int(match[1]), int(match[2])


class TestRetryConnection:
    async def test_attribute_exists_where_expected(self):
        """aiohttp >= 3.11 has ClientSession._retry_connection, True by default (replaying)."""
        async with aiohttp.ClientSession() as session:
            if _aiohttp_version() >= RETRY_CONNECTION_SINCE:
                assert getattr(session, "_retry_connection", None) is True, (
                    f"aiohttp {aiohttp.__version__} has no ClientSession._retry_connection: "
                    "update rollout_client._aiohttp_private (the client's own session would "
                    "replay result polls outside the protocol's retry schedule)"
                )
            else:
                assert not hasattr(session, "_retry_connection")

    async def test_disable_idempotent_replay(self):
        """The switch is flipped off where aiohttp has it, and reported missing otherwise."""
        async with aiohttp.ClientSession() as session:
            switched = disable_idempotent_replay(session)
            assert switched is (_aiohttp_version() >= RETRY_CONNECTION_SINCE)
            if switched:
                assert session._retry_connection is False

    async def test_client_session_has_replay_off(self):
        """The session a RolloutClient creates does not replay idempotent requests."""
        session = make_session()
        try:
            assert getattr(session, "_retry_connection", False) is False
        finally:
            await session.close()
