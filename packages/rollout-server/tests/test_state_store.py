"""The state store on its own: ``--state`` URLs, the SQLite file (group commit, recovery,
retention), and every bad or hostile file (item 6 of issue 28): corrupt, truncated, locked
by another server, read-only, of a newer schema, on a full disk; plus the migration from the
first schema."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

from rollout_server import ServerConfigError
from rollout_server.state import _schema
from rollout_server.state._sqlite import SqliteStore
from rollout_server.state._store import (
    MEMORY,
    AdmissionRow,
    MemoryStore,
    PublicationRow,
    StateOpenError,
    StoreWriteError,
    default_state_url,
    parse_state_url,
    store_for,
)
from rollout_types import CancelDisposition, RolloutStatus

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def admission(
    rollout_id: str, *, process_id: str = "p-old", now: float | None = None
) -> AdmissionRow:
    now = time.time() if now is None else now
    return AdmissionRow(
        rollout_id=rollout_id,
        admitted_at=now,
        process_id=process_id,
        lease_sec=120.0,
        lease_deadline=now + 120.0,
        token_sha256=b"d" * 32,
    )


def publication(rollout_id: str, *, retention: float = 900.0) -> PublicationRow:
    return PublicationRow(
        rollout_id=rollout_id,
        status=RolloutStatus.SUCCESS,
        result=b'{"rollout_id":"%s","status":"success"}' % rollout_id.encode(),
        retention_deadline=time.time() + retention,
    )


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def truncate_to_half(path: Path) -> int:
    size = path.stat().st_size
    with path.open("r+b") as file:
        file.truncate(size // 2)
    return size


def set_mode(path: Path, mode: int) -> None:
    path.chmod(mode)


def remount_read_only(mount: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)


# -- URLs ---------------------------------------------------------------------------------


def test_memory_and_absolute_sqlite_urls_parse() -> None:
    assert parse_state_url("memory:").path is None
    assert not parse_state_url(" memory: ").durable
    location = parse_state_url("sqlite:///var/lib/rollout/state.db")
    assert location.path == PurePosixPath("/var/lib/rollout/state.db")
    assert location.url == "sqlite:///var/lib/rollout/state.db"
    assert location.durable
    assert parse_state_url("SQLITE:////x/y.db") == parse_state_url("sqlite:///x/y.db")
    assert isinstance(store_for(parse_state_url(MEMORY)), MemoryStore)
    assert isinstance(store_for(location), SqliteStore)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("sqlite://relative/state.db", "absolute"),
        ("sqlite:state.db", "absolute"),
        ("sqlite:///", "does not name a file"),
        ("sqlite:///tmp/dir/", "does not name a file"),
        ("sqlite:///tmp/../etc/x.db", "'..'"),
        ("sqlite:///tmp/x.db?mode=ro", "query"),
        ("redis://localhost/0", "unknown scheme 'redis'"),
        ("/var/state.db", "not a URL"),
        ("state.db", "not a URL"),
        ("memory", "not a URL"),
        ("", "not a URL"),
    ],
)
def test_bad_urls_are_refused_clearly(url: str, says: str) -> None:
    with pytest.raises(StateOpenError) as caught:
        parse_state_url(url)
    assert says in str(caught.value)
    assert repr(url.strip()) in str(caught.value) or repr(url) in str(caught.value)
    assert isinstance(caught.value, ServerConfigError)


def test_a_url_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(StateOpenError, match="must be a URL string; got int"):
        parse_state_url(3)


# -- the SQLite file ----------------------------------------------------------------------


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "rollouts.db"


async def test_a_new_file_is_private_versioned_and_in_wal_mode(db_path: Path) -> None:
    store = SqliteStore(db_path)
    assert await store.open(process_id="p1") == []
    await store.close()
    assert mode_of(db_path) == 0o600
    assert mode_of(db_path.parent) == 0o700
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == _schema.CURRENT_VERSION
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_rows_survive_a_reopen_with_their_fields(db_path: Path) -> None:
    store = SqliteStore(db_path)
    await store.open(process_id="p1")
    await store.admit(admission("done", process_id="p1"))
    await store.admit(admission("running", process_id="p1"))
    await store.admit(admission("gone", process_id="p1"))
    await store.publish(publication("done"))
    store.note_disposition("running", CancelDisposition.CANCELLED_RUNNING)
    store.forget("gone")
    await store.close()

    again = SqliteStore(db_path)
    rows = {row.rollout_id: row for row in await again.open(process_id="p2")}
    await again.close()
    assert set(rows) == {"done", "running"}
    done, running = rows["done"], rows["running"]
    assert done.status is RolloutStatus.SUCCESS
    assert done.result == b'{"rollout_id":"done","status":"success"}'
    assert done.retention_deadline is not None
    assert done.retention_deadline > time.time()
    assert running.result is None
    assert running.status is RolloutStatus.QUEUED
    assert running.disposition is CancelDisposition.CANCELLED_RUNNING
    assert running.process_id == "p1"
    assert running.lease_sec == 120.0
    assert running.token_sha256 == b"d" * 32


async def test_results_past_their_retention_are_deleted_at_open(db_path: Path) -> None:
    store = SqliteStore(db_path)
    await store.open(process_id="p1")
    await store.admit(admission("old"))
    await store.admit(admission("kept"))
    await store.publish(publication("old", retention=-1.0))
    await store.publish(publication("kept"))
    await store.close()
    again = SqliteStore(db_path)
    assert [row.rollout_id for row in await again.open(process_id="p2")] == ["kept"]
    await again.close()
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        assert db.execute("SELECT rollout_id FROM rollouts").fetchall() == [("kept",)]


async def test_writes_queued_together_share_commits(db_path: Path) -> None:
    """Group commit: 500 admissions queued at once take far fewer commits than writes."""
    store = SqliteStore(db_path)
    await store.open(process_id="p1")
    await asyncio.gather(*(store.admit(admission(f"r{i}")) for i in range(500)))
    stats = store.stats
    await store.close()
    assert stats.writes == 500
    assert stats.commits < 50
    assert stats.largest_batch >= 50
    assert stats.failed_commits == 0


async def test_close_writes_what_is_queued(db_path: Path) -> None:
    store = SqliteStore(db_path)
    await store.open(process_id="p1")
    pending = [store.admit(admission(f"r{i}")) for i in range(20)]
    await store.close()
    assert all(fut.done() and fut.exception() is None for fut in pending)
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        assert db.execute("SELECT count(*) FROM rollouts").fetchone()[0] == 20
    late = store.admit(admission("late"))
    with pytest.raises(StoreWriteError, match="closed"):
        await late


# -- bad and hostile files ----------------------------------------------------------------


async def open_fails(path: Path) -> str:
    store = SqliteStore(path)
    with pytest.raises(StateOpenError) as caught:
        await store.open(process_id="p-new")
    message = str(caught.value)
    assert str(path) in message
    assert "\n" not in message
    return message


async def test_a_second_server_on_the_same_file_is_refused_naming_the_holder(
    db_path: Path,
) -> None:
    holder = SqliteStore(db_path)
    await holder.open(process_id="p-holder")
    try:
        message = await open_fails(db_path)
    finally:
        await holder.close()
    assert "in use by another rollout-server" in message
    assert f"pid {os.getpid()}" in message
    assert "process_id p-holder" in message
    # Released at close: the next server opens it.
    after = SqliteStore(db_path)
    await after.open(process_id="p-after")
    await after.close()


async def test_a_corrupt_file_is_refused(db_path: Path) -> None:
    write_file(db_path, os.urandom(8192))
    assert "is not a readable rollout-server state file" in await open_fails(db_path)


async def test_a_truncated_file_is_refused(db_path: Path) -> None:
    store = SqliteStore(db_path)
    await store.open(process_id="p1")
    await asyncio.gather(*(store.admit(admission(f"r{i:04d}")) for i in range(300)))
    await asyncio.gather(*(store.publish(publication(f"r{i:04d}")) for i in range(300)))
    await store.close()
    assert truncate_to_half(db_path) > 4 * 4096
    assert "is not a readable rollout-server state file" in await open_fails(db_path)


async def test_a_file_of_a_newer_schema_is_refused(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        db.execute(f"PRAGMA user_version = {_schema.CURRENT_VERSION + 5}")
    message = await open_fails(db_path)
    assert f"schema version {_schema.CURRENT_VERSION + 5}, newer than" in message
    assert "upgrade rollout-server" in message


async def test_a_sqlite_file_of_something_else_is_refused(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        db.execute("CREATE TABLE accounts (id INTEGER)")
    assert "not a rollout-server state file" in await open_fails(db_path)


async def test_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "dir.db").mkdir()
    assert "is a directory" in await open_fails(tmp_path / "dir.db")


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A small tmpfs mounted at ``where`` (root only), unmounted at the end."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


async def test_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    if IS_ROOT:
        # Root ignores permission bits: a read-only mount is what stops it.
        with tmpfs(tmp_path / "ro", "1m") as mount:
            store = SqliteStore(mount / "state.db")
            await store.open(process_id="p1")
            await store.close()
            remount_read_only(mount)
            message = await open_fails(mount / "state.db")
    else:
        directory = tmp_path / "ro"
        write_file(directory / "placeholder", b"")
        set_mode(directory, 0o500)
        try:
            message = await open_fails(directory / "state.db")
        finally:
            set_mode(directory, 0o700)
    assert "cannot be written" in message
    assert "make the file and its directory writable" in message


@pytest.mark.skipif(IS_ROOT, reason="root writes files whatever their mode says")
async def test_a_read_only_file_is_refused(db_path: Path) -> None:
    store = SqliteStore(db_path)
    await store.open(process_id="p1")
    await store.close()
    set_mode(db_path, 0o400)
    try:
        assert "cannot be written" in await open_fails(db_path)
    finally:
        set_mode(db_path, 0o600)


async def test_a_full_disk_fails_writes_without_losing_earlier_ones(db_path: Path) -> None:
    """``max_page_count`` caps the file as a full disk does (SQLITE_FULL)."""
    store = SqliteStore(db_path, max_pages=8)
    await store.open(process_id="p1")
    await store.admit(admission("first"))
    big = PublicationRow(
        rollout_id="first",
        status=RolloutStatus.SUCCESS,
        result=b"x" * 200_000,
        retention_deadline=time.time() + 900,
    )
    with pytest.raises(StoreWriteError, match="full"):
        await store.publish(big)
    assert store.stats.failed_commits == 1
    await store.admit(admission("second"))  # small writes still fit
    await store.close()
    again = SqliteStore(db_path)
    rows = await again.open(process_id="p2")
    await again.close()
    assert [(row.rollout_id, row.result) for row in rows] == [("first", None), ("second", None)]


async def test_a_full_tmpfs_fails_writes_cleanly(tmp_path: Path) -> None:
    if not IS_ROOT:
        pytest.skip("mounting a tmpfs needs root")
    with tmpfs(tmp_path / "small", "200k") as mount:
        store = SqliteStore(mount / "state.db")
        await store.open(process_id="p1")
        try:
            with pytest.raises(StoreWriteError, match="full"):  # noqa: PT012 - the loop fills it
                for i in range(100):
                    await store.admit(admission(f"r{i}"))
                    await store.publish(
                        PublicationRow(
                            rollout_id=f"r{i}",
                            status=RolloutStatus.SUCCESS,
                            result=os.urandom(20_000),
                            retention_deadline=time.time() + 900,
                        )
                    )
        finally:
            await store.close()


# -- migration ----------------------------------------------------------------------------


async def test_a_version_1_file_is_migrated(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    now = time.time()
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        db.executescript(_schema.SCHEMA_V1)
        db.execute("INSERT INTO meta VALUES ('process_id', 'p-v1')")
        db.execute(
            "INSERT INTO rollouts VALUES (?, ?, 'success', ?, ?, ?, ?, NULL)",
            ("kept", now - 10, now + 110, b"t" * 32, b'{"status":"success"}', now + 900),
        )
        db.execute(
            "INSERT INTO rollouts VALUES (?, ?, 'running', ?, ?, NULL, NULL, 'cancelled_running')",
            ("flying", now - 5, now + 115, b"u" * 32),
        )
        db.execute("PRAGMA user_version = 1")
        db.commit()
    store = SqliteStore(db_path)
    rows = {row.rollout_id: row for row in await store.open(process_id="p2")}
    await store.close()
    assert rows["kept"].process_id == "p-v1"
    assert rows["flying"].process_id == "p-v1"
    assert rows["kept"].lease_sec == pytest.approx(120.0)
    assert rows["kept"].result == b'{"status":"success"}'
    assert rows["flying"].status is RolloutStatus.RUNNING
    assert rows["flying"].disposition is CancelDisposition.CANCELLED_RUNNING
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master")}
    assert "meta" not in tables


def test_every_old_version_has_a_migration() -> None:
    assert sorted(_schema.MIGRATIONS) == list(range(1, _schema.CURRENT_VERSION))


async def test_memory_store_keeps_nothing() -> None:
    store = MemoryStore()
    assert not store.durable
    assert await store.open(process_id=str(uuid.uuid4())) == ()
    store.forget("x")
    await store.close()


def test_the_command_default_is_a_file_per_port_under_the_state_home() -> None:
    home = Path.home()
    assert default_state_url(8100, {"XDG_STATE_HOME": "/srv/state"}) == (
        "sqlite:///srv/state/rollout/state/serve-8100.db"
    )
    # XDG: a relative value is ignored, as is an unset one.
    for environ in ({"XDG_STATE_HOME": "relative"}, {}):
        assert default_state_url(8100, environ) == (
            f"sqlite://{home}/.local/state/rollout/state/serve-8100.db"
        )
    assert default_state_url(0, {"XDG_STATE_HOME": "/srv/state"}) == MEMORY
    assert parse_state_url(default_state_url(8100)).durable
