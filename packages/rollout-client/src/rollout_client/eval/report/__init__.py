"""The HTML report of a run: ``rollout-eval report RUN`` and ``rollout-eval run --report``.

This subpackage owns the report, from reading a run directory to the written file: one
self-contained ``RUN_DIR/report.html`` that needs no network access to view (styles, the
charts as inline SVG and a few lines of script are in the file), showing the summary,
pass@k, the reward and latency distributions, the failures by category and the items, each
linked to its final conversation. Every piece of text from the run is escaped, and a
Content-Security-Policy admits no script but the report's own. Its modules, lowest first:
``_charts`` draws SVG charts from plain numbers (it imports nothing of the project);
``_data`` reads what the report shows from the run directory (bounded in size);
``_markup`` holds the shared escaping, formats, ids and outcome colours; ``_figures`` and
``_sections`` turn run data into charts and into text and tables; ``_page`` assembles and
writes the document. It may import the rest of ``rollout_client.eval`` (the journal,
manifest, summary, dataset selection, failure categories and errors) and
``rollout_client.__version__``; nothing in the rest of ``rollout_client.eval`` but the CLI
and the package's ``__init__`` imports it, and the client core never does.
"""

from __future__ import annotations

from ._page import REPORT_FILE, find_run_dir, render_report, write_report

__all__ = ["REPORT_FILE", "find_run_dir", "render_report", "write_report"]
