"""``RolloutServer``: the state and behaviour behind one rollout app.

It holds the registry, the backend, the server's identity and its settings, and does what
the routes ask of it: admit a rollout, cancel a selection (through its
:class:`~rollout_server.protocol._cancellation.Cancellation`), describe its health. It also runs
the staged shutdown (:mod:`rollout_server.protocol._shutdown`) once, and owns the server's metrics
(:mod:`rollout_server.protocol._metrics`) and tracing
(:mod:`rollout_server.observability._tracing`), which
observe the registry, the cancellations and every execution. It knows no HTTP: the routes
(:mod:`rollout_server.http._routes`) and the app (:mod:`rollout_server.http._app`) sit on top of it.

Admission asks the backend's ``try_reserve()`` exactly once per admitted rollout, however
many admissions run at once, and ends each reservation when the rollout's execution starts
(see :mod:`rollout_server.execution._backend`). The backend's ``admission_mode`` says whether
it counts those reservations (``"reservations"``) or only the work it has started
(``"started_work"``); for the latter, the server counts its own admitted-but-not-started
rollouts and lets a new admission ask only once none is left
(:class:`~rollout_server.protocol._turns.AdmissionTurns`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, Final

import attrs

from rollout_types import (
    CancelDisposition,
    CancelRolloutsRequest,
    RolloutHealth,
    RolloutInitRequest,
    RolloutLifecycle,
)

from .._logtext import get_logger
from ..execution._backend import ExecutionBackend, admission_mode_of, request_from_init
from ..execution._reattach import reattacher_of
from ..execution._turns import ModelRouter
from ..observability._observer import NO_OBSERVER, ExecutionObserver
from ..observability._tracing import ServerTracing
from ..state._durability import StoreLink
from ..state._record import RolloutRecord
from ..state._registry import PublicationObserver, RolloutRegistry
from ..state._store import StateStore, parse_state_url, store_for
from ..state._waiting import DEFAULT_STATUS_CHANGE_GRACE_SEC
from ._cancellation import Cancellation
from ._capture import TurnCapture
from ._execution import StatusSink, execution_result, start_execution
from ._health import health_document
from ._metrics import ServerMetrics
from ._recovery import Recovery, recover
from ._settings import (
    DEFAULT_BODY_READ_TIMEOUT_SEC,
    DEFAULT_HEADER_READ_TIMEOUT_SEC,
    DEFAULT_KEEPALIVE_TIMEOUT_SEC,
    ServerSettings,
    resolve_settings,
)
from ._shutdown import DeliveryWatch, ShutdownTimeouts, run_staged_shutdown
from ._turns import AdmissionTurns

__all__ = [
    "DEFAULT_RETRY_AFTER_SEC",
    "INSTANCE_ID_ENV_VARS",
    "Refusal",
    "RolloutServer",
]

logger: Final = get_logger("rollout_server.app")

DEFAULT_RETRY_AFTER_SEC: Final = 5.0
"""The ``Retry-After`` hint (seconds) when the backend's own fails (osmosis-ai's default)."""

INSTANCE_ID_ENV_VARS: Final = ("ROLLOUT_INSTANCE_ID", "_OSMOSIS_ROLLOUT_INSTANCE_ID")
"""Environment variables read for ``/health`` ``instance_id``; the first non-empty wins
(``_OSMOSIS_ROLLOUT_INSTANCE_ID`` is what ``osmosis eval run`` sets)."""


class Refusal(enum.Enum):
    """Why :meth:`RolloutServer.admit` refused a rollout (the value is the HTTP status)."""

    SHUTTING_DOWN = 503
    QUEUE_FULL = 429
    DUPLICATE = 409


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
            ``process_id``.
        settings: The server's :class:`~rollout_server.ServerSettings`; its fields of the
            0.1 API, and ``state``, are also attributes of the same name (``metrics``,
            ``gateway`` and ``model_endpoints`` are not: read them here).
        requires_auth: Whether requests must carry the API key.
        metrics: The Prometheus metrics (``GET /metrics``), or None when turned off.
        tracing: The OpenTelemetry spans of the server, or None when it does not trace.
        model_router: The model gateway that gives each rollout a route (and captures its
            turns), or None.
        deliveries: Told of every first delivery of a result; the shutdown's collect
            window waits on it.
        state: Where admissions and results are kept (``memory:`` or ``sqlite:///...``,
            the setting of the same name).
        recovery: What the last start recovered from ``state`` (counts).
    """

    def __init__(
        self,
        *,
        backend: ExecutionBackend,
        result_wait_timeout_sec: float | None = None,
        polling_lease_timeout_sec: float | None = None,
        result_retention_sec: float | None = None,
        max_body_bytes: int | None = None,
        shutdown_timeouts: ShutdownTimeouts | None = None,
        keepalive_timeout_sec: float = DEFAULT_KEEPALIVE_TIMEOUT_SEC,
        header_read_timeout_sec: float = DEFAULT_HEADER_READ_TIMEOUT_SEC,
        body_read_timeout_sec: float = DEFAULT_BODY_READ_TIMEOUT_SEC,
        requires_auth: bool = False,
        access_log: bool = False,
        status_change_grace_sec: float = DEFAULT_STATUS_CHANGE_GRACE_SEC,
        metrics: bool = True,
        tracing: ServerTracing | None = None,
        settings: ServerSettings | None = None,
        state: str | None = None,
        model_router: ModelRouter | None = None,
    ) -> None:
        """Build the server from ``settings``, or from the keyword of each setting (None,
        or a field's default, is "not given"; see :class:`~rollout_server.ServerSettings`
        for each one's meaning, default and range).

        Raises:
            ServerConfigError: If a setting is out of range, or ``settings`` and a setting's
                keyword are both given.

        .. versionchanged:: 0.3
           ``settings`` and ``state``; the settings are validated here too.
        """
        settings = resolve_settings(
            settings,
            {
                "result_wait_timeout_sec": result_wait_timeout_sec,
                "polling_lease_timeout_sec": polling_lease_timeout_sec,
                "result_retention_sec": result_retention_sec,
                "max_body_bytes": max_body_bytes,
                "shutdown_timeouts": shutdown_timeouts,
                "keepalive_timeout_sec": keepalive_timeout_sec,
                "header_read_timeout_sec": header_read_timeout_sec,
                "body_read_timeout_sec": body_read_timeout_sec,
                "access_log": access_log,
                "status_change_grace_sec": status_change_grace_sec,
                "metrics": metrics,
                "state": state,
            },
        )
        self.backend = backend
        self.settings = settings
        self.result_wait_timeout_sec = settings.result_wait_timeout_sec
        self.polling_lease_timeout_sec = settings.polling_lease_timeout_sec
        self.result_retention_sec = settings.result_retention_sec
        self.max_body_bytes = settings.max_body_bytes
        self.shutdown_timeouts = settings.shutdown_timeouts
        self.keepalive_timeout_sec = settings.keepalive_timeout_sec
        self.header_read_timeout_sec = settings.header_read_timeout_sec
        self.body_read_timeout_sec = settings.body_read_timeout_sec
        self.requires_auth = requires_auth
        self.access_log = settings.access_log
        self.status_change_grace_sec = settings.status_change_grace_sec
        self.process_id = str(uuid.uuid4())
        self.instance_id = _instance_id_from_env() or self.process_id
        self.metrics = ServerMetrics(self) if settings.metrics else None
        self.tracing = tracing
        self.model_router = model_router
        self._capture = None if model_router is None else TurnCapture(model_router)
        self.deliveries = DeliveryWatch()
        observers: list[PublicationObserver] = [
            observer for observer in (self.metrics, tracing) if observer is not None
        ]
        observers.append(self.deliveries)
        self.registry = RolloutRegistry(
            polling_lease_timeout_sec=settings.polling_lease_timeout_sec,
            result_retention_sec=settings.result_retention_sec,
            on_lease_expired=self._on_lease_expired,
            outcome_of=execution_result if self._capture is None else self._capture.outcome_of,
            status_change_grace_sec=settings.status_change_grace_sec,
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
        self._takes_turns = admission_mode_of(backend) == "started_work"
        self._turns: AdmissionTurns | None = None
        self._accepting = True
        self._side_tasks: set[asyncio.Task[Any]] = set()
        self._drain_task: asyncio.Task[None] | None = None
        self._hurry: asyncio.Future[None] | None = None
        self.state = settings.state
        self._store: StateStore = store_for(parse_state_url(settings.state))
        self.recovery = Recovery()

    # -- durable state --------------------------------------------------------------------

    async def open_state(self) -> None:
        """Open the state store and recover what it holds: results stay collectable with
        their original lease tokens, rollouts that were in flight are published as
        ``failure`` / ``internal_error`` naming the server process that ended (see
        ``protocol/_recovery.py``). The app does it before it serves.

        Raises:
            ServerConfigError: If the store cannot be opened: a file that is corrupt, held by
                another server, read-only or of a newer schema (``rollout-server serve``
                exits 2 with the message).
        """
        reattacher = reattacher_of(self.backend)
        if reattacher is not None:
            reattacher._bind_state(self.state)
        try:
            self.recovery = await recover(
                self.registry, self._store, process_id=self.process_id, reattacher=reattacher
            )
        except BaseException:
            if reattacher is not None:
                await self.close()  # the backend's start failed: release the state store
            raise

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

    async def admit(self, init: RolloutInitRequest) -> str | Refusal:
        """Admit ``init``: check shutdown, then room in the backend, then duplicates (in
        that order); register it and schedule its execution task.

        Returns:
            The lease token, or why the rollout was refused.
        """
        link = self.registry.store_link
        if not self._takes_turns:
            return self._admit_now(init) if link is None else await self._admit_stored(init, link)
        turns = self._turns
        if turns is None:
            turns = self._turns = AdmissionTurns(self.registry.loop)
        await turns.take()
        try:
            return self._admit_now(init) if link is None else await self._admit_stored(init, link)
        finally:
            turns.give_back()

    def _refusal(self, init: RolloutInitRequest) -> Refusal | None:
        """Why ``init`` cannot be admitted now, if it cannot; else the backend's room is
        taken (one ``try_reserve()``, whatever the backend's ``admission_mode``)."""
        if not self._accepting:
            return Refusal.SHUTTING_DOWN
        backend = self.backend
        if not backend.try_reserve():
            return Refusal.QUEUE_FULL
        if init.rollout_id in self.registry:
            self._release_reservation()
            return Refusal.DUPLICATE
        return None

    def _admit_now(self, init: RolloutInitRequest) -> str | Refusal:
        refusal = self._refusal(init)
        return self._register(init, None) if refusal is None else refusal

    async def _admit_stored(self, init: RolloutInitRequest, link: StoreLink) -> str | Refusal:
        """Admit ``init`` once its admission is durable (the id is held meanwhile).

        Raises:
            StoreWriteError: If the admission could not be stored (the route answers 503).
        """
        refusal = self._refusal(init)
        if refusal is not None:
            return refusal
        try:
            token = await link.admit(init.rollout_id)
        except BaseException:
            self._release_reservation()
            raise
        if not self._accepting:  # shutdown began during the write
            link.forget(init.rollout_id)
            self._release_reservation()
            return Refusal.SHUTTING_DOWN
        return self._register(init, token)

    def _register(self, init: RolloutInitRequest, token: str | None) -> str:
        registry = self.registry
        backend = self.backend
        observer = self._observer
        trace_scope = self._trace_scope
        admitted_at = time.monotonic()
        scheduled = False

        def start(record: RolloutRecord) -> asyncio.Task[Any]:
            capture = self._capture
            route = None if capture is None else capture.open(init)
            request = request_from_init(
                init,
                admitted_at=admitted_at,
                on_status=StatusSink(registry, record),
                observer=observer,
            )
            if route is not None:
                # The backend sees the rollout's route: a backend that builds its own
                # context (in a worker process) calls the gateway too.
                request = attrs.evolve(request, chat_completions_url=route.base_url)
            nonlocal scheduled
            scheduled = True  # start_execution schedules _on_start before anything else
            if self._turns is not None:
                self._turns.unstarted += 1
            # Traced: the task's context gets the rollout's span (and the server's tracer).
            with trace_scope(record):
                task = start_execution(
                    registry=registry,
                    backend=backend,
                    record=record,
                    request=request,
                    process_id=self.process_id,
                    on_start=self._on_start,
                    model_route=route,
                )
            if capture is not None and route is not None:
                capture.watch(task, route)
            return task

        try:
            _record, token = registry.register(init.rollout_id, start, admitted_at, token)
        except BaseException:
            if not scheduled:
                self._release_reservation()
            raise
        return token

    def _on_start(self) -> None:
        """An admitted rollout starts (or never will): end its reservation or turn."""
        if self._turns is not None:
            self._turns.started()
        self._release_reservation()

    def _release_reservation(self) -> None:
        try:
            self.backend.release_reservation()
        except Exception:
            logger.exception("backend.release_reservation() failed")

    @property
    def captures_turns(self) -> bool:
        """Whether the server runs a model gateway (and so can answer ``return_turns``)."""
        return self._capture is not None

    # -- cancellation ---------------------------------------------------------------------

    async def cancel(self, selection: CancelRolloutsRequest) -> dict[str, CancelDisposition]:
        """Cancel the selected rollouts (spec section 4.9); return one disposition per id.

        Finished and unknown ids are ``not_found``; a repeated cancel before publication
        returns the first disposition. The backend is asked first; the server's own
        execution task is the fallback (see ``rollout_server.protocol._cancellation``).
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
        return health_document(
            backend=self.backend,
            store=self._store,
            recovery=self.recovery,
            instance_id=self.instance_id,
            process_id=self.process_id,
            lifecycle=RolloutLifecycle(
                accepting_rollouts=self._accepting, active_rollouts=self.registry.active
            ),
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
            logger.info("Rollout server shutting down: admissions closed")

    async def drain(self, *, collect: bool = True) -> None:
        """Run the staged shutdown (see ``rollout_server.protocol._shutdown``) once.

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
        await self._store.close()
