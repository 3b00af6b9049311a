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
    "TURNS_PROTOCOL_VERSION",
    "protocol_compatible",
    "protocol_supports",
]

LEASE_HEADER: Final = "X-Osmosis-Rollout-Lease"
"""Request header that carries the polling lease token on every result poll."""

PROTOCOL_VERSION_HEADER: Final = "X-Rollout-Protocol-Version"
"""Header in which each side of this project advertises :data:`PROTOCOL_VERSION`.

osmosis-ai peers neither send nor read it; its absence means "osmosis pull protocol".
"""

PROTOCOL_VERSION: Final = "1.1"
"""This project's wire protocol version, ``MAJOR.MINOR``.

Peers with the same major version interoperate; a minor bump only adds optional keys.
A wire-breaking change bumps the major version (and the ``rollout-types`` major).

History: 1.0 (rollout-types 0.1, 0.2); 1.1 adds the optional request keys
``return_turns``, ``weight_version`` and ``group_id``, and the result key ``turns``
(sent only to a caller that set ``return_turns``): see :data:`TURNS_PROTOCOL_VERSION`.
"""

TURNS_PROTOCOL_VERSION: Final = "1.1"
"""The first protocol version whose servers understand ``return_turns`` (and answer
``turns``): a client that needs turns checks the server's advertised version with
:func:`protocol_supports` (a 1.0 server ignores the key and answers no turns).

.. versionadded:: 0.3
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


def _parse(version: str) -> tuple[int, int] | None:
    major, _, minor = version.strip().partition(".")
    try:
        return int(major), int(minor or "0")
    except ValueError:
        return None


def protocol_supports(advertised: str | None, needed: str) -> bool:
    """Tell whether a peer that advertised ``advertised`` has the features of ``needed``.

    Args:
        advertised: The version the peer advertised in ``X-Rollout-Protocol-Version``,
            or None when it sent none (an osmosis-ai peer: protocol 1.0 features only).
        needed: The version that introduced the feature, such as
            :data:`TURNS_PROTOCOL_VERSION`.

    Returns:
        True when both parse, the majors are equal and the peer's minor is at least the
        needed one.

    .. versionadded:: 0.3
    """
    want = _parse(needed)
    have = _parse(advertised) if advertised is not None else (1, 0)
    if want is None or have is None:
        return False
    return have[0] == want[0] and have[1] >= want[1]
