"""What a user writes to run an agent: an :class:`AgentWorkflow` and its config.

A workflow runs once per rollout. :class:`~rollout_server.LocalBackend` creates a fresh
instance for every rollout, hands it a :class:`WorkflowContext` and turns what ``run()``
returns into the rollout's sample. The chat endpoint, the LLM key and the rollout id are
in the ambient :func:`~rollout_server.get_rollout_context`.
"""

from __future__ import annotations

import abc
import math
import numbers
from pathlib import Path
from typing import Any

import attrs

from ._config import BaseConfig, ConcurrencyConfig
from ._lazydir import LazyDirectory, directory_repr, resolve_directory

__all__ = [
    "AgentWorkflow",
    "AgentWorkflowConfig",
    "AgentWorkflowOutput",
    "ConcurrencyConfig",
    "WorkflowContext",
]


@attrs.frozen(kw_only=True, init=False)
class AgentWorkflowConfig(BaseConfig):
    """Configuration of a workflow: ``name``, ``description``, ``concurrency``, ``extra``.

    ``concurrency.max_concurrent`` is LocalBackend's slot count: an int, or None for no
    limit (a backend built without any workflow config uses 4). Each rollout gets its own
    deep copy. Extra keys are allowed: ``AgentWorkflowConfig(name="agent", model="m")``
    keeps ``model`` in ``extra``, readable as ``config.model`` or ``config.get("model")``.
    """


def _messages(_inst: object, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, list):
        raise TypeError(f"AgentWorkflowOutput.messages must be a list or None; got {value!r}")
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise TypeError(
                f"AgentWorkflowOutput.messages[{index}] must be a dict (a chat message); "
                f"got {type(message).__name__}"
            )


def _metrics(_inst: object, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"AgentWorkflowOutput.metrics must be a dict; got {value!r}")
    for key, number in value.items():
        if not isinstance(key, str):
            raise TypeError(f"AgentWorkflowOutput.metrics keys must be strings; got {key!r}")
        if isinstance(number, bool) or not isinstance(number, numbers.Real):
            raise TypeError(
                f"AgentWorkflowOutput.metrics[{key!r}] must be a number; got {number!r}"
            )
        if not math.isfinite(number):
            raise ValueError(f"AgentWorkflowOutput.metrics[{key!r}] must be finite; got {number!r}")


def _info(_inst: object, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"AgentWorkflowOutput.info must be a dict; got {value!r}")


@attrs.frozen(kw_only=True)
class AgentWorkflowOutput:
    """What ``run()`` may return.

    Attributes:
        messages: The final conversation (chat messages as dicts), or None for "no sample".
        metrics: Finite numeric telemetry by name; it becomes the sample's ``metrics``.
        info: Anything else the workflow wants recorded; it is saved with the trajectory
            (``workflow_info``) and never sent.

    Raises:
        TypeError, ValueError: On a non-dict message, a non-numeric or non-finite metric.
    """

    messages: list[dict[str, Any]] | None = attrs.field(default=None, validator=_messages)
    metrics: dict[str, float] = attrs.field(factory=dict, validator=_metrics)
    info: dict[str, Any] = attrs.field(factory=dict, validator=_info)


@attrs.define(kw_only=True, eq=False)
class WorkflowContext:
    """What one rollout's ``run()`` receives.

    The request's ``label`` is deliberately absent: the workflow must not see the answer.

    Attributes:
        rollout_id: The admitted id.
        prompt: The request's ``initial_messages`` (a copy the workflow may change).
        config: The rollout's own deep copy of the workflow config, or None.
        metadata: The request's ``metadata`` (a copy), or None.
        artifacts_dir: ``<artifact_root>/<rollout_id>/artifacts/`` for files the workflow
            wants kept, or None when it cannot be created. LocalBackend creates it when it
            is first read (see :attr:`artifacts_dir`); a path given here is used as is.
        base_url: The OpenAI-compatible base URL of the policy model for this rollout (the
            same as ``get_rollout_context().base_url``): the rollout's route through the
            server's model gateway when it runs one (its calls are then captured as
            turns), else the request's ``chat_completions_url``; "" when neither is known.

    .. versionchanged:: 0.3
       ``base_url``.
    """

    rollout_id: str
    prompt: list[dict[str, Any]]
    config: AgentWorkflowConfig | None = None
    metadata: dict[str, Any] | None = None
    _artifacts_dir: Path | LazyDirectory | None = attrs.field(
        default=None, alias="artifacts_dir", repr=directory_repr
    )
    base_url: str = ""

    @property
    def artifacts_dir(self) -> Path | None:
        """The rollout's artifacts directory, created on first read; None when it cannot
        be created (a WARNING says why)."""
        return resolve_directory(self._artifacts_dir)


class AgentWorkflow(abc.ABC):
    """Base class of agent workflows: implement :meth:`run`.

    Args:
        config: The rollout's copy of the workflow config (None when the backend has none);
            kept as ``self.config``.
    """

    def __init__(self, config: AgentWorkflowConfig | None = None) -> None:
        self.config = config

    @abc.abstractmethod
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput | list[dict[str, Any]] | None:
        """Run the agent for one rollout.

        Returns:
            An :class:`AgentWorkflowOutput`, a bare message list (taken as its
            ``messages``), or None to take the sample from the source registered with
            ``get_rollout_context().register_sample_source(...)`` (no sample when none is).

        Raises:
            Exception: Any exception fails the rollout, classified by
                :func:`~rollout_server.categorize_exception`.
        """
