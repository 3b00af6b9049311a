"""What the server does with each HTTP connection, below the routes.

aiohttp answers a request it cannot parse by itself, before any middleware runs: a
``text/plain`` 400 that quotes the offending bytes (an ``Authorization`` header, the rest
of a body longer than its ``Content-Length``), logged at ERROR with a traceback. And it
leaves a connection that sent half a request's headers open for the whole keep-alive.
:class:`GuardedRequestHandler`, the protocol of every connection of a rollout app
(installed by :func:`~rollout_server.http._aiohttp_private.install_request_handler`), changes
that:

* a request aiohttp cannot parse gets ``400 {"detail": "bad HTTP request: ..."}`` with the
  protocol header, closing the connection; the text names what was wrong, never the bytes;
* such refusals, and request bodies that break off or cannot be decoded, are logged at
  WARNING without request bytes, at most one line per :data:`PEER_ERROR_LOG_INTERVAL_SEC`
  (the next line counts those left out); each one also at DEBUG;
* once a request's first bytes arrive, its headers must be complete within
  ``header_read_timeout_sec``, or the connection is closed. An idle connection (no bytes
  of a next request) keeps the keep-alive, and a request being handled (a long poll) is
  never cut: the timer covers only headers being received. Bytes of a next request that
  arrive together with the end of the one before are not timed (such a connection holds
  no more than an idle one).

The body's own bound (``body_read_timeout_sec``) is the routes' business: only they read
bodies (see :mod:`rollout_server.http._routes`); a response that closes the connection while
the body is still arriving (their 408, their 400) closes it at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Final

from aiohttp import StreamReader, web
from aiohttp.http_exceptions import (
    BadStatusLine,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
)

from rollout_types import PROTOCOL_VERSION, PROTOCOL_VERSION_HEADER

from .._logtext import get_logger
from ..state._bodies import detail_body
from ._aiohttp_private import last_parsed_payload, parsed_count
from ._responses import json_response

__all__ = ["PEER_ERROR_LOG_INTERVAL_SEC", "ConnectionGuard", "GuardedRequestHandler"]

logger: Final = get_logger("rollout_server.http")

PEER_ERROR_LOG_INTERVAL_SEC: Final = 60.0
"""At most one WARNING per this many seconds about requests refused for the peer's own
errors (bad HTTP, broken bodies, headers never finished)."""

_INTERNAL_ERROR: Final = detail_body(
    "internal server error; the rollout server's log has the details"
)


def _describe(exc: BaseException | None, max_line_bytes: int) -> str:
    """What was wrong with a request aiohttp could not parse, without its bytes."""
    if isinstance(exc, LineTooLong):
        return (
            f"the request line or a header line is longer than this server's limit of "
            f"{max_line_bytes} bytes"
        )
    if isinstance(exc, BadStatusLine):
        return (
            "the request line is malformed (or this is not HTTP/1.1, such as TLS or HTTP/2 "
            "sent to a plain HTTP/1.1 port)"
        )
    if isinstance(exc, InvalidHeader):
        return "a header is malformed"
    if isinstance(exc, InvalidURLError):
        return "the request target (URL) is malformed"
    return (
        "the request is malformed (a control character in a header, bad framing, or bytes "
        "after a body shorter than its Content-Length)"
    )


def peer_error(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is the peer's fault: an HTTP
    parse error, a broken request body, a dropped connection."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, HttpProcessingError | web.RequestPayloadError | ConnectionError):
            return True
        exc = exc.__cause__
        seen += 1
    return False


class _Throttle:
    """At most one WARNING per interval; what it leaves out is counted in the next one
    (and logged at DEBUG)."""

    __slots__ = ("_clock", "_interval", "_left_out", "_quiet_until")

    def __init__(self, interval_sec: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval_sec
        self._clock = clock
        self._quiet_until: float | None = None
        self._left_out = 0

    def warn(self, what: str, peer: str | None) -> None:
        now = self._clock()
        if self._quiet_until is not None and now < self._quiet_until:
            self._left_out += 1
            logger.debug("%s (from %s)", what, peer)
            return
        left_out, self._left_out = self._left_out, 0
        self._quiet_until = now + self._interval
        if left_out:
            logger.warning(
                "%s (from %s); %d more such request(s) in the previous %.0f s were logged "
                "at DEBUG only",
                what,
                peer,
                left_out,
                self._interval,
            )
        else:
            logger.warning("%s (from %s)", what, peer)


class ConnectionGuard:
    """The connection policy of one app: error answers, peer-error logging, header timeout.

    Args:
        header_read_timeout_sec: Bound on receiving a request's headers once its first
            bytes arrived, seconds.
        max_line_bytes: The parser's limit on the request line and each header line
            (named in the 400 for a longer one), bytes.
        log_interval_sec: Least time between two WARNINGs about peer errors, seconds.
        on_refused: Told of each request refused before the routes, with the reason
            (``"bad_request"``: it could not be parsed; ``"header_timeout"``): the
            server's metrics; default None.
    """

    __slots__ = ("_on_refused", "_throttle", "header_read_timeout_sec", "max_line_bytes")

    def __init__(
        self,
        *,
        header_read_timeout_sec: float,
        max_line_bytes: int,
        log_interval_sec: float = PEER_ERROR_LOG_INTERVAL_SEC,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.header_read_timeout_sec = header_read_timeout_sec
        self.max_line_bytes = max_line_bytes
        self._throttle = _Throttle(log_interval_sec)
        self._on_refused = on_refused

    def handler(self, manager: web.Server, **kwargs: Any) -> GuardedRequestHandler:
        """Build the protocol of one connection (the factory for ``install_request_handler``)."""
        return GuardedRequestHandler(manager, guard=self, **kwargs)

    def peer_error(self, what: str, peer: str | None) -> None:
        """Log a request refused for the peer's fault (throttled; never request bytes)."""
        self._throttle.warn(what, peer)

    def refused(self, reason: str, what: str, peer: str | None) -> None:
        """A request refused before the routes, for ``reason``: logged as a peer error
        and counted (``on_refused``)."""
        self.peer_error(what, peer)
        if self._on_refused is not None:
            self._on_refused(reason)

    def error_response(
        self, request: web.BaseRequest, status: int, exc: BaseException | None
    ) -> web.StreamResponse:
        """The answer to a request aiohttp's handler code gave up on (status 400: it could
        not be parsed; 500 and others: an error escaped the app), logged; it closes the
        connection."""
        if status == 400 or peer_error(exc):
            what = _describe(exc, self.max_line_bytes)
            self.refused("bad_request", f"Refused a bad HTTP request: {what}", request.remote)
            body = detail_body(f"bad HTTP request: {what}")
            status = 400
        else:
            logger.error("Unhandled error serving a request", exc_info=exc)
            body = _INTERNAL_ERROR
        response = json_response(status, body, {PROTOCOL_VERSION_HEADER: PROTOCOL_VERSION})
        response.force_close()
        return response


class GuardedRequestHandler(web.RequestHandler):
    """aiohttp's connection protocol with the :class:`ConnectionGuard` policy of its app.

    Args:
        manager: The ``web.Server`` the connection belongs to.
        guard: The app's policy.
        kwargs: What ``web.RequestHandler`` takes (the runner's and app's handler args).
    """

    __slots__ = ("_guard", "_header_timer", "_payload")

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._header_timer: asyncio.TimerHandle | None = None
        self._payload: StreamReader | None = None

    def data_received(self, data: bytes) -> None:
        """Parse ``data``; time the headers of a request whose first bytes these are."""
        payload = self._payload
        awaiting_headers = payload is None or payload.is_eof()
        before = parsed_count(self)
        super().data_received(data)
        after = parsed_count(self)
        if before is None or after is None:
            return  # aiohttp keeps no queue we know: no header timeout (see the module)
        if after > before:
            self._payload = last_parsed_payload(self)
            self._stop_header_timer()
        elif data and awaiting_headers and self._header_timer is None:
            self._header_timer = asyncio.get_running_loop().call_later(
                self._guard.header_read_timeout_sec, self._on_header_timeout
            )

    def connection_lost(self, exc: BaseException | None) -> None:
        """Stop the header timer, then let aiohttp clean up."""
        self._stop_header_timer()
        self._payload = None
        super().connection_lost(exc)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Answer with a JSON error that never quotes the request (``message``, aiohttp's
        text, does), and close the connection."""
        if request.writer.output_size > 0:
            raise ConnectionError(
                "Response is sent already, cannot send another response with the error message"
            )
        return self._guard.error_response(request, status, exc)

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        """Send ``resp``; when it closes the connection while the request body is still
        arriving (a 408 or 400 for a body the app will not read), close at once instead
        of reading (lingering on) that body for up to 10 s more."""
        sent = await super().finish_response(request, resp, start_time)
        if not resp.keep_alive and not request.content.is_eof():
            self.force_close()
        return sent

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """Log an error of aiohttp's connection code: a peer's fault (a body that broke
        off or cannot be decoded) goes through the throttled WARNING without its text."""
        exc = kw.get("exc_info")
        if isinstance(exc, BaseException) and peer_error(exc):
            self._guard.peer_error(
                f"A request body could not be read ({type(exc).__name__})",
                _peer_host(self.transport),
            )
            return
        super().log_exception(*args, **kw)

    def _stop_header_timer(self) -> None:
        timer = self._header_timer
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport is None:
            return
        self._guard.refused(
            "header_timeout",
            "Closed a connection whose request headers did not arrive within "
            f"{self._guard.header_read_timeout_sec:g} s",
            _peer_host(self.transport),
        )
        self.force_close()


def _peer_host(transport: asyncio.BaseTransport | None) -> str | None:
    """The peer's address (host) of a connection's transport, None once it is gone.

    Read from the transport (asyncio's API): aiohttp 3.10 has no ``RequestHandler.peername``.
    """
    peername = None if transport is None else transport.get_extra_info("peername")
    if isinstance(peername, list | tuple) and peername:
        return str(peername[0])
    return None if peername is None else str(peername)
