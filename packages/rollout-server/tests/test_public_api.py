"""The public names of rollout_server, as a snapshot: changing them is a deliberate act."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import rollout_server

EXPECTED = [
    "ROLLOUT_SERVER_KEY", "AgentWorkflow", "AgentWorkflowConfig", "AgentWorkflowOutput",
    "ConcurrencyConfig", "ExecutionBackend", "ExecutionObserver", "ExecutionOutcome",
    "ExecutionRequest",
    "ExecutionResult", "Grader", "GraderConfig", "GraderContext", "LocalBackend",
    "ModelEndpointError", "ModelGateway", "ModelRoute", "ModelRouter",
    "RayBackend", "RolloutContext", "RolloutServer", "RolloutServerError",
    "Sample", "SampleSource", "ServeTargetError", "ServerConfigError", "ServerSettings",
    "ShutdownTimeouts",
    "WorkflowContext",
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

    def test_import_does_not_import_ray(self) -> None:
        """Importing the package (RayBackend included) never imports Ray."""
        code = "import sys, rollout_server; print('ray' in sys.modules)"
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
        )
        assert done.stdout.strip() == "False"

    def test_ray_backend_without_ray_says_how_to_install_it(self) -> None:
        """Without Ray (hidden here), a RayBackend builds, and starting it fails with the
        install hint."""
        code = (
            "import asyncio, sys\n"
            "sys.modules['ray'] = None\n"
            "from rollout_server import AgentWorkflow, RayBackend\n"
            "class W(AgentWorkflow):\n"
            "    async def run(self, ctx): return []\n"
            "try:\n"
            "    asyncio.run(RayBackend(W).startup())\n"
            "except ImportError as exc:\n"
            "    print(exc)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
        )
        assert done.stdout.strip() == "RayBackend needs Ray: pip install 'rollout-server[ray]'"

    def test_names_resolve(self) -> None:
        """Every name in __all__ is importable."""
        for name in rollout_server.__all__:
            assert hasattr(rollout_server, name), name

    def test_version_is_the_installed_distribution(self) -> None:
        """__version__ comes from the installed distribution's metadata."""
        assert rollout_server.__version__ == importlib.metadata.version("rollout-server")
