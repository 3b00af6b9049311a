"""String enums of the protocol: rollout status, error category, cancel disposition, and
the flags of a captured model turn."""

from __future__ import annotations

import enum
from typing import Final

__all__ = [
    "TERMINAL_STATUSES",
    "CancelDisposition",
    "RolloutErrorCategory",
    "RolloutStatus",
    "TurnFlag",
    "is_terminal",
]


class RolloutStatus(enum.StrEnum):
    """Status of a rollout as the wire reports it."""

    QUEUED = "queued"
    RUNNING = "running"
    GRADING = "grading"
    SUCCESS = "success"
    FAILURE = "failure"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"


class RolloutErrorCategory(enum.StrEnum):
    """Classification of a failed rollout (``err_category``)."""

    TIMEOUT = "timeout"
    LEASE_EXPIRED = "lease_expired"
    VALIDATION_ERROR = "validation_error"
    HTTP_ERROR = "http_error"
    AGENT_ERROR = "agent_error"
    INTERNAL_ERROR = "internal_error"


class CancelDisposition(enum.StrEnum):
    """What ``POST /rollout/cancel`` did with one selected rollout."""

    CANCELLED_QUEUED = "cancelled_queued"
    CANCELLED_RUNNING = "cancelled_running"
    NOT_FOUND = "not_found"


class TurnFlag(enum.StrEnum):
    """What is missing from, or went wrong with, one captured model turn
    (:attr:`~rollout_types.RolloutTurn.flags`).

    A ``no_*`` flag is set exactly when that field of the turn is null, whatever the
    reason (the endpoint returned none, or a malformed one: then ``malformed_*`` says so).

    .. versionadded:: 0.3
    """

    NO_PROMPT_TOKEN_IDS = "no_prompt_token_ids"  # noqa: S105 - model tokens
    """The turn has no prompt token ids."""
    NO_COMPLETION_TOKEN_IDS = "no_completion_token_ids"  # noqa: S105 - model tokens
    """The turn has no completion token ids."""
    NO_LOGPROBS = "no_logprobs"
    """The turn has no logprobs."""
    MALFORMED_TOKEN_IDS = "malformed_token_ids"  # noqa: S105 - model tokens
    """Token ids came back, but not as a list of non-negative integers (dropped)."""
    MALFORMED_LOGPROBS = "malformed_logprobs"
    """Logprobs came back, but not as finite numbers, one per completion token (dropped)."""
    UPSTREAM_ERROR = "upstream_error"
    """The endpoint answered with an HTTP error status (passed to the workflow unchanged)."""
    UNREACHABLE = "unreachable"
    """The endpoint could not be reached, or gave no answer in time."""
    DISCONNECTED = "disconnected"
    """The endpoint's answer broke off midway (a dropped connection, a stream cut short)."""
    TOO_LARGE = "too_large"
    """The answer was larger than the gateway captures; it was passed on, not recorded."""
    NOT_A_COMPLETION = "not_a_completion"
    """A successful answer that is not a chat completion (not JSON, no choices)."""
    UNPARSED_REQUEST = "unparsed_request"
    """The workflow's request body was not a JSON object; it was forwarded as is."""
    CANCELLED = "cancelled"
    """The workflow abandoned the call (it disconnected, or the rollout was cancelled)."""


TERMINAL_STATUSES: Final = frozenset(
    {RolloutStatus.SUCCESS, RolloutStatus.FAILURE, RolloutStatus.CANCELLED}
)
"""Statuses after which a rollout never changes again."""


def is_terminal(status: str) -> bool:
    """Tell whether ``status`` (an enum member or a raw wire string) is terminal."""
    return status in TERMINAL_STATUSES
