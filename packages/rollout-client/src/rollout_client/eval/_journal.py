"""The run journal (``events.jsonl``): one fsynced JSON line per recorded ending of a rollout,
final or not.

The journal is append-only and is the resume authority. It holds the final outcome of each
finished item **and** every infrastructure failure (an attempt: the item is run again), so
its line count is not the number of items: count the lines whose ``outcome`` is final
(``success``, ``failed``, ``skipped``; at most one per item, and the item's last line).
Each line is an object::

    {"row_index": 3, "run_index": 0, "rollout_id": "9f0c…", "status": "success",
     "reward": 1.0, "err_category": null, "err_message": null, "outcome": "success",
     "latency_sec": 0.412, "finished_at": "2025-01-01T12:00:00.123456+00:00"}

``outcome`` is one of:

* ``success``: the server reported ``success``; ``reward`` is the grader's reward;
* ``failed``: the rollout failed for a reason that is the agent's or the model's
  (``agent_error``, ``timeout``, ``validation_error``, no category; ``no_reward`` for a
  success without a reward); scored as reward 0;
* ``skipped``: the grader asked to remove the sample (``remove_sample``); not scored;
* ``infra_failure``: the infrastructure failed (``lease_expired``, ``internal_error``,
  ``http_error`` (the model endpoint, a sandbox or a provider failed), a category this
  client does not know, transport or protocol errors, admission timeout, a rollout that
  outlived its deadline); never scored. ``status`` is null when no terminal status was
  received; ``err_category`` then names the client-side cause (``transport_error``,
  ``protocol_error``, ``admission_timeout``, ``deadline_exceeded``, ``client_error``).

An item (``row_index``, ``run_index``) counts as done when its **last** record is
``success``, ``failed`` or ``skipped``. An item whose last record is ``infra_failure`` stays
pending and is retried on resume with a fresh rollout id. Cancelled rollouts are not
recorded at all. Lines are written with ``O_APPEND`` and fsynced one by one, so a crash
loses at most the line being written; a torn last line is cut off when the journal is
reopened.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Final

from ._errors import JournalError

__all__ = [
    "DONE_OUTCOMES",
    "OUTCOMES",
    "Journal",
    "JournalRecord",
    "latest_by_item",
    "read_journal",
    "utc_now",
]

OUTCOMES: Final = ("success", "failed", "skipped", "infra_failure")
"""Every ``outcome`` value a journal record may hold."""

DONE_OUTCOMES: Final = frozenset({"success", "failed", "skipped"})
"""Outcomes after which an item is not run again on resume."""

MAX_ERR_MESSAGE_CHARS: Final = 4000
"""Longer ``err_message`` values are cut to this many characters (with a marker)."""

Item = tuple[int, int]


def utc_now() -> str:
    """The current time as an ISO 8601 UTC timestamp."""
    return datetime.datetime.now(datetime.UTC).isoformat()


def _clip(message: str | None) -> str | None:
    if message is None or len(message) <= MAX_ERR_MESSAGE_CHARS:
        return message
    return (
        message[:MAX_ERR_MESSAGE_CHARS]
        + f"… [{len(message) - MAX_ERR_MESSAGE_CHARS} more characters]"
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JournalRecord:
    """One terminal outcome of one work item, as a journal line holds it.

    ``latency_sec`` is the time from admission (the server's ``202``) to the terminal
    result, or from the first admission attempt to the failure for client-side failures.
    """

    row_index: int
    run_index: int
    rollout_id: str
    status: str | None
    reward: float | None
    err_category: str | None
    err_message: str | None
    outcome: str
    latency_sec: float | None
    finished_at: str = dataclasses.field(default_factory=utc_now)

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, not {self.outcome!r}")
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError("reward must be finite")
        if self.latency_sec is not None:
            # Kept at the precision the journal line holds, so a record read back from the
            # journal equals the one written (and summaries agree before and after a resume).
            object.__setattr__(self, "latency_sec", round(self.latency_sec, 6))

    @property
    def item(self) -> Item:
        """The work item, ``(row_index, run_index)``."""
        return (self.row_index, self.run_index)

    def as_json(self) -> dict[str, Any]:
        """The record as the JSON object of its journal line."""
        return {
            "row_index": self.row_index,
            "run_index": self.run_index,
            "rollout_id": self.rollout_id,
            "status": self.status,
            "reward": self.reward,
            "err_category": self.err_category,
            "err_message": _clip(self.err_message),
            "outcome": self.outcome,
            "latency_sec": None if self.latency_sec is None else round(self.latency_sec, 6),
            "finished_at": self.finished_at,
        }

    @classmethod
    def from_json(cls, data: Any) -> JournalRecord:
        """Build a record from a decoded journal line.

        Raises:
            ValueError: If a field is missing or has the wrong type.
        """
        if not isinstance(data, dict):
            raise ValueError("a journal line must be a JSON object")
        try:
            return cls(
                row_index=_int(data["row_index"]),
                run_index=_int(data["run_index"]),
                rollout_id=_str(data["rollout_id"]),
                status=_opt_str(data["status"]),
                reward=_opt_float(data["reward"]),
                err_category=_opt_str(data["err_category"]),
                err_message=_opt_str(data["err_message"]),
                outcome=_str(data["outcome"]),
                latency_sec=_opt_float(data["latency_sec"]),
                finished_at=_str(data["finished_at"]),
            )
        except KeyError as exc:
            raise ValueError(f"missing field {exc}") from None


def _int(value: Any) -> int:
    if type(value) is not int:
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _opt_str(value: Any) -> str | None:
    return None if value is None else _str(value)


def _opt_float(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


def _parse(data: bytes, path: Path) -> tuple[list[JournalRecord], int]:
    """Parse journal bytes; return the records and the length of the valid prefix.

    A last line without its newline is a torn write: it is left out of the prefix.
    """
    records: list[JournalRecord] = []
    lines = data.split(b"\n")
    complete, tail = lines[:-1], lines[-1]
    for number, raw in enumerate(complete, start=1):
        if not raw.strip():
            continue
        try:
            records.append(JournalRecord.from_json(json.loads(raw)))
        except (ValueError, UnicodeDecodeError) as exc:
            raise JournalError(
                f"{path}:{number} is not a valid journal record ({exc}); the journal was "
                "changed by something other than rollout-eval. Re-run with --fresh to archive "
                "this run and start over."
            ) from None
    return records, len(data) - len(tail)


def read_journal(path: Path) -> list[JournalRecord]:
    """Read every complete record of a journal (a missing file has none).

    Raises:
        JournalError: If a complete line is not a valid record.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return _parse(data, path)[0]


def latest_by_item(records: Iterable[JournalRecord]) -> dict[Item, JournalRecord]:
    """The last record of each item (later lines supersede earlier ones)."""
    latest: dict[Item, JournalRecord] = {}
    for record in records:
        latest[record.item] = record
    return latest


class Journal:
    """An open journal: the records read at opening, then appends, one fsync per line.

    Opening takes an exclusive advisory lock on the file, so two ``rollout-eval``
    processes cannot write the same run.
    """

    def __init__(self, path: Path) -> None:
        """Open (creating if needed) the journal at ``path``.

        Raises:
            JournalError: If a line is corrupt, or another process holds the run.
        """
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self._lock()
            data = _read_all(self._fd)
            self.records, valid = _parse(data, path)
            self.torn_bytes = len(data) - valid
            if self.torn_bytes:
                os.ftruncate(self._fd, valid)
                os.fsync(self._fd)
        except BaseException:
            os.close(self._fd)
            raise

    def _lock(self) -> None:
        if sys.platform == "win32":  # pragma: no cover - advisory locks are POSIX only
            return
        import fcntl

        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JournalError(
                f"another rollout-eval process is writing {self.path}; wait for it to finish "
                "(or stop it) before resuming this run, or pass --name to start another run"
            ) from None

    def append(self, record: JournalRecord) -> None:
        """Append one record as one line and fsync it before returning."""
        line = (json.dumps(record.as_json(), ensure_ascii=False, allow_nan=False) + "\n").encode()
        view = memoryview(line)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        os.fsync(self._fd)
        self.records.append(record)

    def close(self) -> None:
        """Release the lock and close the file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[JournalRecord]:
        return iter(self.records)


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks: list[bytes] = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)
