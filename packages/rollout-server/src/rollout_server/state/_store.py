"""``StateStore``: where the registry keeps what must survive a restart, and the ``--state``
URLs that choose one.

A store keeps one row per rollout the registry holds (see :class:`StoredRollout`): its id,
admission time, status, lease (length and deadline) and a SHA-256 hash of its lease token
(never the token), the published result (the exact bytes a poll answers) with its retention
deadline, the cancel disposition answered for it, and the ``process_id`` of the server
process that admitted it. Times in rows are wall-clock seconds since the epoch
(:func:`time.time`), since monotonic clocks restart with the process.

The registry, the single writer of records, is the only caller. It asks the store to make
an admission and a publication durable and waits for that (the ``202`` of an admission and
the visibility of a result to polls come only after); dispositions and removals it only
hands over (they are written with the next batch, and none is waited for). Lease renewals
are never written: a restart gives the rollouts it recovers a fresh lease from the restart,
so the deadline in a row is the one set at admission.

Two stores exist:

* ``memory:`` (:data:`MEMORY`): nothing is kept; the registry sees ``durable`` false and
  takes its plain path (no await, no copy, no call per admission or publication);
* ``sqlite:///ABS/PATH.db`` (:class:`~rollout_server.state._sqlite.SqliteStore`): a WAL-mode
  SQLite file, written by one thread with group commit.

A networked store implements :class:`StateStore` and gets a scheme of its own in
:func:`parse_state_url`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Final, Protocol

import attrs

from rollout_types import CancelDisposition, RolloutStatus

from .._errors import RolloutServerError, ServerConfigError

__all__ = [
    "MEMORY",
    "AdmissionRow",
    "MemoryStore",
    "PublicationRow",
    "StateLocation",
    "StateOpenError",
    "StateStore",
    "StoreStats",
    "StoreWriteError",
    "StoredRollout",
    "default_state_url",
    "parse_state_url",
    "store_for",
]

MEMORY: Final = "memory:"
"""The ``--state`` URL of the memory store (nothing survives the process)."""

SQLITE_PREFIX: Final = "sqlite:///"


class StateOpenError(ServerConfigError):
    """The state store cannot be opened (a bad URL, or a file that is corrupt, locked by
    another server, read-only, or of a newer schema); the message names the file and what
    to do. ``rollout-server serve`` exits 2 with it."""


class StoreWriteError(RolloutServerError):
    """A write to the state store failed (the disk is full, the file became unwritable):
    an admission is refused with 503; a result is served from memory only.

    Args:
        message: What failed, naming the store (for the log).
        reason: Why, without naming the file (for a client: ``"database or disk is full"``).
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@attrs.frozen(kw_only=True)
class StateLocation:
    """A parsed ``--state`` URL.

    Attributes:
        url: The URL as given (normalised: ``memory:`` or ``sqlite:///ABS/PATH``).
        path: The SQLite file (absolute), or None for ``memory:``.
    """

    url: str
    path: PurePosixPath | None = None

    @property
    def durable(self) -> bool:
        """Whether rollouts survive a restart with this store."""
        return self.path is not None


def parse_state_url(url: object) -> StateLocation:
    """Parse a ``--state`` URL: ``memory:`` or ``sqlite:///ABS/PATH`` (file-URL style: the
    third slash begins the absolute path, so ``sqlite:///var/lib/r.db`` is ``/var/lib/r.db``;
    SQLAlchemy's ``sqlite:////var/lib/r.db`` names the same file).

    Raises:
        StateOpenError: (a :class:`~rollout_server.ServerConfigError`) For anything else,
            naming what is wrong and the accepted forms.
    """
    forms = "use memory: or sqlite:///ABSOLUTE/PATH.db (as in sqlite:///var/lib/rollout.db)"
    if not isinstance(url, str):
        raise StateOpenError(f"state must be a URL string; got {type(url).__name__} ({forms})")
    text = url.strip()
    if text == MEMORY:
        return StateLocation(url=MEMORY)
    scheme, colon, _rest = text.partition(":")
    if not colon:
        raise StateOpenError(f"state {url!r} is not a URL; {forms}")
    if scheme.lower() != "sqlite":
        raise StateOpenError(f"state {url!r} has the unknown scheme {scheme!r}; {forms}")
    if not text.startswith(SQLITE_PREFIX) and text.lower().startswith(SQLITE_PREFIX):
        text = SQLITE_PREFIX + text[len(SQLITE_PREFIX) :]
    if not text.startswith(SQLITE_PREFIX):
        raise StateOpenError(
            f"state {url!r} is not an absolute sqlite URL (relative paths and hosts are "
            f"refused); {forms}"
        )
    # file-URL style: the third slash starts the path (``sqlite:////abs`` works too).
    raw = "/" + text[len(SQLITE_PREFIX) :].lstrip("/")
    if "?" in raw or "#" in raw:
        raise StateOpenError(f"state {url!r} has a query or fragment, which is not supported")
    path = PurePosixPath(raw)
    if raw == "/" or raw.endswith("/"):
        raise StateOpenError(f"state {url!r} does not name a file; {forms}")
    if ".." in path.parts:
        raise StateOpenError(f"state {url!r} has a '..' component; name the file directly")
    if "\x00" in raw:
        raise StateOpenError(f"state {url!r} holds a NUL character")
    return StateLocation(url=f"sqlite://{path}", path=path)


def default_state_url(port: int, environ: Mapping[str, str] | None = None) -> str:
    """The state ``rollout-server serve`` keeps when ``--state`` is not given.

    ``sqlite:///$XDG_STATE_HOME/rollout/state/serve-PORT.db`` (``XDG_STATE_HOME`` when it is
    an absolute path, else ``~/.local/state``; beside the default artifact root
    ``.../rollout/artifacts``), keyed by the port, so servers on different ports never share
    a file, and a server restarted on its port finds its rollouts. With port 0 there is no
    port to come back on (callers could not find a restarted server), so ``memory:``.
    """
    if port == 0:
        return MEMORY
    env = os.environ if environ is None else environ
    state_home = env.get("XDG_STATE_HOME", "").strip()
    if state_home and Path(state_home).is_absolute():  # XDG: relative values are ignored
        root = Path(state_home)
    else:
        root = Path.home() / ".local" / "state"
    return f"sqlite://{root / 'rollout' / 'state' / f'serve-{port}.db'}"


@attrs.frozen(kw_only=True)
class AdmissionRow:
    """What an admission writes (all times wall-clock seconds since the epoch)."""

    rollout_id: str
    admitted_at: float
    process_id: str
    """The ``process_id`` of the server process that admits it (``/health``)."""
    lease_sec: float
    lease_deadline: float
    token_sha256: bytes


@attrs.frozen(kw_only=True)
class PublicationRow:
    """What a publication writes: the result a poll answers, and until when."""

    rollout_id: str
    status: RolloutStatus
    result: bytes
    """The encoded result document, the exact bytes of a poll's answer."""
    retention_deadline: float
    """Wall-clock seconds since the epoch."""


@attrs.frozen(kw_only=True)
class StoredRollout:
    """A rollout as the store held it when it was opened (see :class:`AdmissionRow`)."""

    rollout_id: str
    admitted_at: float
    process_id: str
    status: RolloutStatus
    lease_sec: float
    lease_deadline: float
    token_sha256: bytes
    result: bytes | None
    """None: the rollout was in flight when the process that admitted it ended."""
    retention_deadline: float | None
    disposition: CancelDisposition | None


@attrs.frozen(kw_only=True)
class StoreStats:
    """How the store has written so far (group commit: many writes share one commit).

    Attributes:
        commits: Transactions committed (each one fsync with ``synchronous=FULL``).
        writes: Writes committed (admissions, publications, dispositions, removals).
        largest_batch: The most writes one commit carried.
        failed_commits: Transactions that failed (their writes were refused or kept in
            memory only).
    """

    commits: int = 0
    writes: int = 0
    largest_batch: int = 0
    failed_commits: int = 0


class StateStore(Protocol):
    """What the registry needs of a store (all methods are called on the event loop).

    ``open`` reads what the store holds; ``admit`` and ``publish`` return a future that is
    done once the write is durable (or failed with :class:`StoreWriteError`); ``note_*`` and
    ``forget`` are written with a later batch and never waited for. ``close`` writes what is
    queued and releases the store. A store whose ``durable`` is false is never written to.
    """

    @property
    def durable(self) -> bool:
        """Whether writes are kept (False: the registry never calls the write methods)."""

    @property
    def url(self) -> str:
        """The ``--state`` URL, for log lines and ``/health``."""

    @property
    def stats(self) -> StoreStats:
        """The commits so far."""

    async def open(self, *, process_id: str) -> Sequence[StoredRollout]:
        """Take the store for this server process and return the rollouts it holds (rows
        whose retention has passed are dropped, not returned).

        Raises:
            StateOpenError: If the store cannot be used; the message says why and what to do.
        """

    def admit(self, row: AdmissionRow) -> asyncio.Future[None]:
        """Write an admission (replacing any row of the same id)."""

    def publish(self, row: PublicationRow) -> asyncio.Future[None]:
        """Write the result of an admitted rollout."""

    def note_disposition(self, rollout_id: str, disposition: CancelDisposition) -> None:
        """Write the cancel disposition answered for a rollout, with the next batch."""

    def forget(self, rollout_id: str) -> None:
        """Delete the row of a rollout no longer held, with the next batch."""

    async def flush(self) -> None:
        """Wait until every write queued before this call is durable (or has failed), and
        the futures of those writes have run their callbacks."""

    async def close(self) -> None:
        """Write everything queued, then release the store (idempotent)."""


class MemoryStore:
    """``memory:``: nothing is kept; :attr:`durable` is False, so the registry never writes."""

    url: Final = MEMORY
    durable: Final = False
    stats: Final = StoreStats()

    async def open(self, *, process_id: str) -> Sequence[StoredRollout]:
        """Nothing to recover."""
        del process_id
        return ()

    def admit(self, row: AdmissionRow) -> asyncio.Future[None]:  # pragma: no cover
        raise AssertionError("the memory store is never written to")

    def publish(self, row: PublicationRow) -> asyncio.Future[None]:  # pragma: no cover
        raise AssertionError("the memory store is never written to")

    def note_disposition(self, rollout_id: str, disposition: CancelDisposition) -> None:
        """Nothing kept."""

    def forget(self, rollout_id: str) -> None:
        """Nothing kept."""

    async def flush(self) -> None:
        """Nothing queued."""

    async def close(self) -> None:
        """Nothing to release."""


def store_for(location: StateLocation) -> StateStore:
    """The store a parsed ``--state`` URL names (not opened yet)."""
    if location.path is None:
        return MemoryStore()
    from ._sqlite import SqliteStore

    return SqliteStore(location.path)
