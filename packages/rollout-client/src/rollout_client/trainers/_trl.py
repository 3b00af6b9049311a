"""The TRL adapter: a ``rollout_func`` for ``trl.GRPOTrainer``.

TRL's contract (read at trl v1.9.0-26-gf2cd577, ``trl/trainer/grpo_trainer.py``:
``RolloutFunc = Callable[[list[str], GRPOTrainer], dict[str, Any]]``): the function gets
this process's prompts, each once, and the trainer; it returns ``prompt_ids``,
``completion_ids`` and ``logprobs`` (one list per completion, ``num_generations``
completions per prompt, in prompt order); every other key is handed to the reward
functions, one value per completion. ``env_mask`` (1 for the model's tokens, 0 for the
environment's) keeps tool results out of the loss. A reward function that returns None
for a completion makes it unscorable: TRL leaves it out of the group's baseline and gives
it no advantage.

Nothing here imports TRL or torch: the function only builds lists.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Final

from rollout_types import RolloutStatus

from .._client import RolloutClient
from .._group import DEFAULT_GROUP_RETRIES, GroupPolicy, GroupRollout, RolloutGroup
from .._pool import RolloutClientPool
from ._tokens import TokenSequence, trainable

__all__ = ["TRL_REQUIRED_KEYS", "TRLRolloutFunc", "rollout_reward", "trl_outputs"]

TRL_REQUIRED_KEYS: Final = ("prompt_ids", "completion_ids", "logprobs")
"""The keys TRL's ``GRPOTrainer`` requires of a ``rollout_func``'s answer."""


def rollout_reward(
    completions: Sequence[Any], rollout_reward: Sequence[float | None], **_: Any
) -> list[float | None]:
    """A TRL reward function that hands back the rollout server's rewards (the
    ``rollout_reward`` key :class:`TRLRolloutFunc` returns): None for a masked sibling,
    which TRL then leaves out of the group's baseline.

    Pass it in ``GRPOTrainer(reward_funcs=[rollout_reward], ...)``.

    .. versionadded:: 0.3
    """
    if len(rollout_reward) != len(completions):
        raise ValueError(
            f"rollout_reward has {len(rollout_reward)} values for {len(completions)} "
            "completions; use it with TRLRolloutFunc's answer"
        )
    return list(rollout_reward)


def _reward(rollout: GroupRollout) -> float | None:
    """The sibling's training reward: the grader's on success, 0.0 for a failure that is
    the policy's (scored), None when it must not count."""
    if rollout.masked or rollout.result is None:
        return None
    if rollout.result.status == RolloutStatus.SUCCESS:
        return rollout.reward
    return 0.0


def trl_outputs(
    groups: Sequence[RolloutGroup], *, fallback_eos_id: int | None = None
) -> dict[str, Any]:
    """TRL's ``rollout_func`` answer for ``groups`` (one per prompt, in prompt order).

    A sibling that must not be trained on (masked, or whose turns make no token sequence)
    keeps its place, so every prompt still has its ``num_generations`` completions: it gets
    a trainable sibling's tokens with ``env_mask`` all 0 (no loss) and reward None (out of
    the baseline); in a group with no trainable sibling at all, the placeholder is
    ``fallback_eos_id`` as its one prompt and one completion token.

    Returns:
        ``prompt_ids``, ``completion_ids``, ``logprobs``, ``env_mask`` (lists of lists),
        ``rollout_reward`` (float or None), ``rollout_masked`` (bool), ``rollout_id`` and
        ``rollout_mask_reason`` (str or None), one entry per completion.

    Raises:
        ValueError: A group has no trainable sibling and ``fallback_eos_id`` is None.
    """
    out: dict[str, list[Any]] = {
        key: []
        for key in (
            *TRL_REQUIRED_KEYS,
            "env_mask",
            "rollout_reward",
            "rollout_masked",
            "rollout_id",
            "rollout_mask_reason",
        )
    }
    for group in groups:
        sequences = [trainable(rollout) for rollout in group.rollouts]
        donor = next((seq for seq in sequences if isinstance(seq, TokenSequence)), None)
        for rollout, seq in zip(group.rollouts, sequences, strict=True):
            if isinstance(seq, TokenSequence):
                out["prompt_ids"].append(seq.prompt_ids)
                out["completion_ids"].append(seq.completion_ids)
                out["logprobs"].append(seq.logprobs)
                out["env_mask"].append(seq.mask)
                out["rollout_reward"].append(_reward(rollout))
                out["rollout_masked"].append(False)
                out["rollout_mask_reason"].append(None)
            else:
                if donor is not None:
                    prompt, completion = donor.prompt_ids, donor.completion_ids
                elif fallback_eos_id is not None:
                    prompt, completion = [fallback_eos_id], [fallback_eos_id]
                else:
                    raise ValueError(
                        f"group {group.group_id} has no sibling to train on ({seq}); pass "
                        "fallback_eos_id to keep its place with a masked placeholder"
                    )
                out["prompt_ids"].append(list(prompt))
                out["completion_ids"].append(list(completion))
                out["logprobs"].append([0.0] * len(completion))
                out["env_mask"].append([0] * len(completion))
                out["rollout_reward"].append(None)
                out["rollout_masked"].append(True)
                out["rollout_mask_reason"].append(seq)
            out["rollout_id"].append(rollout.rollout_id)
    return out


def _messages(prompt: Any) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(message, dict) for message in prompt):
        return [dict(message) for message in prompt]
    raise TypeError(
        "each TRL prompt must be a string or a list of chat messages (dicts); got "
        f"{type(prompt).__name__}"
    )


class TRLRolloutFunc:
    """A ``GRPOTrainer(rollout_func=...)`` that runs each prompt as a group of rollouts on
    rollout servers (``return_turns=True``, so the server needs ``--gateway``) and answers
    the token ids and logprobs the model endpoint produced.

    Each call runs its groups concurrently in a fresh event loop (``asyncio.run``: call it
    from synchronous code, as TRL does), one group of ``trainer.num_generations`` siblings
    per prompt (``num_generations_eval`` when the model is not training), with
    ``weight_version`` the trainer's ``state.global_step``. The answer is
    :func:`trl_outputs`'; train on the server's rewards with :func:`rollout_reward`.

    Args:
        chat_completions_url: The model endpoint the rollouts call (the server's gateway
            forwards to it, or to its ``--model-endpoint`` URLs).
        url: One rollout server's base URL; or
        urls: several (a :class:`~rollout_client.RolloutClientPool`, a group on one server).
        api_key: The rollout servers' bearer key; default None.
        policy: The group policy, ``"mask"`` or ``"retry"``; default ``"mask"``.
        max_retries: Retries per sibling under ``"retry"``; default 2.
        label_for: The grader's label of a prompt; default None (no label).
        run_options: More keywords of ``run_group_async`` (``agent_timeout_sec``,
            ``metadata``, ...); default none.
        admission_timeout_sec: As for :class:`~rollout_client.RolloutClient`; default None.

    .. versionadded:: 0.3
    """

    def __init__(
        self,
        *,
        chat_completions_url: str,
        url: str | None = None,
        urls: Sequence[str] | None = None,
        api_key: str | None = None,
        policy: GroupPolicy = "mask",
        max_retries: int = DEFAULT_GROUP_RETRIES,
        label_for: Callable[[Any], str | None] | None = None,
        run_options: dict[str, Any] | None = None,
        admission_timeout_sec: float | None = None,
    ) -> None:
        if (url is None) == (urls is None):
            raise ValueError("pass exactly one of url= (one rollout server) or urls= (several)")
        self._url, self._urls = url, None if urls is None else list(urls)
        self.chat_completions_url = chat_completions_url
        self.api_key = api_key
        self.policy: GroupPolicy = policy
        self.max_retries = max_retries
        self.label_for = label_for
        self.run_options = dict(run_options or {})
        self.admission_timeout_sec = admission_timeout_sec

    def _client(self) -> RolloutClient | RolloutClientPool:
        if self._urls is not None:
            return RolloutClientPool(
                urls=self._urls,
                api_key=self.api_key,
                admission_timeout_sec=self.admission_timeout_sec,
            )
        return RolloutClient(
            url=str(self._url),
            api_key=self.api_key,
            admission_timeout_sec=self.admission_timeout_sec,
        )

    async def run_groups(
        self, prompts: Sequence[Any], *, n: int, weight_version: str | None
    ) -> list[RolloutGroup]:
        """Run one group of ``n`` per prompt, concurrently; the groups in prompt order."""
        async with self._client() as client:
            admissions = [
                client.run_group_async(
                    _messages(prompt),
                    self.chat_completions_url,
                    n=n,
                    group_id=uuid.uuid4().hex,
                    policy=self.policy,
                    max_retries=self.max_retries,
                    label=None if self.label_for is None else self.label_for(prompt),
                    return_turns=True,
                    weight_version=weight_version,
                    **self.run_options,
                )
                for prompt in prompts
            ]
            handles = await asyncio.gather(*admissions)
            return [await handle for handle in handles]

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """TRL's ``rollout_func``: the answer for ``prompts`` (see :func:`trl_outputs`)."""
        training = bool(getattr(getattr(trainer, "model", None), "training", True))
        n = getattr(trainer, "num_generations" if training else "num_generations_eval", None)
        if n is None:
            n = trainer.num_generations
        state = getattr(trainer, "state", None)
        step = getattr(state, "global_step", None)
        groups = asyncio.run(
            self.run_groups(prompts, n=int(n), weight_version=None if step is None else str(step))
        )
        tokenizer = getattr(trainer, "processing_class", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        return trl_outputs(groups, fallback_eos_id=eos if isinstance(eos, int) else None)
