"""The public names of ``rollout_client.eval``."""

from __future__ import annotations

import rollout_client.eval


class TestPublicApi:
    def test_all_is_sorted_and_complete(self) -> None:
        """``__all__`` is sorted, every name exists, and the set is the documented one."""
        names = rollout_client.eval.__all__
        assert names == sorted(names)
        assert all(hasattr(rollout_client.eval, name) for name in names)
        assert set(names) == {
            "Dataset",
            "DatasetError",
            "DatasetRow",
            "EvalError",
            "EvalInputError",
            "EvalOptions",
            "EvalReport",
            "Journal",
            "JournalError",
            "JournalRecord",
            "ManifestMismatchError",
            "RowIssue",
            "RunControl",
            "RunStateError",
            "ServerUnavailableError",
            "classify_result",
            "format_summary",
            "load_dataset",
            "parse_row_selection",
            "read_journal",
            "run_eval",
            "summarize",
            "write_report",
        }
