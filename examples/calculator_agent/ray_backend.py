"""The example agent on Ray: :class:`CalculatorAgent` graded by :class:`AnswerGrader`, each
rollout in one of a pool of Ray worker actors.

Needs ``pip install 'rollout-server[ray]'``. Serve it with::

    rollout-server serve calculator_agent.ray_backend:create_backend --app-dir examples

The server starts a local Ray cluster (bound to 127.0.0.1) at startup, or joins the one
``RAY_ADDRESS`` names; the workers import ``calculator_agent`` by name, so this folder is
put on their ``PYTHONPATH`` (on a real cluster, install the project on every node or ship
it with a ``runtime_env``). Environment variables (all optional), besides those of
:mod:`calculator_agent.backend` (model, streaming, turns):

* ``EXAMPLE_RAY_WORKERS``: worker actors (default 2);
* ``EXAMPLE_AGENT_MAX_CONCURRENT``: rollouts per worker (default 8);
* ``EXAMPLE_AGENT_MAX_QUEUED``: rollouts that may wait for a slot before admission answers
  429 (default: no bound).
"""

from __future__ import annotations

from pathlib import Path

from rollout_server import GraderConfig, RayBackend

from .agent import CalculatorAgent
from .backend import int_env, settings_exit, workflow_config
from .grader import AnswerGrader

__all__ = ["create_backend"]


def create_backend() -> RayBackend:
    """Build the example RayBackend from the environment (see the module docstring).

    Raises:
        SystemExit: When one of the environment variables is not a valid number, with one
            line naming it.
    """
    examples_dir = str(Path(__file__).resolve().parent.parent)
    try:
        config = workflow_config()
        num_workers = int_env("EXAMPLE_RAY_WORKERS", 2)
        max_queued = int_env("EXAMPLE_AGENT_MAX_QUEUED", None, minimum=0)
    except ValueError as exc:
        raise settings_exit(exc) from None
    return RayBackend(
        workflow=CalculatorAgent,
        workflow_config=config,
        grader=AnswerGrader,
        grader_config=GraderConfig(name="answer-match"),
        num_workers=num_workers or 2,
        max_queued=max_queued,
        worker_options={"num_cpus": 1},
        init_options={"runtime_env": {"env_vars": {"PYTHONPATH": examples_dir}}},
    )
