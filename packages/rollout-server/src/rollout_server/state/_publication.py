"""How a rollout's end is worded: the messages of the results the registry makes itself,
what an execution task's end publishes, the observers told of each publication, and the
rollout's one "finished" log line.

Nothing here writes a record: :class:`~rollout_server.state._registry.RolloutRegistry` (the
single writer) asks :func:`task_end` what to publish and calls :func:`log_finished` and its
:class:`PublicationObserver` objects once it has published.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Final, NamedTuple, Protocol

from rollout_types import RolloutErrorCategory, RolloutSample, RolloutStatus

from .._logtext import get_logger
from ..observability._jsonlog import log_fields
from ._record import ResultFields, RolloutRecord

__all__ = [
    "CANCELLED_MESSAGE",
    "CRASH_MESSAGE",
    "LEASE_EXPIRED_MESSAGE",
    "PublicationObserver",
    "TaskEnd",
    "log_finished",
    "task_end",
]

logger: Final = get_logger("rollout_server.registry")

LEASE_EXPIRED_MESSAGE: Final = "polling lease expired"
CRASH_MESSAGE: Final = "rollout task crashed"
CANCELLED_MESSAGE: Final = "cancelled"
"""``err_message`` of a rollout whose execution was cancelled after it started."""

_CRASH: Final = ResultFields(
    status=RolloutStatus.FAILURE,
    err_message=CRASH_MESSAGE,
    err_category=RolloutErrorCategory.INTERNAL_ERROR,
)


class PublicationObserver(Protocol):
    """What the registry tells its observers (called on the loop; must not raise)."""

    def published(
        self,
        record: RolloutRecord,
        status: RolloutStatus,
        category: RolloutErrorCategory | None,
    ) -> None:
        """The result of ``record`` has just been fixed, with this status and category."""

    def delivered(self, record: RolloutRecord) -> None:
        """A poll has returned the published result of ``record`` for the first time."""


class TaskEnd(NamedTuple):
    """What the end of an execution task publishes."""

    fields: ResultFields
    """The result."""
    from_outcome: bool
    """Whether it is what the execution produced (``outcome_of``): a lapsed lease then
    wins over it, as if the lease timer had fired first."""


def task_end(
    record: RolloutRecord,
    task: asyncio.Task[Any],
    outcome_of: Callable[[str, asyncio.Task[Any]], ResultFields | None],
) -> TaskEnd:
    """What to publish for the execution task of ``record``, which is done.

    A cancelled task is ``cancelled``, with the message ``"cancelled"`` once it had
    started; a task that returned or raised an ``Exception`` gets what ``outcome_of`` makes
    of it; anything else (a ``BaseException``, no outcome, a failing ``outcome_of``) is a
    crash: ``failure`` / ``internal_error`` (logged at ERROR).
    """
    rollout_id = record.rollout_id
    if task.cancelled():
        message = CANCELLED_MESSAGE if record.started else None
        return TaskEnd(ResultFields(status=RolloutStatus.CANCELLED, err_message=message), False)
    exc = task.exception()
    if exc is None or isinstance(exc, Exception):
        try:
            fields = outcome_of(rollout_id, task)
        except Exception:
            logger.exception("Publishing the outcome of rollout %s failed", rollout_id)
        else:
            if fields is not None:
                return TaskEnd(fields, True)
            logger.error(
                "Rollout task for %s ended without a result",
                rollout_id,
                extra=log_fields(rollout_id, "failure", "internal_error"),
            )
    else:
        logger.error(
            "Rollout task for %s crashed",
            rollout_id,
            exc_info=exc,
            extra=log_fields(rollout_id, "failure", "internal_error"),
        )
    return TaskEnd(_CRASH, False)


# Speed: benchmarks/README.md, "Server: the `rollout-server serve` process", row "The log lines of
#   one loop turn written with one `write` ..."
def log_finished(
    record: RolloutRecord,
    status: RolloutStatus,
    sample: RolloutSample | None,
    err_message: str | None,
    err_category: RolloutErrorCategory | None,
) -> None:
    """Log the rollout's one "finished" line (INFO, DEBUG for a success)."""
    level = logging.DEBUG if status is RolloutStatus.SUCCESS else logging.INFO
    if not logger.isEnabledFor(level):
        return
    logger.log(
        level,
        "Rollout %s finished: status=%s err_category=%s duration=%.3fs reward=%s err_message=%s",
        record.rollout_id,
        status.value,
        None if err_category is None else err_category.value,
        time.monotonic() - record.admitted_at,
        None if sample is None else sample.reward,
        err_message,
        extra=log_fields(record.rollout_id, status, err_category),
    )
