"""``Cancellation``: the server's cancellation policy, in one place.

* ``POST /rollout/cancel`` (spec section 4.9) selects rollouts by ids, prefix or all and
  answers one disposition per id: ``not_found`` for finished and unknown ids,
  ``cancelled_queued`` or ``cancelled_running`` by the status at the first cancel, and that
  same disposition again for a repeated cancel before publication;
* who stops the work: the backend is asked first (``backend.cancel_rollouts()``); where it
  does not take an id, the server cancels its own execution task. A backend's
  ``not_found`` counts as handled when the backend still reports a terminal status;
* a lapsed polling lease requests cancellation too, the expiries of one loop turn batched
  into one backend request;
* the staged shutdown cancels everything without a result, as ``{"all": true}`` does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final

from rollout_types import CancelDisposition, CancelRolloutsRequest, RolloutStatus, is_terminal

from .._logtext import get_logger, log_list
from ..execution._backend import ExecutionBackend
from ..state._record import RolloutRecord
from ..state._registry import RolloutRegistry

__all__ = ["Cancellation"]

logger: Final = get_logger("rollout_server.app")

_CANCELLED: Final = (CancelDisposition.CANCELLED_QUEUED, CancelDisposition.CANCELLED_RUNNING)


class Cancellation:
    """Cancels rollouts of one registry: by request, on lease expiry, and at shutdown.

    Args:
        registry: The rollouts.
        backend: Asked first to cancel each rollout.
        spawn: Runs a coroutine as a side task of the server (lease-expiry requests).
        on_answered: Called with the dispositions of every answered selection (metrics);
            default None.
    """

    __slots__ = ("_backend", "_expired", "_on_answered", "_registry", "_spawn")

    def __init__(
        self,
        *,
        registry: RolloutRegistry,
        backend: ExecutionBackend,
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
        on_answered: Callable[[Mapping[str, CancelDisposition]], None] | None = None,
    ) -> None:
        self._registry = registry
        self._on_answered = on_answered
        self._backend = backend
        self._spawn = spawn
        self._expired: list[RolloutRecord] = []

    async def cancel(self, selection: CancelRolloutsRequest) -> dict[str, CancelDisposition]:
        """Cancel the selected rollouts; return one disposition per selected id.

        Args:
            selection: The request, with exactly one selector (the route checks that).
        """
        registry = self._registry
        if selection.ids is not None:
            selected = list(dict.fromkeys(selection.ids))
            scope = f"{len(selected)} ids"
        elif selection.prefix is not None:
            prefix = selection.prefix
            selected = [rid for rid in registry.ids() if rid.startswith(prefix)]
            scope = "prefix"
        else:
            selected = registry.ids()
            scope = "all"
        dispositions: dict[str, CancelDisposition] = {}
        pending: list[RolloutRecord] = []
        for rollout_id in selected:
            record = registry.get(rollout_id)
            if record is None or record.published:
                dispositions[rollout_id] = CancelDisposition.NOT_FOUND
            elif record.disposition is not None:
                dispositions[rollout_id] = record.disposition
            else:
                disposition = (
                    CancelDisposition.CANCELLED_QUEUED
                    if record.status is RolloutStatus.QUEUED
                    else CancelDisposition.CANCELLED_RUNNING
                )
                registry.record_disposition(record, disposition)
                dispositions[rollout_id] = disposition
                pending.append(record)
        if pending:
            dispositions.update(await self._request(pending))
        cancelled = sum(1 for d in dispositions.values() if d.startswith("cancelled"))
        logger.info("Cancelled %d rollout(s) (%s)", cancelled, scope)
        if self._on_answered is not None:
            self._on_answered(dispositions)
        return dispositions

    async def cancel_everything(self) -> dict[str, CancelDisposition]:
        """Cancel every rollout without a result, as ``POST /rollout/cancel {"all": true}``."""
        return await self.cancel(CancelRolloutsRequest(all=True))

    def lease_expired(self, record: RolloutRecord) -> None:
        """Request cancellation of ``record``, whose lapsed lease was just published
        (batched with the other expiries of this loop turn)."""
        self._expired.append(record)
        if len(self._expired) == 1:
            self._registry.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send the cancellation request of the lease expiries not requested yet."""
        records, self._expired = self._expired, []
        if records:
            _ = self._spawn(self._request(records))

    async def _request(self, records: list[RolloutRecord]) -> dict[str, CancelDisposition]:
        """Ask the backend to cancel ``records``; cancel the server's own task where the
        backend does not handle an id. Return the dispositions the backend reported."""
        ids = [record.rollout_id for record in records]
        answers: Any
        try:
            answers = await self._backend.cancel_rollouts(ids=ids)
        except Exception:
            logger.exception("Backend cancellation failed for rollout(s) %s", log_list(ids, 20))
            answers = {}
        if not isinstance(answers, Mapping):
            logger.warning(
                "backend.cancel_rollouts() returned %s, not a dict; cancelling the server's tasks",
                type(answers).__name__,
            )
            answers = {}
        registry = self._registry
        adopted: dict[str, CancelDisposition] = {}
        for record in records:
            answer = answers.get(record.rollout_id)
            if answer in _CANCELLED or (
                answer == CancelDisposition.NOT_FOUND and self._backend_retains_terminal(record)
            ):
                disposition = CancelDisposition(answer)
                registry.record_disposition(record, disposition)
                adopted[record.rollout_id] = disposition
            else:
                registry.cancel_task(record)
        return adopted

    def _backend_retains_terminal(self, record: RolloutRecord) -> bool:
        try:
            state = self._backend.rollout_status(record.rollout_id)
        except Exception:
            logger.exception("backend.rollout_status(%r) failed", record.rollout_id)
            return False
        return isinstance(state, Mapping) and is_terminal(str(state.get("status")))
