"""``LocalBackend``: run agent workflows and graders in the server's own process.

One rollout, as :meth:`LocalBackend.execute` runs it (wire-protocol section 5.3):

1. Wait for a concurrency slot (status ``queued``); the agent deadline already counts, and a
   rollout whose deadline passes in the queue fails as ``timeout`` without taking a slot.
2. Holding the slot (status ``running``): create ``<artifact_root>/<id>/`` and run the
   workflow within what is left of ``agent_timeout_sec`` (``artifacts/`` inside is created
   when the workflow or grader first reads ``ctx.artifacts_dir``).
3. Grade (status ``grading``) when ``grade`` is true, the workflow succeeded, a grader is
   configured and the request has a ``label`` or ``metadata``; within
   ``grader_timeout_sec``. The slot is held through grading.
4. Release the slot, save ``trajectory.json`` (and ``diagnostics.json``), return.

Cancellation at any point releases the slot at once and propagates. Each phase's time goes
to ``request.observer`` (the server's metrics) as it ends, and, when the server traces,
each phase is a span (``queue``, ``workflow``, ``grading``, ``trajectory write``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import inspect
import logging
import math
import numbers
import os
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Final, TypeVar

import attrs

from rollout_types import RolloutErrorCategory, RolloutStatus, is_single_path_segment

from . import _tracing
from ._atif import build_trajectory
from ._backend import ExecutionBackend, ExecutionOutcome, ExecutionRequest, ExecutionResult, Sample
from ._categorize import categorize_exception
from ._config import BaseConfig
from ._context import RolloutContext, bind_rollout_context, current_rollout_context
from ._grader import Grader, GraderConfig, GraderContext
from ._imports import resolve_import_string
from ._jsonlog import log_fields
from ._lazydir import LazyDirectory
from ._limiter import ConcurrencyLimiter
from ._logtext import get_logger
from ._offload import BatchOffloader
from ._trajectory import (
    ARTIFACTS_DIR_NAME,
    default_artifact_root,
    make_directory,
    write_rollout_files,
)
from ._workflow import AgentWorkflow, AgentWorkflowConfig, AgentWorkflowOutput, WorkflowContext

__all__ = ["DEFAULT_MAX_CONCURRENT", "LocalBackend"]

logger: Final = get_logger("rollout_server.local_backend")

DEFAULT_MAX_CONCURRENT: Final = 4
"""Slot count of a LocalBackend built without a workflow config."""

ARTIFACTS_DIR_RETRY_DELAYS_SEC: Final = (0.5, 1.0)
"""Pauses between the 3 attempts to create a rollout's directory (as osmosis-ai does for its
artifacts directory)."""

FILE_JOB_TIMEOUT_SEC: Final = 10.0
"""Longest a rollout waits for one of its file jobs (its directory, its trajectory) when
they run in a worker thread (a slow file system); the job goes on after."""

SHUTDOWN_PERSIST_WAIT_SEC: Final = 10.0
"""Longest :meth:`LocalBackend.shutdown` waits for trajectory writes still in flight."""

DEFAULT_ROLLOUT_DURATION_SEC: Final = 5.0
"""Assumed slot-holding time of one rollout until one has finished (for Retry-After)."""

DURATION_EMA_WEIGHT: Final = 0.2
"""Weight of the newest rollout in the moving mean of slot-holding time."""

_T = TypeVar("_T")
_C = TypeVar("_C", bound=BaseConfig)


class _Unbounded:
    """Stands in for ``asyncio.timeout(None)``: never expires (stateless, so shared; a
    Timeout object held per rollout in flight costs about 100 bytes)."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *_exc: object) -> None:
        return None

    def expired(self) -> bool:
        return False


_UNBOUNDED: Final = _Unbounded()


def _timed_out(rollout_id: str) -> dict[str, Any]:
    """The ``extra=`` of a deadline line (the rollout fails as ``timeout``)."""
    return log_fields(rollout_id, RolloutStatus.FAILURE, RolloutErrorCategory.TIMEOUT)


@attrs.define(kw_only=True, eq=False)
class _Run:
    """The mutable record of one rollout inside :meth:`LocalBackend.execute`."""

    request: ExecutionRequest
    entered: float
    task: asyncio.Task[Any] | None = None
    cancelling_baseline: int = 0
    queued_sec: float = 0.0
    workflow_sec: float | None = None
    grader_sec: float | None = None
    # ``<root>/<id>`` once a slot is held (whether or not it could be made); a string, as
    # a Path object held per rollout in flight costs about 250 bytes.
    rollout_dir: str | None = None
    workflow: ExecutionResult | None = None
    grader: ExecutionResult | None = None
    workflow_info: dict[str, Any] = attrs.Factory(dict)

    def check_cancelled(self) -> None:
        """Raise CancelledError if the task was cancelled (user code may have caught it
        and carried on; the request is honoured anyway)."""
        task = self.task
        if task is not None and task.cancelling() > self.cancelling_baseline:
            raise asyncio.CancelledError

    def timings(self) -> dict[str, float | None]:
        return {
            "queued_sec": self.queued_sec,
            "workflow_sec": self.workflow_sec,
            "grader_sec": self.grader_sec,
            "total_sec": time.monotonic() - self.entered,
        }


def _entered(request: ExecutionRequest) -> float:
    """When the rollout's clock started: its admission, if the server stamped it (and it is
    not in the future), else now."""
    now = time.monotonic()
    admitted_at: object = request.admitted_at
    if isinstance(admitted_at, int | float) and 0 < admitted_at <= now:
        return float(admitted_at)
    return now


def _resolve_class(value: object, base: type[Any], what: str) -> type[Any]:
    if isinstance(value, str):
        value = resolve_import_string(value, what=what)
    if isinstance(value, type) and issubclass(value, base):
        if inspect.isabstract(value):
            raise TypeError(
                f"{what} {value.__qualname__} is abstract: implement "
                f"{'run' if base is AgentWorkflow else 'grade'}()"
            )
        return value
    if isinstance(value, base):
        raise TypeError(
            f"{what} must be a class, not an instance: pass {type(value).__qualname__} "
            "itself (a fresh instance is created for every rollout)"
        )
    raise TypeError(
        f"{what} must be a subclass of {base.__name__} or an import string "
        f"'module:Attr' naming one; got {value!r}"
    )


def _resolve_config(value: Any, cls: type[_C], what: str) -> _C | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = resolve_import_string(value, what=what)
    if isinstance(value, Mapping):
        value = cls.from_mapping(value)
    if not isinstance(value, cls):
        raise TypeError(
            f"{what} must be a {cls.__name__}, a mapping, or an import string 'module:Attr' "
            f"naming one; got {value!r}"
        )
    try:
        copy.deepcopy(value)
    except Exception as exc:
        raise TypeError(
            f"{what} must be deep-copyable (each rollout gets its own copy): {exc}"
        ) from exc
    return value


_JSON_SCALARS: Final[tuple[type, ...]] = (str, int, float, bool, type(None))


def _copy_json(value: Any) -> Any:
    """A deep copy, several times faster than :func:`copy.deepcopy` for what JSON parsing
    gives (plain dicts, lists and scalars); anything else inside is deep-copied.

    Shared sub-objects become separate copies; a cycle raises RecursionError.
    """
    kind = type(value)
    if kind is dict:
        return {
            key: item if type(item) in _JSON_SCALARS else _copy_json(item)
            for key, item in value.items()
        }
    if kind is list:
        return [item if type(item) in _JSON_SCALARS else _copy_json(item) for item in value]
    if kind in _JSON_SCALARS:
        return value
    return copy.deepcopy(value)


def _snapshot(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A deep copy of ``messages``; a shallow one when they hold something uncopyable."""
    try:
        try:
            copied: list[dict[str, Any]] = _copy_json(messages)
        except RecursionError:  # a cycle (or very deep nesting): deepcopy keeps cycles
            copied = copy.deepcopy(messages)
    except Exception:  # noqa: BLE001 - non-copyable content: a shallow snapshot will do
        return [dict(message) for message in messages]
    return copied


def _copy(value: _T) -> _T:
    try:
        copied: _T = _copy_json(value)
    except Exception:  # noqa: BLE001 - request values are JSON; keep the original otherwise
        return value
    return copied


def _deadline_message(phase: str, timeout_sec: float, queued_sec: float | None) -> str:
    message = f"{phase} exceeded its {float(timeout_sec)}s deadline"
    if queued_sec is not None and queued_sec >= 0.1:
        message += f" ({queued_sec:.1f}s of it spent queued)"
    return message


def _diagnostics(phase: str, exc: BaseException) -> dict[str, Any]:
    return {
        f"{phase}_error": {
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc)),
        }
    }


def _timeout(message: str, sample: Sample | None = None, **extra: Any) -> ExecutionResult:
    return ExecutionResult(
        status=RolloutStatus.FAILURE,
        sample=sample,
        err_message=message,
        err_category=RolloutErrorCategory.TIMEOUT,
        extra_fields=extra or None,
    )


def _check_reward(sample: Sample | None) -> None:
    if sample is None:
        raise ValueError(
            "No sample to grade. The workflow produced none: return messages from run() "
            "(an AgentWorkflowOutput or a message list), or register a sample source."
        )
    reward: object = sample.reward
    if reward is None:
        if not sample.remove_sample:
            raise ValueError("Sample has no reward after grading")
        return
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise ValueError(f"Sample reward must be a finite number after grading; got {reward!r}")
    if not math.isfinite(reward):
        raise ValueError(f"Sample reward must be a finite number after grading; got {reward!r}")


class LocalBackend(ExecutionBackend):
    """Run an :class:`~rollout_server.AgentWorkflow` (and a grader) in this process.

    Args:
        workflow: The workflow class, or an import string ``"package.module:Attr"``.
        workflow_config: An :class:`~rollout_server.AgentWorkflowConfig`, a mapping for
            :meth:`~rollout_server.AgentWorkflowConfig.from_mapping`, an import string
            naming either, or None. Its ``concurrency.max_concurrent`` is the slot count
            (None: no limit); without a config the limit is 4.
        grader: The grader class, an import string, or None (no grading: a graded request
            then fails with every field null, as osmosis-ai does).
        grader_config: A :class:`~rollout_server.GraderConfig`, a mapping, an import string,
            or None; handed to every grader instance as is.
        max_queued: With a limit, the most rollouts that may wait for a slot: when that many
            wait (and no slot is free), :meth:`has_capacity` is False and admission answers
            429 with :meth:`retry_after_sec`. None (the default) queues without bound; 0
            refuses whenever every slot is busy.
        artifact_root: Directory under which each rollout's files go; default
            ``$ROLLOUT_ARTIFACT_ROOT``, else ``$_OSMOSIS_ROLLOUT_ARTIFACT_ROOT``, else
            ``$XDG_STATE_HOME/rollout/artifacts`` or ``~/.local/state/rollout/artifacts``
            (read once, here).

    Raises:
        ValueError: On a malformed import string, an invalid ``max_queued``, or a
            ``max_queued`` without a concurrency limit.
        ImportError: When an import string names a missing module or attribute.
        TypeError: When ``workflow``/``grader`` is not a concrete subclass of the base
            class, or a config is not a config.
    """

    reports_queue_status: ClassVar[bool] = True

    def __init__(
        self,
        workflow: type[AgentWorkflow] | str,
        *,
        workflow_config: AgentWorkflowConfig | Mapping[str, Any] | str | None = None,
        grader: type[Grader] | str | None = None,
        grader_config: GraderConfig | Mapping[str, Any] | str | None = None,
        max_queued: int | None = None,
        artifact_root: str | os.PathLike[str] | None = None,
    ) -> None:
        self._workflow_cls: type[AgentWorkflow] = _resolve_class(
            workflow, AgentWorkflow, "workflow"
        )
        self._workflow_config = _resolve_config(
            workflow_config, AgentWorkflowConfig, "workflow_config"
        )
        self._grader_cls: type[Grader] | None = (
            None if grader is None else _resolve_class(grader, Grader, "grader")
        )
        self._grader_config = _resolve_config(grader_config, GraderConfig, "grader_config")
        queue_bound: object = max_queued
        if queue_bound is not None and (
            not isinstance(queue_bound, int) or isinstance(queue_bound, bool) or queue_bound < 0
        ):
            raise ValueError(
                f"max_queued must be an int >= 0, or None to queue without bound; "
                f"got {max_queued!r}"
            )
        self._max_queued = max_queued
        limit = (
            DEFAULT_MAX_CONCURRENT
            if self._workflow_config is None
            else self._workflow_config.concurrency.max_concurrent
        )
        if limit is None and max_queued is not None:
            raise ValueError(
                f"max_queued={max_queued} needs a concurrency limit, but the workflow config "
                "has concurrency.max_concurrent=None (no limit, so nothing ever queues): set "
                "max_concurrent, or drop max_queued"
            )
        self._limiter = ConcurrencyLimiter(limit)
        self._reserved = 0
        self._artifact_root = (
            default_artifact_root()
            if artifact_root is None
            else Path(artifact_root).expanduser().absolute()
        )
        self._mean_duration_sec: float | None = None
        self._background: set[asyncio.Future[None]] = set()
        self._files = BatchOffloader(thread_timeout_sec=FILE_JOB_TIMEOUT_SEC)

    @property
    def max_concurrent(self) -> int | None:
        """The slot count, or None for no limit."""
        return self._limiter.max_concurrent

    @property
    def max_queued(self) -> int | None:
        """The bound on waiting rollouts, or None."""
        return self._max_queued

    @property
    def artifact_root(self) -> Path:
        """The absolute directory under which each rollout's files go."""
        return self._artifact_root

    # -- ExecutionBackend -------------------------------------------------------------

    def has_capacity(self) -> bool:
        """False only when ``max_concurrent + max_queued`` rollouts are running, waiting
        for a slot, or admitted and about to start (reserved by :meth:`try_reserve`)."""
        if self._max_queued is None:
            return True
        limiter = self._limiter
        assert limiter.max_concurrent is not None  # max_queued needs a limit
        outstanding = limiter.running + limiter.queued + self._reserved
        return outstanding < limiter.max_concurrent + self._max_queued

    def try_reserve(self) -> bool:
        """Count one admitted rollout until it starts, if :meth:`has_capacity` allows it."""
        if not self.has_capacity():
            return False
        self._reserved += 1
        return True

    def release_reservation(self) -> None:
        """The reserved rollout starts now (it takes its slot or its queue place at once)."""
        if self._reserved > 0:
            self._reserved -= 1

    def retry_after_sec(self) -> float:
        """How long a refused caller should wait: until the rollouts queued ahead of it
        would have drained.

        ``(queued + reserved + 1) * mean_duration / max_concurrent``, clamped to [1, 60] s, where
        ``mean_duration`` is a moving mean (weight 0.2 for the newest) of how long finished
        rollouts held their slot, 5 s until one has finished. 1 s without a limit (which
        never refuses). The server rounds it up to whole seconds.
        """
        slots = self._limiter.max_concurrent
        if slots is None:
            return 1.0
        mean = (
            DEFAULT_ROLLOUT_DURATION_SEC
            if self._mean_duration_sec is None
            else self._mean_duration_sec
        )
        waiting = self._limiter.queued + self._reserved
        return min(60.0, max(1.0, (waiting + 1) * mean / slots))

    def health(self) -> dict[str, Any]:
        """``{"status": "ok", "concurrency": {"max_concurrent", "queued", "running",
        "max_queued"}}``."""
        concurrency = self._limiter.snapshot()
        concurrency["max_queued"] = self._max_queued
        return {"status": "ok", "concurrency": concurrency}

    async def shutdown(self) -> None:
        """Wait (up to 10 s) for trajectory writes still in flight (those of cancelled
        rollouts, and any that outlasted their rollout's 10 s wait)."""
        pending = [task for task in self._background if not task.done()]
        if pending:
            _done, still = await asyncio.wait(pending, timeout=SHUTDOWN_PERSIST_WAIT_SEC)
            for task in still:
                task.cancel()

    async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
        """Run one rollout: slot, workflow, grading, trajectory (module docstring).

        Binds an ambient :class:`~rollout_server.RolloutContext` built from ``request``
        unless the caller (the server) already bound one for this rollout. Queue time counts
        from ``request.admitted_at`` (the server's admission stamp), or from the call of this
        method when the request has no stamp (0) or one in the future.

        Args:
            request: The admitted rollout.

        Returns:
            The workflow result, and the grader result when grading ran or was due.

        Raises:
            asyncio.CancelledError: When the task is cancelled, including a cancellation
                that user code swallowed (reported once that code returns).
        """
        task = asyncio.current_task()
        run = _Run(
            request=request,
            entered=_entered(request),
            task=task,
            cancelling_baseline=0 if task is None else task.cancelling(),
        )
        ambient = current_rollout_context()
        binding: contextlib.AbstractContextManager[RolloutContext]
        if ambient is None or ambient.rollout_id != request.id:
            ambient = RolloutContext.from_request(
                rollout_id=request.id,
                chat_completions_url=request.chat_completions_url,
                llm_api_key=request.llm_api_key,
                process_id="",
                on_status=request.on_status,
            )
            binding = bind_rollout_context(ambient)
        else:
            binding = contextlib.nullcontext(ambient)  # the server bound it already

        try:
            with binding:
                outcome = await self._execute(run, ambient)
        except asyncio.CancelledError:
            self._persist_cancelled(run)
            raise
        await self._persist(run, outcome)
        return outcome

    # -- phases -----------------------------------------------------------------------

    async def _execute(
        self,
        run: _Run,
        ambient: RolloutContext,
    ) -> ExecutionOutcome:
        request = run.request
        timeout = request.agent_timeout_sec
        with _tracing.phase_span("queue", request.id):
            acquired = await self._acquire(run)
        if not acquired:
            assert timeout is not None
            message = _deadline_message("workflow", timeout, run.queued_sec)
            logger.debug("Rollout %s: %s", request.id, message, extra=_timed_out(request.id))
            run.workflow = _timeout(message)
            return ExecutionOutcome(workflow=run.workflow)
        held_from = time.monotonic()
        finished = False
        try:
            request.on_status(RolloutStatus.RUNNING)
            artifacts_dir = await self._artifacts_dir(run)
            with _tracing.phase_span("workflow", request.id) as span:
                run.workflow = await self._run_workflow(run, ambient, artifacts_dir)
                _tracing.set_outcome(span, run.workflow.status, run.workflow.err_category)
            run.check_cancelled()
            if not request.grade or run.workflow.status != RolloutStatus.SUCCESS:
                finished = True
                return ExecutionOutcome(workflow=run.workflow)
            if self._grader_cls is None or (request.label is None and request.metadata is None):
                # Nothing to grade with: a bare failure, which the server reports (5.3).
                run.grader = ExecutionResult(status=RolloutStatus.FAILURE)
            else:
                request.on_status(RolloutStatus.GRADING)
                with _tracing.phase_span("grading", request.id) as span:
                    run.grader = await self._run_grader(
                        run, self._grader_cls, run.workflow.sample, artifacts_dir
                    )
                    _tracing.set_outcome(span, run.grader.status, run.grader.err_category)
                run.check_cancelled()
            finished = True
            return ExecutionOutcome(workflow=run.workflow, grader=run.grader)
        finally:
            self._limiter.release()
            if finished:
                self._observe_duration(time.monotonic() - held_from)

    async def _acquire(self, run: _Run) -> bool:
        """Take a slot; False when the agent deadline passed first (no slot is then held)."""
        timeout = run.request.agent_timeout_sec
        if not self._limiter.has_free_slot:
            run.request.on_status(RolloutStatus.QUEUED)
        try:
            if timeout is None:
                await self._limiter.acquire()
                return True
            remaining = timeout - (time.monotonic() - run.entered)
            if remaining <= 0:
                return False
            try:
                async with asyncio.timeout(remaining):
                    await self._limiter.acquire()
            except TimeoutError:
                return False
            return True
        finally:
            run.queued_sec = time.monotonic() - run.entered
            run.request.observer.observe_queue_wait(run.queued_sec)

    async def _artifacts_dir(self, run: _Run) -> LazyDirectory | None:
        """Create the rollout directory (3 attempts, as osmosis-ai makes its artifacts
        directory); its ``artifacts/`` is made when user code first reads it."""
        rollout_id = run.request.id
        if not is_single_path_segment(rollout_id):
            logger.warning(
                "Rollout %r: the id is not a single path segment; no artifacts directory or "
                "trajectory is kept for it",
                rollout_id,
            )
            return None
        path = run.rollout_dir = os.path.join(self._artifact_root, rollout_id)
        delays = (*ARTIFACTS_DIR_RETRY_DELAYS_SEC, None)
        for attempt, delay in enumerate(delays, start=1):
            try:
                await self._files.submit(functools.partial(make_directory, path))
            except OSError as exc:
                if delay is None:
                    logger.warning(
                        "Rollout %s: cannot create %s after %d attempts (%s); the workflow "
                        "gets artifacts_dir=None",
                        rollout_id,
                        path,
                        attempt,
                        exc,
                    )
                    return None
                await asyncio.sleep(delay)
            else:
                return LazyDirectory(os.path.join(path, ARTIFACTS_DIR_NAME))
        return None  # pragma: no cover - the loop always returns

    async def _run_workflow(
        self, run: _Run, ambient: RolloutContext, artifacts_dir: LazyDirectory | None
    ) -> ExecutionResult:
        request = run.request
        timeout = request.agent_timeout_sec
        start = time.monotonic()
        budget = None if timeout is None else timeout - (start - run.entered)
        message = (
            None if timeout is None else _deadline_message("workflow", timeout, run.queued_sec)
        )
        try:
            if budget is not None and budget <= 0:
                assert message is not None
                logger.debug("Rollout %s: %s", request.id, message, extra=_timed_out(request.id))
                return _timeout(message)
            deadline = _UNBOUNDED if budget is None else asyncio.timeout(budget)
            try:
                async with deadline:
                    config = copy.deepcopy(self._workflow_config)
                    workflow = self._workflow_cls(config)
                    context = WorkflowContext(
                        rollout_id=request.id,
                        prompt=_copy(request.prompt),
                        config=config,
                        metadata=_copy(request.metadata),
                        artifacts_dir=artifacts_dir,
                    )
                    returned = await workflow.run(context)
                    sample = await self._sample_from(returned, run, ambient)
            except Exception as exc:
                if deadline.expired():
                    assert message is not None
                    logger.debug(
                        "Rollout %s: %s", request.id, message, extra=_timed_out(request.id)
                    )
                    return _timeout(message, **_diagnostics("workflow", exc))
                failure = self._failure(exc, None, "workflow")
                logger.debug(
                    "Workflow of rollout %s failed",
                    request.id,
                    exc_info=exc,
                    extra=log_fields(request.id, failure.status, failure.err_category),
                )
                return failure
            if budget is not None and (deadline.expired() or time.monotonic() - start > budget):
                # It returned, but only after its deadline (it swallowed the cancellation or
                # blocked the loop): a timeout, never a late success.
                assert message is not None
                logger.debug(
                    "Rollout %s: %s (it returned late)",
                    request.id,
                    message,
                    extra=_timed_out(request.id),
                )
                return _timeout(message)
            return ExecutionResult(status=RolloutStatus.SUCCESS, sample=sample)
        finally:
            run.workflow_sec = time.monotonic() - start
            request.observer.observe_workflow(run.workflow_sec)

    async def _sample_from(
        self, returned: Any, run: _Run, ambient: RolloutContext
    ) -> Sample | None:
        label = run.request.label
        if returned is None:
            sample = await ambient.get_sample()
            if sample is None:
                return None
            if not isinstance(sample, Sample):
                raise TypeError(
                    "the registered sample source must return a rollout_server.Sample or "
                    f"None; got {type(sample).__name__}"
                )
            if sample.label is None:
                sample.label = label
            if sample.trajectory_messages is None:
                sample.trajectory_messages = _snapshot(sample.messages)
            return sample
        if isinstance(returned, list):
            for index, message in enumerate(returned):
                if not isinstance(message, dict):
                    raise TypeError(
                        f"run() returned a message list whose item {index} is a "
                        f"{type(message).__name__}; each message must be a dict"
                    )
            output = AgentWorkflowOutput(messages=returned)
        elif isinstance(returned, AgentWorkflowOutput):
            output = returned
        else:
            raise TypeError(
                "run() must return AgentWorkflowOutput, a message list, or None; "
                f"got {type(returned).__name__}"
            )
        run.workflow_info = dict(output.info)
        if output.messages is None:
            return None
        messages = list(output.messages)
        return Sample(
            messages=messages,
            label=label,
            metrics=dict(output.metrics),
            trajectory_messages=_snapshot(messages),
        )

    async def _run_grader(
        self,
        run: _Run,
        grader_cls: type[Grader],
        sample: Sample | None,
        artifacts_dir: LazyDirectory | None,
    ) -> ExecutionResult:
        request = run.request
        timeout = request.grader_timeout_sec
        message = None if timeout is None else _deadline_message("grader", timeout, None)
        start = time.monotonic()
        try:
            if timeout is not None and timeout <= 0:
                assert message is not None
                logger.debug("Rollout %s: %s", request.id, message, extra=_timed_out(request.id))
                return _timeout(message, sample)
            deadline = asyncio.timeout(timeout)
            try:
                async with deadline:
                    grader = grader_cls(self._grader_config)
                    context = GraderContext(
                        rollout_id=request.id,
                        label=request.label,
                        sample=sample,
                        metadata=request.metadata,
                        artifacts_dir=artifacts_dir,
                    )
                    await grader.grade(context)
                    graded = context.sample
                    _check_reward(graded)
            except Exception as exc:
                if deadline.expired():
                    assert message is not None
                    logger.debug(
                        "Rollout %s: %s", request.id, message, extra=_timed_out(request.id)
                    )
                    return _timeout(message, sample, **_diagnostics("grader", exc))
                failure = self._failure(exc, sample, "grader")
                logger.debug(
                    "Grader of rollout %s failed",
                    request.id,
                    exc_info=exc,
                    extra=log_fields(request.id, failure.status, failure.err_category),
                )
                return failure
            if timeout is not None and (deadline.expired() or time.monotonic() - start > timeout):
                assert message is not None
                logger.debug(
                    "Rollout %s: %s (it returned late)",
                    request.id,
                    message,
                    extra=_timed_out(request.id),
                )
                return _timeout(message, sample)
            return ExecutionResult(status=RolloutStatus.SUCCESS, sample=graded)
        finally:
            run.grader_sec = time.monotonic() - start
            request.observer.observe_grading(run.grader_sec)

    @staticmethod
    def _failure(exc: Exception, sample: Sample | None, phase: str) -> ExecutionResult:
        return ExecutionResult(
            status=RolloutStatus.FAILURE,
            sample=sample,
            err_message=str(exc),
            err_category=categorize_exception(exc),
            extra_fields=_diagnostics(phase, exc),
        )

    def _observe_duration(self, seconds: float) -> None:
        if self._mean_duration_sec is None:
            self._mean_duration_sec = seconds
        else:
            self._mean_duration_sec += DURATION_EMA_WEIGHT * (seconds - self._mean_duration_sec)

    # -- persistence ------------------------------------------------------------------

    async def _persist(self, run: _Run, outcome: ExecutionOutcome) -> None:
        """Save the trajectory before the result is returned; never raises."""
        job = self._write_job(run, outcome)
        if job is None:
            return
        write = self._write(run, job)
        # Shielded: cancelling this task must not cancel the write. Bounded: the file jobs
        # fail with TimeoutError after FILE_JOB_TIMEOUT_SEC (no timer per rollout here).
        with contextlib.suppress(Exception):  # _log_write reports it
            await asyncio.shield(write)

    def _persist_cancelled(self, run: _Run) -> None:
        """Save the trajectory of a cancelled rollout that has a sample, in the background,
        so that the cancellation propagates at once."""
        workflow = run.workflow
        sample = None if workflow is None else workflow.sample
        if workflow is None or sample is None:
            return
        cancelled = ExecutionResult(status=RolloutStatus.CANCELLED, err_message="cancelled")
        outcome = ExecutionOutcome(workflow=workflow, grader=run.grader)
        job = self._write_job(run, outcome, reported=cancelled)
        if job is not None:
            _ = self._write(run, job)

    def _write(self, run: _Run, job: Callable[[], None]) -> asyncio.Future[None]:
        """Submit the file job that saves the rollout's files; its end is logged, timed
        (``request.observer``) and traced (``trajectory write``)."""
        span = _tracing.start_span("trajectory write", run.request.id)
        write = self._files.submit(job)
        write.add_done_callback(functools.partial(self._log_write, run, time.monotonic(), span))
        self._background.add(write)  # shutdown() waits for writes still in flight
        write.add_done_callback(self._background.discard)
        return write

    def _write_job(
        self, run: _Run, outcome: ExecutionOutcome, reported: ExecutionResult | None = None
    ) -> Callable[[], None] | None:
        """The blocking job that builds and writes the rollout's files (for the file jobs),
        or None when the rollout keeps no files (its id is not a single path segment)."""
        if run.rollout_dir is None:
            # No slot was held (deadline passed in the queue) or the id is not path-safe.
            if not is_single_path_segment(run.request.id):
                return None
            run.rollout_dir = os.path.join(self._artifact_root, run.request.id)
        rollout_dir = Path(run.rollout_dir)
        timings = run.timings()
        workflow_info = run.workflow_info

        def job() -> None:
            # Building the document walks the whole sample (JSON fitting): off the loop too.
            # Nothing changes the sample meanwhile: execute() has finished with it.
            to_save = (
                outcome.grader
                if outcome.grader is not None and outcome.grader.sample is not None
                else outcome.workflow
            )
            document = build_trajectory(
                request=run.request,
                reported=outcome.reported() if reported is None else reported,
                sample=to_save.sample,
                workflow=outcome.workflow,
                grader=outcome.grader,
                timings=timings,
                workflow_info=workflow_info,
            )
            diagnostics: dict[str, Any] = {}
            for result in (outcome.workflow, outcome.grader):
                if result is not None and result.extra_fields:
                    diagnostics.update(result.extra_fields)
            write_rollout_files(rollout_dir, document, diagnostics or None)

        return job

    @staticmethod
    def _log_write(run: _Run, started: float, span: Any, future: asyncio.Future[None]) -> None:
        exc: BaseException | None
        exc = asyncio.CancelledError() if future.cancelled() else future.exception()
        run.request.observer.observe_trajectory_write(
            time.monotonic() - started, failed=exc is not None
        )
        _tracing.end_span(span, exc)
        if future.cancelled():
            return
        if exc is not None:
            logger.warning(
                "Rollout %s: cannot save the trajectory: %s",
                run.request.id,
                exc,
                extra=log_fields(run.request.id),
            )
        elif logger.isEnabledFor(logging.DEBUG):
            # DEBUG, not INFO: a line per rollout on the hot path (the server's own
            # "finished" line already says the rollout is done).
            logger.debug("Rollout %s: trajectory saved in %s", run.request.id, run.rollout_dir)
