"""The Ray actor of :class:`~rollout_server.RayBackend`: a :class:`LocalBackend` in a worker.

One :class:`RolloutWorker` runs many rollouts at once on its own event loop. Each rollout
is ``LocalBackend.execute()`` itself (deadlines, the grading gate, error categories, the
artifacts directory and the trajectory files, all on the worker's node), with the
rollout's :class:`~rollout_server.RolloutContext` bound, as the server runs it in process.
The worker's LocalBackend is built from the same arguments as the RayBackend's, so it has
the slot count the server's pool gives each worker: nothing ever queues here.

The server talks to the actor through five methods:

* :meth:`RolloutWorker.run` executes one rollout and returns its outcome with the phase
  times the LocalBackend measured (:func:`~rollout_server.ray._codec.encode_outcome`),
  or :data:`CANCELLED` once a cancellation has stopped it: the call's end is the
  server's acknowledgement that the rollout no longer runs. One call per rollout, and
  nothing else on the way for most: ``running`` is the server's to report (it holds the
  worker's slot from the dispatch);
* :meth:`RolloutWorker.events` is a long poll for ``grading`` reports: one call in flight
  per worker carries them for all its rollouts, after :data:`GRADING_REPORT_DELAY_SEC`, and
  a rollout that ends before then has its report folded into its result (never sent);
* :meth:`RolloutWorker.cancel` cancels rollouts by dispatch key (before or after their
  ``run`` call has arrived);
* :meth:`RolloutWorker.ready` says which process and node the actor runs in;
* :meth:`RolloutWorker.shutdown` waits (bounded) for trajectory writes still in flight.

A worker that outlives the server process (a named, detached actor of a pool on durable
state; :mod:`rollout_server.ray._pool`) is built with ``keep_outcomes > 0``. Each rollout
then runs in a task of its own, which a ``run`` call whose caller died leaves running, and
every outcome is kept (the latest ``keep_outcomes``, each for at most
:data:`KEPT_OUTCOME_SEC`) by rollout id, so a restarted server collects it:

* :meth:`RolloutWorker.collect` answers which of the rollouts a restarted server asks for
  have finished (their outcomes) and which still run (their request and dispatch key);
  every other rollout still running is one no server waits for any more: it is cancelled;
* :meth:`RolloutWorker.wait` is ``run``'s wait for a rollout that runs already.

Requests and outcomes travel as tuples of plain values (:mod:`rollout_server.ray._codec`).

This module does not import Ray: the backend wraps the class with ``ray.remote`` when it
starts, so importing ``rollout_server`` never needs Ray.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
import socket
import time
from typing import Any, Final

import attrs

from rollout_types import RolloutStatus

from ..execution._backend import ExecutionOutcome, ExecutionResult
from ..execution._categorize import categorize_exception
from ..execution._context import RolloutContext, bind_rollout_context
from ..execution._local_backend import LocalBackend
from ._codec import PhaseTimes, decode_request, encode_outcome, payload_rollout_id

__all__ = [
    "CANCELLED",
    "GRADING_REPORT_DELAY_SEC",
    "KEPT_OUTCOME_SEC",
    "Collected",
    "RolloutWorker",
    "WorkerSpec",
]

CANCELLED: Final = "cancelled"
"""What :meth:`RolloutWorker.run` returns for a rollout that a cancellation stopped."""

EVENTS_WAIT_SEC: Final = 30.0
"""Longest :meth:`RolloutWorker.events` waits for a report before answering without one
(the server then asks again)."""

KEPT_OUTCOME_SEC: Final = 3600.0
"""Longest a worker that keeps outcomes (``keep_outcomes > 0``) keeps one for a restarted
server to collect (seconds)."""

GRADING_REPORT_DELAY_SEC: Final = 0.05
"""How long a ``grading`` report waits in the worker before it is sent (seconds): a
rollout that ends meanwhile has it folded into its result, which saves a round trip."""


@attrs.frozen(kw_only=True)
class WorkerSpec:
    """The arguments every worker of one pool builds its :class:`LocalBackend` with, as
    the RayBackend received them (it checked them by building a LocalBackend itself).

    Classes travel by reference (their import path) when their module is importable, by
    value otherwise (Ray's cloudpickle); import strings resolve on the worker.
    """

    workflow: type[Any] | str
    workflow_config: Any
    grader: type[Any] | str | None
    grader_config: Any
    artifact_root: str | None

    def fingerprint(self) -> str:
        """What the workers of two server processes compare: the workflow and grader (by
        import path), their configs and the artifact root, as one line of text."""
        return repr(
            (
                _named(self.workflow),
                self.workflow_config,
                _named(self.grader),
                self.grader_config,
                self.artifact_root,
            )
        )

    def build(self) -> LocalBackend:
        """The worker's LocalBackend (``artifact_root`` None: the worker's own default)."""
        return LocalBackend(
            self.workflow,
            workflow_config=self.workflow_config,
            grader=self.grader,
            grader_config=self.grader_config,
            artifact_root=self.artifact_root,
        )


def _named(value: Any) -> Any:
    if isinstance(value, type):
        return f"{value.__module__}:{value.__qualname__}"
    return value


# -- the actor -------------------------------------------------------------------------


class _Reporter:
    """``on_status`` of one rollout in the worker: keeps ``grading`` for :meth:`events`
    (``running`` is the server's to report; nothing queues here)."""

    __slots__ = ("_key", "_worker")

    def __init__(self, worker: RolloutWorker, key: int) -> None:
        self._worker = worker
        self._key = key

    def __call__(self, status: RolloutStatus | str) -> None:
        if status == RolloutStatus.GRADING:
            self._worker._report_grading(self._key)


@attrs.frozen(kw_only=True)
class Collected:
    """What :meth:`RolloutWorker.collect` answers.

    Attributes:
        finished: The outcome (``run``'s reply) of each asked-for rollout that has finished.
        running: Per asked-for rollout still running: its dispatch key, its ``run``
            payload, the seconds since the worker received it, and whether it grades.
        cancelled: How many rollouts nobody asked for were still running (now cancelled).
    """

    finished: dict[str, Any]
    running: dict[str, tuple[int, tuple[Any, ...], float, bool]]
    cancelled: int


class RolloutWorker:
    """A Ray actor that executes rollouts with a :class:`LocalBackend` (module docstring).

    Args:
        spec: The arguments of its LocalBackend.
        keep_outcomes: How many outcomes to keep for a restarted server to collect (each
            rollout then runs in a task of its own); default 0 (none: a worker that does
            not outlive its server).
    """

    def __init__(self, spec: WorkerSpec, keep_outcomes: int = 0) -> None:
        self._backend = spec.build()
        self._fingerprint = spec.fingerprint()
        self._tasks: dict[int, asyncio.Task[Any] | None] = {}
        self._cancelled_early: set[int] = set()
        self._grading: list[int] = []
        self._reported: list[int] = []
        self._changed: asyncio.Event | None = None
        self._flush: asyncio.TimerHandle | None = None
        self._keep = keep_outcomes
        # With keep_outcomes: the rollouts running (key -> payload, receipt, task), by id,
        # which of them grade, and the kept outcomes (id -> (monotonic stamp, reply)).
        self._live: dict[int, tuple[tuple[Any, ...], float, asyncio.Task[Any]]] = {}
        self._live_ids: dict[str, int] = {}
        self._grades: set[int] = set()
        self._kept: collections.OrderedDict[str, tuple[float, Any]] = collections.OrderedDict()
        self._generation = 0

    async def ready(self) -> dict[str, Any]:
        """Where this worker runs and what it was built from: ``{"pid", "node_id",
        "node_ip", "host", "spec"}`` (``spec``: :meth:`WorkerSpec.fingerprint`)."""
        import ray

        context = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
            "spec": self._fingerprint,
        }

    async def run(self, payload: tuple[Any, ...]) -> tuple[Any, ...] | str:
        """Execute one rollout; return ``encode_outcome()``'s tuple, or
        :data:`CANCELLED`. An exception of ``execute()`` becomes a categorised failure, as
        the server reports one.

        Args:
            payload: ``encode_request()``'s tuple; its first item is the dispatch key
                (unique per pool, and across the pool's server processes), by which
                reports and cancellations name the rollout.
        """
        key: int = payload[0]
        if key in self._cancelled_early:
            self._cancelled_early.discard(key)
            return CANCELLED
        if not self._keep:
            return await self._run(key, payload)
        rollout_id = payload_rollout_id(payload)
        task = asyncio.ensure_future(self._run(key, payload))
        self._tasks[key] = task  # cancel() reaches it before its first step, too
        self._live[key] = (payload, time.monotonic(), task)
        self._live_ids[rollout_id] = key
        task.add_done_callback(functools.partial(self._ended, key, rollout_id))
        # A cancelled call (its caller, a server process, died) leaves the rollout running.
        reply: tuple[Any, ...] | str = await asyncio.shield(task)
        return reply

    async def wait(self, key: int, rollout_id: str) -> tuple[Any, ...] | str | None:
        """``run``'s reply for a rollout that runs already (or has just finished): what a
        restarted server waits on; None when this worker holds no such rollout."""
        live = self._live.get(key)
        if live is not None:
            reply: tuple[Any, ...] | str = await asyncio.shield(live[2])
            return reply
        kept = self._kept.get(rollout_id)
        return None if kept is None else kept[1]

    async def collect(self, rollout_ids: list[str]) -> Collected:
        """What a restarted server asks for (module docstring): the outcomes of
        ``rollout_ids`` that finished (still kept, within the bounds), those still running,
        and every other running rollout cancelled. Answers the previous server's ``events``
        call."""
        self._generation += 1
        if self._changed is not None:
            self._changed.set()
        self._trim()
        asked = set(rollout_ids)
        # Kept, not handed over once: a server that crashes again before it has stored
        # them collects them again at its next start.
        finished = {rid: self._kept[rid][1] for rid in rollout_ids if rid in self._kept}
        running: dict[str, tuple[int, tuple[Any, ...], float, bool]] = {}
        now = time.monotonic()
        orphans: list[int] = []
        for rollout_id, key in self._live_ids.items():
            if rollout_id in asked:
                payload, received, _task = self._live[key]
                running[rollout_id] = (key, payload, now - received, key in self._grades)
            else:
                orphans.append(key)
        await self.cancel(orphans)
        return Collected(finished=finished, running=running, cancelled=len(orphans))

    def _ended(self, key: int, rollout_id: str, task: asyncio.Task[Any]) -> None:
        self._live.pop(key, None)
        self._grades.discard(key)
        if self._live_ids.get(rollout_id) == key:
            del self._live_ids[rollout_id]
        reply = CANCELLED if task.cancelled() or task.exception() is not None else task.result()
        self._kept[rollout_id] = (time.monotonic(), reply)
        self._kept.move_to_end(rollout_id)
        self._trim()

    def _trim(self) -> None:
        """Forget kept outcomes beyond the count and older than :data:`KEPT_OUTCOME_SEC`."""
        kept = self._kept
        while len(kept) > self._keep:
            kept.popitem(last=False)
        oldest = time.monotonic() - KEPT_OUTCOME_SEC
        while kept and next(iter(kept.values()))[0] < oldest:
            kept.popitem(last=False)

    async def _run(self, key: int, payload: tuple[Any, ...]) -> tuple[Any, ...] | str:
        times = PhaseTimes()
        request, process_id = decode_request(
            payload,
            lambda elapsed: time.monotonic() - max(0.0, elapsed),
            _Reporter(self, key),
            times,
        )
        context = RolloutContext.from_request(
            rollout_id=request.id,
            chat_completions_url=request.chat_completions_url,
            llm_api_key=request.llm_api_key,
            process_id=process_id,
            on_status=request.on_status,
        )
        self._tasks[key] = asyncio.current_task()
        try:
            with bind_rollout_context(context):
                outcome = await self._backend.execute(request)
        except asyncio.CancelledError:
            # By cancel() (or Ray's own cancellation): the rollout has stopped.
            return CANCELLED
        except Exception as exc:  # noqa: BLE001 - reported as the server would report it
            outcome = ExecutionOutcome(
                workflow=ExecutionResult(
                    status=RolloutStatus.FAILURE,
                    err_message=str(exc) or type(exc).__name__,
                    err_category=categorize_exception(exc),
                )
            )
        finally:
            del self._tasks[key]
        return encode_outcome(outcome, times)

    async def cancel(self, keys: list[int]) -> None:
        """Cancel the rollouts of ``keys``; a key whose ``run`` has not arrived yet is
        cancelled when it does."""
        for key in keys:
            if key not in self._tasks:
                self._cancelled_early.add(key)
                continue
            task = self._tasks[key]
            if task is not None:
                task.cancel()

    async def events(self) -> list[int]:
        """The keys of the rollouts that started grading since the previous call (and
        still run).

        Waits up to :data:`EVENTS_WAIT_SEC` for at least one (an empty list after that).
        The server keeps one call in flight per worker; a call of a previous server
        process ends (empty) once a restarted server has collected (:meth:`collect`).
        """
        generation = self._generation
        if not self._reported:
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.clear()
            try:
                async with asyncio.timeout(EVENTS_WAIT_SEC):
                    await self._changed.wait()
            except TimeoutError:
                return []
        if generation != self._generation:
            return []
        batch, self._reported = self._reported, []
        return [key for key in batch if key in self._tasks]

    async def shutdown(self) -> None:
        """Wait (bounded) for trajectory writes still in flight."""
        await self._backend.shutdown()

    def _report_grading(self, key: int) -> None:
        if self._keep:
            self._grades.add(key)
        self._grading.append(key)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(
                GRADING_REPORT_DELAY_SEC, self._send_grading
            )

    def _send_grading(self) -> None:
        self._flush = None
        batch, self._grading = self._grading, []
        self._reported += [key for key in batch if key in self._tasks]
        if self._reported and self._changed is not None:
            self._changed.set()
