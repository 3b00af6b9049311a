"""Every private attribute of aiohttp the client touches, in one place.

aiohttp offers no public switch for these; each use says what it relies on and since which
aiohttp release. ``tests/test_aiohttp_private.py`` fails when an aiohttp release that should
have an attribute lacks it, so an upgrade that drops one is noticed, not silently ignored.
"""

from __future__ import annotations

import aiohttp

__all__ = ["disable_idempotent_replay"]


# Speed: benchmarks/README.md, "Client", row "No idempotent replay ..."
def disable_idempotent_replay(session: aiohttp.ClientSession) -> None:
    """Stop ``session`` from silently replaying an idempotent request whose connection dropped.

    aiohttp resends a GET once, at once, when a kept-alive connection turns out closed; the
    result poll has its own schedule (:class:`~rollout_client.RetrySettings`), so the
    client's own session turns the replay off. aiohttp's test client flips the same
    attribute (``ClientSession._retry_connection``, in every aiohttp the client supports:
    3.11 and later). A no-op on a release without it, which the tests report.

    Args:
        session: A session the client created (never a caller's).
    """
    if hasattr(session, "_retry_connection"):
        session._retry_connection = False
