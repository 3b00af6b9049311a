"""JSON responses of the protocol: every body is strict JSON, every error ``{"detail": ...}``."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from aiohttp import web

from rollout_types import dumps

__all__ = ["LONE_SURROGATE", "detail_response", "encode_json", "json_response"]

_JSON: Final = "application/json"
LONE_SURROGATE: Final = re.compile("[\ud800-\udfff]")
"""A lone surrogate: a code point with no UTF-8 form (only a ``\\uXXXX`` escape makes one)."""


def _escape_surrogate(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def encode_json(text: str) -> bytes:
    """UTF-8 bytes of an encoded JSON document.

    A lone surrogate (which only a JSON string escape such as ``"\\ud800"`` in a request
    can produce) has no UTF-8 form: it is written back as the same ``\\uXXXX`` escape, so
    the body stays valid JSON that decodes to the same value, instead of failing.
    """
    try:
        return text.encode()
    except UnicodeEncodeError:
        return LONE_SURROGATE.sub(_escape_surrogate, text).encode()


class _JsonResponse(web.Response):
    """A response that lets go of its body once the body is sent.

    aiohttp keeps a connection's last response until the next request on that connection
    is answered, so without this a result body (often many KiB) would live on while the
    connection idles in a keep-alive pool or carries the next long poll.
    """

    async def write_eof(self, data: bytes = b"") -> None:
        await super().write_eof(data)
        self.body = None  # the access log reads body_length, which write_eof has set


def json_response(
    status: int, body: bytes | str, headers: Mapping[str, str] | None = None
) -> web.Response:
    """A ``application/json`` response with an already encoded body."""
    if isinstance(body, str):
        body = encode_json(body)
    return _JsonResponse(status=status, body=body, content_type=_JSON, headers=headers)


def detail_response(
    status: int, detail: Any, headers: Mapping[str, str] | None = None
) -> web.Response:
    """An error response ``{"detail": detail}`` (a string, or a 422 list)."""
    return json_response(status, dumps({"detail": detail}), headers)
