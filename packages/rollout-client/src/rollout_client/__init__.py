"""Caller side of the rollout protocol: ``RolloutClient``, the awaitable ``RolloutHandle``
and ``RolloutClientPool`` over several servers."""

from __future__ import annotations

from ._client import RolloutClient
from ._errors import (
    RolloutAdmissionTimeoutError,
    RolloutClientError,
    RolloutNotFoundError,
    RolloutProtocolError,
    RolloutProtocolVersionError,
    RolloutServersUnavailableError,
)
from ._handle import RolloutHandle
from ._pool import PoolServerStatus, RolloutClientPool
from ._version import VERSION

__version__ = VERSION

__all__ = [
    "PoolServerStatus",
    "RolloutAdmissionTimeoutError",
    "RolloutClient",
    "RolloutClientError",
    "RolloutClientPool",
    "RolloutHandle",
    "RolloutNotFoundError",
    "RolloutProtocolError",
    "RolloutProtocolVersionError",
    "RolloutServersUnavailableError",
    "__version__",
]
