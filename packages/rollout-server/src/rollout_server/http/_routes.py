"""The four protocol routes. Handlers stay thin: structure, call the server, unstructure.

* ``GET /health``: backend health plus identity, lifecycle and protocol version;
* ``POST /rollout``: 422 → 400 (pre-0.3.3 caller) → 503 → 429 → 409 → 202 (or 503
  when a durable state store cannot keep the admission);
* ``GET /rollout/{rollout_id}/result``: 422 → 404 → 403 → result, or renew and long-poll;
* ``POST /rollout/cancel``: exactly one selector, one disposition per selected id;
* ``GET /metrics``: the server's Prometheus metrics, unless they are turned off.

(401 and 426 come first, from the middleware.) A request body must arrive within
``body_read_timeout_sec`` (else 408, closing the connection); one that cannot be read (a
Content-Encoding that does not decode, broken chunked framing, a connection that breaks
off) gets 400, and one larger than ``max_body_bytes`` gets 413. With metrics or tracing on,
admissions are counted by answer (every status above, and 500) and traced (a span
continuing the caller's ``traceparent``).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Final, TypeVar

from aiohttp import hdrs, web
from aiohttp.http_exceptions import ContentEncodingError

from rollout_types import (
    LEASE_HEADER,
    PROTOCOL_VERSION,
    PROTOCOL_VERSION_HEADER,
    CancelRolloutsRequest,
    CancelRolloutsResponse,
    RolloutInitRequest,
    RolloutInitResponse,
    RolloutStatus,
    WireValidationError,
    loads,
    structure_wire,
)

from ..protocol._server import DEFAULT_RETRY_AFTER_SEC, Refusal, RolloutServer
from ..state._bodies import LONE_SURROGATE, detail_body, encode, progress_body
from ..state._record import RolloutRecord
from ..state._store import StoreWriteError
from ._aiohttp_private import pause_keepalive_timer
from ._middleware import internal_error_response, self_guarded
from ._responses import detail_response, json_response
from ._validation import (
    header_error,
    too_deep_error,
    turns_unavailable_error,
    unencodable_id_error,
    unpollable_id_error,
)

__all__ = ["Routes", "retry_after_header"]

SHUTTING_DOWN: Final = "rollout server is shutting down"
QUEUE_FULL: Final = "rollout queue is full; retry later"
DUPLICATE: Final = "rollout_id is already registered"
UNKNOWN_ID: Final = "unknown rollout_id"
BAD_LEASE: Final = "invalid polling lease"
ONE_SELECTOR: Final = "pass exactly one selector: ids, prefix, or all"
CALLBACK_PROTOCOL: Final = (
    "this request uses the pre-0.3.3 callback protocol (completion_callback_url); this "
    "rollout server speaks the pull protocol of osmosis-ai >= 0.3.3, which never calls "
    "back: upgrade the caller (client) and the rollout server together"
)

_T = TypeVar("_T")

RETRY_AFTER_BOUNDS_SEC: Final = (1.0, 60.0)

_SHUTTING_DOWN_BODY: Final = detail_body(SHUTTING_DOWN)
_QUEUE_FULL_BODY: Final = detail_body(QUEUE_FULL)
_DUPLICATE_BODY: Final = detail_body(DUPLICATE)
_UNKNOWN_ID_BODY: Final = detail_body(UNKNOWN_ID)
_BAD_LEASE_BODY: Final = detail_body(BAD_LEASE)
_ONE_SELECTOR_BODY: Final = detail_body(ONE_SELECTOR)
_CALLBACK_BODY: Final = detail_body(CALLBACK_PROTOCOL)
_REFUSAL_BODIES: Final = {
    Refusal.SHUTTING_DOWN: _SHUTTING_DOWN_BODY,
    Refusal.QUEUE_FULL: _QUEUE_FULL_BODY,
    Refusal.DUPLICATE: _DUPLICATE_BODY,
}
_UNDECODABLE_BODY: Final = detail_body(
    "the request body could not be decoded with its Content-Encoding; send it encoded as "
    "the header says, or without the header"
)
_BROKEN_BODY: Final = detail_body(
    "the request body could not be read: its chunked framing is broken, or the connection "
    "ended before Content-Length bytes arrived"
)


def retry_after_header(seconds: Any) -> str:
    """The ``Retry-After`` value for a backend's hint: whole seconds, clamped to [1, 60].

    A hint that is not a finite number gives the osmosis default of 5.
    """
    low, high = RETRY_AFTER_BOUNDS_SEC
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
    ):
        seconds = DEFAULT_RETRY_AFTER_SEC
    return str(math.ceil(min(max(float(seconds), low), high)))


class Routes:
    """The route handlers of one server, as bound methods (each callable on its own).

    A handler reads what it needs from the instance (no per-request lookup in the app);
    :meth:`table` is what :func:`~rollout_server.create_rollout_server` installs.

    Args:
        server: The server the handlers call.
    """

    __slots__ = (
        "_body_sec",
        "_max_body",
        "_metrics",
        "_registry",
        "_server",
        "_tracing",
        "_wait_sec",
        "_waits",
    )

    def __init__(self, server: RolloutServer) -> None:
        self._server = server
        self._registry = server.registry
        self._waits = server.registry.waits
        self._wait_sec = server.result_wait_timeout_sec
        self._max_body = server.max_body_bytes
        self._body_sec = server.body_read_timeout_sec
        self._metrics = server.metrics
        self._tracing = server.tracing

    def table(self) -> list[web.RouteDef]:
        """The route table: ``/health``, ``/rollout``, ``/rollout/{id}/result``,
        ``/rollout/cancel``, and ``/metrics`` when the server has metrics."""
        # The result handler answers its own failures (middleware.self_guarded); the bound
        # method marked is the one the route keeps, so the mark lives as long as the route.
        result = self_guarded(self.result)
        observed = self._metrics is not None or self._tracing is not None
        routes = [
            web.get("/health", self.health, allow_head=False),
            web.post("/rollout", self.observed_admit if observed else self.admit),
            web.get("/rollout/{rollout_id:[^/]+}/result", result, allow_head=False),
            web.post("/rollout/cancel", self.cancel),
        ]
        if self._metrics is not None:
            routes.append(web.get("/metrics", self.metrics, allow_head=False))
        return routes

    # -- handlers -------------------------------------------------------------------------

    async def health(self, _request: web.Request) -> web.Response:
        """``GET /health``."""
        return json_response(200, encode(self._server.health()))

    async def admit(self, request: web.Request) -> web.Response:
        """``POST /rollout``: 422 → 400 (pre-0.3.3 caller) → 503 → 429 → 409 → 202."""
        try:
            data = await self._read_json(request)
            if type(data) is dict and data.get("completion_callback_url") is not None:
                return json_response(400, _CALLBACK_BODY)
            init = _structure(data, RolloutInitRequest)
            if LONE_SURROGATE.search(init.rollout_id):
                raise unencodable_id_error(init.rollout_id)
            too_long = unpollable_id_error(init.rollout_id)
            if too_long is not None:
                raise too_long
            if init.return_turns and not self._server.captures_turns:
                raise turns_unavailable_error()
        except WireValidationError as exc:
            return detail_response(422, exc.errors)
        except _BodyError as exc:
            return exc.response
        except RecursionError:
            return detail_response(422, too_deep_error().errors)
        server = self._server
        try:
            token = await server.admit(init)
        except StoreWriteError as exc:
            return self._unstored(exc)
        if isinstance(token, Refusal):
            headers: dict[str, str] | None = None
            if token is Refusal.QUEUE_FULL:
                headers = {hdrs.RETRY_AFTER: retry_after_header(server.retry_after_sec())}
            return json_response(token.value, _REFUSAL_BODIES[token], headers)
        return json_response(
            202,
            encode(
                RolloutInitResponse(
                    rollout_id=init.rollout_id,
                    status=RolloutStatus.QUEUED,
                    polling_lease_token=token,
                    result_wait_timeout_sec=self._wait_sec,
                    polling_lease_timeout_sec=server.polling_lease_timeout_sec,
                )
            ),
        )

    async def observed_admit(self, request: web.Request) -> web.Response:
        """``POST /rollout`` counted by answer (metrics) and traced: a server span that
        continues the caller's trace, current while the rollout's task is created."""
        metrics = self._metrics
        tracing = self._tracing
        try:
            if tracing is None:
                response = await self.admit(request)
            else:
                with tracing.admission(request.headers) as answered:
                    response = await self.admit(request)
                    answered(response.status)
        except Exception:
            if metrics is not None:
                metrics.admission_answered(500)
            raise
        if metrics is not None:
            metrics.admission_answered(response.status)
        return response

    async def metrics(self, request: web.Request) -> web.Response:
        """``GET /metrics``: the Prometheus text format (OpenMetrics when asked for)."""
        metrics = self._metrics
        assert metrics is not None  # the route exists only with metrics
        body, content_type = metrics.exposition(request.headers.get(hdrs.ACCEPT))
        return web.Response(body=body, headers={hdrs.CONTENT_TYPE: content_type})

    # Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "The result route
    #   runs without a middleware frame ..."
    # Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "The connection's
    #   keep-alive timer is cancelled while a poll waits ..."
    async def result(self, request: web.Request) -> web.Response:
        """``GET /rollout/{rollout_id}/result``: 422 → 404 → 403 → the result, or renew the
        lease and long-poll.

        Self-guarded (see :func:`~rollout_server.http._middleware.self_guarded`): the middleware
        hands this coroutine to aiohttp as it is, so a waiting long poll holds no middleware
        frame (and no nested coroutine): this handler answers failures with 500 and sets
        the protocol header itself.
        """
        response: web.Response
        try:
            token = request.headers.get(LEASE_HEADER)
            found = self._lookup(request, token)
            if isinstance(found, web.Response):
                response = found
            else:
                assert token is not None
                # A lapsed lease is published by renew(); with a durable store it becomes
                # visible once stored, so the poll waits for that as for any result.
                waited = found.body is None and (self._registry.renew(found) or found.body is None)
                if waited:
                    waits = self._waits
                    wait = waits.begin(found, self._wait_sec)
                    if wait is not None:
                        pause_keepalive_timer(request)
                        try:
                            await wait
                        finally:
                            waits.end(found, wait)
                response = self._answer(found, token, waited)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - internal_error_response logs it
            response = internal_error_response(request)
        response.headers[PROTOCOL_VERSION_HEADER] = PROTOCOL_VERSION
        return response

    async def cancel(self, request: web.Request) -> web.Response:
        """``POST /rollout/cancel``: exactly one selector, one disposition per selected id."""
        try:
            selection = _structure(await self._read_json(request), CancelRolloutsRequest)
        except WireValidationError as exc:
            return detail_response(422, exc.errors)
        except _BodyError as exc:
            return exc.response
        except RecursionError:
            return detail_response(422, too_deep_error().errors)
        if selection.selector_count != 1:
            return json_response(422, _ONE_SELECTOR_BODY)
        dispositions = await self._server.cancel(selection)
        return json_response(200, encode(CancelRolloutsResponse(dispositions=dict(dispositions))))

    # -- helpers --------------------------------------------------------------------------

    async def _read_json(self, request: web.Request) -> Any:
        """Read and decode the body within ``body_read_timeout_sec``.

        Raises:
            _BodyError: With the answer, when the body is too large (413), late (408) or
                cannot be read (400).
        """
        length = request.content_length
        if length is not None and length > self._max_body:
            raise _BodyError(self._too_large())
        try:
            async with asyncio.timeout(self._body_sec):
                body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _BodyError(self._too_large()) from None
        except TimeoutError:
            raise _BodyError(self._too_slow()) from None
        except (web.RequestPayloadError, ConnectionError) as exc:
            undecodable = isinstance(exc.__cause__, ContentEncodingError)
            response = json_response(400, _UNDECODABLE_BODY if undecodable else _BROKEN_BODY)
            response.force_close()
            raise _BodyError(response) from None
        return loads(body)

    def _unstored(self, exc: StoreWriteError) -> web.Response:
        """503 for an admission the state store could not keep (nothing was admitted)."""
        return json_response(
            503,
            detail_body(
                f"the rollout was not admitted: the server could not store it ({exc.reason}); "
                "retry later (the operator must free disk space or fix the state file)"
            ),
            {hdrs.RETRY_AFTER: retry_after_header(self._server.retry_after_sec())},
        )

    def _too_large(self) -> web.Response:
        return detail_response(
            413,
            f"request body is larger than this server's limit of {self._max_body} bytes; send "
            "a smaller body, or start the server with a higher max_body_bytes "
            "(rollout-server serve --max-body-bytes)",
        )

    def _too_slow(self) -> web.Response:
        response = detail_response(
            408,
            f"the request body did not arrive within {self._body_sec:g} s; send it at once, "
            "or start the server with a higher body_read_timeout_sec "
            "(rollout-server serve --body-read-timeout-sec)",
        )
        response.force_close()
        return response

    def _lookup(self, request: web.Request, token: str | None) -> RolloutRecord | web.Response:
        """422 → 404 → 403, else the record the poll is for."""
        if not token:
            return detail_response(422, header_error(LEASE_HEADER, token).errors)
        record = self._registry.get(request.match_info["rollout_id"])
        if record is None:
            return json_response(404, _UNKNOWN_ID_BODY)
        if not record.check_token(token):
            return json_response(403, _BAD_LEASE_BODY)
        return record

    def _answer(self, record: RolloutRecord, token: str, waited: bool) -> web.Response:
        registry = self._registry
        # After a wait the record may have been removed, or replaced by a re-admission.
        if waited:
            current = registry.get(record.rollout_id)
            if current is None:
                return json_response(404, _UNKNOWN_ID_BODY)
            if current is not record:
                if not current.check_token(token):
                    return json_response(403, _BAD_LEASE_BODY)
                record = current
            if record.body is None:
                status = registry.deliver_status(record)
                return json_response(200, progress_body(record.rollout_id, status))
        body = record.body
        assert body is not None  # published: by now, or by the lapsed-lease check
        registry.mark_delivered(record)
        return json_response(200, body)


def _structure(read: Any, cls: type[_T]) -> _T:
    # A document nested deeper than the interpreter can decode or walk is refused like
    # any undecodable body.
    try:
        return structure_wire(read, cls)
    except RecursionError:
        raise too_deep_error() from None


class _BodyError(Exception):
    """The request body cannot be taken; ``response`` answers it (413, 408 or 400)."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response
