"""``create_rollout_server()``: the rollout protocol as an aiohttp application.

The app holds one :class:`RolloutServer` under :data:`ROLLOUT_SERVER_KEY`: the registry,
the backend, the server's identity and its staged shutdown. The ``rollout-server``
command calls :meth:`RolloutServer.drain` before it stops listening, so results stay
collectable; when an app is stopped any other way (tests, ``web.run_app``), its cleanup
runs the same stages without the collect window.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping
from typing import Any, Final

from aiohttp import web

from rollout_types import (
    DEFAULT_POLLING_LEASE_TIMEOUT_SEC,
    DEFAULT_RESULT_RETENTION_SEC,
    DEFAULT_RESULT_WAIT_TIMEOUT_SEC,
    PROTOCOL_VERSION,
    CancelDisposition,
    CancelRolloutsRequest,
    RolloutHealth,
    RolloutInitRequest,
    RolloutLifecycle,
    RolloutStatus,
    fit_json,
    is_terminal,
)

from ._backend import ExecutionBackend, ExecutionRequest
from ._errors import ServerConfigError
from ._execution import finish_execution, start_execution
from ._middleware import make_protocol_middleware
from ._registry import DEFAULT_STATUS_CHANGE_GRACE_SEC, RolloutRecord, RolloutRegistry
from ._routes import DEFAULT_RETRY_AFTER_SEC, build_routes
from ._shutdown import ShutdownTimeouts, run_staged_shutdown

__all__ = [
    "DEFAULT_KEEPALIVE_TIMEOUT_SEC",
    "DEFAULT_MAX_BODY_BYTES",
    "INSTANCE_ID_ENV_VARS",
    "ROLLOUT_SERVER_KEY",
    "RolloutServer",
    "create_rollout_server",
]

logger: Final = logging.getLogger("rollout_server.app")

DEFAULT_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
"""Default limit on a request body, in bytes (64 MiB; aiohttp's own default is 1 MiB)."""

DEFAULT_KEEPALIVE_TIMEOUT_SEC: Final = 2160.0
"""Default HTTP keep-alive, in seconds: longer than common load-balancer idle timeouts
(2100 s and less), so a gateway never reuses a connection the server is closing."""

INSTANCE_ID_ENV_VARS: Final = ("ROLLOUT_INSTANCE_ID", "_OSMOSIS_ROLLOUT_INSTANCE_ID")
"""Environment variables read for ``/health`` ``instance_id``; the first non-empty wins
(``_OSMOSIS_ROLLOUT_INSTANCE_ID`` is what ``osmosis eval run`` sets)."""


def _instance_id_from_env() -> str | None:
    for name in INSTANCE_ID_ENV_VARS:
        value = os.environ.get(name)
        if value:
            return value
    return None


class RolloutServer:
    """The state and behaviour behind one rollout app (one per :func:`create_rollout_server`).

    Attributes:
        backend: The execution backend.
        registry: Every admitted rollout.
        process_id: A UUID4, new for every server instance (``/health`` ``process_id``).
        instance_id: ``$ROLLOUT_INSTANCE_ID``, else ``$_OSMOSIS_ROLLOUT_INSTANCE_ID``, else
            :attr:`process_id`.
        result_wait_timeout_sec: Long-poll wait, seconds.
        polling_lease_timeout_sec: Polling lease, seconds.
        result_retention_sec: Retention of a published result, seconds.
        max_body_bytes: Largest accepted request body, bytes.
        keepalive_timeout_sec: HTTP keep-alive of idle connections, seconds.
        access_log: Whether one line per request is logged to ``rollout_server.access``.
        status_change_grace_sec: How long a long poll goes on waiting after a non-terminal
            status change, for a result that may follow, seconds (put off while the event
            loop is saturated).
        shutdown_timeouts: Bounds of the staged shutdown.
    """

    def __init__(
        self,
        *,
        backend: ExecutionBackend,
        result_wait_timeout_sec: float,
        polling_lease_timeout_sec: float,
        result_retention_sec: float,
        max_body_bytes: int,
        shutdown_timeouts: ShutdownTimeouts,
        keepalive_timeout_sec: float = DEFAULT_KEEPALIVE_TIMEOUT_SEC,
        access_log: bool = False,
        status_change_grace_sec: float = DEFAULT_STATUS_CHANGE_GRACE_SEC,
    ) -> None:
        self.backend = backend
        self.result_wait_timeout_sec = result_wait_timeout_sec
        self.polling_lease_timeout_sec = polling_lease_timeout_sec
        self.result_retention_sec = result_retention_sec
        self.max_body_bytes = max_body_bytes
        self.shutdown_timeouts = shutdown_timeouts
        self.keepalive_timeout_sec = keepalive_timeout_sec
        self.access_log = access_log
        self.status_change_grace_sec = status_change_grace_sec
        self.process_id = str(uuid.uuid4())
        self.instance_id = _instance_id_from_env() or self.process_id
        self.registry = RolloutRegistry(
            polling_lease_timeout_sec=polling_lease_timeout_sec,
            result_retention_sec=result_retention_sec,
            on_lease_expired=self._on_lease_expired,
            on_task_done=self._on_task_done,
            status_change_grace_sec=status_change_grace_sec,
        )
        self._accepting = True
        self._expired: list[RolloutRecord] = []
        self._side_tasks: set[asyncio.Task[Any]] = set()
        self._drain_task: asyncio.Task[None] | None = None
        self._hurry: asyncio.Future[None] | None = None

    # -- admission ------------------------------------------------------------------------

    @property
    def accepting_rollouts(self) -> bool:
        """True until shutdown begins, then False for good."""
        return self._accepting

    def retry_after_sec(self) -> float:
        """The backend's ``Retry-After`` hint in seconds (5 if it fails)."""
        try:
            return self.backend.retry_after_sec()
        except Exception:
            logger.exception(
                "backend.retry_after_sec() failed; using %.0fs", DEFAULT_RETRY_AFTER_SEC
            )
            return DEFAULT_RETRY_AFTER_SEC

    def admit(self, init: RolloutInitRequest) -> str:
        """Register ``init`` and schedule its execution task; return the lease token.

        The caller has checked shutdown, capacity and duplicates (in that order).
        """
        registry = self.registry
        backend = self.backend
        admitted_at = time.monotonic()

        def start(record: RolloutRecord) -> asyncio.Task[Any]:
            request = ExecutionRequest(
                id=init.rollout_id,
                prompt=init.initial_messages,
                chat_completions_url=init.chat_completions_url,
                llm_api_key=init.llm_api_key,
                label=init.label,
                metadata=init.metadata,
                grade=init.grade,
                agent_timeout_sec=init.agent_timeout_sec,
                grader_timeout_sec=init.grader_timeout_sec,
                request_extra_fields=init.extra_fields,
                admitted_at=admitted_at,
                on_status=_StatusSink(registry, record),
            )
            return start_execution(
                registry=registry,
                backend=backend,
                record=record,
                request=request,
                process_id=self.process_id,
            )

        _record, token = registry.register(init.rollout_id, start)
        return token

    # -- cancellation ---------------------------------------------------------------------

    async def cancel(self, selection: CancelRolloutsRequest) -> dict[str, CancelDisposition]:
        """Cancel the selected rollouts (spec section 4.9); return one disposition per id.

        Finished and unknown ids are ``not_found``; a repeated cancel before publication
        returns the first disposition. The backend is asked first; the server's own
        execution task is the fallback.
        """
        registry = self.registry
        if selection.ids is not None:
            selected = list(dict.fromkeys(selection.ids))
            scope = f"{len(selected)} ids"
        elif selection.prefix is not None:
            prefix = selection.prefix
            selected = [rid for rid in registry.ids() if rid.startswith(prefix)]
            scope = "prefix"
        else:
            selected = registry.ids()
            scope = "all"
        dispositions: dict[str, CancelDisposition] = {}
        pending: list[RolloutRecord] = []
        for rollout_id in selected:
            record = registry.get(rollout_id)
            if record is None or record.published:
                dispositions[rollout_id] = CancelDisposition.NOT_FOUND
            elif record.disposition is not None:
                dispositions[rollout_id] = record.disposition
            else:
                record.disposition = (
                    CancelDisposition.CANCELLED_QUEUED
                    if record.status is RolloutStatus.QUEUED
                    else CancelDisposition.CANCELLED_RUNNING
                )
                dispositions[rollout_id] = record.disposition
                pending.append(record)
        if pending:
            dispositions.update(await self._request_cancellation(pending))
        cancelled = sum(1 for d in dispositions.values() if d.startswith("cancelled"))
        logger.info("Cancelled %d rollout(s) (%s)", cancelled, scope)
        return dispositions

    async def cancel_everything(self) -> dict[str, CancelDisposition]:
        """Cancel every rollout without a result, as ``POST /rollout/cancel {"all": true}``."""
        return await self.cancel(CancelRolloutsRequest(all=True))

    async def _request_cancellation(
        self, records: list[RolloutRecord]
    ) -> dict[str, CancelDisposition]:
        """Ask the backend to cancel ``records``; cancel the server's own task where the
        backend does not handle an id. Return the dispositions the backend reported."""
        ids = [record.rollout_id for record in records]
        answers: Any
        try:
            answers = await self.backend.cancel_rollouts(ids=ids)
        except Exception:
            logger.exception("Backend cancellation failed for rollout(s) %s", ", ".join(ids[:20]))
            answers = {}
        if not isinstance(answers, Mapping):
            logger.warning(
                "backend.cancel_rollouts() returned %s, not a dict; cancelling the server's tasks",
                type(answers).__name__,
            )
            answers = {}
        adopted: dict[str, CancelDisposition] = {}
        for record in records:
            answer = answers.get(record.rollout_id)
            if answer in (
                CancelDisposition.CANCELLED_QUEUED,
                CancelDisposition.CANCELLED_RUNNING,
            ) or (answer == CancelDisposition.NOT_FOUND and self._backend_retains_terminal(record)):
                disposition = CancelDisposition(answer)
                if not record.published:
                    record.disposition = disposition
                adopted[record.rollout_id] = disposition
            else:
                self.registry.cancel_task(record)
        return adopted

    def _backend_retains_terminal(self, record: RolloutRecord) -> bool:
        try:
            state = self.backend.rollout_status(record.rollout_id)
        except Exception:
            logger.exception("backend.rollout_status(%r) failed", record.rollout_id)
            return False
        return isinstance(state, Mapping) and is_terminal(str(state.get("status")))

    def _on_task_done(self, record: RolloutRecord, task: asyncio.Task[Any]) -> None:
        finish_execution(self.registry, record, task)

    def _on_lease_expired(self, record: RolloutRecord) -> None:
        # Batch the expiries of one loop turn into one cancellation request.
        self._expired.append(record)
        if len(self._expired) == 1:
            self.registry.loop.call_soon(self._flush_expired)

    def _flush_expired(self) -> None:
        records, self._expired = self._expired, []
        if records:
            _ = self.spawn(self._request_cancellation(records))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a side task that :meth:`close` waits for (briefly) or cancels."""
        task: asyncio.Task[Any] = self.registry.loop.create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)
        return task

    # -- health ---------------------------------------------------------------------------

    def health(self) -> RolloutHealth:
        """The ``/health`` document: backend fields, identity, lifecycle, protocol version."""
        fitted: Any = None
        try:
            fields: Any = self.backend.health()
        except Exception as exc:
            logger.exception("backend.health() failed")
            fields = {"status": "error", "error": f"backend.health() raised {exc!r}"}
        if isinstance(fields, Mapping):
            fitted, dropped = fit_json(dict(fields), "health")
            if dropped:
                logger.warning("Dropped non-JSON backend health values: %s", ", ".join(dropped))
        if not isinstance(fitted, dict):
            logger.warning("backend.health() returned %s, not a dict", type(fields).__name__)
            fitted = {"status": "unknown"}
        return RolloutHealth(
            instance_id=self.instance_id,
            process_id=self.process_id,
            lifecycle=RolloutLifecycle(
                accepting_rollouts=self._accepting, active_rollouts=self.registry.active
            ),
            protocol_version=PROTOCOL_VERSION,
            backend=fitted,
        )

    # -- shutdown -------------------------------------------------------------------------

    def begin_shutdown(self) -> None:
        """Close admissions (503 from now on); result polls keep being served."""
        if self._accepting:
            self._accepting = False
            self.registry.start_collecting()
            logger.info("Rollout server shutting down: admissions closed")

    async def drain(self, *, collect: bool = True) -> None:
        """Run the staged shutdown (see :mod:`rollout_server._shutdown`) once.

        Concurrent and later calls wait for the same run.

        Args:
            collect: Whether to hold the collect window before returning; default True
                (the server is still listening). The app's cleanup passes False.
        """
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(
                run_staged_shutdown(
                    self, self.shutdown_timeouts, collect=collect, hurry=self._hurry_future()
                )
            )
        await asyncio.shield(self._drain_task)

    def hurry(self) -> None:
        """End the remaining waits of a running or future drain at once (second signal)."""
        _ = self._hurry_future()
        assert self._hurry is not None
        if not self._hurry.done():
            self._hurry.set_result(None)

    def _hurry_future(self) -> asyncio.Future[None]:
        if self._hurry is None:
            self._hurry = self.registry.loop.create_future()
        return self._hurry

    async def close(self) -> None:
        """Close the registry and stop pending cancellation requests (the drain's end)."""
        self.registry.close()
        self._flush_expired()
        tasks = list(self._side_tasks)
        if tasks:
            _, still = await asyncio.wait(tasks, timeout=1.0)
            for task in still:
                task.cancel()
            if still:
                await asyncio.wait(still, timeout=1.0)

    async def _lifecycle(self, _app: web.Application) -> AsyncIterator[None]:
        _ = self.registry.loop
        await self.backend.startup()
        yield
        await self.drain(collect=False)

    async def _on_app_shutdown(self, _app: web.Application) -> None:
        # Runs once the listeners have stopped and before aiohttp waits for handlers:
        # answer waiting long polls now rather than after their full wait.
        self.begin_shutdown()
        self.registry.close()


ROLLOUT_SERVER_KEY: Final = web.AppKey("rollout_server", RolloutServer)
"""Where :func:`create_rollout_server` stores the app's :class:`RolloutServer`."""


class _StatusSink:
    """``on_status`` of one rollout: reports to the registry (smaller than a partial)."""

    __slots__ = ("_record", "_registry")

    def __init__(self, registry: RolloutRegistry, record: RolloutRecord) -> None:
        self._registry = registry
        self._record = record

    def __call__(self, status: RolloutStatus | str) -> None:
        self._registry.set_status(self._record, status)


def _check_seconds(name: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ServerConfigError(f"{name} must be a finite number of seconds; got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ServerConfigError(f"{name} must be {bound} seconds; got {value!r}")
    return float(value)


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
            trip instead of two when a quick grader follows the workflow. A grace during
            which the event loop was saturated (its thread on the CPU for at least 90% of
            the time) is put off by another grace, up to the poll's own wait: a busy
            server answers results rather than progress. 0 answers every change at once
            (osmosis-ai's timing). Finite and >= 0; default 1.0.

    Returns:
        The application; its :class:`RolloutServer` is ``app[ROLLOUT_SERVER_KEY]``.

    Raises:
        ServerConfigError: (a ``ValueError``) If an argument is out of range.
        TypeError: If ``backend`` is not an :class:`ExecutionBackend`.

    .. versionadded:: 0.1
    """
    if not isinstance(backend, ExecutionBackend):
        raise TypeError(
            "backend must be an instance of rollout_server.ExecutionBackend (subclass it and "
            f"implement execute()); got {type(backend).__name__}"
        )
    wait = _check_seconds("result_wait_timeout_sec", result_wait_timeout_sec)
    lease = _check_seconds("polling_lease_timeout_sec", polling_lease_timeout_sec)
    if not lease > wait:
        raise ServerConfigError(
            f"polling_lease_timeout_sec ({lease}) must be greater than result_wait_timeout_sec "
            f"({wait}), so a client that re-polls promptly never loses its lease"
        )
    retention = _check_seconds("result_retention_sec", result_retention_sec, allow_zero=True)
    keepalive = _check_seconds("keepalive_timeout_sec", keepalive_timeout_sec)
    grace = _check_seconds("status_change_grace_sec", status_change_grace_sec, allow_zero=True)
    body_limit: object = max_body_bytes
    if isinstance(body_limit, bool) or not isinstance(body_limit, int) or body_limit < 1:
        raise ServerConfigError(f"max_body_bytes must be a positive int; got {max_body_bytes!r}")
    key: object = api_key
    if api_key is not None:
        if not isinstance(key, str) or not api_key.strip():
            raise ServerConfigError(
                "api_key must be a non-blank string, or None to serve without authentication"
            )
        if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in api_key):
            raise ServerConfigError(
                "api_key must not contain control characters (clients cannot send them "
                "in an Authorization header)"
            )
    timeouts = ShutdownTimeouts() if shutdown_timeouts is None else shutdown_timeouts
    if not isinstance(timeouts, ShutdownTimeouts):
        raise TypeError(
            f"shutdown_timeouts must be a ShutdownTimeouts; got {type(timeouts).__name__}"
        )

    server = RolloutServer(
        backend=backend,
        result_wait_timeout_sec=wait,
        polling_lease_timeout_sec=lease,
        result_retention_sec=retention,
        max_body_bytes=max_body_bytes,
        shutdown_timeouts=timeouts,
        keepalive_timeout_sec=keepalive,
        access_log=bool(access_log),
        status_change_grace_sec=grace,
    )
    app = web.Application(
        middlewares=[make_protocol_middleware(api_key)],
        client_max_size=max_body_bytes,
        handler_args={
            "keepalive_timeout": keepalive,
            "access_log": logging.getLogger("rollout_server.access") if access_log else None,
        },
    )
    app[ROLLOUT_SERVER_KEY] = server
    app.add_routes(build_routes(server))
    app.cleanup_ctx.append(server._lifecycle)
    app.on_shutdown.append(server._on_app_shutdown)
    return app
