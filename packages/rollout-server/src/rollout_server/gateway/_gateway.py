""":class:`ModelGateway`: each rollout's OpenAI-compatible base URL, forwarding its model
calls to a model endpoint and capturing each chat completion as a turn.

The gateway is one handler (:class:`~rollout_server.gateway._relay.Relay`) on a bare
``aiohttp.web.Server`` (no application, router or middleware) with a listener of its own
(``127.0.0.1`` and a free port by default), apart from the rollout API: its routes need
no server key, speak no rollout protocol and are never polled by callers. Each rollout
gets a route ``http://<host>:<port>/r/<token>`` (a random token, so the URL is the
capability); a call to ``<route>/<path>`` is forwarded to ``<endpoint>/<path>``, where the
endpoint is the request's ``chat_completions_url``, or, when the gateway has endpoints of
its own (``--model-endpoint``), the one :class:`~rollout_server.gateway._ring.EndpointRing`
picks for the rollout's group (its ``group_id``, else the rollout itself).

Forwarding: method, query, body and headers go on as they came (but hop-by-hop headers,
``Host`` and ``Accept-Encoding``), through one connection pool with keep-alive and no
cookie jar (an endpoint's cookies reach the workflow and are not kept); the answer comes
back with its status, headers and body, streamed chunk by chunk when it is a
server-sent-event stream. An HTTP error of the endpoint is passed on unchanged. An endpoint
that cannot be reached, or whose answer breaks off before any of it was passed on, gets
``502`` with an OpenAI-style error body (``type`` ``gateway_error``), which a workflow
classifies as it would the endpoint's own 5xx; a stream that breaks off midway is cut off
the same way for the workflow.

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

import secrets
from collections.abc import Sequence
from typing import Final
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from .._errors import ServerConfigError
from .._logtext import get_logger
from ..execution._turns import ModelRoute, ModelRouter
from ._draft import RouteState
from ._relay import Relay
from ._ring import DEFAULT_LOAD_FACTOR, EndpointRing

__all__ = ["DEFAULT_MAX_CAPTURE_BYTES", "ModelGateway"]

logger: Final = get_logger("rollout_server.gateway")

DEFAULT_MAX_CAPTURE_BYTES: Final = 32 * 1024 * 1024
"""Largest answer (or stream) the gateway records, in bytes (32 MiB); larger ones pass on
unrecorded."""

DEFAULT_CONNECT_TIMEOUT_SEC: Final = 10.0
"""Default bound on connecting to a model endpoint, in seconds."""


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
        self._routes: dict[str, RouteState] = {}
        self._runner: web.ServerRunner | None = None
        self._relay = Relay(
            routes=self._routes,
            max_capture_bytes=max_capture_bytes,
            ask_tokens=self.request_token_ids,
        )
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
        # Speed: a bare web.Server (no Application, router or middleware); see
        #   benchmarks/README.md, "The model gateway".
        server = web.Server(
            self._relay.forward, request_factory=self._relay.make_request, access_log=None
        )
        runner = web.ServerRunner(server, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._relay.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0),
            # No cookies: an endpoint's cookie must not follow one rollout into another's
            # calls (and the jar costs each call a lookup).
            cookie_jar=aiohttp.DummyCookieJar(),
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
        runner, session = self._runner, self._relay.session
        self._runner = self._relay.session = None
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
        self._routes[token] = RouteState(
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
