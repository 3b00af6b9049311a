"""The one middleware of the rollout app: auth, protocol version, and error shapes.

It runs for every request, unknown paths included, in this order:

1. with an ``api_key``: ``Authorization`` must be exactly ``Bearer <key>`` (bytes compared
   in constant time), else ``401 {"detail":"unauthorized"}`` without ``WWW-Authenticate``;
2. a request that advertises an incompatible ``X-Rollout-Protocol-Version`` gets 426
   naming both versions (osmosis-ai clients send none and are served normally);
3. the handler; aiohttp's HTTP errors (404, 405, ...) become ``{"detail": "<reason>"}``
   and anything unexpected becomes ``500 {"detail": ...}``, logged with its traceback,
   never shown on the wire. A handler marked :func:`self_guarded` (the long poll) does
   step 3 itself, so the middleware keeps no frame of its own while that handler waits.

Every response carries ``X-Rollout-Protocol-Version``.
"""

from __future__ import annotations

import asyncio
import hmac
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware

from rollout_types import PROTOCOL_VERSION, PROTOCOL_VERSION_HEADER, protocol_compatible

from .._logtext import get_logger
from ..state._bodies import detail_body
from ._responses import detail_response, json_response

__all__ = ["internal_error_response", "make_protocol_middleware", "self_guarded"]

logger: Final = get_logger("rollout_server.middleware")

_UNAUTHORIZED: Final = detail_body("unauthorized")
_INTERNAL_ERROR: Final = detail_body(
    "internal server error; the rollout server's log has the details"
)
_KEPT_HEADERS: Final = (hdrs.ALLOW, hdrs.RETRY_AFTER)

_H = TypeVar("_H", bound=Callable[..., Any])
_SELF_GUARDED: Final[weakref.WeakSet[Callable[..., Any]]] = weakref.WeakSet()
"""Handlers marked with :func:`self_guarded` (weak: they close over their server)."""


def _from_http_exception(exc: web.HTTPException) -> web.Response:
    headers = {str(name): exc.headers[name] for name in _KEPT_HEADERS if name in exc.headers}
    return detail_response(exc.status, exc.reason, headers)


# Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "The result route runs
#   without a middleware frame ..."
def self_guarded(handler: _H) -> _H:
    """Mark a route handler as answering every failure itself (decorator).

    The middleware returns such a handler's coroutine to aiohttp as it is instead of
    awaiting it in a frame of its own, which saves that frame for as long as the handler
    runs (a long poll waits for up to ``result_wait_timeout_sec``). The handler must then
    do what the middleware otherwise does after it: set the ``X-Rollout-Protocol-Version``
    header on its response and turn any exception other than cancellation into
    :func:`internal_error_response`.
    """
    _SELF_GUARDED.add(handler)
    return handler


def internal_error_response(request: web.Request) -> web.Response:
    """Log the exception being handled while serving ``request``; return the opaque 500."""
    logger.exception("Unhandled error serving %s %s", request.method, request.path)
    return json_response(500, _INTERNAL_ERROR)


async def _answer(response: web.StreamResponse) -> web.StreamResponse:
    response.headers[PROTOCOL_VERSION_HEADER] = PROTOCOL_VERSION
    return response


async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    response: web.StreamResponse
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        response = _from_http_exception(exc)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - internal_error_response logs it
        response = internal_error_response(request)
    if not response.prepared:
        response.headers[PROTOCOL_VERSION_HEADER] = PROTOCOL_VERSION
    return response


def make_protocol_middleware(api_key: str | None) -> Middleware:
    """Build the middleware for a server with (or without) a bearer ``api_key``."""
    expected = None if api_key is None else f"Bearer {api_key}".encode("utf-8", "surrogateescape")

    # A plain function returning the awaitable aiohttp awaits: for a self-guarded handler
    # that is the handler's own coroutine, so no middleware frame outlives the checks.
    @web.middleware
    def protocol_middleware(
        request: web.Request, handler: Handler
    ) -> Awaitable[web.StreamResponse]:
        headers = request.headers
        if expected is not None and not hmac.compare_digest(
            headers.get(hdrs.AUTHORIZATION, "").encode("utf-8", "surrogateescape"), expected
        ):
            return _answer(json_response(401, _UNAUTHORIZED))
        version = headers.get(PROTOCOL_VERSION_HEADER)
        if version is not None and not protocol_compatible(PROTOCOL_VERSION, version):
            return _answer(
                detail_response(
                    426,
                    f"client speaks rollout protocol {version} but this server speaks "
                    f"{PROTOCOL_VERSION}; upgrade client and server together",
                )
            )
        if handler in _SELF_GUARDED:
            return handler(request)
        return _guard(request, handler)

    return protocol_middleware
