"""``SqliteStore``: the state store in one SQLite file (``--state sqlite:///ABS/PATH.db``).

Every read and write runs on one thread of the store's own (the writer), never on the
event loop; the connection lives and dies there. The file is in WAL mode with
``synchronous=FULL``: a commit is durable once it returns (one fsync of the WAL).

Group commit: the event loop only queues writes. The writer takes everything queued, runs
it in one transaction and commits; writes queued while a commit runs go together into the
next one, so under load many admissions and publications share one fsync. Once a commit
is done the writer settles the futures of its batch in one loop callback (one thread hop
per commit, none per write). :attr:`SqliteStore.stats` counts commits and batch sizes.

One server at a time: opening takes an exclusive ``flock`` on ``PATH.lock`` beside the file
and writes the holder (pid, host, ``process_id``) into it; a second server on the same file
is refused, naming the holder. The kernel releases the lock when the process ends, however
it ends.

Opening checks the file (``PRAGMA quick_check``), its schema version
(:mod:`rollout_server.state._schema`: older files are migrated, newer ones refused) and
that it can be written; each failure is a :class:`~rollout_server.state._store.StateOpenError`
that names the file and what to do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import os
import queue
import socket
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Final

import attrs

from rollout_types import CancelDisposition, RolloutStatus

from .._logtext import get_logger
from . import _schema
from ._store import (
    AdmissionRow,
    PublicationRow,
    StateOpenError,
    StoredRollout,
    StoreStats,
    StoreWriteError,
)

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock
    fcntl = None  # type: ignore[assignment]

__all__ = ["MAX_BATCH", "SqliteStore"]

logger: Final = get_logger("rollout_server.state")

MAX_BATCH: Final = 4096
"""Most writes one transaction takes (the rest go into the next one)."""

_ADMIT: Final = (
    "INSERT OR REPLACE INTO rollouts (rollout_id, admitted_at, process_id, status, lease_sec, "
    "lease_deadline, token_sha256, result, retention_deadline, cancel_disposition) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, NULL, NULL, NULL)"
)
_PUBLISH: Final = (
    "UPDATE rollouts SET status = ?, result = ?, retention_deadline = ? WHERE rollout_id = ?"
)
_DISPOSITION: Final = "UPDATE rollouts SET cancel_disposition = ? WHERE rollout_id = ?"
_FORGET: Final = "DELETE FROM rollouts WHERE rollout_id = ?"
_BARRIER: Final = ""
"""No statement: a write that only marks a place in the queue (:meth:`SqliteStore.flush`)."""
_SELECT: Final = (
    "SELECT rollout_id, admitted_at, process_id, status, lease_sec, lease_deadline, "
    "token_sha256, result, retention_deadline, cancel_disposition FROM rollouts "
    "ORDER BY admitted_at"
)

_Write = tuple[str, tuple[Any, ...], "asyncio.Future[None] | None"]
_CLOSE: Final = ("", (), None)


def _holder(process_id: str) -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}, process_id {process_id}"


def _settle(batch: list[asyncio.Future[None]], error: BaseException | None) -> None:
    for fut in batch:
        if fut.done():
            continue
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)


class SqliteStore:
    """The state store in the SQLite file ``path`` (see the module docstring).

    Args:
        path: The file (absolute); its directory is created (mode 0700) if missing, and a
            new file is created with mode 0600 (it holds results).
        max_pages: A cap on the file's size in SQLite pages (``PRAGMA max_page_count``);
            default None (the disk is the limit). Writes past it fail as a full disk does.
    """

    durable: Final = True

    def __init__(self, path: PurePosixPath | Path, *, max_pages: int | None = None) -> None:
        self.path = Path(path)
        self.url = f"sqlite://{self.path}"
        self._max_pages = max_pages
        self._queue: queue.SimpleQueue[_Write] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._closing = False
        self._stats = StoreStats()
        self._lock_fd = -1

    @property
    def stats(self) -> StoreStats:
        """The commits so far."""
        return self._stats

    @property
    def lock_path(self) -> Path:
        """The lock file beside the state file."""
        return self.path.with_name(self.path.name + ".lock")

    # -- opening (on the writer thread) ---------------------------------------------------

    async def open(self, *, process_id: str) -> Sequence[StoredRollout]:
        """Start the writer thread, take the file and read what it holds.

        Raises:
            StateOpenError: If the file cannot be used (see the module docstring).
        """
        if self._thread is not None:
            raise RuntimeError(f"{self.url} is open already")
        self._loop = asyncio.get_running_loop()
        opened: concurrent.futures.Future[list[StoredRollout]] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(process_id, opened), name="rollout-state-writer", daemon=True
        )
        self._thread.start()
        return await asyncio.wrap_future(opened)

    def _run(self, process_id: str, opened: concurrent.futures.Future[list[StoredRollout]]) -> None:
        try:
            db = self._connect(process_id)
            rows = self._load(db)
        except BaseException as exc:  # noqa: BLE001 - handed to open()
            self._release_lock()
            self._closed.set_result(None)
            opened.set_exception(exc)
            return
        opened.set_result(rows)
        try:
            self._serve(db)
        finally:
            with contextlib.suppress(sqlite3.Error):
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            db.close()
            self._release_lock()
            self._closed.set_result(None)

    def _fail(self, problem: str, fix: str) -> StateOpenError:
        return StateOpenError(f"state file {self.path} {problem}; {fix}")

    def _take_lock(self, process_id: str) -> None:
        if fcntl is None:  # pragma: no cover - Windows
            raise self._fail("cannot be locked on this platform (no flock)", "pass --state memory:")
        lock = self.lock_path
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise self._unwritable(exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.read(fd, 512).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise self._fail(
                    f"is in use by another rollout-server ({holder})",
                    "stop that server first, or give this one its own file with --state",
                ) from None
            raise self._unwritable(exc) from None
        os.ftruncate(fd, 0)
        os.write(fd, (_holder(process_id) + "\n").encode())
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock; the file stays (harmless)
            self._lock_fd = -1

    def _unwritable(self, exc: BaseException) -> StateOpenError:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return self._fail(
            f"cannot be written ({detail})",
            "make the file and its directory writable by this user, or pass another --state",
        )

    def _connect(self, process_id: str) -> sqlite3.Connection:
        path = self.path
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if path.is_dir():
                raise self._fail("is a directory", "name a file, e.g. .../state.db")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.close(fd)
        except OSError as exc:
            raise self._unwritable(exc) from None
        self._take_lock(process_id)
        try:
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=True)
        except sqlite3.Error as exc:
            raise self._unwritable(exc) from None
        try:
            self._prepare(db)
        except BaseException:
            db.close()
            raise
        return db

    def _prepare(self, db: sqlite3.Connection) -> None:
        try:
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            db.execute("PRAGMA synchronous = FULL")
            if self._max_pages is not None:
                db.execute(f"PRAGMA max_page_count = {int(self._max_pages)}")
            check = db.execute("PRAGMA quick_check").fetchall()
            version = int(db.execute("PRAGMA user_version").fetchone()[0])
        except sqlite3.DatabaseError as exc:
            raise self._corrupt(exc) from None
        if str(mode).lower() != "wal":
            raise self._unwritable(RuntimeError(f"journal_mode WAL refused ({mode})"))
        if [tuple(row) for row in check] != [("ok",)]:
            problems = "; ".join(str(row[0]) for row in check[:3])
            raise self._corrupt(RuntimeError(problems))
        if version > _schema.CURRENT_VERSION:
            raise self._fail(
                f"has schema version {version}, newer than this rollout-server's "
                f"{_schema.CURRENT_VERSION} (a newer rollout-server wrote it)",
                "upgrade rollout-server, or pass another --state",
            )
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                if version == 0:
                    tables = db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
                    if tables:
                        raise self._fail(
                            "is a SQLite file but not a rollout-server state file",
                            "pass the path of a state file, or of a new file",
                        )
                    _schema.create(db)
                elif version < _schema.CURRENT_VERSION:
                    _schema.migrate(db, version)
                    logger.info(
                        "Migrated state file %s from schema version %d to %d",
                        self.path,
                        version,
                        _schema.CURRENT_VERSION,
                    )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        except sqlite3.OperationalError as exc:
            raise self._unwritable(exc) from None
        except sqlite3.DatabaseError as exc:
            raise self._corrupt(exc) from None

    def _corrupt(self, exc: BaseException) -> StateOpenError:
        return self._fail(
            f"is not a readable rollout-server state file ({exc})",
            "move it aside (the server then starts with no recovered rollouts), or pass "
            "another --state",
        )

    def _load(self, db: sqlite3.Connection) -> list[StoredRollout]:
        """The rows still held; rows whose retention has passed are deleted."""
        now = time.time()
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "DELETE FROM rollouts WHERE result IS NOT NULL AND retention_deadline < ?",
                (now,),
            )
            rows = db.execute(_SELECT).fetchall()
            db.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise self._unwritable(exc) from None
        except sqlite3.DatabaseError as exc:
            raise self._corrupt(exc) from None
        try:
            return [self._stored(row) for row in rows]
        except (ValueError, TypeError) as exc:
            raise self._corrupt(RuntimeError(f"a row does not read back: {exc}")) from None

    @staticmethod
    def _stored(row: tuple[Any, ...]) -> StoredRollout:
        rollout_id, admitted, owner, status, lease_sec, lease_deadline = row[:6]
        digest, result, retention, disposition = row[6:]
        if not isinstance(rollout_id, str) or not isinstance(digest, bytes):
            raise TypeError(f"rollout_id {rollout_id!r} or its token hash has the wrong type")
        return StoredRollout(
            rollout_id=rollout_id,
            admitted_at=float(admitted),
            process_id=str(owner),
            status=RolloutStatus(status),
            lease_sec=float(lease_sec),
            lease_deadline=float(lease_deadline),
            token_sha256=digest,
            result=None if result is None else bytes(result),
            retention_deadline=None if retention is None else float(retention),
            disposition=None if disposition is None else CancelDisposition(disposition),
        )

    # -- writing (queued on the loop, run on the writer thread) ----------------------------

    def _submit(self, sql: str, params: tuple[Any, ...]) -> asyncio.Future[None]:
        loop = self._loop
        assert loop is not None, "open() the store first"
        fut = loop.create_future()
        if self._closing:
            fut.set_exception(StoreWriteError(f"{self.url} is closed", reason="closed"))
            return fut
        self._queue.put((sql, params, fut))
        return fut

    def admit(self, row: AdmissionRow) -> asyncio.Future[None]:
        """Write an admission; the future is done once it is durable."""
        return self._submit(
            _ADMIT,
            (
                row.rollout_id,
                row.admitted_at,
                row.process_id,
                RolloutStatus.QUEUED.value,
                row.lease_sec,
                row.lease_deadline,
                row.token_sha256,
            ),
        )

    def publish(self, row: PublicationRow) -> asyncio.Future[None]:
        """Write a result; the future is done once it is durable."""
        return self._submit(
            _PUBLISH, (row.status.value, row.result, row.retention_deadline, row.rollout_id)
        )

    def note_disposition(self, rollout_id: str, disposition: CancelDisposition) -> None:
        """Write a cancel disposition with the next batch."""
        if not self._closing:
            self._queue.put((_DISPOSITION, (disposition.value, rollout_id), None))

    def forget(self, rollout_id: str) -> None:
        """Delete a row with the next batch."""
        if not self._closing:
            self._queue.put((_FORGET, (rollout_id,), None))

    async def flush(self) -> None:
        """Wait until every write queued before this call is committed (or failed) and its
        future settled (the settling runs in commit order, before this returns)."""
        with contextlib.suppress(StoreWriteError):
            await self._submit(_BARRIER, ())

    async def close(self) -> None:
        """Write everything queued, checkpoint the WAL into the file, release the lock."""
        if self._thread is None:
            return
        if not self._closing:
            self._closing = True
            self._queue.put(_CLOSE)
        await asyncio.wrap_future(self._closed)
        stats = self._stats
        if stats.commits:
            logger.info(
                "State file %s closed: %d write(s) in %d commit(s) (%.1f per commit, at most "
                "%d), %d failed commit(s)",
                self.path,
                stats.writes,
                stats.commits,
                stats.writes / stats.commits,
                stats.largest_batch,
                stats.failed_commits,
            )

    def _serve(self, db: sqlite3.Connection) -> None:
        """The writer's loop: one transaction per batch of queued writes, until closed."""
        take = self._queue.get
        take_now = self._queue.get_nowait
        while True:
            batch = [take()]
            with contextlib.suppress(queue.Empty):
                while len(batch) < MAX_BATCH:
                    batch.append(take_now())
            closing = any(write is _CLOSE for write in batch)
            writes = [write for write in batch if write is not _CLOSE]
            if writes:
                self._commit(db, writes)
            if closing:
                # Writes queued before close() are in this batch or still queued.
                rest: list[_Write] = []
                with contextlib.suppress(queue.Empty):
                    while True:
                        write = take_now()
                        if write is not _CLOSE:
                            rest.append(write)
                if rest:
                    self._commit(db, rest)
                return

    def _commit(self, db: sqlite3.Connection, writes: list[_Write]) -> None:
        """Run ``writes`` in one transaction (one fsync), then settle their futures."""
        statements = [(sql, params) for sql, params, _fut in writes if sql]
        error: StoreWriteError | None = None
        if statements:
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    for sql, params in statements:
                        db.execute(sql, params)
                    db.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                    raise
            except Exception as exc:  # noqa: BLE001 - every failure fails the batch, not the writer
                error = StoreWriteError(
                    f"writing state file {self.path} failed: {exc}", reason=str(exc)
                )
                logger.error("%s (%d write(s) in the failed commit)", error, len(statements))
            stats = self._stats
            if error is None:
                self._stats = attrs.evolve(
                    stats,
                    commits=stats.commits + 1,
                    writes=stats.writes + len(statements),
                    largest_batch=max(stats.largest_batch, len(statements)),
                )
            else:
                self._stats = attrs.evolve(stats, failed_commits=stats.failed_commits + 1)
        futures = [fut for _sql, _params, fut in writes if fut is not None]
        loop = self._loop
        if futures and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_settle, futures, error)
