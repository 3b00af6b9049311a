"""``RolloutRecord``: the server-side state of one admitted rollout; ``ResultFields``: the
fields of a result to publish.

A record is data with ``__slots__`` (one per rollout in flight or retained, so every
attribute counts). Others read it; only the registry writes it
(:class:`~rollout_server.state._registry.RolloutRegistry`, whose
:class:`~rollout_server.state._waiting.LongPollWaits` keeps the waiting polls in ``poll_entries``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from typing import Any, NamedTuple

from rollout_types import (
    CancelDisposition,
    RolloutErrorCategory,
    RolloutSample,
    RolloutStatus,
    RolloutTurn,
)

from ._deadlines import Entry

__all__ = ["ResultFields", "RolloutRecord", "token_digest"]


class ResultFields(NamedTuple):
    """The fields of a result to publish, as the execution's outcome gives them."""

    status: RolloutStatus
    sample: RolloutSample | None = None
    err_message: str | None = None
    err_category: RolloutErrorCategory | None = None
    turns: list[RolloutTurn] | None = None
    """The captured model turns, for a caller that asked for them (protocol 1.1)."""


def token_digest(token: str) -> bytes:
    """The SHA-256 digest of a lease token (what a record keeps instead of the token)."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


# Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "A waiting poll is a
#   plain future in one deadline entry ..."
# Speed: benchmarks/README.md, "Server: what a waiting rollout holds", row "Per-rollout objects
#   have `__slots__` ..."
# Speed: benchmarks/README.md, "Server: when a waiting poll answers", row "A poll that finds a
#   status not yet answered ..."
class RolloutRecord:
    """The server-side state of one admitted rollout (written by the registry only).

    Attributes:
        rollout_id: The admitted id.
        admitted_at: When it was admitted, a :func:`time.monotonic` value (seconds).
        status: The current status (the published one once :attr:`published`).
        delivered_status: The last status answered to the caller: ``queued`` from
            admission on (the admission answers it), then each in-progress status a poll
            answered. A poll that finds :attr:`status` different answers it within the
            status-change grace (see :class:`~rollout_server.state._waiting.LongPollWaits`).
        lease_deadline: Loop time (seconds) at which the polling lease lapses.
        body: The encoded result document once published, else None.
        disposition: The cancel disposition recorded for it, if any.
        finished: Whether its execution task has completed (cleanup included).
        delivered: Whether a poll has returned its published result.
        started: Whether its execution task has taken its first step.
        task: Its execution task while that runs, else None.
        lease_timer: The lease's entry in the registry's deadline queue, else None.
        retention_timer: The retention's entry in that queue once published, else None.
        retention_elapsed: Whether ``result_retention_sec`` has passed since publication
            (the record is then removed as soon as its execution has finished).
        poll_entries: The deadline entries of waiting long polls (each entry's argument is
            the poll's future): one entry alone (the usual case), a tuple of several, or
            None. Written by :class:`~rollout_server.state._waiting.LongPollWaits`.
    """

    __slots__ = (
        "_digest",
        "admitted_at",
        "body",
        "delivered",
        "delivered_status",
        "disposition",
        "finished",
        "lease_deadline",
        "lease_timer",
        "poll_entries",
        "retention_elapsed",
        "retention_timer",
        "rollout_id",
        "started",
        "status",
        "task",
    )

    def __init__(
        self, rollout_id: str, digest: bytes, lease_deadline: float, admitted_at: float = 0.0
    ) -> None:
        self.rollout_id = rollout_id
        self.admitted_at = admitted_at
        self.status = RolloutStatus.QUEUED
        # A reference to one of the enum's members (no object of its own): a record with
        # 16 slots takes the same 160-byte block as one with 15.
        self.delivered_status = RolloutStatus.QUEUED
        self.lease_deadline = lease_deadline
        self.body: bytes | None = None
        self.disposition: CancelDisposition | None = None
        self.finished = False
        self.delivered = False
        self.task: asyncio.Task[Any] | None = None
        self.started = False
        self._digest = digest
        self.lease_timer: Entry | None = None
        self.retention_timer: Entry | None = None
        self.retention_elapsed = False
        self.poll_entries: Entry | tuple[Entry, ...] | None = None

    def __repr__(self) -> str:
        return f"<RolloutRecord {self.rollout_id!r} {self.status}>"

    @property
    def published(self) -> bool:
        """Whether the result is fixed."""
        return self.body is not None

    @property
    def waiting(self) -> int:
        """How many long polls are waiting for this rollout's status to change."""
        waiters = self.poll_entries
        if waiters is None:
            return 0
        return len(waiters) if isinstance(waiters, tuple) else 1

    def check_token(self, token: str) -> bool:
        """Tell whether ``token`` is this rollout's lease token (constant-time compare)."""
        return hmac.compare_digest(token_digest(token), self._digest)
