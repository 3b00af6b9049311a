"""The verl adapter: an ``AgentLoopBase`` subclass whose ``run`` is a rollout.

verl's contract (read at verl v0.7.0-125-gb178a3c, ``verl/experimental/agent_loop/
agent_loop.py``, and checked against the verl 0.9.1 release, which adds optional fields):
an agent loop is registered by name, instantiated per sample with
``trainer_config``, ``server_manager``, ``tokenizer``, ``processor``, ``dataset_cls`` and
``dataset_config``, and ``await loop.run(sampling_params, **dataset_fields)`` returns an
``AgentLoopOutput``: ``prompt_ids``, ``response_ids`` (the model's and the tools' tokens),
``response_mask`` (1 model, 0 tool), ``response_logprobs`` (optional), ``reward_score``
(optional), ``num_turns`` (chat turns: user, assistant, tool), ``metrics``
(``AgentLoopMetrics``: ``generate_sequences``, ``tool_calls`` seconds) and
``extra_fields``. verl repeats each prompt ``rollout.n`` times itself (its GRPO group), so
each run is one rollout.

verl is imported only by :func:`verl_agent_loop_class`, when it is called; the fields are
built by :func:`agent_loop_fields`, which needs nothing but this package.
"""

from __future__ import annotations

import uuid
from typing import Any, Final

from rollout_types import RolloutStatus

from .._client import RolloutClient
from .._group import DEFAULT_GROUP_RETRIES, GroupRollout
from ._tokens import TokenSequence, trainable

__all__ = ["AGENT_LOOP_OUTPUT_FIELDS", "agent_loop_fields", "verl_agent_loop_class"]

AGENT_LOOP_OUTPUT_FIELDS: Final = (
    "prompt_ids",
    "response_ids",
    "response_mask",
    "response_logprobs",
    "reward_score",
    "num_turns",
    "metrics",
    "extra_fields",
)
"""The ``AgentLoopOutput`` fields :func:`agent_loop_fields` fills (the others keep verl's
defaults: ``routed_experts``, ``multi_modal_data``)."""


def agent_loop_fields(
    rollout: GroupRollout,
    *,
    prompt_ids: list[int] | None = None,
    response_length: int | None = None,
) -> dict[str, Any]:
    """The ``AgentLoopOutput`` keyword arguments of one finished rollout.

    A rollout that must not be trained on (masked for an infrastructure failure, or whose
    turns make no token sequence) keeps its place with ``response_mask`` all 0 (no loss),
    ``reward_score`` None and ``extra_fields["rollout_masked"]`` True (and the reason in
    ``rollout_mask_reason``): its prompt is ``prompt_ids`` (the loop's own tokenization of
    the prompt) and its response one token of it.

    Args:
        rollout: The rollout (a group of one, or a sibling).
        prompt_ids: The prompt's token ids for a rollout without a sequence; default None.
        response_length: verl's ``rollout.response_length``: longer responses are cut;
            default None (not cut).

    Returns:
        ``prompt_ids``, ``response_ids``, ``response_mask``, ``response_logprobs``,
        ``reward_score``, ``num_turns``, ``metrics`` (a dict of ``AgentLoopMetrics``'s
        fields) and ``extra_fields`` (``rollout_id``, ``rollout_masked``,
        ``rollout_mask_reason``, ``rollout_status``).

    Raises:
        ValueError: The rollout has no sequence and ``prompt_ids`` is None or empty.
    """
    seq = trainable(rollout)
    result = rollout.result
    latency = sum(turn.latency_sec for turn in rollout.turns)
    extra: dict[str, Any] = {
        "rollout_id": rollout.rollout_id,
        "rollout_masked": not isinstance(seq, TokenSequence),
        "rollout_mask_reason": None if isinstance(seq, TokenSequence) else seq,
        "rollout_status": None if result is None else str(result.status),
    }
    messages = [] if result is None or result.sample is None else result.sample.messages
    if isinstance(seq, TokenSequence):
        ids, mask, logprobs = seq.completion_ids, seq.mask, seq.logprobs
        if response_length is not None:
            ids, mask, logprobs = (
                ids[:response_length],
                mask[:response_length],
                logprobs[:response_length],
            )
        reward: float | None
        if result is not None and result.status == RolloutStatus.SUCCESS:
            reward = rollout.reward
        else:
            reward = 0.0  # a failure that is the policy's own (scored)
        return {
            "prompt_ids": seq.prompt_ids,
            "response_ids": ids,
            "response_mask": mask,
            "response_logprobs": logprobs,
            "reward_score": reward,
            "num_turns": len(messages),
            "metrics": {"generate_sequences": latency, "tool_calls": 0.0},
            "extra_fields": extra,
        }
    if not prompt_ids:
        raise ValueError(
            f"rollout {rollout.rollout_id} cannot be trained on ({seq}) and no prompt_ids "
            "were given to keep its place"
        )
    return {
        "prompt_ids": list(prompt_ids),
        "response_ids": [prompt_ids[-1]],
        "response_mask": [0],
        "response_logprobs": [0.0],
        "reward_score": None,
        "num_turns": len(messages),
        "metrics": {"generate_sequences": latency, "tool_calls": 0.0},
        "extra_fields": extra,
    }


def _chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt's token ids by the trainer's own tokenizer (its chat template), for a
    rollout whose turns give none: a list, or the ``input_ids`` of the mapping newer
    ``transformers`` releases return."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(encoded, list):
        encoded = encoded["input_ids"]
    return [int(token) for token in encoded]


def verl_agent_loop_class(
    *,
    rollout_url: str,
    chat_completions_url: str,
    api_key: str | None = None,
    policy: str = "retry",
    max_retries: int = DEFAULT_GROUP_RETRIES,
    run_options: dict[str, Any] | None = None,
) -> type[Any]:
    """Build (importing verl now) an ``AgentLoopBase`` subclass that runs each sample as a
    rollout on a rollout server (``return_turns=True``: the server needs ``--gateway``).

    ``run(sampling_params, **kwargs)`` sends ``kwargs["raw_prompt"]`` (the chat messages)
    with ``label`` from ``kwargs["reward_model"]["ground_truth"]`` when present, as a group
    of one under ``policy`` (``"retry"`` by default: verl cannot leave a sample out, so a
    sibling is retried first, then kept with no loss), and returns
    ``AgentLoopOutput(**agent_loop_fields(...))``. Register it with
    ``verl.experimental.agent_loop.agent_loop.register(name)(cls)``.

    Args:
        rollout_url: The rollout server's base URL.
        chat_completions_url: The model endpoint the rollouts call (verl's servers behind
            an OpenAI-compatible URL, or the gateway's ``--model-endpoint`` list).
        api_key: The rollout server's bearer key; default None.
        policy: ``"retry"`` or ``"mask"``; default ``"retry"``.
        max_retries: Retries under ``"retry"``; default 2.
        run_options: More ``run_group`` keywords (``agent_timeout_sec``, ...).

    Returns:
        The subclass.

    Raises:
        ImportError: verl is not installed.
    """
    from verl.experimental.agent_loop.agent_loop import (  # lazy: verl is optional
        AgentLoopBase,
        AgentLoopOutput,
    )

    options = dict(run_options or {})

    class RolloutAgentLoop(AgentLoopBase):  # type: ignore[misc]
        """A verl agent loop whose every sample is a rollout on a rollout server."""

        async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
            messages = list(kwargs["raw_prompt"])
            ground_truth = (kwargs.get("reward_model") or {}).get("ground_truth")
            async with RolloutClient(url=rollout_url, api_key=api_key) as client:
                group = await client.run_group(
                    messages,
                    chat_completions_url,
                    n=1,
                    group_id=uuid.uuid4().hex,
                    policy=policy,  # type: ignore[arg-type]
                    max_retries=max_retries,
                    label=None if ground_truth is None else str(ground_truth),
                    return_turns=True,
                    **options,
                )
            (rollout,) = group.rollouts
            prompt_ids = None
            if not isinstance(trainable(rollout), TokenSequence):
                prompt_ids = _chat_prompt_ids(self.tokenizer, messages)
            length = self.config.actor_rollout_ref.rollout.response_length
            fields = agent_loop_fields(rollout, prompt_ids=prompt_ids, response_length=length)
            return AgentLoopOutput(**fields)

    return RolloutAgentLoop
