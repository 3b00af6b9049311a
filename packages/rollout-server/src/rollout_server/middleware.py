"""The one middleware of the rollout app: auth, protocol version, and error shapes.

It runs for every request, unknown paths included, in this order:

1. with an ``api_key``: ``Authorization`` must be exactly ``Bearer <key>`` (bytes compared
   in constant time), else ``401 {"detail":"unauthorized"}`` without ``WWW-Authenticate``;
2. a request that advertises an incompatible ``X-Rollout-Protocol-Version`` gets 426
   naming both versions (osmosis-ai clients send none and are served normally);
3. the handler; aiohttp's HTTP errors (404, 405, ...) become ``{"detail": "<reason>"}``
   and anything unexpected becomes ``500 {"detail": ...}``, logged with its traceback,
   never shown on the wire.

Every response carries ``X-Rollout-Protocol-Version``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Final

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware

from rollout_types import PROTOCOL_VERSION, PROTOCOL_VERSION_HEADER, dumps, protocol_compatible

from ._responses import detail_response, json_response

__all__ = ["make_protocol_middleware"]

logger: Final = logging.getLogger("rollout_server.middleware")

_UNAUTHORIZED: Final = dumps({"detail": "unauthorized"}).encode()
_INTERNAL_ERROR: Final = dumps(
    {"detail": "internal server error; the rollout server's log has the details"}
).encode()
_KEPT_HEADERS: Final = (hdrs.ALLOW, hdrs.RETRY_AFTER)


def _from_http_exception(exc: web.HTTPException) -> web.Response:
    headers = {str(name): exc.headers[name] for name in _KEPT_HEADERS if name in exc.headers}
    return detail_response(exc.status, exc.reason, headers)


def make_protocol_middleware(api_key: str | None) -> Middleware:
    """Build the middleware for a server with (or without) a bearer ``api_key``."""
    expected = None if api_key is None else f"Bearer {api_key}".encode("utf-8", "surrogateescape")

    @web.middleware
    async def protocol_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        response: web.StreamResponse
        headers = request.headers
        if expected is not None and not hmac.compare_digest(
            headers.get(hdrs.AUTHORIZATION, "").encode("utf-8", "surrogateescape"), expected
        ):
            response = json_response(401, _UNAUTHORIZED)
        elif (version := headers.get(PROTOCOL_VERSION_HEADER)) is not None and not (
            protocol_compatible(PROTOCOL_VERSION, version)
        ):
            response = detail_response(
                426,
                f"client speaks rollout protocol {version} but this server speaks "
                f"{PROTOCOL_VERSION}; upgrade client and server together",
            )
        else:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                response = _from_http_exception(exc)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("Unhandled error serving %s %s", request.method, request.path)
                response = json_response(500, _INTERNAL_ERROR)
        if not response.prepared:
            response.headers[PROTOCOL_VERSION_HEADER] = PROTOCOL_VERSION
        return response

    return protocol_middleware
