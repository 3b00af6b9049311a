"""The four protocol routes. Handlers stay thin: structure, call the server, unstructure.

* ``GET /health``: backend health plus identity, lifecycle and protocol version;
* ``POST /rollout``: 422 → 400 (pre-0.3.3 caller) → 503 → 429 → 409 → 202;
* ``GET /rollout/{rollout_id}/result``: 422 → 404 → 403 → result, or renew and long-poll;
* ``POST /rollout/cancel``: exactly one selector, one disposition per selected id.

(401 and 426 come first, from the middleware.)
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any, Final, TypeVar

from aiohttp import hdrs, web

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
    dumps,
    header_error,
    loads,
    structure_wire,
)

from ._middleware import internal_error_response, self_guarded
from ._registry import RolloutRecord
from ._responses import LONE_SURROGATE, detail_response, encode_json, json_response

if TYPE_CHECKING:
    from ._app import RolloutServer

__all__ = ["build_routes"]

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

DEFAULT_RETRY_AFTER_SEC: Final = 5.0
RETRY_AFTER_BOUNDS_SEC: Final = (1.0, 60.0)


def _bytes(detail: str) -> bytes:
    return encode_json(dumps({"detail": detail}))


_SHUTTING_DOWN_BODY: Final = _bytes(SHUTTING_DOWN)
_QUEUE_FULL_BODY: Final = _bytes(QUEUE_FULL)
_DUPLICATE_BODY: Final = _bytes(DUPLICATE)
_UNKNOWN_ID_BODY: Final = _bytes(UNKNOWN_ID)
_BAD_LEASE_BODY: Final = _bytes(BAD_LEASE)
_ONE_SELECTOR_BODY: Final = _bytes(ONE_SELECTOR)
_CALLBACK_BODY: Final = _bytes(CALLBACK_PROTOCOL)


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


def pause_keepalive_timer(request: web.Request) -> None:
    """Drop the idle keep-alive timer of the connection ``request`` came on.

    aiohttp arms that timer when a connection opens and keeps it through a request it is
    handling, though it only ever closes idle connections; it re-arms it once the response
    is sent. A long poll holds its connection busy for up to ``result_wait_timeout_sec``,
    so dropping the timer meanwhile changes nothing but saves a loop timer (about half a
    kilobyte) per waiting poll. A no-op where aiohttp keeps no such timer.
    """
    protocol = request.protocol
    handle = getattr(protocol, "_keepalive_handle", None)
    if handle is not None and callable(getattr(handle, "cancel", None)):
        handle.cancel()
        protocol._keepalive_handle = None


def build_routes(server: RolloutServer) -> list[web.RouteDef]:
    """The route table of ``server``; handlers close over it (no per-request lookups)."""
    registry = server.registry
    backend = server.backend
    wait_sec = server.result_wait_timeout_sec
    max_body = server.max_body_bytes

    def too_large() -> web.Response:
        return detail_response(
            413,
            f"request body is larger than this server's limit of {max_body} bytes; send a "
            "smaller body, or start the server with a higher max_body_bytes "
            "(rollout-server serve --max-body-bytes)",
        )

    async def read_json(request: web.Request) -> Any:
        length = request.content_length
        if length is not None and length > max_body:
            raise _TooLargeError
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _TooLargeError from None
        return loads(body)

    def structure(read: Any, cls: type[_T]) -> _T:
        # A document nested deeper than the interpreter can decode or walk is refused
        # like any undecodable body.
        try:
            return structure_wire(read, cls)
        except RecursionError:
            raise _too_deep() from None

    async def health(_request: web.Request) -> web.Response:
        return json_response(200, dumps(server.health()))

    async def admit(request: web.Request) -> web.Response:
        try:
            data = await read_json(request)
            if type(data) is dict and data.get("completion_callback_url") is not None:
                return json_response(400, _CALLBACK_BODY)
            init = structure(data, RolloutInitRequest)
            if LONE_SURROGATE.search(init.rollout_id):
                raise _unencodable_id(init.rollout_id)
        except WireValidationError as exc:
            return detail_response(422, exc.errors)
        except _TooLargeError:
            return too_large()
        except RecursionError:
            return detail_response(422, _too_deep().errors)
        if not server.accepting_rollouts:
            return json_response(503, _SHUTTING_DOWN_BODY)
        if not backend.has_capacity():
            return json_response(
                429,
                _QUEUE_FULL_BODY,
                {hdrs.RETRY_AFTER: retry_after_header(server.retry_after_sec())},
            )
        if init.rollout_id in registry:
            return json_response(409, _DUPLICATE_BODY)
        token = server.admit(init)
        return json_response(
            202,
            dumps(
                RolloutInitResponse(
                    rollout_id=init.rollout_id,
                    status=RolloutStatus.QUEUED,
                    polling_lease_token=token,
                    result_wait_timeout_sec=wait_sec,
                    polling_lease_timeout_sec=server.polling_lease_timeout_sec,
                )
            ),
        )

    def lookup(request: web.Request, token: str | None) -> RolloutRecord | web.Response:
        # 422 → 404 → 403, else the record the poll is for.
        if not token:
            return detail_response(422, header_error(LEASE_HEADER, token).errors)
        record = registry.get(request.match_info["rollout_id"])
        if record is None:
            return json_response(404, _UNKNOWN_ID_BODY)
        if not record.check_token(token):
            return json_response(403, _BAD_LEASE_BODY)
        return record

    def answer(record: RolloutRecord, token: str, waited: bool) -> web.Response:
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
                return json_response(200, record.progress_body())
        body = record.body
        assert body is not None  # published: by now, or by the lapsed-lease check
        registry.mark_delivered(record)
        return json_response(200, body)

    @self_guarded
    async def result(request: web.Request) -> web.Response:
        # Self-guarded (see middleware.self_guarded): the middleware hands this coroutine
        # to aiohttp as it is, so a waiting long poll holds no middleware frame (and no
        # nested coroutine): this handler answers failures with 500 and sets the protocol
        # header itself.
        response: web.Response
        try:
            token = request.headers.get(LEASE_HEADER)
            found = lookup(request, token)
            if isinstance(found, web.Response):
                response = found
            else:
                assert token is not None
                waited = found.body is None and registry.renew(found)
                if waited:
                    wait = registry.begin_wait(found, found.status, wait_sec)
                    if wait is not None:
                        pause_keepalive_timer(request)
                        try:
                            await wait
                        finally:
                            registry.end_wait(found, wait)
                response = answer(found, token, waited)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - internal_error_response logs it
            response = internal_error_response(request)
        response.headers[PROTOCOL_VERSION_HEADER] = PROTOCOL_VERSION
        return response

    async def cancel(request: web.Request) -> web.Response:
        try:
            selection = structure(await read_json(request), CancelRolloutsRequest)
        except WireValidationError as exc:
            return detail_response(422, exc.errors)
        except _TooLargeError:
            return too_large()
        except RecursionError:
            return detail_response(422, _too_deep().errors)
        if selection.selector_count != 1:
            return json_response(422, _ONE_SELECTOR_BODY)
        dispositions = await server.cancel(selection)
        return json_response(200, dumps(CancelRolloutsResponse(dispositions=dict(dispositions))))

    return [
        web.get("/health", health, allow_head=False),
        web.post("/rollout", admit),
        web.get("/rollout/{rollout_id:[^/]+}/result", result, allow_head=False),
        web.post("/rollout/cancel", cancel),
    ]


def _too_deep() -> WireValidationError:
    return WireValidationError(
        [
            {
                "type": "json_invalid",
                "loc": ["body", 0],
                "msg": "JSON decode error",
                "input": {},
                "ctx": {"error": "JSON document nested too deeply"},
            }
        ]
    )


def _unencodable_id(rollout_id: str) -> WireValidationError:
    return WireValidationError(
        [
            {
                "type": "value_error",
                "loc": ["body", "rollout_id"],
                "msg": (
                    "Value error, rollout_id must be valid Unicode: it holds a lone surrogate "
                    "(a \\ud800-\\udfff escape), which no URL can carry"
                ),
                "input": rollout_id,
                "ctx": {"error": {}},
            }
        ]
    )


class _TooLargeError(Exception):
    """The request body exceeds the server's ``max_body_bytes`` (answered with 413)."""
