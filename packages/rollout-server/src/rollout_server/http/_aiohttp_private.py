"""Every private attribute of aiohttp the server touches, and every undocumented method it
overrides, in one place.

aiohttp does not promise these; ``tests/test_aiohttp_private.py`` checks each attribute on a
real connection and each overridden method's signature, so an aiohttp release that drops,
renames or reshapes one fails the tests loudly rather than quietly losing what it buys. At
run time a missing attribute is a no-op: the server stays correct, only larger (the
keep-alive timer), or without its own connection handler (:func:`install_request_handler`:
aiohttp's plain 400s and no header read timeout).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any, Final

from aiohttp import StreamReader, web

__all__ = [
    "KEEPALIVE_HANDLE",
    "MAKE_HANDLER",
    "OVERRIDDEN_METHODS",
    "PARSED_MESSAGES",
    "PRIVATE_ATTRIBUTES",
    "SERVER_HANDLER_KWARGS",
    "SERVER_LOOP",
    "HandlerFactory",
    "install_request_handler",
    "last_parsed_payload",
    "parsed_count",
    "pause_keepalive_timer",
]

KEEPALIVE_HANDLE: Final = "_keepalive_handle"
"""The idle keep-alive timer of a connection (an ``asyncio.TimerHandle`` or None), an
attribute of aiohttp's ``web_protocol.RequestHandler`` (``request.protocol``)."""

PARSED_MESSAGES: Final = "_messages"
"""The requests a connection has parsed and not yet handled: a deque of ``(message,
payload)`` pairs, an attribute of ``RequestHandler``."""

MAKE_HANDLER: Final = "_make_handler"
"""The method of ``web.Application`` that every ``AppRunner`` (``web.run_app`` and the test
servers included) calls to build the app's low-level ``web.Server``."""

SERVER_LOOP: Final = "_loop"
"""The event loop of a ``web.Server``, handed to each ``RequestHandler`` it creates."""

SERVER_HANDLER_KWARGS: Final = "_kwargs"
"""The keyword arguments a ``web.Server`` passes to each ``RequestHandler`` it creates (the
runner's and the app's ``handler_args``)."""

PRIVATE_ATTRIBUTES: Final = {
    "RequestHandler": (KEEPALIVE_HANDLE, PARSED_MESSAGES),
    "Server": (SERVER_LOOP, SERVER_HANDLER_KWARGS),
    "Application": (MAKE_HANDLER,),
}
"""The private attributes used here, by the aiohttp class that holds them."""

OVERRIDDEN_METHODS: Final = {
    "handle_error": "(request, status=500, exc=None, message=None)",
    "finish_response": "(request, resp, start_time)",
    "log_exception": "(*args, **kw)",
}
"""The undocumented methods of ``web.RequestHandler`` that
:class:`~rollout_server.http._connection.GuardedRequestHandler` overrides, each with the
parameters (after ``self``, annotations left out) aiohttp calls it with. aiohttp's own
connection code calls them, so a release that renames one would silently bypass the override
(JSON 400s, closing on an unread body, throttled peer errors) and one that changes the
parameters would break it. The other two overrides, ``data_received`` and
``connection_lost``, are :class:`asyncio.Protocol`'s documented API."""

HandlerFactory = Callable[..., web.RequestHandler]
"""Builds a connection's protocol: called as ``factory(server, loop=loop, **kwargs)``, the
way ``web.Server`` builds a ``web.RequestHandler``."""


# Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "The connection's
#   keep-alive timer is cancelled while a poll waits ..."
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


def parsed_count(protocol: web.RequestHandler) -> int | None:
    """How many parsed requests ``protocol`` holds unhandled (None: aiohttp keeps no such
    queue, so the count is unknown)."""
    messages = getattr(protocol, PARSED_MESSAGES, None)
    return len(messages) if isinstance(messages, collections.deque) else None


def last_parsed_payload(protocol: web.RequestHandler) -> StreamReader | None:
    """The body stream of the request ``protocol`` parsed last, while it is unhandled."""
    messages = getattr(protocol, PARSED_MESSAGES, None)
    if not isinstance(messages, collections.deque) or not messages:
        return None
    payload = messages[-1][1]
    return payload if isinstance(payload, StreamReader) else None


class _Server(web.Server):
    """A ``web.Server`` whose connections are built by a factory of our own."""

    def __init__(self, factory: HandlerFactory, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rollout_factory = factory

    def __call__(self) -> web.RequestHandler:
        loop = getattr(self, SERVER_LOOP)
        kwargs: dict[str, Any] = getattr(self, SERVER_HANDLER_KWARGS)
        return self._rollout_factory(self, loop=loop, **kwargs)


def install_request_handler(app: web.Application, factory: HandlerFactory) -> bool:
    """Have every runner of ``app`` build its connections with ``factory``.

    Any ``AppRunner`` (so ``web.run_app``, the ``rollout-server`` command and aiohttp's
    test servers) asks the app for its low-level server; from now on that server builds
    each connection's protocol with ``factory(server, loop=loop, **kwargs)`` instead of
    ``web.RequestHandler(...)``, with the same arguments (``handler_args`` included).

    Args:
        app: The application, not yet set up by a runner.
        factory: Builds a connection's protocol (a ``web.RequestHandler`` subclass).

    Returns:
        True if installed; False (nothing changed) where aiohttp builds servers otherwise.
    """
    make = getattr(app, MAKE_HANDLER, None)
    if not callable(make):
        return False

    def make_handler(**kwargs: Any) -> web.Server:
        server: web.Server = make(**kwargs)
        loop = getattr(server, SERVER_LOOP, None)
        handler_kwargs = getattr(server, SERVER_HANDLER_KWARGS, None)
        if not isinstance(loop, asyncio.AbstractEventLoop) or not isinstance(handler_kwargs, dict):
            return server  # a shape this module does not know: aiohttp's own handlers
        return _Server(
            factory,
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=loop,
            **handler_kwargs,
        )

    # object.__setattr__: aiohttp's debug mode warns on any attribute set on an app.
    object.__setattr__(app, MAKE_HANDLER, make_handler)
    return True
