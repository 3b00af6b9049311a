"""String enums of the protocol: rollout status, error category, cancel disposition."""

from __future__ import annotations

import enum
from typing import Final

__all__ = [
    "TERMINAL_STATUSES",
    "CancelDisposition",
    "RolloutErrorCategory",
    "RolloutStatus",
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


TERMINAL_STATUSES: Final = frozenset(
    {RolloutStatus.SUCCESS, RolloutStatus.FAILURE, RolloutStatus.CANCELLED}
)
"""Statuses after which a rollout never changes again."""


def is_terminal(status: str) -> bool:
    """Tell whether ``status`` (an enum member or a raw wire string) is terminal."""
    return status in TERMINAL_STATUSES
