"""Fixtures of the compatibility suite: the pairs under test, and the compatibility table.

The pairs come from :mod:`interop_harness.listing` (the pairs file the ``interop`` and
``compat`` nox sessions write, or the quick pairs of the table without releases).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "interop"))

from interop_harness.fixtures import open_client, own_server, standin  # noqa: E402
from interop_harness.listing import compatibility, pair_params  # noqa: E402

__all__ = ["compat", "open_client", "own_server", "standin"]


@pytest.fixture(scope="session")
def compat() -> ModuleType:
    """``tools/compatibility.py``: the table, releases.toml and rebuilding releases."""
    return compatibility()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``works_pair`` and ``failing_pair`` with the pairs of each expectation."""
    for name, expect in (("works_pair", "works"), ("failing_pair", "fails-fast")):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, pair_params(expect), indirect=True, scope="module")
