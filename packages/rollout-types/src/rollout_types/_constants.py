"""Protocol constants shared by the client and the server.

Header names and default timings are those of the osmosis-ai 0.3.x pull protocol; the
protocol version and its header belong to this project.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "DEFAULT_POLLING_LEASE_TIMEOUT_SEC",
    "DEFAULT_RESULT_RETENTION_SEC",
    "DEFAULT_RESULT_WAIT_TIMEOUT_SEC",
    "LEASE_HEADER",
    "OSMOSIS_PROTOCOL_VERSION",
    "PROTOCOL_VERSION",
    "PROTOCOL_VERSION_HEADER",
    "protocol_compatible",
]

LEASE_HEADER: Final = "X-Osmosis-Rollout-Lease"
"""Request header that carries the polling lease token on every result poll."""

PROTOCOL_VERSION_HEADER: Final = "X-Rollout-Protocol-Version"
"""Header in which each side of this project advertises :data:`PROTOCOL_VERSION`.

osmosis-ai peers neither send nor read it; its absence means "osmosis pull protocol".
"""

PROTOCOL_VERSION: Final = "1.0"
"""This project's wire protocol version, ``MAJOR.MINOR``.

Peers with the same major version interoperate; a minor bump only adds optional keys.
A wire-breaking change bumps the major version (and the ``rollout-types`` major).
"""

OSMOSIS_PROTOCOL_VERSION: Final = "0.4"
"""The ``ROLLOUT_PROTOCOL_VERSION`` of the osmosis-ai 0.3.3-0.3.8 pull protocol we speak."""

DEFAULT_RESULT_WAIT_TIMEOUT_SEC: Final = 30.0
"""Default long-poll wait of ``GET /rollout/{id}/result``, in seconds."""

DEFAULT_POLLING_LEASE_TIMEOUT_SEC: Final = 120.0
"""Default polling lease: seconds without a poll before a rollout fails as ``lease_expired``."""

DEFAULT_RESULT_RETENTION_SEC: Final = 900.0
"""Default time, in seconds, a published result stays collectable (and its id reserved)."""


def protocol_compatible(ours: str, theirs: str) -> bool:
    """Tell whether two advertised protocol versions interoperate.

    Args:
        ours: The local protocol version, ``MAJOR.MINOR``.
        theirs: The version the peer advertised.

    Returns:
        True when both parse and their major versions are equal.
    """
    try:
        return int(ours.split(".", 1)[0]) == int(theirs.strip().split(".", 1)[0])
    except ValueError:
        return False
