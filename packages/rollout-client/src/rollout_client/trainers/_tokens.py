"""One rollout's model turns as one token sequence a trainer can train on.

A multi-turn rollout is one sequence: the first turn's prompt, then each turn's completion
(the model's tokens: mask 1, their logprobs) and, between two turns, the tokens the next
prompt adds after the previous prompt and completion (tool results, the environment's
messages: mask 0, logprob 0.0). That is exact only when every turn's prompt extends the
previous prompt and completion token for token (the chat template does not re-render the
history); otherwise the rollout cannot be trained on as one sequence without
re-tokenizing (off-policy drift), and :func:`token_sequence` says so instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from rollout_types import RolloutTurn

from .._group import GroupRollout

__all__ = ["TokenSequence", "UntrainableRolloutError", "token_sequence", "trainable"]


class UntrainableRolloutError(ValueError):
    """A rollout's turns do not make one token sequence (the message says why)."""


@attrs.frozen(kw_only=True)
class TokenSequence:
    """One rollout as token ids: what TRL's ``rollout_func`` and verl's ``AgentLoopOutput``
    are built from.

    Attributes:
        prompt_ids: The first turn's prompt token ids (chat template applied).
        completion_ids: Every token after the prompt: the model's and, between turns, the
            environment's.
        logprobs: One per ``completion_ids`` token: the model's logprob, 0.0 for an
            environment token.
        mask: One per ``completion_ids`` token: 1 for a model token, 0 for an environment
            token.
        num_turns: The model turns the sequence holds.

    .. versionadded:: 0.3
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    mask: list[int]
    num_turns: int


def _complete(turn: RolloutTurn) -> tuple[list[int], list[int], list[float]]:
    prompt, completion, logprobs = turn.prompt_token_ids, turn.completion_token_ids, turn.logprobs
    if prompt is None or completion is None or logprobs is None:
        missing = [
            name
            for name, value in (
                ("prompt_token_ids", prompt),
                ("completion_token_ids", completion),
                ("logprobs", logprobs),
            )
            if value is None
        ]
        flags = ", ".join(str(flag) for flag in turn.flags) or "none"
        raise UntrainableRolloutError(
            f"turn {turn.index} has no {' or '.join(missing)} (flags: {flags}); was the model "
            "endpoint asked for token ids and logprobs (vLLM, SGLang, the chat stand-in)?"
        )
    if len(logprobs) != len(completion):
        raise UntrainableRolloutError(
            f"turn {turn.index} has {len(logprobs)} logprobs for {len(completion)} completion "
            "tokens"
        )
    return prompt, completion, logprobs


def token_sequence(turns: Sequence[RolloutTurn]) -> TokenSequence:
    """The rollout's turns as one token sequence (see the module docstring).

    Raises:
        UntrainableRolloutError: There are no turns, a turn lacks token ids or logprobs
            (its ``flags`` are named), or a turn's prompt does not extend the previous
            prompt and completion.
    """
    if not turns:
        raise UntrainableRolloutError(
            "the rollout has no captured turns (ask with return_turns=True, on a server "
            "started with --gateway, whose workflow calls the model)"
        )
    first_prompt, completion, logprobs = _complete(turns[0])
    seen = [*first_prompt, *completion]
    out_ids, out_logprobs, mask = list(completion), list(logprobs), [1] * len(completion)
    for turn in turns[1:]:
        prompt, completion, logprobs = _complete(turn)
        if prompt[: len(seen)] != seen:
            raise UntrainableRolloutError(
                f"turn {turn.index}'s prompt does not extend turn {turn.index - 1}'s prompt "
                "and completion token for token (the chat template re-renders the history): "
                "the rollout is not one token sequence"
            )
        added = prompt[len(seen) :]
        out_ids += added + completion
        out_logprobs += [0.0] * len(added) + logprobs
        mask += [0] * len(added) + [1] * len(completion)
        seen = [*prompt, *completion]
    return TokenSequence(
        prompt_ids=list(first_prompt),
        completion_ids=out_ids,
        logprobs=out_logprobs,
        mask=mask,
        num_turns=len(turns),
    )


def trainable(rollout: GroupRollout) -> TokenSequence | str:
    """A group sibling's token sequence, or why it must not be trained on (it is masked,
    has no result, or its turns make no sequence)."""
    if rollout.masked:
        return f"masked: {rollout.mask_reason}"
    if rollout.result is None:
        return "no result"
    try:
        return token_sequence(rollout.turns)
    except UntrainableRolloutError as exc:
        return f"untrainable: {exc}"
