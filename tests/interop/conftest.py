"""Fixtures of the interop suites: the chat stand-in, client drivers and servers.

``interop_harness`` (next to this file) is put on ``sys.path``: the suites run with
``--import-mode=importlib``, where test folders are not importable packages.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from interop_harness.fixtures import open_client, own_server, standin

__all__ = ["open_client", "own_server", "standin"]
