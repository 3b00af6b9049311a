"""``RolloutServer``: the state and behaviour behind one rollout app.

It holds the registry, the backend, the server's identity and its settings, and does what
the routes ask of it: admit a rollout, cancel a selection (through its
:class:`~rollout_server._cancellation.Cancellation`), describe its health. It also runs
the staged shutdown (:mod:`rollout_server._shutdown`) once, and owns the server's metrics
(:mod:`rollout_server._metrics`) and tracing (:mod:`rollout_server._tracing`), which
observe the registry, the cancellations and every execution. It knows no HTTP: the routes
(:mod:`rollout_server._routes`) and the app (:mod:`rollout_server._app`) sit on top of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final

from rollout_types import (
    PROTOCOL_VERSION,
    CancelDisposition,
    CancelRolloutsRequest,
    RolloutHealth,
    RolloutInitRequest,
    RolloutLifecycle,
)

from ._backend import ExecutionBackend, ExecutionRequest
from ._cancellation import Cancellation
from ._execution import StatusSink, execution_result, start_execution
from ._metrics import ServerMetrics
from ._observer import NO_OBSERVER, ExecutionObserver
from ._record import RolloutRecord
from ._registry import PublicationObserver, RolloutRegistry
from ._sanitize import fit_json
from ._shutdown import ShutdownTimeouts, run_staged_shutdown
from ._tracing import ServerTracing
from ._waiting import DEFAULT_STATUS_CHANGE_GRACE_SEC

__all__ = [
    "DEFAULT_KEEPALIVE_TIMEOUT_SEC",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_RETRY_AFTER_SEC",
    "INSTANCE_ID_ENV_VARS",
    "RolloutServer",
]

logger: Final = logging.getLogger("rollout_server.app")

DEFAULT_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
"""Default limit on a request body, in bytes (64 MiB; aiohttp's own default is 1 MiB)."""

DEFAULT_KEEPALIVE_TIMEOUT_SEC: Final = 2160.0
"""Default HTTP keep-alive, in seconds: longer than common load-balancer idle timeouts
(2100 s and less), so a gateway never reuses a connection the server is closing."""

DEFAULT_RETRY_AFTER_SEC: Final = 5.0
"""The ``Retry-After`` hint (seconds) when the backend's own fails (osmosis-ai's default)."""

INSTANCE_ID_ENV_VARS: Final = ("ROLLOUT_INSTANCE_ID", "_OSMOSIS_ROLLOUT_INSTANCE_ID")
"""Environment variables read for ``/health`` ``instance_id``; the first non-empty wins
(``_OSMOSIS_ROLLOUT_INSTANCE_ID`` is what ``osmosis eval run`` sets)."""


_NOT_TRACED: Final = contextlib.nullcontext()


def _not_traced(_record: RolloutRecord) -> contextlib.AbstractContextManager[None]:
    return _NOT_TRACED


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
        metrics: The Prometheus metrics (``GET /metrics``), or None when turned off.
        tracing: The OpenTelemetry spans of the server, or None when it does not trace.
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
        metrics: bool = True,
        tracing: ServerTracing | None = None,
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
        self.metrics = ServerMetrics(self) if metrics else None
        self.tracing = tracing
        observers: list[PublicationObserver] = [
            observer for observer in (self.metrics, tracing) if observer is not None
        ]
        self.registry = RolloutRegistry(
            polling_lease_timeout_sec=polling_lease_timeout_sec,
            result_retention_sec=result_retention_sec,
            on_lease_expired=self._on_lease_expired,
            outcome_of=execution_result,
            status_change_grace_sec=status_change_grace_sec,
            observers=observers,
        )
        self._cancellation = Cancellation(
            registry=self.registry,
            backend=backend,
            spawn=self.spawn,
            on_answered=None if self.metrics is None else self.metrics.cancelled,
        )
        self._observer: ExecutionObserver = NO_OBSERVER if self.metrics is None else self.metrics
        self._trace_scope: Callable[[RolloutRecord], contextlib.AbstractContextManager[None]] = (
            _not_traced if tracing is None else tracing.rollout_scope
        )
        self._accepting = True
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
        observer = self._observer
        trace_scope = self._trace_scope
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
                on_status=StatusSink(registry, record),
                observer=observer,
            )
            # Traced: the task's context gets the rollout's span (and the server's tracer).
            with trace_scope(record):
                return start_execution(
                    registry=registry,
                    backend=backend,
                    record=record,
                    request=request,
                    process_id=self.process_id,
                )

        _record, token = registry.register(init.rollout_id, start, admitted_at)
        return token

    # -- cancellation ---------------------------------------------------------------------

    async def cancel(self, selection: CancelRolloutsRequest) -> dict[str, CancelDisposition]:
        """Cancel the selected rollouts (spec section 4.9); return one disposition per id.

        Finished and unknown ids are ``not_found``; a repeated cancel before publication
        returns the first disposition. The backend is asked first; the server's own
        execution task is the fallback (see :mod:`rollout_server._cancellation`).
        """
        return await self._cancellation.cancel(selection)

    async def cancel_everything(self) -> dict[str, CancelDisposition]:
        """Cancel every rollout without a result, as ``POST /rollout/cancel {"all": true}``."""
        return await self._cancellation.cancel_everything()

    def _on_lease_expired(self, record: RolloutRecord) -> None:
        self._cancellation.lease_expired(record)

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

    @property
    def draining(self) -> bool:
        """True while the staged shutdown runs."""
        return self._drain_task is not None and not self._drain_task.done()

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
        hurry = self._hurry_future()
        if not hurry.done():
            hurry.set_result(None)

    def _hurry_future(self) -> asyncio.Future[None]:
        if self._hurry is None:
            self._hurry = self.registry.loop.create_future()
        return self._hurry

    async def close(self) -> None:
        """Close the registry and stop pending cancellation requests (the drain's end)."""
        self.registry.close()
        self._cancellation.flush()
        tasks = list(self._side_tasks)
        if tasks:
            _, still = await asyncio.wait(tasks, timeout=1.0)
            for task in still:
                task.cancel()
            if still:
                await asyncio.wait(still, timeout=1.0)
