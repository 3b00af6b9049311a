"""Every private attribute of aiohttp the server touches, in one place.

aiohttp does not promise these; ``tests/test_aiohttp_private.py`` checks each of them on a
real connection, so an aiohttp release that drops or renames one fails the tests loudly
rather than quietly losing what the attribute buys. At run time a missing attribute is a
no-op: the server stays correct, only larger.
"""

from __future__ import annotations

from typing import Final

from aiohttp import web

__all__ = ["KEEPALIVE_HANDLE", "PRIVATE_ATTRIBUTES", "pause_keepalive_timer"]

KEEPALIVE_HANDLE: Final = "_keepalive_handle"
"""The idle keep-alive timer of a connection (an ``asyncio.TimerHandle`` or None), an
attribute of aiohttp's ``web_protocol.RequestHandler`` (``request.protocol``)."""

PRIVATE_ATTRIBUTES: Final = {"RequestHandler": (KEEPALIVE_HANDLE,)}
"""The private attributes used here, by the aiohttp class that holds them."""


def pause_keepalive_timer(request: web.Request) -> None:
    """Drop the idle keep-alive timer of the connection ``request`` came on.

    aiohttp arms that timer when a connection opens and keeps it through a request it is
    handling, though it only ever closes idle connections; it re-arms it once the response
    is sent. A long poll holds its connection busy for up to ``result_wait_timeout_sec``,
    so dropping the timer meanwhile changes nothing but saves a loop timer (about half a
    kilobyte) per waiting poll. A no-op where aiohttp keeps no such timer.
    """
    protocol = request.protocol
    handle = getattr(protocol, KEEPALIVE_HANDLE, None)
    if handle is not None and callable(getattr(handle, "cancel", None)):
        handle.cancel()
        setattr(protocol, KEEPALIVE_HANDLE, None)
