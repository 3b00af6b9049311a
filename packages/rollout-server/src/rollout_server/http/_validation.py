"""The 422 errors the routes build themselves, beyond what the converter reports.

Each is a :class:`~rollout_types.WireValidationError` whose entries have the shape of
osmosis-ai's (pydantic's) 422 ``detail``: a missing or empty request header, a body nested
deeper than the interpreter can walk, a ``rollout_id`` no URL can carry, or one whose
result URL would not fit the server's request line. Only the server builds these, so they
live here rather than in ``rollout_types``.
"""

from __future__ import annotations

from typing import Any, Final
from urllib.parse import quote

from rollout_types import REDACTED, WireValidationError

__all__ = [
    "MAX_POLLABLE_ID_CHARS",
    "MAX_REQUEST_LINE_BYTES",
    "header_error",
    "too_deep_error",
    "unencodable_id_error",
    "unpollable_id_error",
]

MAX_REQUEST_LINE_BYTES: Final = 8190
"""The server's limit on a request line and on each header line, in bytes (aiohttp's
default, set explicitly so that admission can check ids against it)."""

_RESULT_LINE: Final = "GET /rollout/{}/result HTTP/1.1"

MAX_POLLABLE_ID_CHARS: Final = MAX_REQUEST_LINE_BYTES - len(_RESULT_LINE.format(""))
"""The longest ``rollout_id``, in characters once percent-encoded (UTF-8, every byte but
letters, digits and ``-._~`` as ``%XX``), whose result poll fits the request line: 8161."""


def header_error(name: str, value: str | None) -> WireValidationError:
    """Build the 422 for a missing (``None``) or empty required request header ``name``."""
    if value is None:
        entry: dict[str, Any] = {
            "type": "missing",
            "loc": ["header", name],
            "msg": "Field required",
            "input": None,
        }
    else:
        entry = {
            "type": "string_too_short",
            "loc": ["header", name],
            "msg": "String should have at least 1 character",
            "input": REDACTED if value else value,
            "ctx": {"min_length": 1},
        }
    return WireValidationError([entry])


TURNS_UNAVAILABLE_MESSAGE: Final = (
    "Value error, this server captures no model turns, so it cannot return them: start it "
    "with --gateway (create_rollout_server(model_gateway=...)), or drop return_turns"
)


def turns_unavailable_error() -> WireValidationError:
    """Build the 422 for ``return_turns: true`` sent to a server without a model gateway
    (refused rather than answered without turns, which a trainer could not tell apart from
    a rollout that made no model call)."""
    return WireValidationError(
        [
            {
                "type": "value_error",
                "loc": ["body", "return_turns"],
                "msg": TURNS_UNAVAILABLE_MESSAGE,
                "input": True,
                "ctx": {"error": {}},
            }
        ]
    )


def too_deep_error() -> WireValidationError:
    """Build the 422 for a JSON body nested deeper than the interpreter can decode or walk
    (refused like any undecodable body)."""
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


def unpollable_id_error(rollout_id: str) -> WireValidationError | None:
    """Build the 422 for a ``rollout_id`` too long to be polled, or None if it fits.

    Its result poll ``GET /rollout/{id}/result``, with the id percent-encoded as clients
    do (UTF-8, every byte but ``A-Za-z0-9-._~`` as ``%XX``), must fit the request line
    (:data:`MAX_REQUEST_LINE_BYTES`); otherwise every poll would get a 400 and the result
    would be lost, so admission refuses the id instead.
    """
    if len(rollout_id) * 12 <= MAX_POLLABLE_ID_CHARS:  # at most 4 UTF-8 bytes of 3 chars
        return None
    encoded = len(quote(rollout_id, safe=""))
    if encoded <= MAX_POLLABLE_ID_CHARS:
        return None
    return WireValidationError(
        [
            {
                "type": "value_error",
                "loc": ["body", "rollout_id"],
                "msg": (
                    f"Value error, rollout_id is too long to be polled: percent-encoded it is "
                    f"{encoded} characters, and GET /rollout/{{rollout_id}}/result must fit "
                    f"this server's request line limit of {MAX_REQUEST_LINE_BYTES} bytes, "
                    f"which allows at most {MAX_POLLABLE_ID_CHARS}; use a shorter id"
                ),
                "input": rollout_id,
                "ctx": {"error": {}},
            }
        ]
    )


def unencodable_id_error(rollout_id: str) -> WireValidationError:
    """Build the 422 for a ``rollout_id`` holding a lone surrogate (a ``\\ud800``-``\\udfff``
    escape in the request), which no URL can carry."""
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
