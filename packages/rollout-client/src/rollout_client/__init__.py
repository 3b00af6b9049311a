"""Caller side of the rollout protocol: ``RolloutClient`` and the awaitable ``RolloutHandle``.

``rollout_client.eval`` is the ``rollout-eval`` job as a library; ``rollout_client.testing``
holds hooks for tests (instant sleeps, a simulated clock).
"""

from __future__ import annotations

from ._client import RolloutClient
from ._errors import (
    RolloutAdmissionTimeoutError,
    RolloutClientError,
    RolloutProtocolError,
    RolloutProtocolVersionError,
)
from ._handle import RolloutHandle
from ._retry import RetrySettings
from ._version import VERSION

__version__ = VERSION

__all__ = [
    "RetrySettings",
    "RolloutAdmissionTimeoutError",
    "RolloutClient",
    "RolloutClientError",
    "RolloutHandle",
    "RolloutProtocolError",
    "RolloutProtocolVersionError",
    "__version__",
]
