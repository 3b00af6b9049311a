"""The report's sections of text and tables: the overview cards, the summary tables, the
run's details, the failures by category, the items table and the final conversations."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import Any, Final

from .._failures import FAILED_OUTCOMES, clip_line
from .._journal import JournalRecord
from ._charts import format_number
from ._data import Conversation, Message, RunData
from ._markup import (
    MISSING,
    OUTCOME_SERIES,
    badge,
    category_id,
    count_items,
    esc,
    fixed,
    item_id,
    item_name,
    number,
    percent,
    row_id,
    table,
)

__all__ = [
    "MAX_FAILURE_MESSAGE_CHARS",
    "MAX_LINKED_ITEMS",
    "MAX_MESSAGES_PER_CATEGORY",
    "MAX_TABLE_MESSAGE_CHARS",
    "cards",
    "conversations",
    "failures",
    "items_table",
    "run_details",
    "summary_tables",
]

MAX_TABLE_MESSAGE_CHARS: Final = 160
"""Error messages in the items table are cut to this many characters (one line)."""

MAX_FAILURE_MESSAGE_CHARS: Final = 2000
"""Error messages in the failures section are cut to this many characters."""

MAX_MESSAGES_PER_CATEGORY: Final = 10
"""Distinct messages listed per error category in the failures section."""

MAX_LINKED_ITEMS: Final = 20
"""Items linked per message in the failures section."""


def cards(summary: Mapping[str, Any]) -> str:
    items = summary["items"]
    passing = summary["pass"]
    reward = summary["reward"]
    latency = summary["latency_sec"]
    cards = [
        ("items done", f"{items['done']}/{items['total']}", f"{items['pending']} pending"),
        (
            "pass rate",
            percent(passing["rate"]),
            f"{passing['passed']}/{passing['scored']} with reward ≥ {passing['threshold']:g}",
        ),
        ("mean reward", fixed(reward["mean"]), f"median {fixed(reward['median'])}"),
    ]
    pass_at_k = summary.get("pass_at_k") or {}
    if pass_at_k:
        k, entry = list(pass_at_k.items())[-1]
        cards.append((f"pass@{k}", fixed(entry["value"]), f"over {entry['rows']} rows"))
    cards.append(
        ("latency p50", fixed(latency["p50"], " s"), f"p95 {fixed(latency['p95'], ' s')}"),
    )
    return (
        '<div class="cards">'
        + "".join(
            f'<div class="card"><div class="label">{esc(label)}</div>'
            f'<div class="value">{esc(value)}</div><div class="sub">{esc(sub)}</div></div>'
            for label, value, sub in cards
        )
        + "</div>"
    )


def summary_tables(summary: Mapping[str, Any]) -> str:
    total = summary["items"]["total"]
    outcomes = table(
        "Outcomes",
        ["outcome", "items", "share"],
        (
            (badge(name), str(count), percent(count / total) if total else MISSING)
            for name, count in summary["by_outcome"].items()
        ),
    )
    statuses = table(
        "Server status and error category",
        ["status / category", "items"],
        [
            *((esc(f"status {name}"), str(count)) for name, count in summary["by_status"].items()),
            *(
                (f'<a href="#{category_id(name)}">{esc(name)}</a>', str(count))
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
        ("reward mean (failed = 0)", fixed(reward["mean"])),
        ("reward median", fixed(reward["median"])),
        ("reward min / max", f"{fixed(reward['min'])} / {fixed(reward['max'])}"),
        ("mean reward of successes", fixed(reward["mean_of_successes"])),
        ("scored items", str(reward["count"])),
        (f"pass rate (reward ≥ {passing['threshold']:g})", percent(passing["rate"])),
    ]
    for k, entry in (summary.get("pass_at_k") or {}).items():
        metrics.append((f"pass@{k}", f"{fixed(entry['value'])} ({entry['rows']} rows)"))
    metrics += [
        (
            "latency p50 / p95 / p99 (s)",
            " / ".join(fixed(latency[q]) for q in ("p50", "p95", "p99")),
        ),
        ("latency mean / max (s)", f"{fixed(latency['mean'])} / {fixed(latency['max'])}"),
        (
            "infrastructure failures",
            f"{infra['pending_items']} items pending, {infra['attempts']} attempts",
        ),
    ]
    figures = table(
        "Rewards, pass rate and latency",
        ["metric", "value"],
        ((esc(name), esc(value)) for name, value in metrics),
    )
    return f'<div class="tables">{outcomes}{statuses}{figures}</div>'


def run_details(data: RunData) -> str:
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
        ("concurrency", run.get("concurrency", MISSING)),
        ("started", manifest.created_at),
        ("rollout-eval", manifest.tool_version),
    ]
    if run.get("stopped"):
        fields.append(("stopped early", run["stopped"]))
    rows = "".join(f"<dt>{esc(name)}</dt><dd>{esc(value)}</dd>" for name, value in fields)
    return f'<div class="panel"><h3>Run</h3><dl class="run">{rows}</dl></div>'


def failures(data: RunData, listed: set[tuple[int, int]]) -> str:
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
                f'<a href="#{item_id(r.item)}">{esc(item_name(r.item, n))}</a>'
                for r in records
                if r.item in listed
            ][:MAX_LINKED_ITEMS]
            more = len(records) - len(links)
            entries.append(
                f'<tr><td class="num">{len(records)}</td><td><div class="msg-text">'
                f'{esc(message)}</div><div class="items-links">'
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
            f'<div class="category panel" id="{category_id(category)}"><h3>{esc(category)} '
            f'<span class="muted">— {count_items(count)} ({esc(kinds)})</span></h3>'
            '<table class="messages"><thead><tr><th scope="col" class="num">items</th>'
            '<th scope="col">message, and the items that ended with it</th></tr></thead>'
            f"<tbody>{''.join(entries)}</tbody></table></div>"
        )
    return "".join(blocks)


def items_table(data: RunData) -> str:
    if not data.items:
        return '<p class="muted">This run has no items.</p>'
    threshold = data.summary["pass"]["threshold"]
    n = data.manifest.inputs.n
    present = Counter(item.record.outcome if item.record else "not_started" for item in data.items)
    options = ['<option value="all">all items</option>']
    if present["failed"] or present["infra_failure"]:
        options.append('<option value="failures">failures</option>')
    options += [
        f'<option value="{esc(name)}">{esc(name)} ({present[name]})</option>'
        for name in OUTCOME_SERIES
        if present[name]
    ]
    rows = []
    for item in data.items:
        record = item.record
        outcome = record.outcome if record else "not_started"
        link = (
            f'<a href="#{item_id(item.key)}">{esc(item_name(item.key, n))}</a>'
            if record
            else esc(item_name(item.key, n))
        )
        if record is None:
            cells = [MISSING] * 6
        else:
            passed = record.outcome == "success" and (record.reward or 0.0) >= threshold
            message = record.err_message or ""
            reward = (
                '<span class="muted" title="a failed rollout scores 0">0</span>'
                if record.outcome == "failed"
                else number(record.reward)
            )
            cells = [
                esc(record.status or "no result"),
                reward,
                "pass" if passed else "no" if record.outcome in ("success", "failed") else MISSING,
                fixed(record.latency_sec),
                esc(record.err_category or ""),
                f'<span title="{esc(message[:MAX_FAILURE_MESSAGE_CHARS])}">'
                f"{esc(clip_line(message, MAX_TABLE_MESSAGE_CHARS))}</span>",
            ]
        conversation = (
            f'<a href="#{item_id(item.key)}">{item.conversation.length} messages</a>'
            if item.conversation
            else '<span class="muted">none</span>'
        )
        failure = " data-failure" if outcome in FAILED_OUTCOMES else ""
        rows.append(
            f'<tr id="{row_id(item.key)}" data-outcome="{esc(outcome)}"{failure}>'
            f'<th scope="row">{link}</th><td>{badge(outcome)}</td><td>{cells[0]}</td>'
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
    parts = [f'<div class="message role-{esc(role.lower())}"><div class="who">{esc(who)}</div>']
    if message.text:
        parts.append(f"<pre>{esc(message.text)}</pre>")
    if message.calls:
        parts.append(f'<pre class="calls">{esc(message.calls)}</pre>')
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
        parts.append(f'<p class="muted">metrics: {esc(metrics)}</p>')
    return "".join(parts)


def conversations(data: RunData) -> str:
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
            facts.insert(1 if record.reward is not None else 0, fixed(record.latency_sec, " s"))
        body = []
        if record.err_category or record.err_message:
            body.append(
                f'<div class="note">{esc(record.err_category or "error")}: '
                f"{esc(record.err_message or '(no message)')}</div>"
            )
        if item.conversation is None:
            body.append('<p class="muted">No conversation was recorded for this rollout.</p>')
        else:
            body.append(_conversation_html(item.conversation))
        body.append(f'<p><a href="#{row_id(item.key)}">back to the items table</a></p>')
        blocks.append(
            f'<details class="conversation" id="{item_id(item.key)}"><summary>'
            f"{badge(record.outcome)} <strong>{esc(item_name(item.key, n))}</strong> "
            f'<span class="muted">{esc(" · ".join(facts))}</span></summary>'
            f'<div class="conversation-body">{"".join(body)}</div></details>'
        )
    return "".join(blocks) or '<p class="muted">No rollout has finished yet.</p>'
