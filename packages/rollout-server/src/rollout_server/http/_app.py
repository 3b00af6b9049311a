"""``create_rollout_server()``: the rollout protocol as an aiohttp application.

The app holds one :class:`~rollout_server.RolloutServer` under :data:`ROLLOUT_SERVER_KEY`
(the registry, the backend, the server's identity and its staged shutdown), the protocol
middleware and the routes. The ``rollout-server`` command calls
:meth:`RolloutServer.drain` before it stops listening, so results stay collectable; when
an app is stopped any other way (tests, ``web.run_app``), its cleanup runs the same stages
without the collect window.

Every connection, whatever runner serves the app (``web.run_app``, an ``AppRunner`` of the
user's, the command), runs the app's connection policy
(:class:`~rollout_server.http._connection.GuardedRequestHandler`): JSON 400s that never quote
the request, throttled logging of peer errors, the header read timeout.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

from aiohttp import web

from rollout_types import (
    DEFAULT_POLLING_LEASE_TIMEOUT_SEC,
    DEFAULT_RESULT_RETENTION_SEC,
    DEFAULT_RESULT_WAIT_TIMEOUT_SEC,
    check_api_key,
)

from .._errors import ServerConfigError
from ..execution._backend import ExecutionBackend
from ..gateway._gateway import ModelGateway
from ..observability._tracing import ServerTracing, default_tracer_provider
from ..protocol._server import RolloutServer
from ..protocol._settings import (
    DEFAULT_BODY_READ_TIMEOUT_SEC,
    DEFAULT_HEADER_READ_TIMEOUT_SEC,
    DEFAULT_KEEPALIVE_TIMEOUT_SEC,
    DEFAULT_MAX_BODY_BYTES,
    ServerSettings,
    resolve_settings,
)
from ..protocol._shutdown import ShutdownTimeouts
from ..state._store import MEMORY
from ..state._waiting import DEFAULT_STATUS_CHANGE_GRACE_SEC
from ._aiohttp_private import install_request_handler
from ._connection import ConnectionGuard
from ._middleware import make_protocol_middleware
from ._routes import Routes
from ._validation import MAX_REQUEST_LINE_BYTES

__all__ = ["ROLLOUT_SERVER_KEY", "create_rollout_server"]

ROLLOUT_SERVER_KEY: Final = web.AppKey("rollout_server", RolloutServer)
"""Where :func:`create_rollout_server` stores the app's :class:`RolloutServer`."""

MODEL_GATEWAY_KEY: Final = web.AppKey("model_gateway", ModelGateway)
"""Where :func:`create_rollout_server` stores the app's model gateway, when it has one."""


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """The app's cleanup context: bind the registry to the serving loop, open the state
    store (recovering what it holds) and start the backend
    (:meth:`~rollout_server.ExecutionBackend.startup`) before the app serves; at cleanup,
    run the staged shutdown without the collect window (the listeners are gone by then)."""
    server = app[ROLLOUT_SERVER_KEY]
    _ = server.registry.loop
    await server.open_state()
    gateway = app.get(MODEL_GATEWAY_KEY)
    try:
        try:
            if gateway is not None:
                await gateway.start()
            await server.backend.startup()
        except BaseException:
            await server.close()  # releases the state store for the next start
            raise
        yield
        await server.drain(collect=False)
    finally:
        if gateway is not None:
            await gateway.stop()


async def _on_shutdown(app: web.Application) -> None:
    """Runs once the listeners have stopped and before aiohttp waits for handlers: answer
    waiting long polls now rather than after their full wait."""
    server = app[ROLLOUT_SERVER_KEY]
    server.begin_shutdown()
    server.registry.close()


def create_rollout_server(
    *,
    backend: ExecutionBackend,
    api_key: str | None = None,
    result_wait_timeout_sec: float = DEFAULT_RESULT_WAIT_TIMEOUT_SEC,
    polling_lease_timeout_sec: float = DEFAULT_POLLING_LEASE_TIMEOUT_SEC,
    result_retention_sec: float = DEFAULT_RESULT_RETENTION_SEC,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    keepalive_timeout_sec: float = DEFAULT_KEEPALIVE_TIMEOUT_SEC,
    access_log: bool = False,
    shutdown_timeouts: ShutdownTimeouts | None = None,
    status_change_grace_sec: float = DEFAULT_STATUS_CHANGE_GRACE_SEC,
    header_read_timeout_sec: float = DEFAULT_HEADER_READ_TIMEOUT_SEC,
    body_read_timeout_sec: float = DEFAULT_BODY_READ_TIMEOUT_SEC,
    metrics: bool = True,
    tracer_provider: Any = None,
    gateway: bool = False,
    model_endpoints: Sequence[str] = (),
    settings: ServerSettings | None = None,
    model_gateway: ModelGateway | None = None,
    state: str = MEMORY,
) -> web.Application:
    """Build the rollout protocol server as an aiohttp application.

    Args:
        backend: What executes admitted rollouts.
        api_key: When given, every request (unknown paths included) must carry
            ``Authorization: Bearer <api_key>``; default None (no auth).
        result_wait_timeout_sec: Long-poll wait of ``GET /rollout/{id}/result``, seconds;
            finite and > 0; default 30.0.
        polling_lease_timeout_sec: Seconds without a poll before a rollout fails as
            ``lease_expired``; finite, > 0 and > ``result_wait_timeout_sec``; default 120.0.
        result_retention_sec: Seconds a published result stays collectable (and its id
            reserved) once its execution has finished; finite and >= 0; default 900.0.
        max_body_bytes: Largest accepted request body in bytes (larger ones get 413);
            default 64 MiB.
        keepalive_timeout_sec: HTTP keep-alive of idle connections, seconds; default 2160.0.
        access_log: Whether to log one line per request to ``rollout_server.access``;
            default False.
        shutdown_timeouts: Bounds of the staged shutdown; default :class:`ShutdownTimeouts()`.
        status_change_grace_sec: After a non-terminal status change (``queued`` →
            ``running`` → ``grading``), a waiting long poll answers within this many
            seconds, or at once with the result if that is published meanwhile: one round
            trip instead of two when a quick grader follows the workflow. A poll that
            arrives to find a status not yet answered to the caller (a change between two
            polls; the admission answered ``queued``) is answered the same way, so no
            change goes unseen for a whole wait. A grace during which the event loop was
            saturated (its thread on the CPU for at least 90% of the time) is put off by
            another grace, up to the poll's own wait: a busy server answers results rather
            than progress. 0 answers every change at once. Finite and >= 0; default 1.0.
        header_read_timeout_sec: Once the first bytes of a request arrive, its headers must
            be complete within this many seconds, or the connection is closed (an idle
            keep-alive connection is not timed); finite and > 0; default 30.0.
        body_read_timeout_sec: Once a request's headers arrive, its body must be complete
            within this many seconds, or the request gets 408 and the connection is
            closed; finite and > 0; default 60.0.
        metrics: Whether to serve Prometheus metrics at ``GET /metrics`` (behind the same
            bearer auth as every route); default True.
        tracer_provider: The OpenTelemetry ``TracerProvider`` of the server's spans
            (the ``[otel]`` extra). Default None: the process's global provider when one
            is set, else one configured from the ``OTEL_*`` environment variables (or
            ``OSMOSIS_ROLLOUT_OTLP_ENDPOINT``) when they ask for an exporter, else no
            tracing at all.
        settings: All the settings above at once (``api_key`` and ``tracer_provider``
            are not settings); default None: built from the keywords. When given, leave
            the setting keywords at their defaults.
        gateway: Whether to run a model gateway (a :class:`~rollout_server.ModelGateway`
            with the default options) when ``model_gateway`` is not given; default False.
        model_endpoints: Model endpoints' base URLs for that gateway (a non-empty list
            implies ``gateway``); default none: each request's ``chat_completions_url``.
        model_gateway: A :class:`~rollout_server.ModelGateway` that gives each
            rollout its own OpenAI-compatible base URL (the rollout context's
            ``chat_completions_url`` and ``base_url``) and records its model calls as turns
            (in ``trajectory.json``, and in the result of a request with
            ``return_turns``); it starts and stops with the app. Default None: workflows
            call the request's endpoint directly (unless ``settings.gateway`` or
            ``settings.model_endpoints`` asks for one), and ``return_turns`` gets 422.
        state: Where admissions and results are kept, so that a restart loses nothing:
            ``"memory:"`` (default: nothing survives the process) or
            ``"sqlite:///ABS/PATH.db"`` (a SQLite file: an admission is answered 202 and a
            result becomes visible only once stored; a server restarted on the same file
            serves the stored results to the original lease tokens and fails the rollouts
            that were in flight as ``internal_error``). The file is opened when the app
            starts: a file that cannot be used (corrupt, locked by another server,
            read-only, of a newer schema) fails the start with :class:`ServerConfigError`.

    Returns:
        The application; its :class:`RolloutServer` is ``app[ROLLOUT_SERVER_KEY]``.

    Raises:
        ServerConfigError: (a ``ValueError``) If an argument is out of range, or
            ``settings`` and a setting's keyword are both given, or ``model_gateway`` and
            ``settings.model_endpoints`` both.
        TypeError: If ``backend`` is not an :class:`ExecutionBackend`, ``settings`` not a
            :class:`ServerSettings` or ``shutdown_timeouts`` not a :class:`ShutdownTimeouts`,
            or ``model_gateway`` not a :class:`~rollout_server.ModelGateway`.

    .. versionadded:: 0.1
    .. versionchanged:: 0.2
       ``header_read_timeout_sec``, ``body_read_timeout_sec``, ``metrics`` and
       ``tracer_provider``; request lines (and so result URLs) are limited to 8190 bytes,
       and longer ids are refused at admission.
    .. versionchanged:: 0.3
       ``settings``, ``gateway``, ``model_endpoints``, ``model_gateway`` and ``state``.
    """
    if not isinstance(backend, ExecutionBackend):
        raise TypeError(
            "backend must be an instance of rollout_server.ExecutionBackend (subclass it and "
            f"implement execute()); got {type(backend).__name__}"
        )
    if model_gateway is not None and not isinstance(model_gateway, ModelGateway):
        raise TypeError(
            "model_gateway must be a rollout_server.ModelGateway; "
            f"got {type(model_gateway).__name__}"
        )
    settings = resolve_settings(
        settings,
        {
            "result_wait_timeout_sec": result_wait_timeout_sec,
            "polling_lease_timeout_sec": polling_lease_timeout_sec,
            "result_retention_sec": result_retention_sec,
            "max_body_bytes": max_body_bytes,
            "keepalive_timeout_sec": keepalive_timeout_sec,
            "access_log": access_log,
            "shutdown_timeouts": shutdown_timeouts,
            "status_change_grace_sec": status_change_grace_sec,
            "header_read_timeout_sec": header_read_timeout_sec,
            "body_read_timeout_sec": body_read_timeout_sec,
            "metrics": metrics,
            "state": state,
            "gateway": gateway,
            "model_endpoints": model_endpoints,
        },
    )
    if model_gateway is None and (settings.gateway or settings.model_endpoints):
        model_gateway = ModelGateway(endpoints=settings.model_endpoints)
    elif model_gateway is not None and settings.model_endpoints:
        raise ServerConfigError(
            "model_endpoints (a setting) and model_gateway both given; pass the endpoints "
            "to ModelGateway(endpoints=...)"
        )
    check_api_key(api_key, error=ServerConfigError)

    provider = default_tracer_provider() if tracer_provider is None else tracer_provider
    server = RolloutServer(
        backend=backend,
        settings=settings,
        requires_auth=api_key is not None,
        tracing=None if provider is None else ServerTracing(provider),
        model_router=model_gateway,
    )
    app = web.Application(
        middlewares=[make_protocol_middleware(api_key)],
        client_max_size=settings.max_body_bytes,
        handler_args={
            "keepalive_timeout": settings.keepalive_timeout_sec,
            "access_log": (
                logging.getLogger("rollout_server.access") if settings.access_log else None
            ),
            "max_line_size": MAX_REQUEST_LINE_BYTES,
            "max_field_size": MAX_REQUEST_LINE_BYTES,
        },
    )
    guard = ConnectionGuard(
        header_read_timeout_sec=settings.header_read_timeout_sec,
        max_line_bytes=MAX_REQUEST_LINE_BYTES,
        on_refused=None if server.metrics is None else server.metrics.http_refused,
    )
    install_request_handler(app, guard.handler)
    app[ROLLOUT_SERVER_KEY] = server
    if model_gateway is not None:
        app[MODEL_GATEWAY_KEY] = model_gateway
    app.add_routes(Routes(server).table())
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_on_shutdown)
    return app
