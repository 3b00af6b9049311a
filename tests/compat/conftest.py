"""Fixtures of the compatibility suite: the pairs under test, and this repo's noxfile.

The pairs come from the JSON file ``ROLLOUT_COMPAT_PAIRS`` names (written by the
``interop`` and ``compat`` nox sessions: each side's peer name and interpreter, the
expectation and the expected error). Without it, the quick pairs of the noxfile's table
run with the interpreters of ``tests/interop/interop_harness/peers.py`` (this venv for
our sides; pairs whose osmosis-ai venv is not named are skipped).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "interop"))

from interop_harness import OSMOSIS_032, Pair, peers  # noqa: E402
from interop_harness.fixtures import open_client, own_server, standin  # noqa: E402

__all__ = ["noxfile", "open_client", "own_server", "standin"]

PAIRS_ENV = "ROLLOUT_COMPAT_PAIRS"


def load_noxfile() -> ModuleType:
    """Import the repository's ``noxfile.py`` (the compatibility table lives there).

    Skips (fails under ``ROLLOUT_INTEROP_REQUIRE=1``) when ``nox`` is not installed.
    """
    if "rollout_noxfile" in sys.modules:
        return sys.modules["rollout_noxfile"]
    if importlib.util.find_spec("nox") is None:
        peers.unavailable("importing noxfile.py needs nox installed in the test venv")
    spec = importlib.util.spec_from_file_location("rollout_noxfile", ROOT / "noxfile.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rollout_noxfile"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def noxfile() -> ModuleType:
    """The repository's ``noxfile.py``, imported (skips or fails without nox)."""
    return load_noxfile()


def _listed_pairs() -> list[dict[str, Any]]:
    path = os.environ.get(PAIRS_ENV)
    if path:
        listing: list[dict[str, Any]] = json.loads(Path(path).read_text("utf-8"))
        return listing
    if importlib.util.find_spec("nox") is None:
        return []
    return [
        {
            "id": pair.id,
            "client": {"peer": pair.client.peer, "python": None},
            "server": {"peer": pair.server.peer, "python": None},
            "expect": pair.expect,
            "error": pair.error,
        }
        for pair in load_noxfile().compat_table(releases=[])
        if pair.quick
    ]


def _param(entry: dict[str, Any]) -> Any:
    pair = Pair(
        client=entry["client"]["peer"],
        server=entry["server"]["peer"],
        client_python=entry["client"]["python"],
        server_python=entry["server"]["python"],
    )
    osmosis = {pair.client, pair.server} & {peers.OSMOSIS, OSMOSIS_032}
    marks = [pytest.mark.osmosis] if osmosis else []
    return pytest.param((pair, entry), id=entry["id"], marks=marks)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``works_pair`` and ``failing_pair`` with the pairs of each expectation."""
    for name, expect in (("works_pair", "works"), ("failing_pair", "fails-fast")):
        if name in metafunc.fixturenames:
            entries = [entry for entry in _listed_pairs() if entry["expect"] == expect]
            metafunc.parametrize(
                name, [_param(entry) for entry in entries], indirect=True, scope="module"
            )
