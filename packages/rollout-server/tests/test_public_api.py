"""The public names of rollout_server, as a snapshot: changing them is a deliberate act."""

from __future__ import annotations

import importlib.metadata

import rollout_server

EXPECTED = [
    "ROLLOUT_SERVER_KEY", "AgentWorkflow", "AgentWorkflowConfig", "AgentWorkflowOutput",
    "ConcurrencyConfig", "ExecutionBackend", "ExecutionObserver", "ExecutionOutcome",
    "ExecutionRequest",
    "ExecutionResult", "Grader", "GraderConfig", "GraderContext", "LocalBackend",
    "ModelEndpointError", "RolloutContext", "RolloutServer", "RolloutServerError", "Sample",
    "SampleSource", "ServeTargetError", "ServerConfigError", "ShutdownTimeouts", "WorkflowContext",
    "__version__", "categorize_exception", "create_rollout_server", "current_rollout_context",
    "get_rollout_context",
]  # fmt: skip


class TestPublicApi:
    def test_all_snapshot(self) -> None:
        """__all__ lists exactly the documented names."""
        assert rollout_server.__all__ == EXPECTED

    def test_all_is_sorted(self) -> None:
        """__all__ keeps ruff's RUF022 order: CONSTANTS, then Classes, then functions."""

        def kind(name: str) -> int:
            if name.isupper():
                return 0
            return 1 if name[0].isupper() else 2

        assert sorted(EXPECTED, key=lambda n: (kind(n), n)) == EXPECTED

    def test_names_resolve(self) -> None:
        """Every name in __all__ is importable."""
        for name in rollout_server.__all__:
            assert hasattr(rollout_server, name), name

    def test_version_is_the_installed_distribution(self) -> None:
        """__version__ comes from the installed distribution's metadata."""
        assert rollout_server.__version__ == importlib.metadata.version("rollout-server")
