"""JSON responses of the protocol: every body is strict JSON, every error ``{"detail": ...}``.

The bodies come from :mod:`rollout_server.state._bodies`; this module only wraps them in aiohttp
responses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from aiohttp import web

from ..state._bodies import detail_body

__all__ = ["detail_response", "json_response"]

_JSON: Final = "application/json"


class _JsonResponse(web.Response):
    """A response that lets go of its body once the body is sent.

    aiohttp keeps a connection's last response until the next request on that connection
    is answered, so without this a result body (often many KiB) would live on while the
    connection idles in a keep-alive pool or carries the next long poll.
    """

    # Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "Response bodies are
    #   let go once sent ..."
    async def write_eof(self, data: bytes = b"") -> None:
        await super().write_eof(data)
        self.body = None  # the access log reads body_length, which write_eof has set


# Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "Response bodies are let
#   go once sent ..."
def json_response(
    status: int, body: bytes, headers: Mapping[str, str] | None = None
) -> web.Response:
    """A ``application/json`` response with an already encoded body."""
    return _JsonResponse(status=status, body=body, content_type=_JSON, headers=headers)


def detail_response(
    status: int, detail: Any, headers: Mapping[str, str] | None = None
) -> web.Response:
    """An error response ``{"detail": detail}`` (a string, or a 422 list)."""
    return json_response(status, detail_body(detail), headers)
