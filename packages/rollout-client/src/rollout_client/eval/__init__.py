"""``rollout-eval``: evaluate a dataset through a rollout server with ``RolloutClient``.

The command is ``rollout-eval`` (or ``python -m rollout_client.eval``); :func:`run_eval` is
the same job as a coroutine for programs that drive it themselves.
"""

from __future__ import annotations

from ._control import RunControl
from ._dataset import Dataset, DatasetRow, load_dataset, parse_row_selection
from ._errors import (
    DatasetError,
    EvalError,
    EvalInputError,
    JournalError,
    ManifestMismatchError,
    RowIssue,
    RunStateError,
    ServerUnavailableError,
)
from ._journal import Journal, JournalRecord, read_journal
from ._options import EvalOptions
from ._outcomes import classify_result
from ._runner import EvalReport, run_eval
from ._summary import format_summary, summarize
from .report import write_report

__all__ = [
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
]
