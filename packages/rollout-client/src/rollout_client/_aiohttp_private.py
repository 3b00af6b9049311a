"""Every private attribute of aiohttp the client touches, in one place.

aiohttp offers no public switch for these; each use says what it relies on and since which
aiohttp release. ``tests/test_aiohttp_private.py`` fails when an aiohttp release that should
have an attribute lacks it, so an upgrade that drops one is noticed, not silently ignored.
"""

from __future__ import annotations

from typing import Final

import aiohttp

__all__ = ["RETRY_CONNECTION_SINCE", "disable_idempotent_replay"]

RETRY_CONNECTION_SINCE: Final = (3, 11)
"""The first aiohttp release whose ``ClientSession`` has ``_retry_connection``."""


def disable_idempotent_replay(session: aiohttp.ClientSession) -> bool:
    """Stop ``session`` from silently replaying an idempotent request whose connection dropped.

    aiohttp resends a GET once, at once, when a kept-alive connection turns out closed; the
    result poll has its own schedule (:class:`~rollout_client.RetrySettings`), so the
    client's own session turns the replay off. aiohttp's test client flips the same
    attribute (``ClientSession._retry_connection``, aiohttp 3.11 and later); aiohttp 3.10
    has no switch and keeps replaying.

    Args:
        session: A session the client created (never a caller's).

    Returns:
        True when the replay is now off, False on an aiohttp without the switch.
    """
    if not hasattr(session, "_retry_connection"):
        return False
    session._retry_connection = False
    return True
