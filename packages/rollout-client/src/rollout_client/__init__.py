"""Caller side of the rollout protocol: ``RolloutClient`` and the awaitable ``RolloutHandle``."""

from __future__ import annotations

from ._version import VERSION
from .client import RolloutClient
from .errors import (
    RolloutAdmissionTimeoutError,
    RolloutClientError,
    RolloutProtocolError,
    RolloutProtocolVersionError,
)
from .handle import RolloutHandle

__version__ = VERSION

__all__ = [
    "RolloutAdmissionTimeoutError",
    "RolloutClient",
    "RolloutClientError",
    "RolloutHandle",
    "RolloutProtocolError",
    "RolloutProtocolVersionError",
    "__version__",
]
