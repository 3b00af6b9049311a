"""The layout of a SQLite state file, by schema version, and the migrations between them.

``PRAGMA user_version`` holds the version. A new file gets :data:`CURRENT_VERSION`; an
older one is migrated in one transaction when it is opened (each step of
:data:`MIGRATIONS` takes it one version up); a newer one is refused, since this server
cannot know what it would lose.

Versions:

1. The first layout: one ``meta`` row held the ``process_id`` of the server that opened
   the file, and rows had no lease length.
2. (current) Each row names the server process that admitted it (``process_id``), so a
   file that outlived several processes blames the right one, and keeps its lease length
   (``lease_sec``), so a future re-attach can grant the same lease again.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Final

__all__ = ["CURRENT_VERSION", "MIGRATIONS", "SCHEMA_V1", "SCHEMA_V2", "create", "migrate"]

SCHEMA_V1: Final = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE rollouts (
    rollout_id TEXT PRIMARY KEY,
    admitted_at REAL NOT NULL,
    status TEXT NOT NULL,
    lease_deadline REAL NOT NULL,
    token_sha256 BLOB NOT NULL,
    result BLOB,
    retention_deadline REAL,
    cancel_disposition TEXT
);
"""
"""Version 1, kept verbatim: the migration test builds a version-1 file from it."""

SCHEMA_V2: Final = """
CREATE TABLE rollouts (
    rollout_id TEXT PRIMARY KEY,
    admitted_at REAL NOT NULL,
    process_id TEXT NOT NULL,
    status TEXT NOT NULL,
    lease_sec REAL NOT NULL,
    lease_deadline REAL NOT NULL,
    token_sha256 BLOB NOT NULL,
    result BLOB,
    retention_deadline REAL,
    cancel_disposition TEXT
);
"""
"""Version 2 (current). Times are wall-clock seconds since the epoch; ``result`` is the
encoded result document (NULL while the rollout is in flight)."""

CURRENT_VERSION: Final = 2


def _v1_to_v2(db: sqlite3.Connection) -> None:
    row = db.execute("SELECT value FROM meta WHERE key = 'process_id'").fetchone()
    owner = "" if row is None else str(row[0])
    db.execute("ALTER TABLE rollouts ADD COLUMN process_id TEXT NOT NULL DEFAULT ''")
    db.execute("ALTER TABLE rollouts ADD COLUMN lease_sec REAL NOT NULL DEFAULT 0")
    db.execute(
        "UPDATE rollouts SET process_id = ?, lease_sec = max(lease_deadline - admitted_at, 0)",
        (owner,),
    )
    db.execute("DROP TABLE meta")


MIGRATIONS: Final[dict[int, Callable[[sqlite3.Connection], None]]] = {1: _v1_to_v2}
"""``MIGRATIONS[v]`` takes a file from version ``v`` to ``v + 1`` (inside the caller's
transaction)."""


def create(db: sqlite3.Connection) -> None:
    """Lay out an empty file at :data:`CURRENT_VERSION` (inside the caller's transaction)."""
    for statement in SCHEMA_V2.split(";"):
        if statement.strip():
            db.execute(statement)
    db.execute(f"PRAGMA user_version = {CURRENT_VERSION}")


def migrate(db: sqlite3.Connection, version: int) -> None:
    """Take a file from ``version`` to :data:`CURRENT_VERSION` (inside the caller's
    transaction)."""
    while version < CURRENT_VERSION:
        MIGRATIONS[version](db)
        version += 1
    db.execute(f"PRAGMA user_version = {CURRENT_VERSION}")
