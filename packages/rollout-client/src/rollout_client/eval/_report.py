"""The HTML report of a run: ``rollout-eval report RUN`` and ``rollout-eval run --report``.

One self-contained file, ``RUN_DIR/report.html``: no network access is needed to view it
(styles, the charts as inline SVG and a few lines of script are in the file). It shows the
summary table, pass@k, the reward and latency distributions, the failures by category with
their messages, and a table of the items, each linked to its final conversation.

Every piece of text from the run (messages, error messages, URLs, names) is escaped, and a
Content-Security-Policy allows no script but the report's own, so a conversation holding
markup shows it as text. What is read and how the size is bounded: see
:mod:`._report_data`.

The module is longer than 500 lines because it is the page itself: its stylesheet and script
(about 120 lines) and one small function per section and chart, each writing markup the page
shows; nothing else uses them, and they share the escaping and formatting helpers at the top.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import html
import os
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from .. import __version__
from ._errors import EvalInputError
from ._failures import FAILED_OUTCOMES, clip_line
from ._journal import JournalRecord
from ._report_charts import (
    Bar,
    Series,
    bar_chart,
    equal_bins,
    format_number,
    histogram,
    share_bar,
)
from ._report_data import Conversation, Message, RunData, load_run

__all__ = ["REPORT_FILE", "find_run_dir", "render_report", "write_report"]

REPORT_FILE: Final = "report.html"
"""The report's file name in the run directory."""

_MISSING: Final = "\N{EN DASH}"
"""Shown for a value that does not exist (no scored items, no latency, ...)."""

_RUN_FILES: Final = ("manifest.json", "events.jsonl", "summary.json")

MAX_TABLE_MESSAGE_CHARS: Final = 160
"""Error messages in the items table are cut to this many characters (one line)."""

MAX_FAILURE_MESSAGE_CHARS: Final = 2000
"""Error messages in the failures section are cut to this many characters."""

MAX_MESSAGES_PER_CATEGORY: Final = 10
"""Distinct messages listed per error category in the failures section."""

MAX_LINKED_ITEMS: Final = 20
"""Items linked per message in the failures section."""

MAX_DISCRETE_REWARDS: Final = 10
"""Rewards with at most this many distinct values get one bar per value, not bins."""

OUTCOME_SERIES: Final = {
    "success": Series(name="success", color="#0b8a5f"),
    "failed": Series(name="failed", color="#d55e00"),
    "skipped": Series(name="skipped", color="#8c8c8c"),
    "infra_failure": Series(name="infra_failure", color="#9c4f96"),
    "cancelled": Series(name="cancelled", color="#56b4e9"),
    "not_started": Series(name="not_started", color="#d5d9de"),
}
"""Colours of the outcomes (from the Okabe-Ito palette, distinguishable with colour blindness)."""

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


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _num(value: float | None) -> str:
    return _MISSING if value is None else format_number(value)


def _fixed(value: float | None, unit: str = "") -> str:
    return _MISSING if value is None else f"{value:.3f}{unit}"


def _pct(value: float | None) -> str:
    return _MISSING if value is None else f"{value * 100:.1f}%"


def _items(count: int) -> str:
    return f"{count} item" if count == 1 else f"{count} items"


def _item_id(key: tuple[int, int]) -> str:
    return f"item-{key[0]}-{key[1]}"


def _row_id(key: tuple[int, int]) -> str:
    return f"row-{key[0]}-{key[1]}"


def _item_name(key: tuple[int, int], n: int) -> str:
    """``row 3``, or ``row 3 · run 1`` when rows run more than once."""
    return f"row {key[0]}" if n == 1 else f"row {key[0]} · run {key[1]}"


def _category_id(category: str) -> str:
    return "cat-" + re.sub(r"[^A-Za-z0-9_-]", "_", category)


def _badge(outcome: str) -> str:
    css = outcome if outcome in OUTCOME_SERIES else "not_started"
    return f'<span class="badge {css}">{_e(outcome)}</span>'


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


# -- sections --------------------------------------------------------------------------


def _cards(summary: Mapping[str, Any]) -> str:
    items = summary["items"]
    passing = summary["pass"]
    reward = summary["reward"]
    latency = summary["latency_sec"]
    cards = [
        ("items done", f"{items['done']}/{items['total']}", f"{items['pending']} pending"),
        (
            "pass rate",
            _pct(passing["rate"]),
            f"{passing['passed']}/{passing['scored']} with reward ≥ {passing['threshold']:g}",
        ),
        ("mean reward", _fixed(reward["mean"]), f"median {_fixed(reward['median'])}"),
    ]
    pass_at_k = summary.get("pass_at_k") or {}
    if pass_at_k:
        k, entry = list(pass_at_k.items())[-1]
        cards.append((f"pass@{k}", _fixed(entry["value"]), f"over {entry['rows']} rows"))
    cards.append(
        ("latency p50", _fixed(latency["p50"], " s"), f"p95 {_fixed(latency['p95'], ' s')}"),
    )
    return (
        '<div class="cards">'
        + "".join(
            f'<div class="card"><div class="label">{_e(label)}</div>'
            f'<div class="value">{_e(value)}</div><div class="sub">{_e(sub)}</div></div>'
            for label, value, sub in cards
        )
        + "</div>"
    )


def _outcome_share(summary: Mapping[str, Any]) -> str:
    parts = [
        (OUTCOME_SERIES[name], count)
        for name, count in summary["by_outcome"].items()
        if name in OUTCOME_SERIES
    ]
    legend = "".join(
        f'<li><span class="swatch" style="background:{series.color}"></span>'
        f"{_e(series.name)} {count}</li>"
        for series, count in parts
    )
    chart = share_bar(chart_id="chart-outcomes", title="Items by outcome", parts=parts)
    return f'<div class="panel">{chart}<ul class="legend">{legend}</ul></div>'


_NUM: Final = ' class="num"'


def _table(caption: str, headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A table whose cells are already-escaped HTML; numeric columns are marked ``num``."""
    head = "".join(
        f'<th scope="col"{_NUM if index else ""}>{_e(name)}</th>'
        for index, name in enumerate(headers)
    )
    body = "".join(
        "<tr>"
        + "".join(
            f'<th scope="row">{cell}</th>' if index == 0 else f'<td class="num">{cell}</td>'
            for index, cell in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return (
        f"<table><caption>{_e(caption)}</caption><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table>"
    )


def _summary_tables(summary: Mapping[str, Any]) -> str:
    total = summary["items"]["total"]
    outcomes = _table(
        "Outcomes",
        ["outcome", "items", "share"],
        (
            (_badge(name), str(count), _pct(count / total) if total else _MISSING)
            for name, count in summary["by_outcome"].items()
        ),
    )
    statuses = _table(
        "Server status and error category",
        ["status / category", "items"],
        [
            *((_e(f"status {name}"), str(count)) for name, count in summary["by_status"].items()),
            *(
                (f'<a href="#{_category_id(name)}">{_e(name)}</a>', str(count))
                for name, count in summary["by_err_category"].items()
            ),
        ]
        or [("<span class=muted>none</span>", "")],
    )
    reward = summary["reward"]
    passing = summary["pass"]
    latency = summary["latency_sec"]
    infra = summary["infra_failures"]
    metrics: list[tuple[str, str]] = [
        ("reward mean (failed = 0)", _fixed(reward["mean"])),
        ("reward median", _fixed(reward["median"])),
        ("reward min / max", f"{_fixed(reward['min'])} / {_fixed(reward['max'])}"),
        ("mean reward of successes", _fixed(reward["mean_of_successes"])),
        ("scored items", str(reward["count"])),
        (f"pass rate (reward ≥ {passing['threshold']:g})", _pct(passing["rate"])),
    ]
    for k, entry in (summary.get("pass_at_k") or {}).items():
        metrics.append((f"pass@{k}", f"{_fixed(entry['value'])} ({entry['rows']} rows)"))
    metrics += [
        (
            "latency p50 / p95 / p99 (s)",
            " / ".join(_fixed(latency[q]) for q in ("p50", "p95", "p99")),
        ),
        ("latency mean / max (s)", f"{_fixed(latency['mean'])} / {_fixed(latency['max'])}"),
        (
            "infrastructure failures",
            f"{infra['pending_items']} items pending, {infra['attempts']} attempts",
        ),
    ]
    figures = _table(
        "Rewards, pass rate and latency",
        ["metric", "value"],
        ((_e(name), _e(value)) for name, value in metrics),
    )
    return f'<div class="tables">{outcomes}{statuses}{figures}</div>'


def _run_details(data: RunData) -> str:
    run = data.summary.get("run") or {}
    manifest = data.manifest
    models = run.get("chat_models") or manifest.chat_models
    fields: list[tuple[str, Any]] = [
        ("run directory", data.run_dir),
        ("dataset", run.get("dataset") or manifest.dataset_path),
        ("dataset sha256", manifest.inputs.dataset_sha256),
        ("rows", manifest.inputs.rows or "none"),
        ("runs per row (n)", manifest.inputs.n),
        ("rollout server", run.get("server_url") or manifest.server_url),
        ("chat URL", run.get("chat_url") or manifest.chat_url),
        ("models at the chat URL", ", ".join(map(str, models)) if models else "not reported"),
        (
            "agent / grader timeout",
            " / ".join(
                "server default" if value is None else f"{value:g} s"
                for value in (manifest.inputs.agent_timeout_sec, manifest.inputs.grader_timeout_sec)
            ),
        ),
        ("concurrency", run.get("concurrency", _MISSING)),
        ("started", manifest.created_at),
        ("rollout-eval", manifest.tool_version),
    ]
    if run.get("stopped"):
        fields.append(("stopped early", run["stopped"]))
    rows = "".join(f"<dt>{_e(name)}</dt><dd>{_e(value)}</dd>" for name, value in fields)
    return f'<div class="panel"><h3>Run</h3><dl class="run">{rows}</dl></div>'


def _reward_chart(data: RunData) -> str:
    series = [OUTCOME_SERIES["success"], OUTCOME_SERIES["failed"]]
    scored = [
        ((record.reward or 0.0) if record.outcome == "success" else 0.0, record.outcome)
        for record in data.final_records
        if record.outcome in ("success", "failed")
    ]
    if not scored:
        return '<p class="empty-chart">No scored items yet.</p>'
    title = "Reward distribution"
    distinct = sorted({round(value, 6) for value, _ in scored})
    description = f"{len(scored)} scored items (failed count as 0): " + ", ".join(
        f"{name} {sum(1 for _, o in scored if o == name)}" for name in ("success", "failed")
    )
    if len(distinct) <= MAX_DISCRETE_REWARDS:
        bars = []
        for value in distinct:
            counts = tuple(
                float(sum(1 for v, o in scored if round(v, 6) == value and o == s.name))
                for s in series
            )
            bars.append(
                Bar(
                    label=format_number(value),
                    values=counts,
                    tooltip=f"reward {format_number(value)}: {int(sum(counts))} items "
                    f"(success {int(counts[0])}, failed {int(counts[1])})",
                )
            )
        description += "; " + ", ".join(
            f"reward {bar.label}: {int(sum(bar.values))}" for bar in bars
        )
        return bar_chart(
            chart_id="chart-reward",
            title=title,
            description=description,
            bars=bars,
            series=series,
            x_label="reward",
        )
    bins = equal_bins([value for value, _ in scored])
    return histogram(
        chart_id="chart-reward",
        title=title,
        description=description,
        bins=bins,
        counts=_bin_counts(bins, scored, series),
        series=series,
        x_label="reward",
    )


def _bin_counts(
    bins: Sequence[tuple[float, float]],
    values: Sequence[tuple[float, str]],
    series: Sequence[Series],
) -> list[tuple[float, ...]]:
    counts: list[Counter[str]] = [Counter() for _ in bins]
    low, high = bins[0][0], bins[-1][1]
    width = (high - low) / len(bins)
    for value, name in values:
        index = min(int((value - low) / width), len(bins) - 1) if width else 0
        counts[index][name] += 1
    return [tuple(float(counter[s.name]) for s in series) for counter in counts]


def _latency_chart(data: RunData) -> str:
    names = ("success", "failed", "skipped")
    series = [OUTCOME_SERIES[name] for name in names]
    values = [
        (record.latency_sec, record.outcome)
        for record in data.final_records
        if record.outcome in names and record.latency_sec is not None
    ]
    if not values:
        return '<p class="empty-chart">No latencies recorded yet.</p>'
    latency = data.summary["latency_sec"]
    bins = equal_bins([value for value, _ in values])
    markers = [(q, latency[q]) for q in ("p50", "p95", "p99") if latency[q] is not None]
    return histogram(
        chart_id="chart-latency",
        title="Latency distribution (admission to result)",
        description=f"{len(values)} items from {format_number(bins[0][0])} s to "
        f"{format_number(bins[-1][1])} s; "
        + ", ".join(f"{q} {format_number(value)} s" for q, value in markers),
        bins=bins,
        counts=_bin_counts(bins, values, series),
        series=series,
        x_label="seconds",
        unit=" s",
        markers=markers,
    )


def _pass_at_k_chart(summary: Mapping[str, Any]) -> str:
    pass_at_k = summary.get("pass_at_k")
    if not pass_at_k:
        return (
            '<p class="empty-chart">pass@k needs several runs per row (rollout-eval run --n K); '
            f"this run has one: pass@1 is the pass rate, {_e(_pct(summary['pass']['rate']))}.</p>"
        )
    bars = [
        Bar(
            label=f"pass@{k}",
            values=(entry["value"] or 0.0,),
            tooltip=f"pass@{k}: {_fixed(entry['value'])} over {entry['rows']} rows",
        )
        for k, entry in pass_at_k.items()
    ]
    return bar_chart(
        chart_id="chart-pass-at-k",
        title="pass@k",
        description="; ".join(bar.tooltip for bar in bars),
        bars=bars,
        series=[Series(name="pass@k", color="#1f5fbf")],
        x_label="k (samples per row)",
        y_label="estimated pass@k",
        y_max=1.0,
        y_format=lambda value: f"{value:.0%}",
    )


def _charts(data: RunData) -> str:
    figures = [
        ("Reward distribution", _reward_chart(data), "Scored items; a failed rollout counts as 0."),
        (
            "Latency distribution",
            _latency_chart(data),
            "Seconds from admission to result, for scored and skipped items; dashed lines are "
            "p50, p95 and p99.",
        ),
        ("pass@k", _pass_at_k_chart(data.summary), "Unbiased estimator, averaged over rows."),
    ]
    return (
        '<div class="grid">'
        + "".join(
            f'<figure class="panel"><h3>{_e(title)}</h3>{chart}'
            f"<figcaption>{_e(caption)}</figcaption></figure>"
            for title, chart, caption in figures
        )
        + "</div>"
    )


def _failures(data: RunData, listed: set[tuple[int, int]]) -> str:
    n = data.manifest.inputs.n
    groups: defaultdict[str, defaultdict[str, list[JournalRecord]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for record in data.final_records:
        if record.outcome in FAILED_OUTCOMES:
            category = record.err_category or "(no category)"
            message = (record.err_message or "(no message)").strip()
            if len(message) > MAX_FAILURE_MESSAGE_CHARS:
                message = message[:MAX_FAILURE_MESSAGE_CHARS] + " …"
            groups[category][message].append(record)
    if not groups:
        return '<p class="muted">No failures.</p>'
    ordered = sorted(groups.items(), key=lambda kv: (-sum(map(len, kv[1].values())), kv[0]))
    blocks = []
    for category, messages in ordered:
        count = sum(len(records) for records in messages.values())
        outcomes = Counter(r.outcome for records in messages.values() for r in records)
        kinds = ", ".join(f"{outcome} {n}" for outcome, n in outcomes.most_common())
        entries = []
        by_size = sorted(messages.items(), key=lambda kv: -len(kv[1]))
        for message, records in by_size[:MAX_MESSAGES_PER_CATEGORY]:
            links = [
                f'<a href="#{_item_id(r.item)}">{_e(_item_name(r.item, n))}</a>'
                for r in records
                if r.item in listed
            ][:MAX_LINKED_ITEMS]
            more = len(records) - len(links)
            entries.append(
                f'<tr><td class="num">{len(records)}</td><td><div class="msg-text">'
                f'{_e(message)}</div><div class="items-links">'
                + "".join(links)
                + (f'<span class="muted">+{more} more</span>' if more > 0 else "")
                + "</div></td></tr>"
            )
        rest = by_size[MAX_MESSAGES_PER_CATEGORY:]
        if rest:
            entries.append(
                f'<tr><td class="num">{sum(len(r) for _, r in rest)}</td><td class="muted">'
                f"{len(rest)} other messages (events.jsonl has them)</td></tr>"
            )
        blocks.append(
            f'<div class="category panel" id="{_category_id(category)}"><h3>{_e(category)} '
            f'<span class="muted">— {_items(count)} ({_e(kinds)})</span></h3>'
            '<table class="messages"><thead><tr><th scope="col" class="num">items</th>'
            '<th scope="col">message, and the items that ended with it</th></tr></thead>'
            f"<tbody>{''.join(entries)}</tbody></table></div>"
        )
    return "".join(blocks)


def _items_table(data: RunData) -> str:
    if not data.items:
        return '<p class="muted">This run has no items.</p>'
    threshold = data.summary["pass"]["threshold"]
    n = data.manifest.inputs.n
    present = Counter(item.record.outcome if item.record else "not_started" for item in data.items)
    options = ['<option value="all">all items</option>']
    if present["failed"] or present["infra_failure"]:
        options.append('<option value="failures">failures</option>')
    options += [
        f'<option value="{_e(name)}">{_e(name)} ({present[name]})</option>'
        for name in OUTCOME_SERIES
        if present[name]
    ]
    rows = []
    for item in data.items:
        record = item.record
        outcome = record.outcome if record else "not_started"
        link = (
            f'<a href="#{_item_id(item.key)}">{_e(_item_name(item.key, n))}</a>'
            if record
            else _e(_item_name(item.key, n))
        )
        if record is None:
            cells = [_MISSING] * 6
        else:
            passed = record.outcome == "success" and (record.reward or 0.0) >= threshold
            message = record.err_message or ""
            reward = (
                '<span class="muted" title="a failed rollout scores 0">0</span>'
                if record.outcome == "failed"
                else _num(record.reward)
            )
            cells = [
                _e(record.status or "no result"),
                reward,
                "pass" if passed else "no" if record.outcome in ("success", "failed") else _MISSING,
                _fixed(record.latency_sec),
                _e(record.err_category or ""),
                f'<span title="{_e(message[:MAX_FAILURE_MESSAGE_CHARS])}">'
                f"{_e(clip_line(message, MAX_TABLE_MESSAGE_CHARS))}</span>",
            ]
        conversation = (
            f'<a href="#{_item_id(item.key)}">{item.conversation.length} messages</a>'
            if item.conversation
            else '<span class="muted">none</span>'
        )
        failure = " data-failure" if outcome in FAILED_OUTCOMES else ""
        rows.append(
            f'<tr id="{_row_id(item.key)}" data-outcome="{_e(outcome)}"{failure}>'
            f'<th scope="row">{link}</th><td>{_badge(outcome)}</td><td>{cells[0]}</td>'
            f'<td class="num">{cells[1]}</td><td>{cells[2]}</td><td class="num">{cells[3]}</td>'
            f'<td>{cells[4]}</td><td class="msg">{cells[5]}</td><td>{conversation}</td></tr>'
        )
    headers = "".join(
        f'<th scope="col"{cls}>{name}</th>'
        for name, cls in (
            ("item", ""),
            ("outcome", ""),
            ("server status", ""),
            ("reward", ' class="num"'),
            ("pass", ""),
            ("latency (s)", ' class="num"'),
            ("error category", ""),
            ("error message", ""),
            ("conversation", ""),
        )
    )
    return (
        '<div class="filter"><label for="outcome-filter">Show </label>'
        f'<select id="outcome-filter">{"".join(options)}</select></div>'
        '<table id="items-table"><caption>Each item\'s final outcome; the item links to its '
        "final conversation</caption>"
        f"<thead><tr>{headers}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _message_html(message: Message) -> str:
    role = message.role if message.role.replace("_", "").isalpha() else "other"
    who = message.role + (f" · {message.label}" if message.label else "")
    parts = [f'<div class="message role-{_e(role.lower())}"><div class="who">{_e(who)}</div>']
    if message.text:
        parts.append(f"<pre>{_e(message.text)}</pre>")
    if message.calls:
        parts.append(f'<pre class="calls">{_e(message.calls)}</pre>')
    if message.cut:
        parts.append(f'<p class="omitted">{message.cut} more characters not shown</p>')
    parts.append("</div>")
    return "".join(parts)


def _conversation_html(conversation: Conversation) -> str:
    parts = [_message_html(message) for message in conversation.head]
    if conversation.omitted:
        parts.append(
            f'<p class="omitted">{conversation.omitted} messages not shown here: line '
            f"{conversation.line} of samples.jsonl has them</p>"
        )
    parts += [_message_html(message) for message in conversation.tail]
    if conversation.metrics:
        metrics = ", ".join(
            f"{name} {value}" for name, value in sorted(conversation.metrics.items())
        )
        parts.append(f'<p class="muted">metrics: {_e(metrics)}</p>')
    return "".join(parts)


def _conversations(data: RunData) -> str:
    n = data.manifest.inputs.n
    blocks = []
    for item in data.items:
        record = item.record
        if record is None:
            continue
        facts = [f"rollout {record.rollout_id}"]
        if record.reward is not None:
            facts.insert(0, f"reward {format_number(record.reward)}")
        if record.latency_sec is not None:
            facts.insert(1 if record.reward is not None else 0, _fixed(record.latency_sec, " s"))
        body = []
        if record.err_category or record.err_message:
            body.append(
                f'<div class="note">{_e(record.err_category or "error")}: '
                f"{_e(record.err_message or '(no message)')}</div>"
            )
        if item.conversation is None:
            body.append('<p class="muted">No conversation was recorded for this rollout.</p>')
        else:
            body.append(_conversation_html(item.conversation))
        body.append(f'<p><a href="#{_row_id(item.key)}">back to the items table</a></p>')
        blocks.append(
            f'<details class="conversation" id="{_item_id(item.key)}"><summary>'
            f"{_badge(record.outcome)} <strong>{_e(_item_name(item.key, n))}</strong> "
            f'<span class="muted">{_e(" · ".join(facts))}</span></summary>'
            f'<div class="conversation-body">{"".join(body)}</div></details>'
        )
    return "".join(blocks) or '<p class="muted">No rollout has finished yet.</p>'


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
        f'<h2 id="h-{section_id}">{_e(title)}</h2>\n{body}\n</section>\n'
    )


def render_report(data: RunData) -> str:
    """The report of a run, as one HTML document (see the module docstring)."""
    summary = data.summary
    run = summary.get("run") or {}
    name = _e(run.get("name") or data.run_dir.name)
    items = summary["items"]
    state = (
        '<span class="state">complete</span>'
        if summary["complete"]
        else f'<span class="state pending">{items["pending"]} pending</span>'
    )
    generated = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    dataset = run.get("dataset") or data.manifest.dataset_path
    bodies = {
        "overview": _cards(summary) + _outcome_share(summary),
        "summary": _summary_tables(summary) + _run_details(data),
        "charts": _charts(data),
        "failures": _failures(data, {item.key for item in data.items}),
        "items": _items_table(data),
        "conversations": _conversations(data),
    }
    nav = "".join(f'<a href="#{key}">{_e(link)}</a>' for key, _, link in _SECTIONS)
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
        f"<p>{_e(_items(items['total']))} · {_e(dataset)} · generated {_e(generated)}</p>"
        "</header>\n"
        f'<nav aria-label="Sections">{nav}</nav>\n<main>\n'
        + "".join(f'<p class="note">{_e(note)}</p>\n' for note in data.notes)
        + "".join(_section(key, title, bodies[key]) for key, title, _ in _SECTIONS)
        + f"</main>\n<footer>rollout-eval {_e(__version__)} · from {_e(data.run_dir)}: "
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
