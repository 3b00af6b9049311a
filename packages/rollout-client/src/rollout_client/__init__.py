"""Caller side of the rollout protocol: ``RolloutClient`` and the awaitable ``RolloutHandle``."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .client import RolloutClient
from .errors import (
    RolloutAdmissionTimeoutError,
    RolloutClientError,
    RolloutProtocolError,
    RolloutProtocolVersionError,
)
from .handle import RolloutHandle

try:
    __version__ = version("rollout-client")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "RolloutAdmissionTimeoutError",
    "RolloutClient",
    "RolloutClientError",
    "RolloutHandle",
    "RolloutProtocolError",
    "RolloutProtocolVersionError",
    "__version__",
]
