"""This distribution's version, and the User-Agent the client sends."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Final

__all__ = ["USER_AGENT", "VERSION"]


def _installed_version() -> str:
    try:
        return version("rollout-client")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0.0.0"


VERSION: Final = _installed_version()
"""The installed ``rollout-client`` version (``0.0.0`` from a bare source tree)."""

# Speed: benchmarks/README.md, "Client", row "Lean request headers ..."
USER_AGENT: Final = f"rollout-client/{VERSION}"
"""The ``User-Agent`` of requests from a session the client makes itself."""
