"""The Ray actor of :class:`~rollout_server.RayBackend`: a :class:`LocalBackend` in a worker.

One :class:`RolloutWorker` runs many rollouts at once on its own event loop. Each rollout
is ``LocalBackend.execute()`` itself (deadlines, the grading gate, error categories, the
artifacts directory and the trajectory files, all on the worker's node), run as a task
with the rollout's :class:`~rollout_server.RolloutContext` bound, as the server runs it in
process. The server talks to the actor through four methods:

* :meth:`RolloutWorker.run` executes one rollout and returns its outcome (lightened: the
  trajectory snapshot and the diagnostics stay in the files written here), or
  :data:`CANCELLED` once a cancellation has stopped it: the call's end is the server's
  acknowledgement that the rollout no longer runs;
* :meth:`RolloutWorker.cancel` cancels rollouts by dispatch key (before or after their
  ``run`` call has arrived);
* :meth:`RolloutWorker.events` is a long poll for status changes (``running``,
  ``grading``): it answers as soon as there is at least one, with every change since the
  previous call, so one call in flight per worker carries the statuses of all its
  rollouts, batched under load;
* :meth:`RolloutWorker.ready` says which process and node the actor runs in.

This module does not import Ray: the backend wraps the class with ``ray.remote`` when it
starts, so importing ``rollout_server`` never needs Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from typing import Any, Final

import attrs

from rollout_types import RolloutErrorCategory, RolloutStatus

from ._backend import ExecutionOutcome, ExecutionRequest, ExecutionResult, Sample
from ._categorize import categorize_exception
from ._context import RolloutContext, context_binding
from ._grader import Grader, GraderConfig
from ._limiter import ConcurrencyLimiter
from ._local_backend import LocalBackend
from ._workflow import AgentWorkflow, AgentWorkflowConfig

__all__ = ["CANCELLED", "RolloutWorker", "WorkerSpec", "portable_request"]

CANCELLED: Final = "cancelled"
"""What :meth:`RolloutWorker.run` returns for a rollout that a cancellation stopped."""

EVENTS_WAIT_SEC: Final = 30.0
"""Longest :meth:`RolloutWorker.events` waits for a status change before answering
without one (the server then asks again)."""


@attrs.frozen(kw_only=True)
class WorkerSpec:
    """What every worker of one pool builds its :class:`LocalBackend` from.

    The classes travel by reference (their import path) when their module is importable,
    by value otherwise (Ray's cloudpickle), so they resolve on every node.
    """

    workflow: type[AgentWorkflow]
    workflow_config: AgentWorkflowConfig | None
    grader: type[Grader] | None
    grader_config: GraderConfig | None
    slots: int
    artifact_root: str | None


def _no_status(_status: RolloutStatus) -> None:
    return None


def portable_request(request: ExecutionRequest) -> ExecutionRequest:
    """``request`` as it travels to a worker: without the server's ``on_status`` and
    admission stamp (the worker sets both)."""
    return attrs.evolve(request, on_status=_no_status, admitted_at=0.0)


class _WorkerBackend(LocalBackend):
    """A :class:`LocalBackend` whose slot count is the pool's per-worker count.

    The server's pool never sends a worker more rollouts than it has slots, so nothing
    queues here; the workflow config is handed to each rollout unchanged.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(
            spec.workflow,
            workflow_config=spec.workflow_config,
            grader=spec.grader,
            grader_config=spec.grader_config,
            artifact_root=spec.artifact_root,
        )
        self._limiter = ConcurrencyLimiter(spec.slots)


class _Reporter:
    """``on_status`` of one rollout in the worker: queues the change for :meth:`events`."""

    __slots__ = ("_key", "_worker")

    def __init__(self, worker: RolloutWorker, key: int) -> None:
        self._worker = worker
        self._key = key

    def __call__(self, status: RolloutStatus | str) -> None:
        self._worker._report(self._key, status)


class RolloutWorker:
    """A Ray actor that executes rollouts with a :class:`LocalBackend` (module docstring).

    Args:
        spec: The workflow, grader, configs, slot count and artifact root.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self._backend = _WorkerBackend(spec)
        self._tasks: dict[int, asyncio.Task[ExecutionOutcome]] = {}
        self._cancelled_early: set[int] = set()
        self._events: list[tuple[int, str]] = []
        self._changed: asyncio.Event | None = None

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

    async def run(
        self, key: int, request: ExecutionRequest, elapsed_sec: float, process_id: str
    ) -> ExecutionOutcome | str:
        """Execute one rollout; return its outcome (see :func:`portable_outcome`), or
        :data:`CANCELLED`. An exception of ``execute()`` becomes a categorised failure, as
        the server reports one.

        Args:
            key: The dispatch key (unique per pool): status changes and cancellations
                name the rollout by it.
            request: The request, without its ``on_status`` (a server object).
            elapsed_sec: Seconds since the server admitted the rollout (the deadline
                counts from admission; monotonic clocks differ between nodes).
            process_id: The server's ``process_id``, for the rollout context.
        """
        admitted_at = time.monotonic() - max(0.0, elapsed_sec)
        reporter = _Reporter(self, key)
        request = attrs.evolve(request, admitted_at=admitted_at, on_status=reporter)
        context = RolloutContext.from_request(
            rollout_id=request.id,
            chat_completions_url=request.chat_completions_url,
            llm_api_key=request.llm_api_key,
            process_id=process_id,
            on_status=reporter,
        )
        if key in self._cancelled_early:
            self._cancelled_early.discard(key)
            return CANCELLED
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._backend.execute(request), context=context_binding(context))
        self._tasks[key] = task
        try:
            outcome = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                # The call itself was cancelled (ray.cancel): stop the rollout too.
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            return CANCELLED
        except Exception as exc:  # noqa: BLE001 - reported as the server would report it
            return ExecutionOutcome(
                workflow=ExecutionResult(
                    status=RolloutStatus.FAILURE,
                    err_message=str(exc) or type(exc).__name__,
                    err_category=categorize_exception(exc),
                )
            )
        finally:
            self._tasks.pop(key, None)
        return portable_outcome(outcome)

    async def cancel(self, keys: list[int]) -> None:
        """Cancel the rollouts of ``keys``; a key whose ``run`` has not arrived yet is
        cancelled when it does."""
        for key in keys:
            task = self._tasks.get(key)
            if task is None:
                self._cancelled_early.add(key)
            else:
                task.cancel()

    async def events(self) -> list[tuple[int, str]]:
        """The status changes since the previous call, as ``[(key, status), ...]``.

        Waits up to :data:`EVENTS_WAIT_SEC` for at least one (an empty list after that).
        The server keeps one call in flight per worker.
        """
        if not self._events:
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(EVENTS_WAIT_SEC):
                    await self._changed.wait()
        batch, self._events = self._events, []
        return batch

    async def shutdown(self) -> None:
        """Wait (bounded) for trajectory writes still in flight."""
        await self._backend.shutdown()

    def _report(self, key: int, status: RolloutStatus | str) -> None:
        if key not in self._tasks:
            return  # reported after the rollout ended: the server ignores it anyway
        self._events.append((key, str(getattr(status, "value", status))))
        if self._changed is not None:
            self._changed.set()


def _portable_result(result: ExecutionResult | None) -> ExecutionResult | None:
    if result is None:
        return None
    sample = result.sample
    if isinstance(sample, Sample) and sample.trajectory_messages is not None:
        sample = attrs.evolve(sample, trajectory_messages=None)
    return attrs.evolve(result, sample=sample, extra_fields=None)


def portable_outcome(outcome: Any) -> ExecutionOutcome:
    """``outcome`` as it travels back to the server: without the trajectory snapshot and
    the diagnostics (both are in the rollout's files on this node, and never sent).

    Anything else in a sample must pickle; otherwise the server reports the rollout as
    ``internal_error`` saying its result could not be returned.
    """
    if not isinstance(outcome, ExecutionOutcome):
        return ExecutionOutcome(
            workflow=ExecutionResult(
                status=RolloutStatus.FAILURE,
                err_message="backend.execute() must return an ExecutionOutcome; got "
                f"{type(outcome).__name__}",
                err_category=RolloutErrorCategory.INTERNAL_ERROR,
            )
        )
    workflow = _portable_result(outcome.workflow)
    assert workflow is not None
    return ExecutionOutcome(workflow=workflow, grader=_portable_result(outcome.grader))
