"""The append-only journal: records, torn lines, corruption and the run lock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_client.eval import Journal, JournalError, JournalRecord, read_journal
from rollout_client.eval._journal import latest_by_item


def record(row: int, outcome: str = "success", reward: float | None = 1.0) -> JournalRecord:
    return JournalRecord(
        row_index=row,
        run_index=0,
        rollout_id=f"r{row}",
        status="success" if outcome == "success" else "failure",
        reward=reward,
        err_category=None,
        err_message=None,
        outcome=outcome,
        latency_sec=0.5,
    )


class TestJournal:
    def test_appended_records_read_back(self, tmp_path: Path) -> None:
        """Each append is one JSON line, and reading gives the same records."""
        path = tmp_path / "events.jsonl"
        with Journal(path) as journal:
            journal.append(record(0))
            journal.append(record(1, "failed", None))
        lines = path.read_text().splitlines()
        assert json.loads(lines[1])["outcome"] == "failed"
        assert [r.item for r in read_journal(path)] == [(0, 0), (1, 0)]
        assert [r.outcome for r in read_journal(path)] == ["success", "failed"]

    def test_torn_last_line_is_cut_on_open(self, tmp_path: Path) -> None:
        """A last line without its newline (a crash mid-write) is dropped and truncated."""
        path = tmp_path / "events.jsonl"
        with Journal(path) as journal:
            journal.append(record(0))
        with path.open("ab") as file:
            file.write(b'{"row_index": 1, "run_')
        with Journal(path) as journal:
            assert journal.torn_bytes > 0
            assert [r.row_index for r in journal.records] == [0]
            journal.append(record(2))
        assert [r.row_index for r in read_journal(path)] == [0, 2]

    def test_corrupt_line_names_the_line(self, tmp_path: Path) -> None:
        """A complete line that is not a record is an error naming the file and line."""
        path = tmp_path / "events.jsonl"
        path.write_text(json.dumps(record(0).as_json()) + '\n{"row_index": 1}\n')
        with pytest.raises(JournalError, match=r"events.jsonl:2 is not a valid journal record"):
            read_journal(path)

    def test_second_writer_is_refused(self, tmp_path: Path) -> None:
        """While one journal is open, opening it again fails with a clear error."""
        path = tmp_path / "events.jsonl"
        with Journal(path), pytest.raises(JournalError, match="another rollout-eval process"):
            Journal(path)

    def test_latest_record_wins(self) -> None:
        """An item's state is its last record."""
        latest = latest_by_item([record(0, "infra_failure", None), record(0)])
        assert latest[(0, 0)].outcome == "success"

    def test_invalid_records_are_rejected(self) -> None:
        """Unknown outcomes and non-finite rewards cannot be written."""
        with pytest.raises(ValueError, match="outcome must be one of"):
            record(0, "great")
        with pytest.raises(ValueError, match="reward must be finite"):
            record(0, "success", float("inf"))
