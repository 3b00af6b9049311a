"""Which interpreter runs which peer, from environment variables the nox sessions set.

Each side of a pair lives in its own venv; the tests reach it only through subprocesses
run by that venv's interpreter (the drivers and servers under ``remote/``):

* ``ROLLOUT_INTEROP_CLIENT_PYTHON``: has ``rollout-client`` (and ``aiohttp``);
  default: this interpreter when it can import ``rollout_client``;
* ``ROLLOUT_INTEROP_SERVER_PYTHON``: has ``rollout-server``; default: this interpreter
  when it can import ``rollout_server``;
* ``ROLLOUT_INTEROP_OSMOSIS_PYTHON``: has ``osmosis-ai[server,eval]==0.3.8`` and uvicorn
  (``eval`` for ``osmosis eval run``);
* ``ROLLOUT_INTEROP_OSMOSIS032_PYTHON``: has ``osmosis-ai[server]==0.3.2`` and uvicorn.

A test whose peer is missing is skipped with a reason naming the variable, so a plain
``pytest tests/`` needs no osmosis-ai; when ``ROLLOUT_INTEROP_REQUIRE=1`` (set by the
``interop`` and ``compat`` nox sessions) it fails instead, so a session cannot pass by
skipping.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Final, NoReturn

import pytest

REMOTE_DIR: Final = Path(__file__).resolve().parent / "remote"
"""Scripts and modules the peers' interpreters run (standard library plus the peer)."""

REQUIRE_ENV: Final = "ROLLOUT_INTEROP_REQUIRE"

OURS_CLIENT: Final = "ours-client"
OURS_SERVER: Final = "ours-server"
OSMOSIS: Final = "osmosis-0.3.8"
OSMOSIS_032: Final = "osmosis-0.3.2"

ENV_BY_PEER: Final = {
    OURS_CLIENT: "ROLLOUT_INTEROP_CLIENT_PYTHON",
    OURS_SERVER: "ROLLOUT_INTEROP_SERVER_PYTHON",
    OSMOSIS: "ROLLOUT_INTEROP_OSMOSIS_PYTHON",
    OSMOSIS_032: "ROLLOUT_INTEROP_OSMOSIS032_PYTHON",
}
_LOCAL_MODULE: Final = {OURS_CLIENT: "rollout_client", OURS_SERVER: "rollout_server"}
_CONTENTS: Final = {
    OURS_CLIENT: "rollout-client",
    OURS_SERVER: "rollout-server",
    OSMOSIS: "osmosis-ai[server,eval]==0.3.8 and uvicorn",
    OSMOSIS_032: "osmosis-ai[server]==0.3.2 and uvicorn",
}


def required() -> bool:
    """Whether missing peers fail the run (``ROLLOUT_INTEROP_REQUIRE=1``)."""
    return os.environ.get(REQUIRE_ENV, "") == "1"


def unavailable(reason: str) -> NoReturn:
    """Skip the test, or fail it when peers are required."""
    if required():
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: this session must not skip)", pytrace=False)
    pytest.skip(reason)


def python_of(peer: str) -> str:
    """The interpreter of ``peer`` (one of the names above); skip or fail when unset."""
    variable = ENV_BY_PEER[peer]
    value = os.environ.get(variable, "").strip()
    if value:
        if not Path(value).exists():
            unavailable(f"{variable}={value} does not exist")
        return value
    module = _LOCAL_MODULE.get(peer)
    if module is not None and importlib.util.find_spec(module) is not None:
        return sys.executable
    unavailable(
        f"{variable} is not set: point it at the python of a venv with {_CONTENTS[peer]} "
        "(the interop and compat nox sessions do)"
    )
