"""What a restart on durable state does: recover the rollouts the store held, and answer
those whose execution died with the process that admitted them.

At startup, before the app serves (:meth:`RolloutServer.open_state
<rollout_server.RolloutServer.open_state>`), :func:`recover` opens the store, hands it to
the registry, restores every rollout the store held within retention, and publishes each
one that was still in flight as ``failure`` / ``internal_error`` with
:data:`RESTART_ERR_MESSAGE` (its execution ended with the old process: a LocalBackend
keeps nothing across a restart). It waits until those failures are durable, then logs one
line with both counts. Nothing changes on the wire: the original lease tokens collect the
recovered results (200), a wrong token still gets 403, a recovered id still gets 409 on
re-admission within retention. ``/health`` reports the counts under ``state``
(:func:`health_fields`).

A backend whose executions outlive the server process (RayBackend's named, detached
workers; :mod:`rollout_server.execution._reattach`) is asked first: each in-flight rollout
it still holds gets an execution task again (waiting on the backend, its lease armed) and
is published as usual when it ends; only the rest fail as above, with the backend's note
(the workers that ended too) appended to the message.
"""

from __future__ import annotations

from typing import Any, Final

import attrs

from rollout_types import RolloutErrorCategory, RolloutStatus

from .._logtext import get_logger
from ..execution._reattach import Reattacher
from ..state._registry import RolloutRegistry
from ..state._store import StateStore
from ._execution import StatusSink

__all__ = ["RESTART_ERR_MESSAGE", "Recovery", "health_fields", "recover"]

logger: Final = get_logger("rollout_server.app")

RESTART_ERR_MESSAGE: Final = "the server process {process_id} ended before the rollout finished"
"""``err_message`` of a rollout in flight when the server process that admitted it ended
(``process_id`` is that process's ``/health`` ``process_id``)."""


@attrs.frozen(kw_only=True)
class Recovery:
    """What the last start recovered from the state store.

    Attributes:
        recovered_rollouts: Rollouts whose published result the store kept (collectable
            again with their original lease tokens).
        failed_by_restart: Rollouts in flight when their server process ended, now
            published as ``failure`` / ``internal_error`` (:data:`RESTART_ERR_MESSAGE`).
    """

    recovered_rollouts: int = 0
    failed_by_restart: int = 0
    reattached_rollouts: int = 0
    """Rollouts in flight that the backend still held (they finish as usual)."""


async def recover(
    registry: RolloutRegistry,
    store: StateStore,
    *,
    process_id: str,
    reattacher: Reattacher | None = None,
) -> Recovery:
    """Open ``store`` for this server process, restore what it holds into ``registry``,
    take back from ``reattacher`` (the backend, if its executions outlive the process) what
    it still holds, and fail the other rollouts that were in flight (module docstring).

    Raises:
        StateOpenError: If the store cannot be opened (the message says why and what to do).
        Exception: What the backend's start raised (``reattacher`` starts it).
    """
    rows = await store.open(process_id=process_id)
    registry.attach_store(store, process_id=process_id)
    owners = {row.rollout_id: row.process_id for row in rows}
    unfinished = registry.restore(rows)
    note = ""
    reattached = 0
    if reattacher is not None and store.durable:
        sinks = {record.rollout_id: StatusSink(registry, record) for record in unfinished}
        taken = await reattacher._reattach(sinks)
        note = taken.note or ""
        loop = registry.loop
        left = []
        for record in unfinished:
            coroutine = taken.running.get(record.rollout_id)
            if coroutine is None:
                left.append(record)
            else:
                registry.adopt(record, loop.create_task(coroutine))
        reattached = len(unfinished) - len(left)
        unfinished = left
    for record in unfinished:
        owner = owners.get(record.rollout_id) or "unknown"
        registry.publish(
            record,
            status=RolloutStatus.FAILURE,
            err_message=RESTART_ERR_MESSAGE.format(process_id=owner) + note,
            err_category=RolloutErrorCategory.INTERNAL_ERROR,
        )
    if unfinished:
        await store.flush()  # each failure is published once durable (polls wait till then)
    recovery = Recovery(
        recovered_rollouts=len(rows) - len(unfinished) - reattached,
        failed_by_restart=len(unfinished),
        reattached_rollouts=reattached,
    )
    if store.durable:
        ended = sorted({owners[record.rollout_id] for record in unfinished})
        logger.info(
            "State %s: recovered %d rollout result(s); %d rollout(s) in flight failed by the "
            "restart%s%s",
            store.url,
            recovery.recovered_rollouts,
            recovery.failed_by_restart,
            f" (server process {', '.join(ended)} ended before they finished)" if ended else "",
            f"; {reattached} rollout(s) re-attached to the backend" if reattacher else "",
        )
    return recovery


def health_fields(store: StateStore, recovery: Recovery) -> dict[str, Any]:
    """The ``state`` object of ``/health``: the store kind, what the last start recovered,
    and the store's commits (additive fields; clients that do not know them ignore them)."""
    stats = store.stats
    return {
        "store": store.url.partition(":")[0],
        "recovered_rollouts": recovery.recovered_rollouts,
        "failed_by_restart": recovery.failed_by_restart,
        "reattached_rollouts": recovery.reattached_rollouts,
        "commits": stats.commits,
        "writes": stats.writes,
        "largest_commit": stats.largest_batch,
        "failed_commits": stats.failed_commits,
    }
