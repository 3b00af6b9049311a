"""Turn capture on the server's side: a model route per rollout, and the captured turns in
the result of a caller that asked for them.

With a model router (the gateway, :mod:`rollout_server.gateway`), every admitted rollout
gets a route as its execution is set up (:meth:`TurnCapture.open`; the route goes into
the rollout's context, see :func:`~rollout_server.protocol._execution.start_execution`),
and the route is closed as the execution task ends. When the request set
``return_turns``, the published result carries the route's turns
(:meth:`TurnCapture.outcome_of`): on every result of an execution that returned or raised
(success or failure); never on ``cancelled``, ``lease_expired`` or crash results, which
are published without asking for the execution's outcome.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollout_types import RolloutInitRequest

from ..execution._context import upstream_url
from ..execution._turns import ModelRoute, ModelRouter
from ..state._record import ResultFields
from ._execution import execution_result

__all__ = ["TurnCapture"]


class TurnCapture:
    """The routes of a server's rollouts through its model router.

    Args:
        router: The model router (gateway).
    """

    def __init__(self, router: ModelRouter) -> None:
        self.router = router
        self._asked: dict[str, ModelRoute] = {}

    def open(self, init: RolloutInitRequest) -> ModelRoute:
        """Open the route of the rollout ``init`` admits (its execution is being set up)."""
        route = self.router.open_route(
            rollout_id=init.rollout_id,
            chat_completions_url=upstream_url(init.chat_completions_url),
            weight_version=init.weight_version,
            group_id=init.group_id,
        )
        if init.return_turns:
            self._asked[init.rollout_id] = route
        return route

    def watch(self, task: asyncio.Task[Any], route: ModelRoute) -> None:
        """Close ``route`` when ``task`` (its execution) ends; forget it once the registry
        has published (the registry's own done callback runs between the two)."""
        loop = task.get_loop()

        def done(_task: asyncio.Task[Any]) -> None:
            self.router.close_route(route)
            # Scheduled, so it runs after the registry's done callback (added later, so
            # already queued), which asks outcome_of for the turns.
            loop.call_soon(self._forget, route)

        task.add_done_callback(done)

    def _forget(self, route: ModelRoute) -> None:
        if self._asked.get(route.rollout_id) is route:
            del self._asked[route.rollout_id]

    def outcome_of(self, rollout_id: str, task: asyncio.Task[Any]) -> ResultFields:
        """What to publish for an execution task that returned or raised: its
        :func:`~rollout_server.protocol._execution.execution_result`, with the captured
        turns (in call order) when the request asked for them."""
        fields = execution_result(rollout_id, task)
        route = self._asked.get(rollout_id)
        if route is None:
            return fields
        return fields._replace(turns=list(route.turns))
