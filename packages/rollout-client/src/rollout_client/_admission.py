"""Admission (``POST /rollout``, wire protocol section 6.2): the request, checked as the
server would check it, one send, the admission deadline, the 429 loop under it, and the
answer. :class:`RolloutClient` admits through :func:`admit`; ``RolloutClientPool`` sends
single attempts to the server it picks, under the same deadline."""

from __future__ import annotations

import asyncio
import contextlib
import types
import typing
from collections.abc import AsyncIterator
from typing import Any, Final

import attrs

from rollout_types import (
    PROTOCOL_VERSION,
    RolloutInitRequest,
    RolloutInitResponse,
    WireValidationError,
    check_seconds,
    dumps,
    loads,
    structure_wire,
)

from ._errors import (
    UNAUTHORIZED_HINT,
    RolloutAdmissionTimeoutError,
    RolloutProtocolError,
    RolloutProtocolVersionError,
)
from ._retry import parse_retry_after
from ._settings import ClientSettings
from ._transport import HttpResponse, Transport

__all__ = [
    "SHUTTING_DOWN_DETAIL",
    "AdmissionAttempt",
    "admission_answer",
    "admission_deadline",
    "admit",
    "encode_request",
    "is_shutting_down",
    "rollout_request",
    "send_admission",
]

SHUTTING_DOWN_DETAIL: Final = "rollout server is shutting down"
"""The ``detail`` of the ``503`` a rollout server (ours, osmosis-ai >= 0.3.5) answers to
``POST /rollout`` once its shutdown has begun (wire-protocol section 4.2)."""

_MAY_HAVE_SUCCEEDED: Final = (
    "; admission may have succeeded; the server requests cancellation when an unobserved "
    "rollout's polling lease expires"
)
_CALLBACK_PROTOCOL_SERVER: Final = "0.3 (osmosis-ai <= 0.3.2 callback protocol)"

_ADMISSION_HINTS: Final = {
    401: UNAUTHORIZED_HINT,
    409: " (the rollout_id is already registered on the server: use a fresh id per attempt)",
    503: " (the server is shutting down and admits no new rollouts)",
}


def _json_types() -> dict[str, tuple[type, bool]]:
    """Each non-float field of :class:`RolloutInitRequest`: its runtime type and whether
    None is allowed, read from the model's annotations."""
    checked: dict[str, tuple[type, bool]] = {}
    hints = typing.get_type_hints(RolloutInitRequest)
    for field in attrs.fields(RolloutInitRequest):
        options = typing.get_args(hints[field.name]) if _is_union(hints[field.name]) else ()
        kinds = [kind for kind in options or (hints[field.name],) if kind is not type(None)]
        (kind,) = kinds
        runtime = typing.get_origin(kind) or kind
        if runtime is not float:
            checked[field.name] = (runtime, type(None) in options)
    return checked


def _is_union(hint: object) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


_FIELD_TYPES: Final = _json_types()
"""Type checks of the request fields (the timeouts are checked as durations)."""

_DURATIONS: Final = ("agent_timeout_sec", "grader_timeout_sec")


def rollout_request(**fields: Any) -> RolloutInitRequest:
    """The admission request built from the fields of :class:`RolloutInitRequest`, checked
    as the server would check it (spec section 3.2) before any I/O.

    Raises:
        TypeError: A field has the wrong type.
        ValueError: A timeout is not finite, or the wire model rejects a value.
    """
    for name, (expected, optional) in _FIELD_TYPES.items():
        if name not in fields:
            continue  # the model's default (a field a newer protocol added, for one)
        value = fields[name]
        if (value is None and optional) or isinstance(value, expected):
            continue
        raise TypeError(
            f"{name} must be {'None or ' if optional else ''}a {expected.__name__}; "
            f"got {type(value).__name__}"
        )
    for name in _DURATIONS:
        seconds = fields.get(name)
        if seconds is not None:
            check_seconds(name, seconds, allow_negative=True)
    return RolloutInitRequest(**fields)


def encode_request(request: RolloutInitRequest) -> bytes:
    """The admission body as JSON bytes.

    Raises:
        ValueError: A value is not finite JSON.
    """
    try:
        return dumps(request).encode()
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"the request for rollout {request.rollout_id!r} is not valid JSON: {exc}; "
            "messages, metadata and extra_fields must hold finite JSON values only"
        ) from exc


async def send_admission(
    transport: Transport, settings: ClientSettings, body: bytes
) -> tuple[HttpResponse, float]:
    """One ``POST /rollout``, each read bounded by ``settings.admission_read_timeout_sec``.

    Returns:
        The answer, whatever its status, and the send time (on ``settings.clock``).

    Raises:
        aiohttp.ClientError: The POST failed on a transport error.
    """
    sent_at = settings.clock()
    read_sec = settings.admission_read_timeout_sec
    response = await transport.send(
        "POST",
        transport.url("rollout"),
        body=body,
        timeout=settings.timeout(read_sec=read_sec, pool_sec=read_sec),
    )
    return response, sent_at


class AdmissionAttempt:
    """Whether a ``POST /rollout`` is on its way: set it around each send, so that an
    expired deadline can say whether the rollout may have been admitted."""

    def __init__(self) -> None:
        self.in_flight = False


@contextlib.asynccontextmanager
async def admission_deadline(
    rollout_id: str, timeout_sec: float | None
) -> AsyncIterator[AdmissionAttempt]:
    """Bound the admission inside the ``async with`` to ``timeout_sec``.

    Args:
        rollout_id: The rollout being admitted (named in the error).
        timeout_sec: The admission deadline, seconds; None for none; <= 0 expires at once
            (before anything is sent).

    Yields:
        The attempt flag to set around each send.

    Raises:
        RolloutAdmissionTimeoutError: ``timeout_sec`` expired; ``may_have_succeeded`` is the
            attempt flag at that moment.
    """
    if timeout_sec is not None and timeout_sec <= 0:
        raise RolloutAdmissionTimeoutError(
            f"admission for rollout {rollout_id} timed out after {timeout_sec} seconds",
            rollout_id=rollout_id,
            may_have_succeeded=False,
        )
    loop = asyncio.get_running_loop()
    scope = asyncio.timeout_at(None if timeout_sec is None else loop.time() + timeout_sec)
    attempt = AdmissionAttempt()
    try:
        async with scope:
            yield attempt
    except TimeoutError as exc:
        if not scope.expired():
            raise
        raise RolloutAdmissionTimeoutError(
            f"admission for rollout {rollout_id} timed out after {timeout_sec} seconds"
            + (_MAY_HAVE_SUCCEEDED if attempt.in_flight else ""),
            rollout_id=rollout_id,
            may_have_succeeded=attempt.in_flight,
        ) from exc


async def admit(
    transport: Transport,
    settings: ClientSettings,
    *,
    rollout_id: str,
    body: bytes,
    timeout_sec: float | None,
) -> tuple[RolloutInitResponse, float]:
    """POST the admission, retrying 429s, within the admission deadline.

    Args:
        transport: Where to send it.
        settings: The 429 backoff (``settings.retry``), the sleep, the clock and the read
            bound.
        rollout_id: The rollout's id (also in ``body``).
        body: The encoded :class:`RolloutInitRequest`.
        timeout_sec: The admission deadline, seconds; None for none; <= 0 expires at once.

    Returns:
        The 202 answer and the send time (on ``settings.clock``) of the request it answered.

    Raises:
        RolloutAdmissionTimeoutError: ``timeout_sec`` expired.
        RolloutProtocolVersionError: The server speaks an incompatible protocol version.
        RolloutProtocolError: Any status but 202 and 429, or an invalid 202 body.
        aiohttp.ClientError: The POST failed on a transport error (never retried).
    """
    async with admission_deadline(rollout_id, timeout_sec) as attempt:
        while True:
            attempt.in_flight = True
            response, sent_at = await send_admission(transport, settings, body)
            attempt.in_flight = False
            if response.status == 429:
                await settings.sleep(parse_retry_after(response.headers, settings.retry))
                continue
            return admission_answer(rollout_id, response), sent_at


def admission_answer(rollout_id: str, response: HttpResponse) -> RolloutInitResponse:
    """Accept a 202 with a valid body for ``rollout_id``; raise for anything else."""
    status = response.status
    if status == 202:
        try:
            admitted = structure_wire(loads(response.body), RolloutInitResponse)
        except WireValidationError as exc:
            raise RolloutProtocolError(
                f"POST /rollout returned an invalid response: {exc}", status_code=202
            ) from exc
        if admitted.rollout_id != rollout_id:
            raise RolloutProtocolError(
                f"POST /rollout returned a different rollout_id ({admitted.rollout_id!r} "
                f"instead of {rollout_id!r})",
                status_code=202,
            )
        return admitted
    if status == 422 and _is_callback_protocol_rejection(response.body):
        raise RolloutProtocolVersionError(
            "the rollout server speaks the pre-0.3.3 callback protocol (osmosis-ai <= 0.3.2, "
            "it requires completion_callback_url) and is too old for this client, which "
            f"speaks the pull protocol (rollout protocol {PROTOCOL_VERSION}); upgrade the "
            "client and the server together",
            status_code=422,
            client_version=PROTOCOL_VERSION,
            server_version=_CALLBACK_PROTOCOL_SERVER,
        )
    raise RolloutProtocolError(
        f"POST /rollout returned {status}; only 202 and 429 are accepted"
        + _ADMISSION_HINTS.get(status, "")
        + response.detail_suffix(),
        status_code=status,
    )


def is_shutting_down(response: HttpResponse) -> bool:
    """Whether an admission answer is a rollout server's ``503`` "shutting down" (its
    ``detail`` is :data:`SHUTTING_DOWN_DETAIL`), not a gateway's ``503``."""
    if response.status != 503:
        return False
    try:
        detail = loads(response.body).get("detail")
    except (WireValidationError, AttributeError):
        return False
    return bool(detail == SHUTTING_DOWN_DETAIL)


def _is_callback_protocol_rejection(body: bytes) -> bool:
    """Whether a 422 is an osmosis-ai <= 0.3.2 server missing ``completion_callback_url``."""
    try:
        detail = loads(body).get("detail")
    except (WireValidationError, AttributeError):
        return False
    return isinstance(detail, list) and any(
        isinstance(entry, dict) and entry.get("loc") == ["body", "completion_callback_url"]
        for entry in detail
    )
