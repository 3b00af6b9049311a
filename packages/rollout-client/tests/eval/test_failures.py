"""Failures in the summary and in rollout-eval show: the common messages and the failed items."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_client.eval import Journal, JournalRecord, format_summary, summarize
from rollout_client.eval._cli import main
from rollout_client.eval._failures import common_err_messages, format_failures


def rec(row: int, outcome: str, category: str | None, message: str | None) -> JournalRecord:
    return JournalRecord(
        row_index=row,
        run_index=0,
        rollout_id=f"r{row}",
        status="success" if outcome == "success" else "failure",
        reward=1.0 if outcome == "success" else None,
        err_category=category,
        err_message=message,
        outcome=outcome,
        latency_sec=0.5,
    )


RECORDS = [
    rec(0, "success", None, None),
    rec(1, "failed", "agent_error", "model answered 500"),
    rec(2, "failed", "agent_error", "model  answered\n500"),
    rec(3, "failed", "agent_error", "tool crashed"),
    rec(4, "infra_failure", "lease_expired", "lease expired after 60 s"),
    rec(5, "failed", "timeout", None),
    rec(6, "failed", None, "no category given"),
]


class TestCommonMessages:
    def test_messages_are_counted_per_category_most_common_first(self) -> None:
        """Messages are flattened to one line, counted per category, most common first."""
        assert common_err_messages(RECORDS) == {
            "agent_error": [
                {"message": "model answered 500", "count": 2},
                {"message": "tool crashed", "count": 1},
            ],
            "lease_expired": [{"message": "lease expired after 60 s", "count": 1}],
        }

    def test_only_the_most_common_are_kept_and_long_ones_cut(self) -> None:
        """At most ``limit`` messages per category, each cut to 300 characters."""
        records = [rec(i, "failed", "agent_error", f"m{i % 4} " + "x" * 400) for i in range(8)]
        messages = common_err_messages(records, limit=2)["agent_error"]
        assert [entry["count"] for entry in messages] == [2, 2]
        assert all(len(entry["message"]) == 300 for entry in messages)

    def test_the_summary_and_its_table_list_them(self) -> None:
        """summary.json holds err_messages; the printed table shows them under each category."""
        summary = summarize(
            RECORDS, items=[(i, 0) for i in range(7)], n=1, pass_threshold=1.0, run={"name": "r"}
        )
        assert summary["err_messages"]["agent_error"][0] == {
            "message": "model answered 500",
            "count": 2,
        }
        text = format_summary(summary)
        assert "  agent_error    3\n" in text
        assert "2x  model answered 500" in text
        assert "1x  tool crashed" in text

    def test_a_summary_of_an_older_version_still_prints(self) -> None:
        """A summary.json without err_messages (0.1.0) prints its categories with counts only."""
        summary = summarize(RECORDS, items=[(i, 0) for i in range(7)], n=1, pass_threshold=1.0)
        del summary["err_messages"]
        assert "model answered" not in format_summary(summary)


class TestFailedItems:
    def test_failed_items_are_listed_with_their_message(self) -> None:
        """Each failed or infra-failed item is a line: row, run, outcome, category, message."""
        text = format_failures(RECORDS)
        assert text.splitlines()[0] == "failures (6 items; the last outcome of each):"
        assert "  row 2 run 0  failed  agent_error  model answered 500" in text
        assert "  row 5 run 0  failed  timeout  (no message)" in text
        assert "  row 6 run 0  failed  (no category)  no category given" in text

    def test_the_list_is_bounded(self) -> None:
        """Beyond the limit the rest are counted and the report is suggested."""
        text = format_failures(RECORDS, limit=2)
        assert "... and 4 more: see events.jsonl, or rollout-eval report" in text
        assert format_failures(RECORDS[:1]) == "failures: none"

    def test_show_prints_the_summary_and_the_failures(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """rollout-eval show NAME --output DIR prints the table, then the failed items."""
        run_dir = tmp_path / "out" / "r"
        run_dir.mkdir(parents=True)
        with Journal(run_dir / "events.jsonl") as journal:
            for record in RECORDS:
                journal.append(record)
        summary = summarize(RECORDS, items=[(i, 0) for i in range(7)], n=1, pass_threshold=1.0)
        (run_dir / "summary.json").write_text(json.dumps(summary))
        assert main(["show", "r", "--output", str(tmp_path / "out")]) == 0
        out = capsys.readouterr().out
        assert "2x  model answered 500" in out
        assert "failures (6 items; the last outcome of each):" in out
        assert "row 4 run 0  infra_failure  lease_expired  lease expired after 60 s" in out
