"""Caller side of the rollout protocol: ``RolloutClient``, the awaitable ``RolloutHandle``
and ``RolloutClientPool`` over several servers.

``rollout_client.eval`` is the ``rollout-eval`` job as a library; ``rollout_client.testing``
holds hooks for tests (instant sleeps, a simulated clock).
"""

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
from ._pool import RolloutClientPool
from ._retry import RetrySettings
from ._rotation import PoolServerStatus
from ._version import VERSION

__version__ = VERSION

__all__ = [
    "PoolServerStatus",
    "RetrySettings",
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
