"""The report as one HTML document: its head (stylesheet, the script and the
Content-Security-Policy that admits only that script), the navigation, the sections in
order, and the footer; writing it into the run directory, and finding that directory."""

from __future__ import annotations

import base64
import datetime
import hashlib
import os
from pathlib import Path
from typing import Final

from ... import __version__
from .._errors import EvalInputError
from ._data import RunData, load_run
from ._figures import charts, outcome_share
from ._markup import count_items, esc
from ._sections import cards, conversations, failures, items_table, run_details, summary_tables

__all__ = ["REPORT_FILE", "find_run_dir", "render_report", "write_report"]

REPORT_FILE: Final = "report.html"
"""The report's file name in the run directory."""

_RUN_FILES: Final = ("manifest.json", "events.jsonl", "summary.json")

_SCRIPT: Final = """
(function () {
  function openTarget() {
    var id = decodeURIComponent(location.hash.slice(1));
    var target = id && document.getElementById(id);
    if (target && target.tagName === "DETAILS") { target.open = true; }
  }
  window.addEventListener("hashchange", openTarget);
  openTarget();
  var filter = document.getElementById("outcome-filter");
  if (filter) {
    filter.addEventListener("change", function () {
      var rows = document.querySelectorAll("#items-table tbody tr");
      for (var i = 0; i < rows.length; i++) {
        var outcome = rows[i].getAttribute("data-outcome");
        rows[i].hidden = !(filter.value === "all" || filter.value === outcome ||
          (filter.value === "failures" && rows[i].hasAttribute("data-failure")));
      }
    });
  }
})();
"""
_SCRIPT_HASH: Final = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()

_STYLE: Final = """
:root { color-scheme: light; --ink: #1d2433; --muted: #5b6474; --line: #e2e6ec;
  --panel: #ffffff; --page: #f5f7fa; --accent: #1f5fbf; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--page); color: var(--ink);
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
header { background: #1d2433; color: #fff; padding: 20px 32px 16px; }
header h1 { margin: 0 0 4px; font-size: 22px; font-weight: 600; }
header p { margin: 0; color: #c7cfdb; }
header .state { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px;
  margin-left: 8px; vertical-align: 2px; background: #0b8a5f; color: #fff; }
header .state.pending { background: #b8860b; }
nav { background: #fff; border-bottom: 1px solid var(--line); padding: 8px 32px;
  position: sticky; top: 0; z-index: 1; }
nav a { margin-right: 18px; color: var(--accent); text-decoration: none; font-weight: 500; }
main { padding: 8px 32px 32px; max-width: 1280px; }
section { margin-top: 24px; }
h2 { font-size: 18px; margin: 0 0 10px; font-weight: 600; }
h3 { font-size: 15px; margin: 0 0 8px; font-weight: 600; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin-bottom: 14px; }
.card { background: var(--panel); border: 1px solid var(--line); border-radius: 8px;
  padding: 10px 16px; min-width: 150px; }
.card .value { font-size: 24px; font-weight: 600; }
.card .label { color: var(--muted); font-size: 12px; text-transform: uppercase;
  letter-spacing: .04em; }
.card .sub { color: var(--muted); font-size: 12px; }
.panel { background: var(--panel); border: 1px solid var(--line); border-radius: 8px;
  padding: 14px 16px; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(420px, 1fr)); gap: 14px; }
svg.share { width: 100%; height: 22px; display: block; border-radius: 4px; }
svg.share .empty { fill: #eef0f3; }
.legend { list-style: none; padding: 0; margin: 8px 0 0; display: flex; flex-wrap: wrap;
  gap: 14px; color: var(--muted); font-size: 13px; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px;
  margin-right: 5px; }
figure { margin: 0; }
figcaption { color: var(--muted); font-size: 12px; margin-top: 4px; }
svg.chart { width: 100%; height: auto; max-width: 640px; display: block; }
svg.chart text { font: 11px system-ui, "DejaVu Sans", sans-serif; fill: var(--muted); }
svg.chart .axis-label { fill: var(--ink); font-size: 12px; }
svg.chart .grid { stroke: #edf0f4; }
svg.chart .axis { stroke: #9aa3af; }
svg.chart .marker line { stroke: #1d2433; stroke-dasharray: 4 3; }
svg.chart .marker text { fill: #1d2433; font-size: 11px; }
.empty-chart { color: var(--muted); padding: 40px 0; text-align: center; }
table { border-collapse: collapse; width: 100%; background: var(--panel); }
caption { text-align: left; font-weight: 600; padding: 0 0 6px; }
th, td { text-align: left; padding: 5px 10px; border-bottom: 1px solid var(--line);
  vertical-align: top; }
thead th { font-weight: 600; color: var(--muted); font-size: 12px; background: #fafbfc; }
tbody th { font-weight: 500; }
.tables tbody th { white-space: nowrap; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.tables { display: grid; grid-template-columns: repeat(auto-fit, minmax(320px, 1fr));
  gap: 14px; align-items: start; }
.tables table { border: 1px solid var(--line); border-radius: 8px; }
.tables + .panel { margin-top: 14px; }
dl.run { display: grid; grid-template-columns: max-content 1fr; gap: 3px 14px; margin: 0; }
dl.run dt { color: var(--muted); }
dl.run dd { margin: 0; overflow-wrap: anywhere; }
.badge { display: inline-block; padding: 0 7px; border-radius: 9px; font-size: 12px;
  color: #fff; white-space: nowrap; }
.badge.success { background: #0b8a5f; } .badge.failed { background: #d55e00; }
.badge.skipped { background: #8c8c8c; } .badge.infra_failure { background: #9c4f96; }
.badge.cancelled { background: #56b4e9; color: var(--ink); }
.badge.not_started { background: #d5d9de; color: var(--ink); }
.category { margin-bottom: 14px; }
table.messages td.num { width: 4em; font-weight: 600; }
.category .msg-text { white-space: pre-wrap; overflow-wrap: anywhere;
  font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px;
  background: #f7f8fa; border: 1px solid var(--line); border-radius: 4px; padding: 4px 8px;
  margin: 2px 0; }
.items-links a { margin-right: 8px; white-space: nowrap; }
.muted { color: var(--muted); }
.note { color: #7a5b00; background: #fff8e1; border: 1px solid #f3e0a0; border-radius: 6px;
  padding: 6px 10px; margin: 8px 0; }
#items-table td.msg { max-width: 420px; overflow-wrap: anywhere; color: var(--muted); }
#items-table tr:target { background: #fff6d6; }
.filter { margin-bottom: 8px; }
details.conversation { background: var(--panel); border: 1px solid var(--line);
  border-radius: 8px; margin-bottom: 8px; }
details.conversation > summary { cursor: pointer; padding: 8px 12px; }
details.conversation[open] > summary { border-bottom: 1px solid var(--line); }
details.conversation:target { outline: 2px solid var(--accent); }
.conversation-body { padding: 10px 14px; }
.message { border-left: 3px solid #c9d1dc; padding: 2px 10px; margin: 8px 0; }
.message .who { font-size: 12px; font-weight: 600; color: var(--muted); }
.message.role-user { border-color: #1f5fbf; } .message.role-assistant { border-color: #0b8a5f; }
.message.role-tool { border-color: #b8860b; } .message.role-system { border-color: #5b6474; }
.message pre { margin: 2px 0; white-space: pre-wrap; overflow-wrap: anywhere;
  max-height: 30em; overflow-y: auto;
  font: 12.5px/1.45 ui-monospace, "DejaVu Sans Mono", monospace; }
.message pre.calls { color: #6b4e00; }
.omitted { color: var(--muted); font-style: italic; margin: 8px 0; }
footer { color: var(--muted); font-size: 12px; padding: 0 32px 24px; }
"""


def find_run_dir(run: str, output: Path) -> Path:
    """The run directory ``run`` names: a path to one, or a run name in ``output``.

    A run directory holds ``manifest.json``, ``events.jsonl`` or ``summary.json``.

    Raises:
        EvalInputError: If neither ``run`` nor ``output/run`` is a run directory.
    """
    candidates = list(dict.fromkeys([Path(run), output / run]))
    for candidate in candidates:
        if any((candidate / name).is_file() for name in _RUN_FILES):
            return candidate
    raise EvalInputError(
        f"no run {run!r}: {' nor '.join(map(str, candidates))} holds the files of a run "
        f"({', '.join(_RUN_FILES)}); name a run directory (OUTPUT/NAME), or a run name with "
        "--output OUTPUT"
    )


_SECTIONS: Final = (
    ("overview", "Overview", "Overview"),
    ("summary", "Summary", "Summary"),
    ("charts", "Charts", "Charts"),
    ("failures", "Failures by category", "Failures"),
    ("items", "Items", "Items"),
    ("conversations", "Final conversations", "Conversations"),
)
"""Each section's id, heading and link text in the navigation bar."""


def _section(section_id: str, title: str, body: str) -> str:
    return (
        f'<section id="{section_id}" aria-labelledby="h-{section_id}">'
        f'<h2 id="h-{section_id}">{esc(title)}</h2>\n{body}\n</section>\n'
    )


def render_report(data: RunData) -> str:
    """The report of a run, as one HTML document (see :mod:`rollout_client.eval.report`)."""
    summary = data.summary
    run = summary.get("run") or {}
    name = esc(run.get("name") or data.run_dir.name)
    items = summary["items"]
    state = (
        '<span class="state">complete</span>'
        if summary["complete"]
        else f'<span class="state pending">{items["pending"]} pending</span>'
    )
    generated = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    dataset = run.get("dataset") or data.manifest.dataset_path
    bodies = {
        "overview": cards(summary) + outcome_share(summary),
        "summary": summary_tables(summary) + run_details(data),
        "charts": charts(data),
        "failures": failures(data, {item.key for item in data.items}),
        "items": items_table(data),
        "conversations": conversations(data),
    }
    nav = "".join(f'<a href="#{key}">{esc(link)}</a>' for key, _, link in _SECTIONS)
    csp = (
        "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
        f"script-src 'sha256-{_SCRIPT_HASH}'"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
        f"<title>rollout-eval report: {name}</title>\n"
        '<link rel="icon" href="data:,">\n'
        f"<style>{_STYLE}</style>\n</head>\n<body>\n"
        f"<header><h1>rollout-eval report: {name}{state}</h1>\n"
        f"<p>{esc(count_items(items['total']))} · {esc(dataset)} · generated {esc(generated)}</p>"
        "</header>\n"
        f'<nav aria-label="Sections">{nav}</nav>\n<main>\n'
        + "".join(f'<p class="note">{esc(note)}</p>\n' for note in data.notes)
        + "".join(_section(key, title, bodies[key]) for key, title, _ in _SECTIONS)
        + f"</main>\n<footer>rollout-eval {esc(__version__)} · from {esc(data.run_dir)}: "
        "manifest.json, events.jsonl, samples.jsonl, summary.json</footer>\n"
        f"<script>{_SCRIPT}</script>\n</body>\n</html>\n"
    )


def write_report(run_dir: Path, path: Path | None = None) -> Path:
    """Write the HTML report of the run in ``run_dir``.

    Args:
        run_dir: The run directory (``OUTPUT/NAME``).
        path: Where to write it (default ``run_dir/report.html``).

    Returns:
        The path written (atomically: a temporary file, then a rename).

    Raises:
        EvalInputError: If ``run_dir`` is not a run directory.
        JournalError: If its journal is corrupt.

    .. versionadded:: 0.2.0
    """
    target = path or run_dir / REPORT_FILE
    text = render_report(load_run(run_dir))
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, target)
    return target
