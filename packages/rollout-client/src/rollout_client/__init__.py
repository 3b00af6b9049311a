"""Caller side of the rollout protocol: ``RolloutClient`` and the awaitable ``RolloutHandle``."""

from __future__ import annotations

from ._client import RolloutClient
from ._errors import (
    RolloutAdmissionTimeoutError,
    RolloutClientError,
    RolloutProtocolError,
    RolloutProtocolVersionError,
)
from ._handle import RolloutHandle
from ._version import VERSION

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
