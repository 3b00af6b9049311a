"""JSON responses of the protocol: every body is strict JSON, every error ``{"detail": ...}``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from rollout_types import dumps

__all__ = ["detail_response", "json_response"]

_JSON = "application/json"


def json_response(
    status: int, body: bytes | str, headers: Mapping[str, str] | None = None
) -> web.Response:
    """A ``application/json`` response with an already encoded body."""
    if isinstance(body, str):
        body = body.encode()
    return web.Response(status=status, body=body, content_type=_JSON, headers=headers)


def detail_response(
    status: int, detail: Any, headers: Mapping[str, str] | None = None
) -> web.Response:
    """An error response ``{"detail": detail}`` (a string, or a 422 list)."""
    return json_response(status, dumps({"detail": detail}), headers)
