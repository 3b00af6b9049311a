"""Rollout server on aiohttp: ``create_rollout_server()``, the backend interface and
``LocalBackend``."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .backend import ExecutionBackend, ExecutionOutcome, ExecutionRequest, ExecutionResult, Sample
from .context import RolloutContext, current_rollout_context, get_rollout_context

try:
    __version__ = version("rollout-server")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "ExecutionBackend",
    "ExecutionOutcome",
    "ExecutionRequest",
    "ExecutionResult",
    "RolloutContext",
    "Sample",
    "__version__",
    "current_rollout_context",
    "get_rollout_context",
]
