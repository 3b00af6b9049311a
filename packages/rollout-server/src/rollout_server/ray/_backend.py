"""``RayBackend``: run agent workflows and graders on a pool of Ray actors.

The server stays the light front (admission, leases, long polls, publication); each
rollout runs in one of ``num_workers`` long-lived async actors
(:class:`~rollout_server.ray._worker.RolloutWorker`), each a :class:`LocalBackend` built
from the RayBackend's own arguments. One rollout, as :meth:`RayBackend.execute` runs it:

1. Take a free slot in the pool, or wait for one (status ``queued``) in arrival order;
   the agent deadline already counts, and a rollout whose deadline passes here fails as
   ``timeout`` without reaching a worker (and so without a trajectory file).
2. Dispatch it to the least-loaded live worker (status ``running``: it holds that
   worker's slot). The worker reports ``grading`` when the grader starts and the pool
   relays it (:mod:`rollout_server.ray._pool`).
3. The worker runs LocalBackend's phases (deadlines, grading gate, error categories,
   artifacts and trajectory files on its node) and returns the outcome with the phase
   times, which go to the server's observer (its metrics).

Meanwhile the server enforces the rollout's own deadline plus ``deadline_grace_sec``, so
a wedged worker cannot hold a rollout forever; a cancellation is forwarded to the worker
and, without an acknowledgement within ``cancel_grace_sec``, the worker is killed and
replaced; a worker that dies fails each of its rollouts as ``internal_error`` with the
cause. Ray never re-runs a rollout: a caller retries with a new id.

On durable state (the server tells the backend its state URL before it starts) with a Ray
cluster the backend joins, the workers outlive the server process: named, detached actors
that keep their latest outcomes (:mod:`rollout_server.ray._actors`). A server restarted on
the same state re-attaches (:meth:`RayBackend._reattach`, called by the server's recovery):
it takes the workers over, collects what finished while it was down and waits again for
what still runs. A graceful shutdown kills them; with ``memory:`` state or a local cluster
the backend starts itself, the workers are anonymous actors of the server process.

Importing this module does not import Ray; :meth:`RayBackend.startup` does.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final

from rollout_types import RolloutErrorCategory, RolloutStatus

from .._logtext import get_logger
from ..execution._backend import ExecutionOutcome, ExecutionRequest, ExecutionResult
from ..execution._context import current_rollout_context
from ..execution._grader import Grader, GraderConfig
from ..execution._local_backend import LocalBackend
from ..execution._phases import Phase, RolloutRun, timed_out
from ..execution._reattach import Reattached
from ..execution._slot_backend import SlotBackend
from ..execution._workflow import AgentWorkflow, AgentWorkflowConfig
from ._actors import actor_options, describe_options, kept_outcomes, state_namespace
from ._codec import decode_outcome
from ._dispatch import Dispatch, PoolWorker, RolloutLostError, ServerDeadlineError
from ._pool import WorkerPool
from ._worker import CANCELLED, RolloutWorker, WorkerSpec

__all__ = ["RayBackend"]

logger: Final = get_logger("rollout_server.ray_backend")

DEFAULT_CANCEL_GRACE_SEC: Final = 5.0
DEFAULT_DEADLINE_GRACE_SEC: Final = 5.0
DEFAULT_START_TIMEOUT_SEC: Final = 120.0

LOOPBACK_ENV: Final = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to ``0`` (unless set already) before RayBackend imports Ray to start a local cluster
itself: every Ray process then binds to 127.0.0.1 only (Ray reads it when imported)."""

INSTALL_HINT: Final = "RayBackend needs Ray: pip install 'rollout-server[ray]'"


def _positive_seconds(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a finite number of seconds > 0; got {value!r}")
    return float(value)


def _failed(exc: Exception, category: RolloutErrorCategory) -> ExecutionOutcome:
    """The outcome of a rollout the server ended itself (``exc`` says why)."""
    return ExecutionOutcome(
        workflow=ExecutionResult(
            status=RolloutStatus.FAILURE, err_message=str(exc), err_category=category
        )
    )


class RayBackend(SlotBackend[PoolWorker]):
    """Run an :class:`~rollout_server.AgentWorkflow` (and a grader) on a pool of Ray actors.

    Each worker is a :class:`LocalBackend` built from this backend's ``workflow``,
    ``workflow_config``, ``grader``, ``grader_config`` and ``artifact_root``, so the same
    classes and configs run unchanged under both, and each worker has the slots a
    LocalBackend would have (the config's ``concurrency.max_concurrent``, 4 without a
    config). Pass the classes as import strings (``"package.module:Attr"``) or as classes
    whose module every node can import (classes defined in ``__main__`` travel by value).

    Args:
        workflow: The workflow class, or an import string naming it.
        workflow_config: As for :class:`LocalBackend`; its ``concurrency.max_concurrent``
            is the slot count of each worker (None: no limit).
        grader: The grader class, an import string, or None (no grading).
        grader_config: As for :class:`LocalBackend`.
        num_workers: How many worker actors the pool keeps; default 1.
        max_queued: With a slot limit, the most rollouts that may wait for a slot in the
            server: when that many wait (and no slot of a live worker is free), admission
            answers 429. None (the default) queues without bound; 0 refuses whenever every
            slot is busy.
        worker_options: Ray actor options of each worker (``num_cpus``, ``num_gpus``,
            ``memory``, ``resources``, ``runtime_env``, ``scheduling_strategy``, ...);
            default ``{"num_cpus": 1, "enable_task_events": False}``. The pool sets
            ``max_restarts``, ``max_task_retries``, ``max_concurrency`` and
            ``concurrency_groups`` itself.
        address: The Ray cluster to join; default ``$RAY_ADDRESS``, else a new local
            cluster (bound to 127.0.0.1). Ignored when Ray is initialised already. A
            cluster the backend joins outlives the server: on durable state its workers
            are then named and detached, and a restarted server re-attaches to them
            (the README's "Workers that outlive the server").
        init_options: Further keyword arguments of ``ray.init()`` (such as ``num_cpus``
            or ``runtime_env``), used only when this backend initialises Ray.
        artifact_root: Directory on each worker's node under which rollout files go;
            default as for :class:`LocalBackend`, read on the worker.
        cancel_grace_sec: How long a worker has to acknowledge a cancellation before it
            is killed and replaced (its other rollouts then fail); default 5.0.
        deadline_grace_sec: How long past a rollout's deadline (agent, then grader) the
            server waits for its worker before it publishes a ``timeout`` itself and
            treats the worker as wedged; covers the trajectory write; default 5.0.
        start_timeout_sec: Bound on starting one worker (scheduling, ``runtime_env``,
            imports); default 120.0.

    Raises:
        ValueError: On an invalid count, option or grace, a ``max_queued`` without a slot
            limit, or a malformed import string.
        ImportError: When an import string names a missing module or attribute.
        TypeError: When ``workflow``/``grader`` is not a concrete subclass of the base
            class, or a config is not a config.

    .. versionadded:: 0.2
    """

    def __init__(
        self,
        workflow: type[AgentWorkflow] | str,
        *,
        workflow_config: AgentWorkflowConfig | Mapping[str, Any] | str | None = None,
        grader: type[Grader] | str | None = None,
        grader_config: GraderConfig | Mapping[str, Any] | str | None = None,
        num_workers: int = 1,
        max_queued: int | None = None,
        worker_options: Mapping[str, Any] | None = None,
        address: str | None = None,
        init_options: Mapping[str, Any] | None = None,
        artifact_root: str | os.PathLike[str] | None = None,
        cancel_grace_sec: float = DEFAULT_CANCEL_GRACE_SEC,
        deadline_grace_sec: float = DEFAULT_DEADLINE_GRACE_SEC,
        start_timeout_sec: float = DEFAULT_START_TIMEOUT_SEC,
    ) -> None:
        # The workers' LocalBackend, built here once: it resolves and checks every argument
        # as LocalBackend does, and says how many slots each worker has.
        template = LocalBackend(
            workflow,
            workflow_config=workflow_config,
            grader=grader,
            grader_config=grader_config,
            max_queued=max_queued,
            artifact_root=artifact_root,
        )
        count: object = num_workers
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"num_workers must be an int >= 1; got {num_workers!r}")
        self._num_workers = num_workers
        self._slots = template.max_concurrent
        super().__init__(
            slots=None if self._slots is None else num_workers * self._slots,
            max_queued=max_queued,
        )
        self._actor_options = actor_options(worker_options, self._slots)
        self._spec = WorkerSpec(
            workflow=workflow,
            workflow_config=workflow_config,
            grader=grader,
            grader_config=grader_config,
            artifact_root=None if artifact_root is None else os.fspath(artifact_root),
        )
        self._address = address
        self._init_options = dict(init_options or {})
        self._cancel_grace_sec = _positive_seconds("cancel_grace_sec", cancel_grace_sec)
        self._deadline_grace_sec = _positive_seconds("deadline_grace_sec", deadline_grace_sec)
        self._start_timeout_sec = _positive_seconds("start_timeout_sec", start_timeout_sec)
        self._pool: WorkerPool | None = None
        self._starting: asyncio.Future[WorkerPool] | None = None
        self._owns_ray = False
        self._address_used: str | None = None
        self._cluster_address: str | None = None
        self._state_namespace: str | None = None

    # -- properties -------------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        """How many workers the pool keeps."""
        return self._num_workers

    @property
    def max_concurrent_per_worker(self) -> int | None:
        """Slots of each worker, or None for no limit."""
        return self._slots

    @property
    def cluster_address(self) -> str | None:
        """The Ray cluster's address once started (its GCS ``host:port``), else None."""
        return self._cluster_address

    # -- lifecycle --------------------------------------------------------------------

    async def startup(self) -> None:
        """Initialise Ray if needed and start the workers; the app calls it at startup.

        Joins ``address`` (else ``$RAY_ADDRESS``, else starts a local cluster) unless Ray
        is initialised already. Concurrent calls wait for the same start.

        Raises:
            ImportError: When Ray is not installed.
            RuntimeError: When a worker cannot start within ``start_timeout_sec``.
        """
        if self._pool is not None:
            return
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> WorkerPool:
        address = self._address or os.environ.get("RAY_ADDRESS") or "local"
        if address == "local":
            # Read when Ray is imported: too late if the application imported Ray already.
            os.environ.setdefault(LOOPBACK_ENV, "0")
        try:
            import ray
        except ImportError as exc:
            raise ImportError(INSTALL_HINT) from exc
        if not ray.is_initialized():
            ray.init(address=address, **self._init_options)
            self._owns_ray = True
            self._address_used = address
        self._cluster_address = ray.get_runtime_context().gcs_address
        # Named, detached workers only when both outlive this process: the state, and a
        # cluster this backend joins (a local cluster it starts ends with it).
        namespace = self._state_namespace if address != "local" else None
        pool = WorkerPool(
            remote_class=ray.remote(RolloutWorker),
            spec=self._spec,
            size=self._num_workers,
            slots=self._slots,
            actor_options=self._actor_options,
            start_timeout_sec=self._start_timeout_sec,
            cancel_grace_sec=self._cancel_grace_sec,
            deadline_grace_sec=self._deadline_grace_sec,
            namespace=namespace,
            keep_outcomes=kept_outcomes(self._slots),
        )
        try:
            await pool.start()
        except RuntimeError as exc:
            asks = describe_options(self._actor_options)
            raise RuntimeError(
                f"{exc} (each worker asks for {asks}; check that the "
                f"cluster at {self._cluster_address} has room for {self._num_workers} of them "
                "and that every node can import the workflow and grader modules)"
            ) from exc.__cause__
        self._pool = pool
        logger.info(
            "RayBackend started %d worker(s) x %s slot(s) on the Ray cluster at %s%s",
            self._num_workers,
            "unlimited" if self._slots is None else self._slots,
            self._cluster_address,
            ""
            if namespace is None
            else f" (named, detached workers in the Ray namespace {namespace}: a crash leaves "
            "them for the next start on the same state; a SIGTERM stops them)",
        )
        return pool

    def _bind_state(self, state_url: str) -> None:
        """The server's state URL, before the backend starts: on durable state
        (``sqlite:``), workers are named and detached in :func:`state_namespace` when the
        Ray cluster is one this backend joins (so it outlives the server process)."""
        self._state_namespace = None if state_url == "memory:" else state_namespace(state_url)

    async def _reattach(
        self, on_status: Mapping[str, Callable[[RolloutStatus], None]]
    ) -> Reattached:
        """Start the pool, and take back the rollouts of ``on_status`` that named workers
        of a previous server process on the same state finished or still run."""
        await self.startup()
        pool = self._pool
        assert pool is not None
        if pool.namespace is None:
            return Reattached(running={})
        finished, running = await pool.reattach(on_status)
        held_from = time.monotonic()
        coroutines: dict[str, Coroutine[Any, Any, ExecutionOutcome]] = {
            rollout_id: self._collected(reply) for rollout_id, reply in finished.items()
        }
        for rollout_id, dispatch in running.items():
            coroutines[rollout_id] = self._outcome(pool, dispatch, held_from)
        causes = []
        if pool.gone:
            which = ", ".join(str(index) for index in pool.gone)
            causes.append(f"Ray worker(s) {which} of the pool ended while it was down")
        if pool.retired:
            causes.append(
                f"{pool.retired} Ray worker(s) beyond num_workers={self._num_workers} were "
                "stopped at the restart"
            )
        note = f"; {' and '.join(causes)}, and no live worker holds the rollout" if causes else None
        logger.info(
            "RayBackend re-attached to %d worker(s) of the previous server process: %d "
            "rollout(s) finished meanwhile, %d still running%s",
            self._num_workers - len(pool.gone),
            len(finished),
            len(running),
            f"; worker(s) {', '.join(map(str, pool.gone))} were gone and are replaced"
            if pool.gone
            else "",
        )
        return Reattached(running=coroutines, note=note)

    @staticmethod
    async def _collected(reply: Any) -> ExecutionOutcome:
        """The outcome of a rollout that finished on its worker while no server waited."""
        if reply == CANCELLED:
            return ExecutionOutcome(
                workflow=ExecutionResult(status=RolloutStatus.CANCELLED, err_message="cancelled")
            )
        outcome, _times = decode_outcome(reply)
        return outcome

    async def shutdown(self) -> None:
        """Let the workers finish their file writes (bounded), release the actors, and
        shut Ray down if this backend initialised it."""
        pool = self._pool
        if pool is None and self._starting is not None and not self._starting.done():
            self._starting.cancel()
        if pool is not None:
            await pool.close()
        if self._owns_ray:
            import ray

            logger.info(
                "RayBackend: %s at %s",
                "stopping the local Ray cluster it started"
                if self._address_used == "local"
                else "disconnecting from the Ray cluster",
                self._cluster_address,
            )
            ray.shutdown()
            self._owns_ray = False
        logger.info("RayBackend: shutdown complete")

    # -- slots (SlotBackend) ----------------------------------------------------------

    def _load(self) -> tuple[int, int]:
        pool = self._pool
        return (0, 0) if pool is None else (pool.slots.running, pool.slots.queued)

    def _live_slots(self) -> int | None:
        """The slots of the live workers (none before the pool has started)."""
        pool = self._pool
        if pool is None:
            return None if self._slots is None else 0
        return pool.slots.capacity()

    def _take_slot(self) -> PoolWorker | None:
        assert self._pool is not None  # execute() starts the pool first
        return self._pool.slots.take()

    async def _wait_for_slot(self, deadline: float | None) -> PoolWorker | None:
        assert self._pool is not None
        return await self._pool.slots.acquire(deadline)

    # -- health -----------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """``{"status", "concurrency": {...}, "ray": {...}}``.

        ``status`` is ``ok`` while every worker serves, ``degraded`` while some are being
        replaced, ``unavailable`` while none serves and ``starting`` before the pool has
        started. ``concurrency`` has LocalBackend's keys (``max_concurrent`` counts the
        slots of every worker, None without a limit); ``ray`` has the cluster
        ``address``, the ``workers`` configured and ``workers_alive``,
        ``slots_per_worker``, ``free_slots``, the count of workers ``lost`` and
        ``replaced``, and one entry per worker.
        """
        pool = self._pool
        slots = self._slots
        ray_fields: dict[str, Any] = {
            "address": self._cluster_address,
            "namespace": None if pool is None else pool.namespace,
            "workers": self._num_workers,
            "workers_alive": 0 if pool is None else pool.slots.alive,
            "slots_per_worker": slots,
            "free_slots": (0 if slots is not None else None)
            if pool is None
            else pool.slots.free_slots(),
            "lost": 0 if pool is None else pool.lost_count,
            "replaced": 0 if pool is None else pool.replacements,
            "pool": []
            if pool is None
            else [
                {"index": index, "alive": False} if w is None else w.describe()
                for index, w in enumerate(pool.workers)
            ],
        }
        if pool is None:
            status = "starting"
        elif pool.slots.alive == self._num_workers:
            status = "ok"
        else:
            status = "degraded" if pool.slots.alive else "unavailable"
        return {"status": status, "concurrency": self._concurrency(), "ray": ray_fields}

    # -- execution --------------------------------------------------------------------

    async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
        """Run one rollout on a worker (module docstring).

        Args:
            request: The admitted rollout.

        Returns:
            The worker's outcome (without the trajectory snapshot and the diagnostics,
            which stay in the files on the worker's node).

        Raises:
            asyncio.CancelledError: When cancelled; the rollout has stopped on its worker
                (or the worker was killed) by the time this raises, unless a second
                cancellation cut the wait short.
        """
        pool = self._pool
        if pool is None:
            await self.startup()
            pool = self._pool
            assert pool is not None
        run = RolloutRun.start(request)
        worker = await self._queue_for_slot(run)
        if worker is None:  # the agent deadline passed first
            return ExecutionOutcome(workflow=timed_out(run, Phase.WORKFLOW))
        held_from = time.monotonic()
        request.on_status(RolloutStatus.RUNNING)
        ambient = current_rollout_context()
        process_id = (
            ambient.process_id if ambient is not None and ambient.rollout_id == request.id else ""
        )
        timeout = request.agent_timeout_sec
        # The server's deadline for the workflow, on the loop's clock: the agent deadline
        # plus the grace.
        deadline = (
            None
            if timeout is None
            else asyncio.get_running_loop().time()
            + (run.entered + timeout - held_from)
            + self._deadline_grace_sec
        )
        dispatch = pool.dispatch(worker, request, held_from - run.entered, process_id, deadline)
        return await self._outcome(pool, dispatch, held_from)

    async def _outcome(
        self, pool: WorkerPool, dispatch: Dispatch, held_from: float
    ) -> ExecutionOutcome:
        """Wait for ``dispatch``'s reply (its slot held since ``held_from``) and make it
        the outcome; a cancellation is forwarded to the worker."""
        request = dispatch.request
        try:
            reply = await dispatch.future
        except asyncio.CancelledError:
            await pool.stop(dispatch, "the rollout was cancelled")
            raise
        except ServerDeadlineError as exc:
            logger.error("Rollout %s: %s; cancelling it there", request.id, exc)
            return _failed(exc, RolloutErrorCategory.TIMEOUT)
        except RolloutLostError as exc:
            logger.error("Rollout %s: %s", request.id, exc)
            return _failed(exc, RolloutErrorCategory.INTERNAL_ERROR)
        self._slot_held_for(time.monotonic() - held_from)
        if reply == CANCELLED:
            # Stopped on the worker without a cancellation from here (Ray's own).
            return ExecutionOutcome(
                workflow=ExecutionResult(status=RolloutStatus.CANCELLED, err_message="cancelled")
            )
        outcome, times = decode_outcome(reply)
        times.replay(request.observer)
        return outcome
