"""Markup helpers every part of the report shares: escaping, number formats, element ids,
the outcome colours and badges, and the plain table."""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Sequence
from typing import Final

from ._charts import Series, format_number

__all__ = [
    "MISSING",
    "OUTCOME_SERIES",
    "badge",
    "category_id",
    "count_items",
    "esc",
    "fixed",
    "item_id",
    "item_name",
    "number",
    "percent",
    "row_id",
    "table",
]

MISSING: Final = "\N{EN DASH}"
"""Shown for a value that does not exist (no scored items, no latency, ...)."""

OUTCOME_SERIES: Final = {
    "success": Series(name="success", color="#0b8a5f"),
    "failed": Series(name="failed", color="#d55e00"),
    "skipped": Series(name="skipped", color="#8c8c8c"),
    "infra_failure": Series(name="infra_failure", color="#9c4f96"),
    "cancelled": Series(name="cancelled", color="#56b4e9"),
    "not_started": Series(name="not_started", color="#d5d9de"),
}
"""Colours of the outcomes (from the Okabe-Ito palette, distinguishable with colour blindness)."""


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def number(value: float | None) -> str:
    return MISSING if value is None else format_number(value)


def fixed(value: float | None, unit: str = "") -> str:
    return MISSING if value is None else f"{value:.3f}{unit}"


def percent(value: float | None) -> str:
    return MISSING if value is None else f"{value * 100:.1f}%"


def count_items(count: int) -> str:
    return f"{count} item" if count == 1 else f"{count} items"


def item_id(key: tuple[int, int]) -> str:
    return f"item-{key[0]}-{key[1]}"


def row_id(key: tuple[int, int]) -> str:
    return f"row-{key[0]}-{key[1]}"


def item_name(key: tuple[int, int], n: int) -> str:
    """``row 3``, or ``row 3 · run 1`` when rows run more than once."""
    return f"row {key[0]}" if n == 1 else f"row {key[0]} · run {key[1]}"


def category_id(category: str) -> str:
    return "cat-" + re.sub(r"[^A-Za-z0-9_-]", "_", category)


def badge(outcome: str) -> str:
    css = outcome if outcome in OUTCOME_SERIES else "not_started"
    return f'<span class="badge {css}">{esc(outcome)}</span>'


_NUM: Final = ' class="num"'


def table(caption: str, headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A table whose cells are already-escaped HTML; numeric columns are marked ``num``."""
    head = "".join(
        f'<th scope="col"{_NUM if index else ""}>{esc(name)}</th>'
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
        f"<table><caption>{esc(caption)}</caption><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table>"
    )
