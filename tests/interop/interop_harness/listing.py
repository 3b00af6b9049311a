"""The pairs under test, shared by tests/interop and tests/compat, and the compatibility table.

The pairs come from the JSON file ``ROLLOUT_COMPAT_PAIRS`` names (written by the ``interop``
and ``compat`` nox sessions: each side's peer name and interpreter, the expectation and the
expected error). Without it, the quick pairs of the table without releases run, with the
interpreters of :mod:`.peers` (this venv for our sides; pairs whose osmosis-ai venv is not
named are skipped).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import pytest

from .pairs import Pair
from .peers import OSMOSIS, OSMOSIS_032
from .processes import TOOLS_DIR

PAIRS_ENV: Final = "ROLLOUT_COMPAT_PAIRS"


def compatibility() -> ModuleType:
    """``tools/compatibility.py``, the compatibility table (imported from ``tools/``)."""
    if str(TOOLS_DIR) not in sys.path:
        sys.path.insert(0, str(TOOLS_DIR))
    import compatibility as module

    return module


def listed_pairs() -> list[dict[str, Any]]:
    """Every pair under test, as the entries of the pairs file."""
    path = os.environ.get(PAIRS_ENV)
    if path:
        listing: list[dict[str, Any]] = json.loads(Path(path).read_text("utf-8"))
        return listing
    return [
        {
            "id": pair.id,
            "client": {"peer": pair.client.peer, "python": None},
            "server": {"peer": pair.server.peer, "python": None},
            "expect": pair.expect,
            "error": pair.error,
        }
        for pair in compatibility().compat_table(releases=[])
        if pair.quick
    ]


def pair_params(expect: str) -> list[Any]:
    """``pytest.param((Pair, entry), id=...)`` for each listed pair expected to ``expect``.

    Pairs with an osmosis-ai side carry the ``osmosis`` mark.
    """
    params = []
    for entry in listed_pairs():
        if entry["expect"] != expect:
            continue
        pair = Pair(
            client=entry["client"]["peer"],
            server=entry["server"]["peer"],
            client_python=entry["client"]["python"],
            server_python=entry["server"]["python"],
        )
        marks = [pytest.mark.osmosis] if {pair.client, pair.server} & {OSMOSIS, OSMOSIS_032} else []
        params.append(pytest.param((pair, entry), id=entry["id"], marks=marks))
    return params
