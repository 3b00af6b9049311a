"""The sessions of the CI set (``nox`` with no ``-s``; ``python3 run.py test``), in two groups.

``run.py test`` runs the two groups as two nox processes at once: the first group mostly
computes (lint, types, the per-package suites on three Pythons, floors, docs), the second
mostly waits (subprocess servers, long polls, a Ray cluster, a browser, SIGKILL restarts),
so on a 2-core host the second's waits overlap the first's work. ``nox`` alone runs both
groups one after the other. Standard library only: ``run.py`` imports it before nox exists.
"""

from __future__ import annotations

from typing import Final

__all__ = ["CI_COMPUTE_SESSIONS", "CI_WAITING_SESSIONS"]

CI_COMPUTE_SESSIONS: Final = (
    "lint",
    "typecheck",
    "dist",
    "tests_types",
    "tests_client",
    "tests_server",
    "floors",
    "docs",
)
"""The sessions that mostly compute, in the order they run."""

CI_WAITING_SESSIONS: Final = (
    "interop",
    "ray",
    "integration",
    "soak_short",
    "report_browser",
)
"""The sessions that mostly wait on servers, clusters and browsers, in the order they run."""
