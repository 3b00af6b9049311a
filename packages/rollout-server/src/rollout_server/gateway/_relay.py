"""The gateway's forwarding: a call to a route goes on to the route's model endpoint and
its answer comes back (:class:`Relay`; the behaviour is described in
:mod:`rollout_server.gateway._gateway`).

A whole answer is read (up to the capture limit) and handed to the call's
:class:`~rollout_server.gateway._draft.TurnDraft`; a server-sent-event stream is relayed
chunk by chunk and assembled on the way (:class:`~rollout_server.gateway._capture.StreamReader`);
an answer past the limit is relayed as it comes, unrecorded. An endpoint that cannot be
reached, or whose answer breaks off before any of it was passed on, gets the workflow a
``502`` with an OpenAI-style error body (:func:`gateway_error`); one that breaks off midway
has the workflow's connection cut (:func:`cut_off`).
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Final

import aiohttp
from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import HttpVersion11, RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

from rollout_types import TurnFlag

from .._logtext import get_logger
from ._capture import StreamReader as AnswerStreamReader
from ._draft import RouteState, TurnDraft, public_url

__all__ = ["Relay", "cut_off", "gateway_error"]

logger: Final = get_logger("rollout_server.gateway")

_HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "accept-encoding",
    }
)
"""Request headers that stay at the gateway."""

_RESPONSE_DROPPED: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "content-encoding",
        "date",
        "server",
    }
)
"""Answer headers the gateway sets itself (the body it sends is decoded)."""

_READ_CHUNK: Final = 64 * 1024

MAX_BODY_BYTES: Final = 1024**3
"""Largest request body a call may send, in bytes (1 GiB; larger ones get ``413``)."""

_TOKEN: Final = re.compile(r"[^{}/]+")
"""What a route token may be (aiohttp's pattern of a ``{token}`` path segment)."""


async def _expect(request: web.BaseRequest) -> None:
    """Answer an ``Expect`` header as aiohttp's router does: ``100 Continue`` to
    ``100-continue`` over HTTP/1.1, ``417`` to anything else."""
    expect = request.headers.get(hdrs.EXPECT, "")
    if request.version != HttpVersion11:
        return
    if expect.lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the body has not started


def gateway_error(status: int, message: str, code: str) -> web.Response:
    """An OpenAI-style error answer of the gateway itself (``type`` ``gateway_error``)."""
    body = {"error": {"message": message, "type": "gateway_error", "param": None, "code": code}}
    return web.json_response(body, status=status)


class Relay:
    """Forwards the calls of the open routes (``routes``, by token) to their endpoints.

    Args:
        routes: The open routes by token; the gateway adds and removes them.
        max_capture_bytes: Largest answer recorded, bytes.
        ask_tokens: Ask for token ids and logprobs when the workflow did not.
    """

    def __init__(
        self, *, routes: dict[str, RouteState], max_capture_bytes: int, ask_tokens: bool
    ) -> None:
        self._routes = routes
        self._max_capture_bytes = max_capture_bytes
        self._ask_tokens = ask_tokens
        self.session: aiohttp.ClientSession | None = None
        """The connection pool to the endpoints while the gateway runs, else None."""

    def make_request(
        self,
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        """The request object of one call (``web.Server``'s ``request_factory``): a bare
        :class:`~aiohttp.web.BaseRequest` whose body may be as large as
        :data:`MAX_BODY_BYTES`."""
        return web.BaseRequest(
            message,
            payload,
            protocol,
            writer,
            task,
            task.get_loop(),
            client_max_size=MAX_BODY_BYTES,
        )

    async def forward(self, request: web.BaseRequest) -> web.StreamResponse:
        """Forward one call through its route: the gateway's one handler, on a bare
        ``web.Server`` (no application, router or middleware between the connection and
        here). ``/r/<token>/<tail>`` is read from the decoded path, as a route
        ``/r/{token}/{tail:.*}`` would; any other path gets aiohttp's plain 404."""
        token, slash, tail = request.path[3:].partition("/")
        if not (request.path.startswith("/r/") and slash and token) or not _TOKEN.fullmatch(token):
            return web.Response(status=404, text="404: Not Found")
        if request.headers.get(hdrs.EXPECT):
            await _expect(request)
            await request.writer.drain()
        state = self._routes.get(token)
        if state is None:
            return gateway_error(
                404,
                "model gateway: no such route (the rollout has finished, or the URL is wrong)",
                "route_not_found",
            )
        session = self.session
        if session is None:  # stopping
            return gateway_error(503, "model gateway: shutting down", "gateway_stopping")
        if not state.endpoint:
            return gateway_error(
                502,
                "model gateway: the rollout has no chat_completions_url to forward to",
                "no_endpoint",
            )
        url = f"{state.endpoint}/{tail}"
        if request.query_string:
            url += f"?{request.query_string}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        body = await request.read()
        if request.method != "POST" or not tail.rstrip("/").endswith("chat/completions"):
            return await self._send(request, session, url, headers=headers, body=body, turn=None)
        index = state.calls
        state.calls += 1
        turn = TurnDraft(state=state, index=index, started=time.monotonic())
        body = turn.read_request(body, ask_tokens=self._ask_tokens)
        try:
            return await self._send(request, session, url, headers=headers, body=body, turn=turn)
        except asyncio.CancelledError:
            turn.parts.flag(TurnFlag.CANCELLED)
            raise
        finally:
            turn.record()

    async def _send(
        self,
        request: web.BaseRequest,
        session: aiohttp.ClientSession,
        url: str,
        *,
        headers: dict[str, str],
        body: bytes,
        turn: TurnDraft | None,
    ) -> web.StreamResponse:
        try:
            upstream = await session.request(
                request.method, url, data=body, headers=headers, allow_redirects=False
            )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if turn is not None:
                turn.parts.flag(TurnFlag.UNREACHABLE)
            return gateway_error(
                502,
                f"model gateway: cannot reach the model endpoint {public_url(url)}: {exc!r}",
                "upstream_unreachable",
            )
        async with upstream:
            if turn is not None:
                turn.status_code = upstream.status
            out_headers = {
                k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_DROPPED
            }
            # The media type read straight from the header (aiohttp's content_type parses
            # every parameter of it, for each answer).
            media = upstream.headers.get(hdrs.CONTENT_TYPE, "").partition(";")[0]
            streamed = media.strip().lower() == "text/event-stream"
            if streamed and upstream.status < 400:
                return await self._pipe(request, upstream, out_headers, turn)
            return await self._buffer(request, upstream, out_headers, turn)

    async def _buffer(
        self,
        request: web.BaseRequest,
        upstream: aiohttp.ClientResponse,
        headers: dict[str, str],
        turn: TurnDraft | None,
    ) -> web.StreamResponse:
        """A whole answer, read up to the capture limit; past it, relayed as it comes."""
        limit = self._max_capture_bytes
        chunks: list[bytes] = []
        size = 0
        try:
            length = upstream.content_length
            if length is not None and length <= limit:  # the common case: one read
                data = await upstream.read()
                if turn is not None:
                    turn.answer(upstream.status, data)
                return web.Response(body=data, status=upstream.status, headers=headers)
            async for chunk in upstream.content.iter_chunked(_READ_CHUNK):
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    break
            else:
                data = b"".join(chunks)
                if turn is not None:
                    turn.answer(upstream.status, data)
                return web.Response(body=data, status=upstream.status, headers=headers)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if turn is not None:
                turn.parts.flag(TurnFlag.DISCONNECTED)
            return gateway_error(
                502,
                f"model gateway: the model endpoint's answer broke off: {exc!r}",
                "upstream_disconnected",
            )
        # Too large to record: relay it as it comes.
        if turn is not None:
            turn.parts.flag(TurnFlag.TOO_LARGE)
            if upstream.status >= 400:
                turn.parts.flag(TurnFlag.UPSTREAM_ERROR)
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        try:
            await response.write(b"".join(chunks))
            chunks.clear()
            async for chunk in upstream.content.iter_chunked(_READ_CHUNK):
                await response.write(chunk)
        except (aiohttp.ClientError, TimeoutError) as exc:
            if turn is not None:
                turn.parts.flag(TurnFlag.DISCONNECTED)
                turn.record()  # before the cut (see _pipe)
            return cut_off(request, response, exc)
        except ConnectionError:
            if turn is not None:
                turn.parts.flag(TurnFlag.CANCELLED)
            return response
        await response.write_eof()
        return response

    async def _pipe(
        self,
        request: web.BaseRequest,
        upstream: aiohttp.ClientResponse,
        headers: dict[str, str],
        turn: TurnDraft | None,
    ) -> web.StreamResponse:
        """A server-sent-event stream, relayed chunk by chunk (and assembled on the way)."""
        reader = AnswerStreamReader(self._max_capture_bytes) if turn is not None else None
        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        broken = False
        try:
            try:
                async for chunk in upstream.content.iter_any():
                    if reader is not None:
                        reader.feed(chunk)
                    await response.write(chunk)
            except (aiohttp.ClientError, TimeoutError) as exc:
                broken = True
                if reader is not None and turn is not None:
                    # Recorded before the workflow's connection is cut, so a workflow
                    # that sees the cut finds the turn.
                    turn.merge(reader.finish(broken=True))
                    turn.record()
                    reader = None
                return cut_off(request, response, exc)
            except ConnectionError:  # the workflow went away
                if turn is not None:
                    turn.parts.flag(TurnFlag.CANCELLED)
                return response
            await response.write_eof()
            return response
        finally:
            if reader is not None and turn is not None:
                turn.merge(reader.finish(broken=broken))


def cut_off(
    request: web.BaseRequest, response: web.StreamResponse, exc: BaseException
) -> web.StreamResponse:
    """Break the workflow's connection, as the endpoint broke the gateway's."""
    logger.debug("Model endpoint answer broke off for %s: %r", request.path, exc)
    transport = request.transport
    if transport is not None:
        transport.close()
    response.force_close()
    return response
