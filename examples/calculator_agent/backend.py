"""The example backend: :class:`CalculatorAgent` graded by :class:`AnswerGrader`.

Serve it with::

    rollout-server serve calculator_agent.backend:create_backend --app-dir examples

Environment variables (all optional) tune it without code:

* ``EXAMPLE_AGENT_MODEL``: the model name to request (default: the first one the chat
  endpoint's ``/models`` lists);
* ``EXAMPLE_AGENT_STREAM``: ``1`` to request streamed completions (default ``0``);
* ``EXAMPLE_AGENT_MAX_TURNS``: most model calls per rollout (default 6);
* ``EXAMPLE_AGENT_MAX_CONCURRENT``: LocalBackend slots (default 8);
* ``EXAMPLE_AGENT_MAX_QUEUED``: rollouts that may wait for a slot before admission answers
  429 (default: no bound).
"""

from __future__ import annotations

import os
from typing import Any

from rollout_server import AgentWorkflowConfig, GraderConfig, LocalBackend

from .agent import CalculatorAgent
from .grader import AnswerGrader

__all__ = ["create_backend", "int_env", "workflow_config"]


def int_env(name: str, default: int | None) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def workflow_config() -> AgentWorkflowConfig:
    """The agent's config from the environment (see the module docstring).

    Raises:
        ValueError: When one of the environment variables is not a valid number.
    """
    extra: dict[str, Any] = {
        "stream": os.environ.get("EXAMPLE_AGENT_STREAM", "0").strip().lower() in {"1", "true"},
        "max_turns": int_env("EXAMPLE_AGENT_MAX_TURNS", 6),
    }
    model = os.environ.get("EXAMPLE_AGENT_MODEL", "").strip()
    if model:
        extra["model"] = model
    return AgentWorkflowConfig(
        name="calculator-agent",
        description="multi-turn chat agent with a calculator tool",
        concurrency={"max_concurrent": int_env("EXAMPLE_AGENT_MAX_CONCURRENT", 8)},
        extra=extra,
    )


def create_backend() -> LocalBackend:
    """Build the example LocalBackend from the environment (see the module docstring).

    Raises:
        ValueError: When one of the environment variables is not a valid number.
    """
    return LocalBackend(
        workflow=CalculatorAgent,
        workflow_config=workflow_config(),
        grader=AnswerGrader,
        grader_config=GraderConfig(name="answer-match"),
        max_queued=int_env("EXAMPLE_AGENT_MAX_QUEUED", None),
    )
