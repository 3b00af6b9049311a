"""The summary: scoring rules, pass@k, percentiles and the printed table."""

from __future__ import annotations

import math

import pytest

from rollout_client.eval import JournalRecord, format_summary, summarize
from rollout_client.eval._summary import pass_at_k, percentile


def rec(
    row: int, run: int, outcome: str, reward: float | None = None, latency: float = 1.0
) -> JournalRecord:
    return JournalRecord(
        row_index=row,
        run_index=run,
        rollout_id=f"{row}-{run}",
        status={"success": "success", "skipped": "success"}.get(outcome, "failure"),
        reward=reward,
        err_category={"failed": "agent_error", "infra_failure": "lease_expired"}.get(outcome),
        err_message=None,
        outcome=outcome,
        latency_sec=latency,
    )


class TestSummarize:
    def test_scoring_rules(self) -> None:
        """Failed scores 0, skipped and infra failures are not scored, infra stays pending."""
        records = [
            rec(0, 0, "success", 1.0, 1.0),
            rec(1, 0, "success", 0.5, 2.0),
            rec(2, 0, "failed", None, 3.0),
            rec(3, 0, "skipped", None, 4.0),
            rec(4, 0, "infra_failure"),
        ]
        items = [(i, 0) for i in range(6)]
        summary = summarize(records, items=items, n=1, pass_threshold=0.5)
        assert summary["by_outcome"] == {
            "success": 2,
            "failed": 1,
            "skipped": 1,
            "infra_failure": 1,
            "cancelled": 0,
            "not_started": 1,
        }
        assert summary["items"] == {"total": 6, "done": 4, "pending": 2, "scored": 3}
        assert summary["reward"]["mean"] == 0.5
        assert summary["reward"]["median"] == 0.5
        assert summary["pass"]["passed"] == 2
        assert summary["pass"]["rate"] == pytest.approx(2 / 3, abs=1e-6)
        assert summary["latency_sec"]["count"] == 4
        assert summary["latency_sec"]["p50"] == 2.5
        assert summary["by_err_category"] == {"agent_error": 1, "lease_expired": 1}
        assert summary["complete"] is False
        assert summary["pass_at_k"] is None

    def test_a_retried_infra_failure_counts_its_final_outcome(self) -> None:
        """A later success supersedes an earlier infra failure; the attempt is still counted."""
        records = [rec(0, 0, "infra_failure"), rec(0, 0, "success", 1.0)]
        summary = summarize(records, items=[(0, 0)], n=1, pass_threshold=1.0)
        assert summary["complete"] is True
        assert summary["infra_failures"] == {"attempts": 1, "pending_items": 0}

    def test_pass_at_k_with_repetitions(self) -> None:
        """pass@k averages the unbiased estimator over rows."""
        records = [
            rec(0, 0, "success", 1.0),
            rec(0, 1, "success", 0.0),
            rec(1, 0, "failed"),
            rec(1, 1, "failed"),
        ]
        items = [(r, k) for r in range(2) for k in range(2)]
        summary = summarize(records, items=items, n=2, pass_threshold=1.0)
        assert summary["pass_at_k"]["1"] == {"value": 0.25, "rows": 2}
        assert summary["pass_at_k"]["2"] == {"value": 0.5, "rows": 2}

    def test_same_records_give_the_same_summary(self) -> None:
        """The summary is a function of the records and items (apart from its timestamp)."""
        records = [rec(0, 0, "success", 1.0), rec(1, 0, "failed")]
        first = summarize(records, items=[(0, 0), (1, 0)], n=1, pass_threshold=1.0)
        second = summarize(list(reversed(records)), items=[(0, 0), (1, 0)], n=1, pass_threshold=1.0)
        first.pop("generated_at")
        second.pop("generated_at")
        assert first == second

    def test_table_shows_the_key_numbers(self) -> None:
        """The printed table has outcome counts, reward, pass rate, pass@k and latency."""
        records = [rec(0, 0, "success", 1.0), rec(0, 1, "failed")]
        summary = summarize(
            records, items=[(0, 0), (0, 1)], n=2, pass_threshold=1.0, run={"name": "r"}
        )
        text = format_summary(summary, files=["out/r/summary.json"])
        assert "run 'r', 2 items (complete)" in text
        assert "pass rate        50.0%  (1/2 with reward >= 1)" in text
        assert "pass@1 0.500  pass@2 1.000" in text
        assert "agent_error" in text
        assert "out/r/summary.json" in text


class TestStatistics:
    def test_percentile_interpolates(self) -> None:
        """Percentiles interpolate linearly between order statistics."""
        values = [1.0, 2.0, 3.0, 4.0]
        assert percentile(values, 0) == 1.0
        assert percentile(values, 50) == 2.5
        assert percentile(values, 100) == 4.0
        with pytest.raises(ValueError, match="no values"):
            percentile([], 50)

    def test_pass_at_k_estimator(self) -> None:
        """pass@k is 1 - C(m-c, k)/C(m, k), and 1 when fewer than k samples fail."""
        assert pass_at_k(4, 1, 1) == 0.25
        assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))
        assert pass_at_k(4, 3, 2) == 1.0
        with pytest.raises(ValueError, match="k must be within"):
            pass_at_k(2, 1, 3)
