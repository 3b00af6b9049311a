"""The phases of a LocalBackend rollout: its workflow, then its grader, each user code run
under its own deadline by one :class:`PhaseRunner`.

A phase ends in an :class:`~rollout_server.ExecutionResult`, never an exception (but
cancellation):

* success, with the sample the workflow produced or the grader scored;
* ``timeout`` when its deadline passes: the agent deadline counts from the rollout's
  admission (queue time is spent already, and the message says how much), the grader's
  from its own start. A phase that returns after its deadline (it swallowed the
  cancellation, or blocked the loop) is a timeout too, never a late success; a budget
  already spent fails at once without running user code;
* a failure classified by :func:`~rollout_server.categorize_exception` when user code
  raises, with its traceback in the result's diagnostics (``extra_fields``).

A grader's failures keep the workflow's sample (with the reward as far as it was set).
Cancellation of the rollout's task propagates; one that user code swallowed is honoured
by :meth:`RolloutRun.check_cancelled` once the phase has returned.

Failures and deadlines of user code are expected: they are logged at DEBUG (with the
traceback), with the rollout's id, status and category as ``extra=`` fields (JSON logs).
Each phase's time goes to ``request.observer`` as it ends (cancelled or not), and, when the
server traces, each phase is a span (``workflow``, ``grading``) with its outcome.

Memory: thousands of rollouts may be in flight, each suspended inside its phase. So a
phase without a deadline holds the shared :data:`UNBOUNDED` instead of an
``asyncio.timeout`` object, the deadline message is only formatted when it is needed, and
the runner awaits user code directly (no coroutine frame of its own between them).
"""

from __future__ import annotations

import asyncio
import copy
import enum
import math
import numbers
import time
import traceback
from typing import Any, Final

import attrs

from rollout_types import RolloutErrorCategory, RolloutStatus

from .._logtext import get_logger
from ..observability import _tracing
from ..observability._jsonlog import log_fields
from ._backend import ExecutionRequest, ExecutionResult, Sample
from ._categorize import categorize_exception
from ._context import RolloutContext
from ._copying import copy_or_keep, snapshot_messages
from ._grader import Grader, GraderConfig, GraderContext
from ._lazydir import LazyDirectory
from ._turns import ModelRoute
from ._workflow import AgentWorkflow, AgentWorkflowConfig, AgentWorkflowOutput, WorkflowContext

__all__ = ["UNBOUNDED", "Phase", "PhaseRunner", "RolloutRun", "timed_out"]

logger: Final = get_logger("rollout_server.local_backend")


class Phase(enum.StrEnum):
    """A phase of a rollout; its value names it in messages and diagnostics."""

    WORKFLOW = "workflow"
    GRADER = "grader"

    @property
    def span_name(self) -> str:
        """The name of the phase's trace span (``workflow``, ``grading``)."""
        return "workflow" if self is Phase.WORKFLOW else "grading"


class _Unbounded:
    """Stands in for ``asyncio.timeout(None)``: never expires (stateless, so shared; a
    Timeout object held per rollout in flight costs about 100 bytes)."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *_exc: object) -> None:
        return None

    def expired(self) -> bool:
        return False


# Speed: benchmarks/README.md, "LocalBackend: files and copies", row "No `asyncio.timeout` object
#   for a rollout whose workflow has no deadline ..."
UNBOUNDED: Final = _Unbounded()


# Speed: benchmarks/README.md, "LocalBackend: files and copies", row "A rollout's directory kept as
#   a string, not a Path object ..."
@attrs.define(kw_only=True, eq=False)
class RolloutRun:
    """The mutable record of one rollout inside :meth:`LocalBackend.execute`.

    Attributes:
        request: The rollout's request.
        entered: When its clock started (``time.monotonic()``): see :func:`entered_at`.
        task: The task running it, or None.
        cancelling_baseline: ``task.cancelling()`` when it began.
        queued_sec: Seconds from ``entered`` until it held a slot (or gave up).
        workflow_sec, grader_sec: Seconds each phase ran, or None if it did not.
        workflow, grader: Each phase's result once it has one.
        workflow_info: ``AgentWorkflowOutput.info``.
        route: The rollout's route through the server's model gateway (its captured
            turns go into the trajectory), or None.
    """

    request: ExecutionRequest
    entered: float
    task: asyncio.Task[Any] | None = None
    cancelling_baseline: int = 0
    queued_sec: float = 0.0
    workflow_sec: float | None = None
    grader_sec: float | None = None
    workflow: ExecutionResult | None = None
    grader: ExecutionResult | None = None
    workflow_info: dict[str, Any] = attrs.Factory(dict)
    route: ModelRoute | None = None

    @classmethod
    def start(cls, request: ExecutionRequest) -> RolloutRun:
        """The record of ``request`` starting now in the current task."""
        task = asyncio.current_task()
        return cls(
            request=request,
            entered=entered_at(request),
            task=task,
            cancelling_baseline=0 if task is None else task.cancelling(),
        )

    def check_cancelled(self) -> None:
        """Raise CancelledError if the task was cancelled (user code may have caught it
        and carried on; the request is honoured anyway)."""
        task = self.task
        if task is not None and task.cancelling() > self.cancelling_baseline:
            raise asyncio.CancelledError

    def timings(self) -> dict[str, float | None]:
        """``queued_sec``, ``workflow_sec``, ``grader_sec`` and ``total_sec`` (until now)."""
        return {
            "queued_sec": self.queued_sec,
            "workflow_sec": self.workflow_sec,
            "grader_sec": self.grader_sec,
            "total_sec": time.monotonic() - self.entered,
        }


def entered_at(request: ExecutionRequest) -> float:
    """When the rollout's clock started: its admission, if the server stamped it (and it is
    not in the future), else now."""
    now = time.monotonic()
    admitted_at: object = request.admitted_at
    if isinstance(admitted_at, int | float) and 0 < admitted_at <= now:
        return float(admitted_at)
    return now


def _deadline_message(run: RolloutRun, phase: Phase) -> str:
    request = run.request
    if phase is Phase.WORKFLOW:
        timeout, queued_sec = request.agent_timeout_sec, run.queued_sec
    else:
        timeout, queued_sec = request.grader_timeout_sec, None
    assert timeout is not None  # a phase without a deadline never times out
    message = f"{phase} exceeded its {float(timeout)}s deadline"
    if queued_sec is not None and queued_sec >= 0.1:
        message += f" ({queued_sec:.1f}s of it spent queued)"
    return message


def _diagnostics(phase: Phase, exc: BaseException) -> dict[str, Any]:
    return {
        f"{phase}_error": {
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc)),
        }
    }


def timed_out(
    run: RolloutRun,
    phase: Phase,
    sample: Sample | None = None,
    *,
    exc: BaseException | None = None,
    late: bool = False,
) -> ExecutionResult:
    """The ``timeout`` failure of a phase whose deadline passed (logged at DEBUG).

    Args:
        run: The rollout.
        phase: The phase whose deadline passed.
        sample: The sample it keeps (the grader keeps the workflow's).
        exc: What user code raised as the deadline passed, for the diagnostics.
        late: Whether the phase returned after its deadline (said in the log).
    """
    message = _deadline_message(run, phase)
    rollout_id = run.request.id
    logger.debug(
        "Rollout %s: %s%s",
        rollout_id,
        message,
        " (it returned late)" if late else "",
        extra=log_fields(rollout_id, RolloutStatus.FAILURE, RolloutErrorCategory.TIMEOUT),
    )
    return ExecutionResult(
        status=RolloutStatus.FAILURE,
        sample=sample,
        err_message=message,
        err_category=RolloutErrorCategory.TIMEOUT,
        extra_fields=None if exc is None else _diagnostics(phase, exc),
    )


def _failure(exc: Exception, sample: Sample | None, phase: Phase) -> ExecutionResult:
    return ExecutionResult(
        status=RolloutStatus.FAILURE,
        sample=sample,
        err_message=str(exc),
        err_category=categorize_exception(exc),
        extra_fields=_diagnostics(phase, exc),
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


class PhaseRunner:
    """Run the phases of a backend's rollouts: a fresh workflow (with its own copy of the
    config) or grader instance per rollout, under the phase's deadline (module docstring).

    Args:
        workflow_cls: The workflow class.
        workflow_config: The workflow config (deep-copied for every rollout), or None.
        grader_cls: The grader class, or None when the backend does not grade.
        grader_config: The grader config (shared by every grading run), or None.
    """

    def __init__(
        self,
        workflow_cls: type[AgentWorkflow],
        workflow_config: AgentWorkflowConfig | None,
        grader_cls: type[Grader] | None,
        grader_config: GraderConfig | None,
    ) -> None:
        self.workflow_cls = workflow_cls
        self.workflow_config = workflow_config
        self.grader_cls = grader_cls
        self.grader_config = grader_config

    async def run(
        self,
        run: RolloutRun,
        phase: Phase,
        artifacts_dir: LazyDirectory | None,
        ambient: RolloutContext,
        sample: Sample | None = None,
    ) -> ExecutionResult:
        """Run one phase of ``run`` to its result; its duration goes into ``run``.

        Args:
            run: The rollout.
            phase: Which phase.
            artifacts_dir: The rollout's artifacts directory, or None.
            ambient: The rollout's bound context (its sample source, for the workflow).
            sample: The grader's: the workflow's sample to score (None for the workflow).

        Raises:
            asyncio.CancelledError: When the task is cancelled while user code runs.
        """
        request = run.request
        start = time.monotonic()
        if phase is Phase.WORKFLOW:
            timeout = request.agent_timeout_sec
            budget = None if timeout is None else timeout - (start - run.entered)
        else:
            budget = request.grader_timeout_sec
        # Each return names its result (``result :=``) for the span's outcome below.
        result: ExecutionResult | None = None
        with _tracing.phase_span(phase.span_name, request.id) as span:
            try:
                if budget is not None and budget <= 0:
                    return (result := timed_out(run, phase, sample))
                deadline = UNBOUNDED if budget is None else asyncio.timeout(budget)
                try:
                    async with deadline:
                        # User code is awaited right here: a helper coroutine per phase would
                        # add a frame to every rollout in flight.
                        if phase is Phase.WORKFLOW:
                            config = copy.deepcopy(self.workflow_config)
                            workflow = self.workflow_cls(config)
                            context = WorkflowContext(
                                rollout_id=request.id,
                                prompt=copy_or_keep(request.prompt),
                                config=config,
                                metadata=copy_or_keep(request.metadata),
                                artifacts_dir=artifacts_dir,
                                base_url=ambient.base_url,
                            )
                            returned = await workflow.run(context)
                            produced = await _sample_from(returned, run, ambient)
                        else:
                            assert self.grader_cls is not None
                            grader = self.grader_cls(self.grader_config)
                            grading = GraderContext(
                                rollout_id=request.id,
                                label=request.label,
                                sample=sample,
                                metadata=request.metadata,
                                artifacts_dir=artifacts_dir,
                            )
                            await grader.grade(grading)
                            produced = grading.sample
                            _check_reward(produced)
                except Exception as exc:
                    if deadline.expired():
                        return (result := timed_out(run, phase, sample, exc=exc))
                    result = _failure(exc, sample, phase)
                    logger.debug(
                        "%s of rollout %s failed",
                        phase.capitalize(),
                        request.id,
                        exc_info=exc,
                        extra=log_fields(request.id, result.status, result.err_category),
                    )
                    return result
                if budget is not None and (deadline.expired() or time.monotonic() - start > budget):
                    # It returned, but only after its deadline (it swallowed the cancellation
                    # or blocked the loop): a timeout, never a late success.
                    return (result := timed_out(run, phase, sample, late=True))
                return (result := ExecutionResult(status=RolloutStatus.SUCCESS, sample=produced))
            finally:
                elapsed = time.monotonic() - start
                if phase is Phase.WORKFLOW:
                    run.workflow_sec = elapsed
                    request.observer.observe_workflow(elapsed)
                else:
                    run.grader_sec = elapsed
                    request.observer.observe_grading(elapsed)
                if result is not None:  # None: cancelled (the span records the exception)
                    _tracing.set_outcome(span, result.status, result.err_category)


async def _sample_from(returned: Any, run: RolloutRun, ambient: RolloutContext) -> Sample | None:
    """The sample of what ``run()`` returned (or of the registered sample source, for
    None); records ``AgentWorkflowOutput.info`` in ``run``."""
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
            sample.trajectory_messages = snapshot_messages(sample.messages)
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
        trajectory_messages=snapshot_messages(messages),
    )
