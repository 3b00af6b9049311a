"""Which model endpoint serves a rollout: consistent hashing with bounded loads.

Each endpoint has :data:`VIRTUAL_NODES` points on a 64-bit hash ring. A routing key (a
group's id, else the rollout's) starts at its own hash and walks the ring clockwise to the
first endpoint whose load is below the bound ``ceil(load_factor * (active + 1) / n)``,
where ``active`` counts the rollouts in flight and ``n`` the endpoints (Mirrokni, Thorup
and Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018): with a light load a
key always lands on its home endpoint (the same prefix cache, run after run), and no
endpoint ever holds more than ``load_factor`` times its share.

A key is pinned to its endpoint while any rollout that uses it is in flight: every turn
of a rollout, and every sibling of a group admitted meanwhile, goes to the same endpoint
whatever the loads have become (affinity wins over balance within a group). The load of an
endpoint is its number of rollouts in flight.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from typing import Final

__all__ = ["DEFAULT_LOAD_FACTOR", "VIRTUAL_NODES", "EndpointRing"]

VIRTUAL_NODES: Final = 64
"""Points per endpoint on the ring (more points, a more even share of the keys)."""

DEFAULT_LOAD_FACTOR: Final = 1.25
"""Default bound on an endpoint's load, as a multiple of the mean load."""


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class EndpointRing:
    """The endpoints of a gateway and which keys are pinned to which.

    Args:
        endpoints: The endpoints' base URLs (at least one, no duplicates).
        load_factor: The bound on an endpoint's load as a multiple of the mean; > 1;
            default 1.25.

    Raises:
        ValueError: On no endpoints, a duplicate, or a load factor of 1 or less.
    """

    def __init__(
        self, endpoints: Sequence[str], *, load_factor: float = DEFAULT_LOAD_FACTOR
    ) -> None:
        if not endpoints:
            raise ValueError("an endpoint ring needs at least one endpoint")
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"duplicate model endpoints: {list(endpoints)!r}")
        if not (math.isfinite(load_factor) and load_factor > 1):
            raise ValueError(f"load_factor must be a finite number > 1; got {load_factor!r}")
        self.endpoints = tuple(endpoints)
        self.load_factor = load_factor
        points = sorted(
            (_hash(f"{endpoint}#{replica}"), index)
            for index, endpoint in enumerate(self.endpoints)
            for replica in range(VIRTUAL_NODES)
        )
        self._points = [point for point, _ in points]
        self._owners = [index for _, index in points]
        self._loads = [0] * len(self.endpoints)
        self._pinned: dict[str, tuple[int, int]] = {}  # key -> (endpoint index, rollouts)
        self._active = 0

    def load(self, endpoint: str) -> int:
        """Rollouts in flight on ``endpoint``."""
        return self._loads[self.endpoints.index(endpoint)]

    def acquire(self, key: str) -> str:
        """The endpoint of one more rollout with routing key ``key`` (pair with
        :meth:`release`): the key's pinned endpoint, else the first on the ring from the
        key's hash whose load is under the bound (then pinned)."""
        pinned = self._pinned.get(key)
        if pinned is not None:
            index, count = pinned
            self._pinned[key] = (index, count + 1)
        else:
            index = self._choose(key)
            self._pinned[key] = (index, 1)
        self._loads[index] += 1
        self._active += 1
        return self.endpoints[index]

    def release(self, key: str) -> None:
        """One rollout with ``key`` is done; the key is unpinned once none is left."""
        pinned = self._pinned.get(key)
        if pinned is None:
            return
        index, count = pinned
        if count <= 1:
            del self._pinned[key]
        else:
            self._pinned[key] = (index, count - 1)
        self._loads[index] -= 1
        self._active -= 1

    def _choose(self, key: str) -> int:
        bound = math.ceil(self.load_factor * (self._active + 1) / len(self.endpoints))
        start = bisect.bisect(self._points, _hash(key))
        total = len(self._points)
        for step in range(total):
            index = self._owners[(start + step) % total]
            if self._loads[index] < bound:
                return index
        # Unreachable: the bound is above the mean, so some endpoint is under it.
        return self._owners[start % total]  # pragma: no cover
