"""The failures of a run: the most common error messages per category, and the failed items.

Both work on each item's final journal record (the one that decides its state), so they
agree with the summary's ``by_err_category`` counts.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from ._journal import JournalRecord

__all__ = [
    "FAILED_OUTCOMES",
    "MAX_COMMON_MESSAGES",
    "MAX_LISTED_FAILURES",
    "clip_line",
    "common_err_messages",
    "format_common_messages",
    "format_failures",
]

FAILED_OUTCOMES: Final = ("failed", "infra_failure")
"""Outcomes that count as failures (scored as 0, or pending after an infrastructure fault)."""

MAX_COMMON_MESSAGES: Final = 3
"""The summary keeps this many of the most common messages of each error category."""

MAX_SUMMARY_MESSAGE_CHARS: Final = 300
"""Messages in the summary are cut to this many characters (the journal has them whole)."""

MAX_LISTED_FAILURES: Final = 20
"""``rollout-eval show`` lists this many failed items (the report and the journal list all)."""


def clip_line(text: str, limit: int) -> str:
    """``text`` on one line (whitespace runs become one space), cut to ``limit`` characters."""
    flat = " ".join(text.split())
    if len(flat) <= limit:
        return flat
    return flat[: max(limit - 1, 0)] + "…"


def common_err_messages(
    records: Iterable[JournalRecord], *, limit: int = MAX_COMMON_MESSAGES
) -> dict[str, list[dict[str, Any]]]:
    """The most common error messages of each error category.

    Args:
        records: Each item's final journal record.
        limit: Messages kept per category (default :data:`MAX_COMMON_MESSAGES`).

    Returns:
        ``{category: [{"message": text, "count": items}, ...]}``, categories sorted, each
        list most common first (ties in record order). Messages are flattened to one line
        and cut to :data:`MAX_SUMMARY_MESSAGE_CHARS`; records without a category or a
        message are not listed (the category still counts them in ``by_err_category``).
    """
    by_category: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for record in records:
        if record.err_category is not None and record.err_message:
            by_category[record.err_category][
                clip_line(record.err_message, MAX_SUMMARY_MESSAGE_CHARS)
            ] += 1
    return {
        category: [
            {"message": message, "count": count}
            for message, count in by_category[category].most_common(limit)
        ]
        for category in sorted(by_category)
    }


def format_common_messages(
    categories: Mapping[str, int], messages: Mapping[str, Sequence[Mapping[str, Any]]]
) -> list[tuple[str, str]]:
    """Rows ``(label, value)`` of the summary table: each category, then its top messages."""
    rows: list[tuple[str, str]] = []
    for category, count in categories.items():
        rows.append((f"  {category}", str(count)))
        listed = messages.get(category, [])
        rows.extend(
            ("", f"  {entry['count']}x  {clip_line(entry['message'], 90)}") for entry in listed
        )
        others = count - sum(entry["count"] for entry in listed)
        if listed and others > 0:
            rows.append(("", f"  {others}x  other or no message"))
    return rows


def format_failures(records: Sequence[JournalRecord], *, limit: int = MAX_LISTED_FAILURES) -> str:
    """The failed items as text lines (``rollout-eval show``), at most ``limit`` of them.

    Args:
        records: Each item's final journal record, in item order.
        limit: Items listed (default :data:`MAX_LISTED_FAILURES`); the rest are counted.

    Returns:
        ``"failures: none"`` or a header and one line per failed item: row, run, outcome,
        category and the message (one line, cut to 100 characters).
    """
    failed = [record for record in records if record.outcome in FAILED_OUTCOMES]
    if not failed:
        return "failures: none"
    lines = [f"failures ({len(failed)} items; the last outcome of each):"]
    for record in failed[:limit]:
        message = clip_line(record.err_message or "(no message)", 100)
        lines.append(
            f"  row {record.row_index} run {record.run_index}  {record.outcome}  "
            f"{record.err_category or '(no category)'}  {message}"
        )
    if len(failed) > limit:
        lines.append(
            f"  ... and {len(failed) - limit} more: see events.jsonl, or rollout-eval report"
        )
    return "\n".join(lines)
