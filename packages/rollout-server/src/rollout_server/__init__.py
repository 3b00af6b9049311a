"""Rollout server on aiohttp: ``create_rollout_server()``, the backend interface,
``LocalBackend`` and ``RayBackend`` (Ray itself is imported only when a RayBackend starts)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from ._app import ROLLOUT_SERVER_KEY, create_rollout_server
from ._backend import ExecutionBackend, ExecutionOutcome, ExecutionRequest, ExecutionResult, Sample
from ._categorize import categorize_exception
from ._context import (
    RolloutContext,
    SampleSource,
    current_rollout_context,
    get_rollout_context,
)
from ._errors import (
    ModelEndpointError,
    RolloutServerError,
    ServerConfigError,
    ServeTargetError,
)
from ._grader import Grader, GraderConfig, GraderContext
from ._local_backend import LocalBackend
from ._observer import ExecutionObserver
from ._ray_backend import RayBackend
from ._server import RolloutServer
from ._shutdown import ShutdownTimeouts
from ._workflow import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    ConcurrencyConfig,
    WorkflowContext,
)

try:
    __version__ = version("rollout-server")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "ROLLOUT_SERVER_KEY",
    "AgentWorkflow",
    "AgentWorkflowConfig",
    "AgentWorkflowOutput",
    "ConcurrencyConfig",
    "ExecutionBackend",
    "ExecutionObserver",
    "ExecutionOutcome",
    "ExecutionRequest",
    "ExecutionResult",
    "Grader",
    "GraderConfig",
    "GraderContext",
    "LocalBackend",
    "ModelEndpointError",
    "RayBackend",
    "RolloutContext",
    "RolloutServer",
    "RolloutServerError",
    "Sample",
    "SampleSource",
    "ServeTargetError",
    "ServerConfigError",
    "ShutdownTimeouts",
    "WorkflowContext",
    "__version__",
    "categorize_exception",
    "create_rollout_server",
    "current_rollout_context",
    "get_rollout_context",
]
