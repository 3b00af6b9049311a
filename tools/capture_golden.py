"""Capture golden wire payloads from live osmosis-ai rollout servers and callers.

The reference implementation of the rollout protocol is the ``osmosis-ai`` package.
This tool runs it as a live peer and records what actually crosses the wire, so the
tests of ``rollout-types`` (and the interop tests of the client and server) can
compare our encoders and decoders with real bytes instead of with a reading of the
specification. Nothing of osmosis-ai is imported by the project itself; this script
only *uses* it, from a separate virtual environment.

How to run it (from the repository root)::

    python3.12 -m venv /work/.venv-osmosis
    /work/.venv-osmosis/bin/pip install 'osmosis-ai[server]==0.3.8' uvicorn
    # optional, for the pre-0.3.3 callback protocol:
    python3.12 -m venv /work/.venv-osmosis032
    /work/.venv-osmosis032/bin/pip install 'osmosis-ai[server]==0.3.2' uvicorn

    /work/.venv-osmosis/bin/python tools/capture_golden.py \\
        --legacy-python /work/.venv-osmosis032/bin/python

It takes about 15 seconds. Without ``--legacy-python`` only the 0.3.8 set is
rewritten. The tool must be started with the interpreter of the 0.3.8 venv; it
re-runs itself with ``--legacy-mode`` under the 0.3.2 interpreter for the legacy
set.

What it does:

* Serves osmosis-ai's own ``create_rollout_server(backend=LocalBackend(...))`` with
  uvicorn on ``127.0.0.1`` (ephemeral ports, in-process), wrapped in a small ASGI
  recorder that keeps every request and response byte for byte. The workflow and
  grader classes below choose their behaviour from the request ``metadata``
  (``{"workflow": ..., "grader": ...}``) so one server covers every outcome.
* Drives those servers with osmosis-ai's ``RolloutClient`` (so request bodies are
  exactly what the reference client sends, explicit ``null`` keys included) and
  with raw ``httpx`` requests for the error paths the client never produces.
* The shutdown-time 503 cannot be reached through uvicorn (it closes its sockets
  before the app's lifespan shutdown runs), so that one is captured by running the
  app's lifespan by hand behind ``httpx.ASGITransport``.
* Writes one pretty-printed JSON file per payload (``.txt`` for the one non-JSON
  body) under ``packages/rollout-types/tests/data/golden/osmosis-<version>/`` and an
  ``index.json`` there. The index maps each file name to ``method``, ``path``,
  ``status`` (``null`` for requests), ``headers_of_interest``, ``kind``
  (``"request"`` or ``"response"``), ``source``, ``description``, the
  ``request_body`` that produced a response when the tool wrote that body by hand,
  and ``placeholders`` when random values were replaced.

Determinism: lease tokens, the server's ``process_id``/``instance_id`` UUID and
ephemeral loopback ports are random, so they are replaced by fixed placeholders of
the same shape (``GOLDEN_LEASE_TOKEN``, ``GOLDEN_UUID``, ``GOLDEN_LOOPBACK_BASE``).
Rollout ids are fixed strings chosen here. Running the tool twice gives identical
files.

The parts live in ``tools/golden/`` (its ``__init__`` lists them); this file is the
command line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from golden.inputs import CURRENT_VERSION, DEFAULT_GOLDEN_ROOT, LEGACY_VERSION, LOGGER_NAME


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_GOLDEN_ROOT, help="golden root directory"
    )
    parser.add_argument(
        "--legacy-python",
        help="python of a venv with osmosis-ai[server]==0.3.2 (enables the legacy set)",
    )
    parser.add_argument("--legacy-mode", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)

    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # osmosis logs every workflow exception with a traceback; keep the run readable.
    logging.getLogger("osmosis_ai").setLevel(logging.DEBUG if args.verbose else logging.CRITICAL)
    logging.getLogger("httpx").setLevel(logging.INFO if args.verbose else logging.WARNING)
    if args.verbose:
        logging.getLogger(LOGGER_NAME).setLevel(logging.DEBUG)

    expected = LEGACY_VERSION if args.legacy_mode else CURRENT_VERSION
    installed = version("osmosis-ai")
    if installed != expected:
        parser.error(f"needs osmosis-ai=={expected} in this interpreter, found {installed}")

    with tempfile.TemporaryDirectory(prefix="golden-artifacts-") as artifacts:
        # LocalBackend writes artifacts and trajectories; keep them out of ~/.osmosis.
        os.environ["_OSMOSIS_ROLLOUT_ARTIFACT_ROOT"] = artifacts
        os.environ.pop("_OSMOSIS_ROLLOUT_INSTANCE_ID", None)
        # Imported here, after the version check: the capture modules import osmosis-ai.
        if args.legacy_mode:
            from golden.legacy import capture_legacy

            asyncio.run(capture_legacy(args.out, args.verbose))
        else:
            from golden.current import capture_current

            asyncio.run(capture_current(args.out, args.legacy_python, args.verbose))
    return 0


if __name__ == "__main__":
    sys.exit(main())
