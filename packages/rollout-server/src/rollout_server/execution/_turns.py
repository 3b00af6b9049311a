"""The seam between a model gateway and the rollouts it serves: a :class:`ModelRoute` per
rollout (the base URL its workflow calls, the turns captured on the way) and the
:class:`ModelRouter` interface that opens and closes routes.

A gateway (:class:`~rollout_server.ModelGateway`) implements :class:`ModelRouter`;
the server opens a route when a rollout's execution starts, binds it into the rollout's
:class:`~rollout_server.RolloutContext` (whose ``chat_completions_url`` and ``base_url``
then name the route) and closes it when the execution ends. Execution code sees only the
context: a base URL to call, and the list of captured turns that the trajectory is built
with. Turns are :class:`rollout_types.RolloutTurn` records, the same the result carries.
"""

from __future__ import annotations

import abc

import attrs

from rollout_types import RolloutTurn

__all__ = ["ModelRoute", "ModelRouter"]


@attrs.define(kw_only=True, eq=False)
class ModelRoute:
    """One rollout's way to the model through a gateway.

    Attributes:
        rollout_id: The rollout it serves.
        base_url: The OpenAI-compatible base URL the rollout's workflow calls (agent SDKs
            append ``/chat/completions``).
        turns: The model calls captured so far, in the order they ended (the gateway
            appends; readers copy). Each turn's ``index`` is its place in the order the
            calls arrived.
    """

    rollout_id: str
    base_url: str
    turns: list[RolloutTurn] = attrs.Factory(list)


class ModelRouter(abc.ABC):
    """What gives each rollout a route to the model: a model gateway."""

    @abc.abstractmethod
    def open_route(
        self,
        *,
        rollout_id: str,
        chat_completions_url: str,
        weight_version: str | None = None,
        group_id: str | None = None,
    ) -> ModelRoute:
        """Open the route of one rollout whose execution is about to start.

        Args:
            rollout_id: The rollout's id.
            chat_completions_url: The request's model base URL (after the environment
                fallback), where calls go unless the router has endpoints of its own.
            weight_version: The request's ``weight_version``, recorded on each turn.
            group_id: The request's ``group_id``: rollouts of one group share an endpoint.

        Returns:
            The route; its turns fill as calls end.
        """

    @abc.abstractmethod
    def close_route(self, route: ModelRoute) -> None:
        """Close ``route`` (its execution ended): later calls through it get 404; calls in
        flight finish and are still recorded."""
