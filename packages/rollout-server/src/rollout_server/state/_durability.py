"""``StoreLink``: the registry's side of a durable state store.

When the server keeps its state in a durable store (see
:mod:`rollout_server.state._store`), the registry owns one link. The link turns an
admission or a publication into the row the store writes, and remembers what is in the
middle of a write: the ids being admitted (held, so a duplicate gets 409 meanwhile) and the
records whose result is being written (a second publication is refused meanwhile; polls
keep waiting until the write is durable). It also rebuilds the records of the rollouts a
store recovered. It writes no record it did not create: the registry does.

With ``memory:`` there is no link, and the registry's paths are those without a store.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Final

from rollout_types import RolloutStatus

from ._record import RolloutRecord, token_digest
from ._store import AdmissionRow, PublicationRow, StateStore, StoredRollout

__all__ = ["TOKEN_BYTES", "StoreLink", "new_token", "restored_record"]

TOKEN_BYTES: Final = 32
"""Random bytes in a lease token (``secrets.token_urlsafe(32)``: 43 characters of base64url)."""


def new_token() -> str:
    """A new lease token (:data:`TOKEN_BYTES` random bytes, base64url without padding)."""
    return secrets.token_urlsafe(TOKEN_BYTES)


class StoreLink:
    """The registry's writes to ``store`` (see the module docstring).

    Args:
        store: A durable store, opened.
        process_id: The ``process_id`` of this server process (kept in each admission).
        lease_sec: The polling lease, seconds.
        retention_sec: How long a published result is kept, seconds.

    Attributes:
        holding: The ids whose admission is being written.
        publishing: The records whose result is being written.
    """

    __slots__ = ("_lease_sec", "_process_id", "_retention_sec", "holding", "publishing", "store")

    def __init__(
        self, store: StateStore, *, process_id: str, lease_sec: float, retention_sec: float
    ) -> None:
        self.store = store
        self._process_id = process_id
        self._lease_sec = lease_sec
        self._retention_sec = retention_sec
        self.holding: set[str] = set()
        self.publishing: set[RolloutRecord] = set()

    async def admit(self, rollout_id: str) -> str:
        """Write the admission of ``rollout_id`` with a new lease token and wait until it is
        durable; the id is held meanwhile (the registry counts it as taken). Register it
        next, without awaiting in between.

        Returns:
            The token.

        Raises:
            StoreWriteError: If the write failed (nothing is kept).
        """
        token = new_token()
        now = time.time()
        self.holding.add(rollout_id)
        try:
            await self.store.admit(
                AdmissionRow(
                    rollout_id=rollout_id,
                    admitted_at=now,
                    process_id=self._process_id,
                    lease_sec=self._lease_sec,
                    lease_deadline=now + self._lease_sec,
                    token_sha256=token_digest(token),
                )
            )
        except BaseException:
            self.store.forget(rollout_id)  # in case the write lands after a cancellation
            raise
        finally:
            self.holding.discard(rollout_id)
        return token

    def forget(self, rollout_id: str) -> None:
        """Delete a stored admission that no registration follows."""
        self.store.forget(rollout_id)

    def publication(
        self, record: RolloutRecord, status: RolloutStatus, body: bytes
    ) -> asyncio.Future[None]:
        """Write the result ``body`` of ``record``; the caller drops it from
        :attr:`publishing` once the write is done."""
        self.publishing.add(record)
        return self.store.publish(
            PublicationRow(
                rollout_id=record.rollout_id,
                status=status,
                result=body,
                retention_deadline=time.time() + self._retention_sec,
            )
        )


def restored_record(row: StoredRollout, *, loop_time: float, lease_sec: float) -> RolloutRecord:
    """A record for a rollout recovered from the store, its execution over (it has no task
    in this process).

    Its lease is fresh from now (``loop_time`` + ``lease_sec``): renewals are not stored,
    and the restart must not cost a caller its lease. Its admission stamp is moved onto
    this process's monotonic clock by its wall-clock age. A result it had is its body, as
    delivered already: the shutdown's collect window does not wait for recovered results
    (they stay in the store).
    """
    age = max(time.time() - row.admitted_at, 0.0)
    record = RolloutRecord(
        row.rollout_id, row.token_sha256, loop_time + lease_sec, time.monotonic() - age
    )
    record.finished = True
    record.disposition = row.disposition
    if row.result is not None:
        record.body = row.result
        record.status = row.status
        record.delivered = True
    return record
