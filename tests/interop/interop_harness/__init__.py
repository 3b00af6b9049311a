"""Test harness shared by ``tests/interop`` and ``tests/compat``.

The tests run in a venv of their own (pytest + aiohttp); every peer (our client, our
server, osmosis-ai 0.3.8 and 0.3.2) runs as a subprocess of its own venv's interpreter,
named by environment variables (:mod:`.peers`). Clients are reached through drivers
(``remote/driver_*.py``) that speak JSON lines; servers are ``rollout-server serve`` and
``remote/osmosis_app.py``. :mod:`.standin` is the chat endpoint the workflows call.
"""

from __future__ import annotations

from .pairs import Pair
from .peers import OSMOSIS, OSMOSIS_032, OURS_CLIENT, OURS_SERVER, python_of, required
from .processes import DriverError, DriverProcess, ServerProcess
from .standin import ChatStandIn

__all__ = [
    "OSMOSIS",
    "OSMOSIS_032",
    "OURS_CLIENT",
    "OURS_SERVER",
    "ChatStandIn",
    "DriverError",
    "DriverProcess",
    "Pair",
    "ServerProcess",
    "python_of",
    "required",
]
