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

__all__ = ["create_backend", "int_env", "settings_exit", "workflow_config"]


def int_env(name: str, default: int | None, *, minimum: int = 1) -> int | None:
    """The integer in environment variable ``name``, or ``default`` when it is unset or blank.

    Raises:
        ValueError: When the value is not an integer of at least ``minimum``, naming the
            variable.
    """
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise ValueError(
            f"environment variable {name} must be an integer of at least {minimum}, got {value!r}"
        )
    return number


def settings_exit(exc: ValueError) -> SystemExit:
    """The one-line exit of a factory whose environment variable is bad.

    ``rollout-server serve`` calls the factory; a ``SystemExit`` ends it with this one line
    (status 1) where any other exception would be reported with its traceback.
    """
    return SystemExit(f"calculator_agent: {exc}")


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
        SystemExit: When one of the environment variables is not a valid number, with one
            line naming it (see :func:`settings_exit`).
    """
    try:
        config = workflow_config()
        max_queued = int_env("EXAMPLE_AGENT_MAX_QUEUED", None, minimum=0)
    except ValueError as exc:
        raise settings_exit(exc) from None
    return LocalBackend(
        workflow=CalculatorAgent,
        workflow_config=config,
        grader=AnswerGrader,
        grader_config=GraderConfig(name="answer-match"),
        max_queued=max_queued,
    )
