"""How a backend whose executions outlive the server process hands them back after a
restart on durable state (RayBackend's named, detached workers do; LocalBackend's
executions end with the process).

The server tells such a backend its state URL before the backend starts (``_bind_state``),
so the backend can find what a previous process on the same state left running; while it
recovers, the server asks it (``_reattach``) for the rollouts that were in flight, and
registers each one the backend still holds as running (its execution task waits on the
backend, its lease runs) before it fails the rest as ended by the restart. The hooks are
private: a third-party backend gets today's behaviour (everything in flight fails).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Protocol, cast

import attrs

from rollout_types import RolloutStatus

from ._backend import ExecutionOutcome

__all__ = ["Reattached", "Reattacher", "reattacher_of"]


@attrs.frozen(kw_only=True)
class Reattached:
    """What a backend took back after a restart.

    Attributes:
        running: Per rollout id, the coroutine that ends with its outcome (the execution
            task's coroutine: cancelling the task cancels the rollout).
        note: Appended to the restart message of every rollout it did not take back (why
            its execution may have ended too), or None.
    """

    running: Mapping[str, Coroutine[Any, Any, ExecutionOutcome]]
    note: str | None = None


class Reattacher(Protocol):
    """The private hooks of a backend whose executions outlive the server process."""

    def _bind_state(self, state_url: str) -> None:
        """The server's state URL (``memory:`` or ``sqlite:///ABS/PATH``), told before the
        backend starts."""

    async def _reattach(
        self, on_status: Mapping[str, Callable[[RolloutStatus], None]]
    ) -> Reattached:
        """Start (if not started) and take back the rollouts of ``on_status`` (ids of the
        rollouts in flight when the previous process ended, each with its status sink)."""


def reattacher_of(backend: object) -> Reattacher | None:
    """``backend`` if it has both hooks, else None."""
    if callable(getattr(backend, "_bind_state", None)) and callable(
        getattr(backend, "_reattach", None)
    ):
        return cast("Reattacher", backend)
    return None
