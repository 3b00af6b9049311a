"""The execution task of one rollout: call the backend, pick the result, make it wire-safe.

This is spec section 4.7: the task runs ``backend.execute()`` with the ambient
:class:`~rollout_server.execution._context.RolloutContext` bound; ``running`` is reported as it
starts (unless the backend reports its own queue status); once it is done the registry publishes
what :func:`execution_result` makes of it: the result to report, selected and run through
the wire-sample pipeline, or a categorised failure. Cancellation and a ``BaseException``
(a task crash) the registry publishes itself.

An exception raised by ``execute()`` is a failure the backend reports (its traceback is
logged at DEBUG; the registry's "finished" line says the category and message); an outcome
the server cannot report (a backend contract violation) is logged at ERROR.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import numbers
from collections.abc import Callable
from typing import Any, Final

import attrs

from rollout_types import RolloutErrorCategory, RolloutSample, RolloutStatus, is_terminal

from .._logtext import get_logger
from .._sanitize import json_safe_sample, scrub_text
from ..execution._backend import (
    ExecutionBackend,
    ExecutionOutcome,
    ExecutionRequest,
    ExecutionResult,
    Sample,
)
from ..execution._categorize import categorize_exception
from ..execution._context import RolloutContext, context_binding
from ..execution._turns import ModelRoute
from ..state._record import ResultFields, RolloutRecord
from ..state._registry import RolloutRegistry

__all__ = ["StatusSink", "execution_result", "start_execution", "wire_result"]

logger: Final = get_logger("rollout_server.execution")

FALLBACK_MESSAGE: Final = "Internal server error"


def _wire_reward(value: Any) -> float | None:
    if isinstance(value, numbers.Real):
        number = float(value)
        if math.isfinite(number):
            return number
    return None


def _wire_sample(sample: Sample, status: RolloutStatus, rollout_id: str) -> RolloutSample:
    if not isinstance(sample, Sample):
        raise TypeError(
            "an ExecutionResult's sample must be a rollout_server.Sample; "
            f"got {type(sample).__name__}"
        )
    messages: Any = sample.messages
    if isinstance(messages, tuple):
        messages = list(messages)
    if not isinstance(messages, list):
        logger.warning(
            "Rollout %s: sample.messages is a %s, not a list; sending no messages",
            rollout_id,
            type(messages).__name__,
        )
        messages = []
    wire = json_safe_sample(
        RolloutSample(
            messages=messages,
            label=sample.label,
            reward=_wire_reward(sample.reward),
            remove_sample=bool(sample.remove_sample),
            metrics=sample.metrics,
            extra_fields=sample.extra_fields,
        ),
        context=rollout_id,
    )
    if wire.reward is not None and (status != RolloutStatus.SUCCESS or wire.remove_sample):
        wire = attrs.evolve(wire, reward=None)
    return wire


def wire_result(rollout_id: str, result: ExecutionResult) -> ResultFields:
    """Turn the reported result into the fields to publish (spec section 4.7 steps 6-7).

    The sample loses ``trajectory_messages``, is made JSON-safe and has its reward nulled
    unless the status is ``success`` and ``remove_sample`` is false; ``err_message`` is
    made valid UTF-8. A non-terminal or unknown status is a backend contract violation,
    reported as ``failure`` / ``internal_error``.
    """
    try:
        status = RolloutStatus(result.status)
    except ValueError:
        status = RolloutStatus.UNKNOWN
    if not is_terminal(status):
        return ResultFields(
            status=RolloutStatus.FAILURE,
            err_message=(
                f"backend reported the non-terminal status {str(result.status)!r} as the "
                "outcome; an outcome's status must be success, failure or cancelled"
            ),
            err_category=RolloutErrorCategory.INTERNAL_ERROR,
        )
    sample = None if result.sample is None else _wire_sample(result.sample, status, rollout_id)
    err_message = None if result.err_message is None else scrub_text(str(result.err_message))
    err_category: RolloutErrorCategory | None = None
    if result.err_category is not None:
        try:
            err_category = RolloutErrorCategory(result.err_category)
        except ValueError:
            logger.warning(
                "Rollout %s: unknown err_category %r reported; sending agent_error",
                rollout_id,
                result.err_category,
            )
            err_category = RolloutErrorCategory.AGENT_ERROR
    return ResultFields(
        status=status, sample=sample, err_message=err_message, err_category=err_category
    )


class StatusSink:
    """``on_status`` of one rollout: reports to the registry (smaller than a partial)."""

    __slots__ = ("_record", "_registry")

    def __init__(self, registry: RolloutRegistry, record: RolloutRecord) -> None:
        self._registry = registry
        self._record = record

    def __call__(self, status: RolloutStatus | str) -> None:
        self._registry.set_status(self._record, status)


# Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "The execution task runs
#   `backend.execute()` itself ..."
def start_execution(
    *,
    registry: RolloutRegistry,
    backend: ExecutionBackend,
    record: RolloutRecord,
    request: ExecutionRequest,
    process_id: str,
    on_start: Callable[[], None],
    model_route: ModelRoute | None = None,
) -> asyncio.Task[Any]:
    """Start the execution task of one rollout: ``backend.execute(request)`` itself.

    The task runs the backend's coroutine directly, in a copy of the current context with
    the rollout's :class:`~rollout_server.execution._context.RolloutContext` bound, rather than in a
    wrapper coroutine: a waiting rollout holds one frame less (about 300 bytes). What a
    wrapper would do around the call happens in callbacks instead: ``running`` is
    reported just before the task's first step (unless the backend reports its own queue
    status), and the registry publishes once the task is done (:func:`execution_result`).
    ``on_start`` is called just before that first step too, in any case: also when the
    task was cancelled before it (then ``execute()`` never runs), and also when this
    function raises after scheduling it.

    Args:
        registry: Where the status is reported.
        backend: What executes the rollout.
        record: The rollout's registry record.
        request: What the backend receives.
        process_id: The server instance's ``process_id`` (for the ambient context).
        on_start: Called once, right before the task's first step (see above).
        model_route: The rollout's route through the server's model gateway (bound into
            its context), or None.

    Returns:
        The task, scheduled on the registry's loop.
    """
    loop = registry.loop
    # Scheduled right before the task's first step, so nothing runs in between: the
    # rollout counts as started unless a cancellation has landed before that step.
    loop.call_soon(
        _mark_started,
        registry,
        record,
        not backend.reports_queue_status,
        on_start,
        context=_NO_CONTEXT,
    )
    context = context_binding(
        RolloutContext.from_request(
            rollout_id=record.rollout_id,
            chat_completions_url=request.chat_completions_url,
            llm_api_key=request.llm_api_key,
            process_id=process_id,
            on_status=request.on_status,
            model_route=model_route,
        )
    )
    return loop.create_task(backend.execute(request), context=context)


_NO_CONTEXT: Final = contextvars.Context()
"""The context of the started callback (it reads no context variable)."""


def _mark_started(
    registry: RolloutRegistry,
    record: RolloutRecord,
    report_running: bool,
    on_start: Callable[[], None],
) -> None:
    on_start()
    if registry.mark_started(record) and report_running:
        registry.set_status(record, RolloutStatus.RUNNING)


def execution_result(rollout_id: str, task: asyncio.Task[Any]) -> ResultFields:
    """What to publish for an execution task that returned or raised an ``Exception``
    (the registry's ``outcome_of``).

    An outcome is checked and made wire-safe (:func:`wire_result`); an ``Exception`` (or an
    outcome that fails those checks) is a categorised ``failure``. The traceback of an
    exception ``execute()`` raised is logged at DEBUG; an outcome that fails the checks is
    logged at ERROR, with its traceback.
    """
    error = task.exception()
    if error is None:
        outcome = task.result()
        try:
            if not isinstance(outcome, ExecutionOutcome):
                raise TypeError(
                    "backend.execute() must return an ExecutionOutcome; "
                    f"got {type(outcome).__name__}"
                )
            return wire_result(rollout_id, outcome.reported())
        except Exception as exc:
            logger.exception("Rollout %s: the backend's outcome cannot be reported", rollout_id)
            error = exc
    else:
        logger.debug("Rollout %s: execute() raised", rollout_id, exc_info=error)
    return ResultFields(
        status=RolloutStatus.FAILURE,
        err_message=scrub_text(str(error)) or FALLBACK_MESSAGE,
        err_category=categorize_exception(error),
    )
