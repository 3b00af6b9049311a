"""This distribution's version: what ``__version__``, trajectories, traces and metrics report."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Final

__all__ = ["VERSION"]


def _installed_version() -> str:
    try:
        return version("rollout-server")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0.0.0"


# Speed: benchmarks/README.md, "LocalBackend: files and copies", row "The rollout-server version of
#   the trajectory document looked up once per process ..."
VERSION: Final = _installed_version()
"""The installed ``rollout-server`` version (``0.0.0`` from a bare source tree). Read once at
import: ``importlib.metadata`` scans ``sys.path`` on every call, which was a sixth of a
trajectory write's CPU in the benchmarks' profile when it ran per document."""
