"""The Ray actor of :class:`~rollout_server.RayBackend`: a :class:`LocalBackend` in a worker.

One :class:`RolloutWorker` runs many rollouts at once on its own event loop. Each rollout
is ``LocalBackend.execute()`` itself (deadlines, the grading gate, error categories, the
artifacts directory and the trajectory files, all on the worker's node), with the
rollout's :class:`~rollout_server.RolloutContext` bound, as the server runs it in process.
The worker's LocalBackend is built from the same arguments as the RayBackend's, so it has
the slot count the server's pool gives each worker: nothing ever queues here.

The server talks to the actor through five methods:

* :meth:`RolloutWorker.run` executes one rollout and returns its outcome with the phase
  times the LocalBackend measured (:func:`encode_outcome`), or :data:`CANCELLED` once a
  cancellation has stopped it: the call's end is the server's acknowledgement that the
  rollout no longer runs. One call per rollout, and nothing else on the way for most:
  ``running`` is the server's to report (it holds the worker's slot from the dispatch);
* :meth:`RolloutWorker.events` is a long poll for ``grading`` reports: one call in flight
  per worker carries them for all its rollouts, after :data:`GRADING_REPORT_DELAY_SEC`, and
  a rollout that ends before then has its report folded into its result (never sent);
* :meth:`RolloutWorker.cancel` cancels rollouts by dispatch key (before or after their
  ``run`` call has arrived);
* :meth:`RolloutWorker.ready` says which process and node the actor runs in;
* :meth:`RolloutWorker.shutdown` waits (bounded) for trajectory writes still in flight.

Requests and outcomes travel as tuples of plain values (:func:`encode_request`,
:func:`encode_outcome`): Ray packs those with msgpack, much cheaper than pickling the
attrs classes for every rollout.

This module does not import Ray: the backend wraps the class with ``ray.remote`` when it
starts, so importing ``rollout_server`` never needs Ray.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from typing import Any, Final

import attrs

from rollout_types import RolloutErrorCategory, RolloutStatus

from ..execution._backend import ExecutionOutcome, ExecutionRequest, ExecutionResult, Sample
from ..execution._categorize import categorize_exception
from ..execution._context import RolloutContext, bind_rollout_context
from ..execution._local_backend import LocalBackend
from ..observability._observer import ExecutionObserver

__all__ = [
    "CANCELLED",
    "GRADING_REPORT_DELAY_SEC",
    "PhaseTimes",
    "RolloutWorker",
    "WorkerSpec",
    "decode_outcome",
    "encode_outcome",
    "encode_request",
]

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


# -- what travels ----------------------------------------------------------------------


def encode_request(
    key: int, request: ExecutionRequest, elapsed_sec: float, process_id: str
) -> tuple[Any, ...]:
    """``request`` as :meth:`RolloutWorker.run` receives it, under its dispatch ``key``:
    plain values, without the server's callbacks, and with the seconds since admission
    instead of the admission stamp (monotonic clocks differ between nodes). One argument:
    Ray serializes each argument of a call on its own."""
    return (
        key,
        request.id,
        request.prompt,
        request.chat_completions_url,
        request.llm_api_key,
        request.label,
        request.metadata,
        request.grade,
        request.agent_timeout_sec,
        request.grader_timeout_sec,
        request.request_extra_fields,
        elapsed_sec,
        process_id,
    )


def _decode_request(
    payload: tuple[Any, ...],
    admitted_at: Callable[[float], float],
    on_status: Callable[[RolloutStatus], None],
    observer: ExecutionObserver,
) -> tuple[ExecutionRequest, str]:
    (
        _key,
        rollout_id,
        prompt,
        url,
        api_key,
        label,
        metadata,
        grade,
        agent_timeout,
        grader_timeout,
        extra,
        elapsed,
        process_id,
    ) = payload
    request = ExecutionRequest(
        id=rollout_id,
        prompt=prompt,
        chat_completions_url=url,
        llm_api_key=api_key,
        label=label,
        metadata=metadata,
        grade=grade,
        agent_timeout_sec=agent_timeout,
        grader_timeout_sec=grader_timeout,
        request_extra_fields=extra,
        admitted_at=admitted_at(elapsed),
        on_status=on_status,
        observer=observer,
    )
    return request, process_id


def _encode_result(result: ExecutionResult | None) -> tuple[Any, ...] | None:
    """A phase result without what stays in the worker's files: the trajectory snapshot
    and the diagnostics (``extra_fields``)."""
    if result is None:
        return None
    sample = result.sample
    packed = (
        None
        if not isinstance(sample, Sample)
        else (
            sample.messages,
            sample.label,
            sample.reward,
            sample.remove_sample,
            sample.metrics,
            sample.extra_fields,
        )
    )
    category = None if result.err_category is None else str(result.err_category)
    return (str(result.status), packed, result.err_message, category)


def _decode_result(packed: tuple[Any, ...] | None) -> ExecutionResult | None:
    if packed is None:
        return None
    status, sample, message, category = packed
    return ExecutionResult(
        status=RolloutStatus(status),
        sample=None
        if sample is None
        else Sample(
            messages=sample[0],
            label=sample[1],
            reward=sample[2],
            remove_sample=sample[3],
            metrics=sample[4],
            extra_fields=sample[5],
        ),
        err_message=message,
        err_category=None if category is None else RolloutErrorCategory(category),
    )


@attrs.define(kw_only=True, eq=False)
class PhaseTimes(ExecutionObserver):
    """The phase times a worker's LocalBackend measured for one rollout (its observer
    there); they travel back with the outcome for the server's observer."""

    workflow_sec: float | None = None
    grading_sec: float | None = None
    write_sec: float | None = None
    write_failed: bool = False

    def observe_queue_wait(self, seconds: float) -> None:
        """Ignored: a worker never queues; the server measures the queue wait."""

    def observe_workflow(self, seconds: float) -> None:
        """Keep the workflow's time."""
        self.workflow_sec = seconds

    def observe_grading(self, seconds: float) -> None:
        """Keep the grader's time."""
        self.grading_sec = seconds

    def observe_trajectory_write(self, seconds: float, *, failed: bool) -> None:
        """Keep the trajectory write's time."""
        self.write_sec = seconds
        self.write_failed = failed

    def replay(self, observer: ExecutionObserver) -> None:
        """Report the kept times to ``observer`` (on the server's loop)."""
        if self.workflow_sec is not None:
            observer.observe_workflow(self.workflow_sec)
        if self.grading_sec is not None:
            observer.observe_grading(self.grading_sec)
        if self.write_sec is not None:
            observer.observe_trajectory_write(self.write_sec, failed=self.write_failed)


def encode_outcome(outcome: ExecutionOutcome, times: PhaseTimes) -> tuple[Any, ...]:
    """What :meth:`RolloutWorker.run` returns for a finished rollout.

    Anything in a sample must pickle; otherwise the server reports the rollout as
    ``internal_error`` saying its result could not be returned.
    """
    return (
        _encode_result(outcome.workflow),
        _encode_result(outcome.grader),
        (times.workflow_sec, times.grading_sec, times.write_sec, times.write_failed),
    )


def decode_outcome(reply: tuple[Any, ...]) -> tuple[ExecutionOutcome, PhaseTimes]:
    """The outcome and phase times of a :func:`encode_outcome` reply."""
    workflow, grader, (workflow_sec, grading_sec, write_sec, write_failed) = reply
    decoded = _decode_result(workflow)
    assert decoded is not None
    return (
        ExecutionOutcome(workflow=decoded, grader=_decode_result(grader)),
        PhaseTimes(
            workflow_sec=workflow_sec,
            grading_sec=grading_sec,
            write_sec=write_sec,
            write_failed=write_failed,
        ),
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
        """Execute one rollout; return :func:`encode_outcome`'s tuple, or
        :data:`CANCELLED`. An exception of ``execute()`` becomes a categorised failure, as
        the server reports one.

        Args:
            payload: :func:`encode_request`'s tuple; its first item is the dispatch key
                (unique per pool), by which reports and cancellations name the rollout.
        """
        key: int = payload[0]
        if key in self._cancelled_early:
            self._cancelled_early.discard(key)
            return CANCELLED
        times = PhaseTimes()
        request, process_id = _decode_request(
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
