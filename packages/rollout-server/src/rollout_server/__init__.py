"""Rollout server on aiohttp: ``create_rollout_server()``, the backend interface,
``LocalBackend`` and ``RayBackend`` (Ray itself is imported only when a RayBackend starts)."""

from __future__ import annotations

from ._errors import (
    ModelEndpointError,
    RolloutServerError,
    ServerConfigError,
    ServeTargetError,
)
from ._version import VERSION
from .execution._backend import (
    ExecutionBackend,
    ExecutionOutcome,
    ExecutionRequest,
    ExecutionResult,
    Sample,
)
from .execution._categorize import categorize_exception
from .execution._context import (
    RolloutContext,
    SampleSource,
    current_rollout_context,
    get_rollout_context,
)
from .execution._grader import Grader, GraderConfig, GraderContext
from .execution._local_backend import LocalBackend
from .execution._turns import ModelRoute, ModelRouter
from .execution._workflow import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    ConcurrencyConfig,
    WorkflowContext,
)
from .gateway._gateway import ModelGateway
from .http._app import ROLLOUT_SERVER_KEY, create_rollout_server
from .observability._observer import ExecutionObserver
from .protocol._server import RolloutServer
from .protocol._settings import ServerSettings
from .protocol._shutdown import ShutdownTimeouts
from .ray._backend import RayBackend

__version__ = VERSION
"""The installed ``rollout-server`` version (``0.0.0`` from a bare source tree)."""

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
    "ModelGateway",
    "ModelRoute",
    "ModelRouter",
    "RayBackend",
    "RolloutContext",
    "RolloutServer",
    "RolloutServerError",
    "Sample",
    "SampleSource",
    "ServeTargetError",
    "ServerConfigError",
    "ServerSettings",
    "ShutdownTimeouts",
    "WorkflowContext",
    "__version__",
    "categorize_exception",
    "create_rollout_server",
    "current_rollout_context",
    "get_rollout_context",
]
