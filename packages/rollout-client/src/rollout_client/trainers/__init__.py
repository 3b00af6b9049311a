"""Trainer adapters (``pip install rollout-client[trainers]``): rollouts as the token ids
and logprobs a trainer trains on.

* TRL: :class:`TRLRolloutFunc` is a ``GRPOTrainer(rollout_func=...)``; :func:`rollout_reward`
  hands the rollout server's rewards to TRL (None for a masked sibling).
* verl: :func:`verl_agent_loop_class` builds an ``AgentLoopBase`` subclass (verl is
  imported then, not before); :func:`agent_loop_fields` makes its ``AgentLoopOutput``.
* :func:`token_sequence` turns a rollout's captured turns into one sequence
  (:class:`TokenSequence`).

Pure Python: nothing here imports TRL, verl or torch at import time.

.. versionadded:: 0.3
"""

from __future__ import annotations

from ._tokens import TokenSequence, UntrainableRolloutError, token_sequence
from ._trl import TRLRolloutFunc, rollout_reward, trl_outputs
from ._verl import agent_loop_fields, verl_agent_loop_class

__all__ = [
    "TRLRolloutFunc",
    "TokenSequence",
    "UntrainableRolloutError",
    "agent_loop_fields",
    "rollout_reward",
    "token_sequence",
    "trl_outputs",
    "verl_agent_loop_class",
]
