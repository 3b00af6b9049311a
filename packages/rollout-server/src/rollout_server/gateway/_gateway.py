""":class:`ModelGateway`: each rollout's OpenAI-compatible base URL, forwarding its model
calls to a model endpoint and capturing each chat completion as a turn.

The gateway is an aiohttp app on a listener of its own (``127.0.0.1`` and a free port by
default), apart from the rollout API: its routes need no server key, speak no rollout
protocol and are never polled by callers. Each rollout gets a route
``http://<host>:<port>/r/<token>`` (a random token, so the URL is the capability); a call to
``<route>/<path>`` is forwarded to ``<endpoint>/<path>``, where the endpoint is the
request's ``chat_completions_url``, or, when the gateway has endpoints of its own
(``--model-endpoint``), the one :class:`~rollout_server.gateway._ring.EndpointRing` picks
for the rollout's group (its ``group_id``, else the rollout itself).

Forwarding: method, query, body and headers go on as they came (but hop-by-hop headers,
``Host`` and ``Accept-Encoding``); the answer comes back with its status, headers and
body, streamed chunk by chunk when it is a server-sent-event stream. An HTTP error of the
endpoint is passed on unchanged. An endpoint that cannot be reached, or whose answer breaks
off before any of it was passed on, gets ``502`` with an OpenAI-style error body (``type``
``gateway_error``), which a workflow classifies as it would the endpoint's own 5xx; a
stream that breaks off midway is cut off the same way for the workflow.

Capture: a ``POST`` to a path ending in ``chat/completions`` is a turn. Unless the body
already says, the gateway asks for token ids and logprobs (``"logprobs": true``,
``"return_token_ids": true``: vLLM's names; SGLang accepts them too) when it was built
with ``request_token_ids=True`` (the default; turn it off for an endpoint that refuses
unknown fields). The turn records the request's messages, the answer
(:mod:`rollout_server.gateway._capture`), the status, the latency and the weights'
version, flagged (:class:`~rollout_types.TurnFlag`) where something is missing or broke:
a bad answer never fails the gateway, it is a flagged turn. Answers larger than
``max_capture_bytes`` pass on unrecorded (``too_large``).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import secrets
import time
from collections.abc import Sequence
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import attrs
from aiohttp import web

from rollout_types import RolloutTurn, TurnFlag

from .._errors import ServerConfigError
from .._logtext import get_logger
from ..execution._turns import ModelRoute, ModelRouter
from ._capture import AnswerParts, StreamReader, read_completion
from ._ring import DEFAULT_LOAD_FACTOR, EndpointRing

__all__ = ["DEFAULT_MAX_CAPTURE_BYTES", "ModelGateway"]

logger: Final = get_logger("rollout_server.gateway")

DEFAULT_MAX_CAPTURE_BYTES: Final = 32 * 1024 * 1024
"""Largest answer (or stream) the gateway records, in bytes (32 MiB); larger ones pass on
unrecorded."""

DEFAULT_CONNECT_TIMEOUT_SEC: Final = 10.0
"""Default bound on connecting to a model endpoint, in seconds."""

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

_TOKEN_KNOBS: Final = ("logprobs", "return_token_ids")
"""What the gateway asks for when the workflow did not (vLLM's names; SGLang reads them)."""


def _public_url(url: str) -> str:
    """``url`` without credentials (the ``endpoint`` a turn records)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit(parts._replace(netloc=netloc))


@attrs.define(kw_only=True, eq=False)
class _Route:
    """The gateway's state of one open route."""

    route: ModelRoute
    endpoint: str
    ring_key: str | None
    weight_version: str | None
    calls: int = 0


def _gateway_error(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "gateway_error", "param": None, "code": code}}
    return web.json_response(body, status=status)


class ModelGateway(ModelRouter):
    """The model gateway of a rollout server (module docstring).

    Give it to :func:`~rollout_server.create_rollout_server` (``model_gateway=``), which
    starts it with the app and stops it at cleanup; or start and stop it yourself.

    Args:
        endpoints: Model endpoints' base URLs (``http://host:8000/v1``) the gateway routes
            to by consistent hashing with bounded loads; default none: each rollout's
            calls go to its request's ``chat_completions_url``.
        host: Address the gateway listens on; default ``127.0.0.1`` (workflows run in this
            process). Bind another only on a trusted network: a route's URL is its only key.
        port: Port to listen on; default 0 (a free one).
        request_token_ids: Ask for token ids and logprobs on each chat completion when the
            workflow did not; default True.
        max_capture_bytes: Largest answer recorded, bytes; default 32 MiB.
        load_factor: Bound on an endpoint's load, as a multiple of the mean; > 1; default
            1.25.
        connect_timeout_sec: Bound on connecting to an endpoint, seconds; default 10.0.

    Raises:
        ServerConfigError: On an endpoint that is not an http(s) URL, a duplicate endpoint,
            or an out-of-range number.

    .. versionadded:: 0.3
    """

    def __init__(
        self,
        *,
        endpoints: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        request_token_ids: bool = True,
        max_capture_bytes: int = DEFAULT_MAX_CAPTURE_BYTES,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        connect_timeout_sec: float = DEFAULT_CONNECT_TIMEOUT_SEC,
    ) -> None:
        cleaned = []
        for endpoint in endpoints:
            given: object = endpoint
            scheme = urlsplit(endpoint).scheme if isinstance(given, str) else ""
            if scheme not in ("http", "https"):
                raise ServerConfigError(
                    f"model endpoint {endpoint!r} is not an http(s) URL (for example "
                    "http://127.0.0.1:8000/v1)"
                )
            cleaned.append(endpoint.rstrip("/"))
        try:
            self._ring = EndpointRing(cleaned, load_factor=load_factor) if cleaned else None
        except ValueError as exc:
            raise ServerConfigError(str(exc)) from None
        limit: object = max_capture_bytes
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ServerConfigError(
                f"max_capture_bytes must be a positive int; got {max_capture_bytes!r}"
            )
        given_port: object = port
        if not (isinstance(given_port, int) and 0 <= port <= 65535):
            raise ServerConfigError(f"port must be within [0, 65535]; got {port!r}")
        if not connect_timeout_sec > 0:
            raise ServerConfigError(f"connect_timeout_sec must be > 0; got {connect_timeout_sec!r}")
        self.endpoints: tuple[str, ...] = tuple(cleaned)
        self.host = host
        self.port = port
        self.request_token_ids = bool(request_token_ids)
        self.max_capture_bytes = max_capture_bytes
        self._connect_timeout_sec = float(connect_timeout_sec)
        self._routes: dict[str, _Route] = {}
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._url: str | None = None

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://<host>:<port>`` once started.

        Raises:
            RuntimeError: Before :meth:`start`.
        """
        if self._url is None:
            raise RuntimeError("the model gateway has not started: await gateway.start() first")
        return self._url

    @property
    def running(self) -> bool:
        """Whether the gateway is listening."""
        return self._runner is not None

    async def start(self) -> None:
        """Listen (and open the connection pool to the endpoints); idempotent."""
        if self._runner is not None:
            return
        app = web.Application(client_max_size=1024**3)
        app.router.add_route("*", "/r/{token}/{tail:.*}", self._forward)
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_sec),
            auto_decompress=True,
        )
        self._runner = runner
        host, port = runner.addresses[0][:2]
        shown = f"[{host}]" if ":" in host else host
        self._url = f"http://{shown}:{port}"
        logger.info(
            "Model gateway listening on %s (%s)",
            self._url,
            ", ".join(self.endpoints) if self.endpoints else "each request's endpoint",
        )

    async def stop(self) -> None:
        """Stop listening and close the connection pool; idempotent."""
        runner, session = self._runner, self._session
        self._runner = self._session = None
        if runner is not None:
            await runner.cleanup()
        if session is not None:
            await session.close()

    # -- ModelRouter ----------------------------------------------------------------------

    def open_route(
        self,
        *,
        rollout_id: str,
        chat_completions_url: str,
        weight_version: str | None = None,
        group_id: str | None = None,
    ) -> ModelRoute:
        """Open the route of one rollout (see
        :class:`~rollout_server.ModelRouter`).

        Raises:
            RuntimeError: Before :meth:`start`.
        """
        token = secrets.token_urlsafe(18)
        route = ModelRoute(rollout_id=rollout_id, base_url=f"{self.url}/r/{token}")
        ring_key: str | None = None
        if self._ring is not None:
            ring_key = f"g:{group_id}" if group_id is not None else f"r:{rollout_id}"
            endpoint = self._ring.acquire(ring_key)
        else:
            endpoint = chat_completions_url.rstrip("/")
        self._routes[token] = _Route(
            route=route, endpoint=endpoint, ring_key=ring_key, weight_version=weight_version
        )
        return route

    def close_route(self, route: ModelRoute) -> None:
        """Close ``route``: later calls through it get 404; its endpoint's load drops."""
        token = route.base_url.rsplit("/", 1)[-1]
        state = self._routes.pop(token, None)
        if state is not None and state.ring_key is not None and self._ring is not None:
            self._ring.release(state.ring_key)

    def endpoint_of(self, route: ModelRoute) -> str | None:
        """The endpoint an open route forwards to, or None when it is closed."""
        state = self._routes.get(route.base_url.rsplit("/", 1)[-1])
        return None if state is None else state.endpoint

    @property
    def open_routes(self) -> int:
        """Routes open now (one per rollout in flight)."""
        return len(self._routes)

    # -- forwarding -----------------------------------------------------------------------

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        state = self._routes.get(request.match_info["token"])
        if state is None:
            return _gateway_error(
                404,
                "model gateway: no such route (the rollout has finished, or the URL is wrong)",
                "route_not_found",
            )
        session = self._session
        if session is None:  # stopping
            return _gateway_error(503, "model gateway: shutting down", "gateway_stopping")
        tail = request.match_info["tail"]
        if not state.endpoint:
            return _gateway_error(
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
            return await self._relay(request, session, url, headers=headers, body=body, turn=None)
        index = state.calls
        state.calls += 1
        turn = _TurnDraft(state=state, index=index, started=time.monotonic())
        body = turn.read_request(body, ask_tokens=self.request_token_ids)
        try:
            return await self._relay(request, session, url, headers=headers, body=body, turn=turn)
        except asyncio.CancelledError:
            turn.parts.flag(TurnFlag.CANCELLED)
            raise
        finally:
            turn.record()

    async def _relay(
        self,
        request: web.Request,
        session: aiohttp.ClientSession,
        url: str,
        *,
        headers: dict[str, str],
        body: bytes,
        turn: _TurnDraft | None,
    ) -> web.StreamResponse:
        try:
            upstream = await session.request(
                request.method, url, data=body, headers=headers, allow_redirects=False
            )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if turn is not None:
                turn.parts.flag(TurnFlag.UNREACHABLE)
            return _gateway_error(
                502,
                f"model gateway: cannot reach the model endpoint {_public_url(url)}: {exc!r}",
                "upstream_unreachable",
            )
        async with upstream:
            if turn is not None:
                turn.status_code = upstream.status
            out_headers = {
                k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_DROPPED
            }
            streamed = upstream.content_type == "text/event-stream"
            if streamed and upstream.status < 400:
                return await self._pipe(request, upstream, out_headers, turn)
            return await self._buffer(request, upstream, out_headers, turn)

    async def _buffer(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        headers: dict[str, str],
        turn: _TurnDraft | None,
    ) -> web.StreamResponse:
        """A whole answer, read up to the capture limit; past it, relayed as it comes."""
        limit = self.max_capture_bytes
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
            return _gateway_error(
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
            return _cut_off(request, response, exc)
        except ConnectionError:
            if turn is not None:
                turn.parts.flag(TurnFlag.CANCELLED)
            return response
        await response.write_eof()
        return response

    async def _pipe(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        headers: dict[str, str],
        turn: _TurnDraft | None,
    ) -> web.StreamResponse:
        """A server-sent-event stream, relayed chunk by chunk (and assembled on the way)."""
        reader = StreamReader(self.max_capture_bytes) if turn is not None else None
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
                return _cut_off(request, response, exc)
            except ConnectionError:  # the workflow went away
                if turn is not None:
                    turn.parts.flag(TurnFlag.CANCELLED)
                return response
            await response.write_eof()
            return response
        finally:
            if reader is not None and turn is not None:
                turn.merge(reader.finish(broken=broken))


def _cut_off(
    request: web.Request, response: web.StreamResponse, exc: BaseException
) -> web.StreamResponse:
    """Break the workflow's connection, as the endpoint broke the gateway's."""
    logger.debug("Model endpoint answer broke off for %s: %r", request.path, exc)
    transport = request.transport
    if transport is not None:
        transport.close()
    response.force_close()
    return response


@attrs.define(kw_only=True, eq=False)
class _TurnDraft:
    """One chat completion call in flight, recorded as a turn when it ends."""

    state: _Route
    index: int
    started: float
    messages: list[Any] = attrs.Factory(list)
    status_code: int | None = None
    parts: AnswerParts = attrs.Factory(AnswerParts)
    recorded: bool = False

    def read_request(self, body: bytes, *, ask_tokens: bool) -> bytes:
        """Note the request's messages; return the body to send (asking for token ids and
        logprobs unless the request already says)."""
        try:
            document = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            document = None
        if not isinstance(document, dict):
            self.parts.flag(TurnFlag.UNPARSED_REQUEST)
            return body
        messages = document.get("messages")
        if isinstance(messages, list):
            self.messages = messages
        if not ask_tokens:
            return body
        missing = [key for key in _TOKEN_KNOBS if key not in document]
        if not missing:
            return body
        # Spliced in after the opening brace: the rest of the body goes on byte for byte
        # (and is not encoded again).
        if body.lstrip()[:1] != b"{":  # not UTF-8 (json reads UTF-16 and -32 too)
            document.update(dict.fromkeys(missing, True))
            return json.dumps(document, ensure_ascii=False).encode()
        head = b"".join(b'"%s":true,' % key.encode() for key in missing)
        start = body.index(b"{") + 1
        if not document:
            head = head[:-1]  # "{}": no member follows
        return body[:start] + head + body[start:]

    def answer(self, status: int, data: bytes) -> None:
        """Take a whole answer."""
        if status >= 400:
            self.parts.flag(TurnFlag.UPSTREAM_ERROR)
            return
        self.merge(read_completion(data))

    def merge(self, parts: AnswerParts) -> None:
        """Take what the answer said, keeping the flags noted so far."""
        for flag in self.parts.flags:
            parts.flag(flag)
        self.parts = parts

    def record(self) -> None:
        """Add the turn to its route, in call order (once; later calls do nothing)."""
        if self.recorded:
            return
        self.recorded = True
        state, parts = self.state, self.parts
        if self.status_code is not None and self.status_code >= 400:
            parts.flag(TurnFlag.UPSTREAM_ERROR)
        turn = RolloutTurn(
            index=self.index,
            endpoint=_public_url(state.endpoint),
            request_messages=self.messages,
            response_message=parts.response_message,
            finish_reason=parts.finish_reason,
            prompt_token_ids=parts.prompt_token_ids,
            completion_token_ids=parts.completion_token_ids,
            logprobs=parts.logprobs,
            weight_version=parts.weight_version or state.weight_version,
            status_code=self.status_code,
            latency_sec=time.monotonic() - self.started,
            flags=list(parts.flags),
        )
        bisect.insort(state.route.turns, turn, key=_turn_index)


def _turn_index(turn: RolloutTurn) -> int:
    return turn.index
