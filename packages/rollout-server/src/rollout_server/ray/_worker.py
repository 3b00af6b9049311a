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

Requests and outcomes travel as tuples of plain values (:mod:`rollout_server.ray._codec`).

This module does not import Ray: the backend wraps the class with ``ray.remote`` when it
starts, so importing ``rollout_server`` never needs Ray.
"""

from __future__ import annotations

import asyncio
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
from ._codec import PhaseTimes, decode_request, encode_outcome

__all__ = ["CANCELLED", "GRADING_REPORT_DELAY_SEC", "RolloutWorker", "WorkerSpec"]

CANCELLED: Final = "cancelled"
"""What :meth:`RolloutWorker.run` returns for a rollout that a cancellation stopped."""

EVENTS_WAIT_SEC: Final = 30.0
"""Longest :meth:`RolloutWorker.events` waits for a report before answering without one
(the server then asks again)."""

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

    def build(self) -> LocalBackend:
        """The worker's LocalBackend (``artifact_root`` None: the worker's own default)."""
        return LocalBackend(
            self.workflow,
            workflow_config=self.workflow_config,
            grader=self.grader,
            grader_config=self.grader_config,
            artifact_root=self.artifact_root,
        )


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


class RolloutWorker:
    """A Ray actor that executes rollouts with a :class:`LocalBackend` (module docstring).

    Args:
        spec: The arguments of its LocalBackend.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self._backend = spec.build()
        self._tasks: dict[int, asyncio.Task[Any] | None] = {}
        self._cancelled_early: set[int] = set()
        self._grading: list[int] = []
        self._reported: list[int] = []
        self._changed: asyncio.Event | None = None
        self._flush: asyncio.TimerHandle | None = None

    async def ready(self) -> dict[str, Any]:
        """Where this worker runs: ``{"pid", "node_id", "node_ip", "host"}``."""
        import ray

        context = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
        }

    async def run(self, payload: tuple[Any, ...]) -> tuple[Any, ...] | str:
        """Execute one rollout; return ``encode_outcome()``'s tuple, or
        :data:`CANCELLED`. An exception of ``execute()`` becomes a categorised failure, as
        the server reports one.

        Args:
            payload: ``encode_request()``'s tuple; its first item is the dispatch key
                (unique per pool), by which reports and cancellations name the rollout.
        """
        key: int = payload[0]
        if key in self._cancelled_early:
            self._cancelled_early.discard(key)
            return CANCELLED
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
        The server keeps one call in flight per worker.
        """
        if not self._reported:
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.clear()
            try:
                async with asyncio.timeout(EVENTS_WAIT_SEC):
                    await self._changed.wait()
            except TimeoutError:
                return []
        batch, self._reported = self._reported, []
        return [key for key in batch if key in self._tasks]

    async def shutdown(self) -> None:
        """Wait (bounded) for trajectory writes still in flight."""
        await self._backend.shutdown()

    def _report_grading(self, key: int) -> None:
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
