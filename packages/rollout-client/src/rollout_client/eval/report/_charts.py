"""Inline SVG charts of the HTML report: bar charts, histograms and a share bar.

Each chart is a self-contained ``<svg role="img">`` with a ``<title>`` and a ``<desc>``
that state the data in words (what a screen reader reads), and a ``<title>`` on every bar
(the tooltip). Text is escaped here; callers pass plain strings.
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Callable, Sequence
from typing import Final

__all__ = [
    "Bar",
    "Series",
    "bar_chart",
    "equal_bins",
    "format_number",
    "histogram",
    "share_bar",
    "y_scale",
]

WIDTH: Final = 560
HEIGHT: Final = 250
_LEFT: Final = 52
_RIGHT: Final = 14
_TOP: Final = 14
_BOTTOM: Final = 48
_MAX_X_LABELS: Final = 12
_PLOT_W: Final = WIDTH - _LEFT - _RIGHT
_PLOT_H: Final = HEIGHT - _TOP - _BOTTOM
_MAX_BAR_W: Final = 90
_MARKER_CHAR_W: Final = 7
"""Width of one character of a marker label (11 px text), rounded up, in chart units."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Series:
    """One stacked part of every bar: its name (legend) and fill colour."""

    name: str
    color: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Bar:
    """One bar: its x label, one value per series (stacked bottom-up) and its tooltip."""

    label: str
    values: tuple[float, ...]
    tooltip: str


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def format_number(value: float, digits: int = 3) -> str:
    """A short decimal: ``0.1234`` -> ``"0.123"``, ``12.0`` -> ``"12"``, ``1234.5`` -> ``"1234"``.

    ``digits`` significant digits (default 3), trailing zeros dropped; integer digits are
    never dropped.
    """
    if value == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(value)))
    decimals = max(digits - 1 - magnitude, 0)
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def y_scale(tallest: float, *, max_ticks: int = 5) -> tuple[float, float]:
    """The top and the tick step of a count axis reaching ``tallest``.

    The step is 1, 2 or 5 times a power of ten (at least 1: counts are whole), the
    smallest that needs at most ``max_ticks`` intervals; the top is the first tick at or
    above ``tallest`` (one step for an empty chart).
    """
    power = 1.0
    while True:
        for factor in (1.0, 2.0, 5.0):
            step = factor * power
            if math.ceil(tallest / step) <= max_ticks:
                return max(math.ceil(tallest / step), 1) * step, step
        power *= 10


def equal_bins(values: Sequence[float], *, max_bins: int = 20) -> list[tuple[float, float]]:
    """Equal-width bins ``(low, high)`` covering ``values`` (sqrt rule, 5 to ``max_bins``).

    One bin when every value is the same; no bins for no values.
    """
    if not values:
        return []
    low, high = min(values), max(values)
    if low == high:
        return [(low, high)]
    count = max(5, min(max_bins, math.ceil(math.sqrt(len(values)))))
    width = (high - low) / count
    return [
        (low + i * width, high if i == count - 1 else low + (i + 1) * width) for i in range(count)
    ]


def _frame(chart_id: str, title: str, description: str, body: list[str]) -> str:
    return (
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'role="img" aria-labelledby="{chart_id}-title {chart_id}-desc" '
        'xmlns="http://www.w3.org/2000/svg">'
        f'<title id="{chart_id}-title">{_e(title)}</title>'
        f'<desc id="{chart_id}-desc">{_e(description)}</desc>' + "".join(body) + "</svg>"
    )


def _y_axis(
    top_value: float, step: float, y_format: Callable[[float], str], y_label: str
) -> list[str]:
    parts: list[str] = []
    ticks = round(top_value / step)
    for i in range(ticks + 1):
        value = step * i
        y = _TOP + _PLOT_H - _PLOT_H * i / ticks
        parts.append(
            f'<line class="grid" x1="{_LEFT}" x2="{WIDTH - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="tick" x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{_e(y_format(value))}</text>"
        )
    parts.append(
        f'<text class="axis-label" transform="translate(13 {_TOP + _PLOT_H / 2:.1f}) rotate(-90)" '
        f'text-anchor="middle">{_e(y_label)}</text>'
    )
    return parts


def _plot(
    bars: Sequence[Bar],
    series: Sequence[Series],
    *,
    x_label: str,
    y_label: str,
    y_max: float | None,
    y_format: Callable[[float], str],
    bar_labels: bool,
) -> list[str]:
    """The axes, grid and stacked bars of a chart, as SVG elements."""
    tallest = max((sum(bar.values) for bar in bars), default=0.0)
    top_value, step = (y_max, y_max / 4) if y_max is not None else y_scale(tallest)
    body = _y_axis(top_value, step, y_format, y_label)
    slot = _PLOT_W / max(len(bars), 1)
    width = min(slot - min(slot * 0.2, 8.0), _MAX_BAR_W if bar_labels else slot)
    every = math.ceil(len(bars) / _MAX_X_LABELS) if bars else 1
    for index, bar in enumerate(bars):
        x = _LEFT + index * slot + (slot - width) / 2
        base = float(_TOP + _PLOT_H)
        body.append(f"<g><title>{_e(bar.tooltip)}</title>")
        for part, value in zip(series, bar.values, strict=True):
            height = _PLOT_H * value / top_value
            if height <= 0:
                continue
            base -= height
            body.append(
                f'<rect x="{x:.1f}" y="{base:.1f}" width="{width:.1f}" '
                f'height="{height:.1f}" fill="{_e(part.color)}"/>'
            )
        body.append("</g>")
        if bar_labels and index % every == 0:
            body.append(
                f'<text class="tick" x="{x + width / 2:.1f}" y="{_TOP + _PLOT_H + 16}" '
                f'text-anchor="middle">{_e(bar.label)}</text>'
            )
    body.append(
        f'<line class="axis" x1="{_LEFT}" x2="{WIDTH - _RIGHT}" y1="{_TOP + _PLOT_H}" '
        f'y2="{_TOP + _PLOT_H}"/>'
        f'<text class="axis-label" x="{_LEFT + _PLOT_W / 2:.1f}" y="{HEIGHT - 8}" '
        f'text-anchor="middle">{_e(x_label)}</text>'
    )
    return body


def bar_chart(
    *,
    chart_id: str,
    title: str,
    description: str,
    bars: Sequence[Bar],
    series: Sequence[Series],
    x_label: str,
    y_label: str = "items",
    y_max: float | None = None,
    y_format: Callable[[float], str] = format_number,
) -> str:
    """A vertical bar chart, bars stacked by series, one x label per bar.

    Args:
        chart_id: Unique id prefix of the chart's title and description elements.
        title: The chart's accessible name.
        description: The data in words.
        bars: The bars, left to right.
        series: The stacked parts (each bar has one value per series).
        x_label: Caption under the x axis.
        y_label: Caption of the y axis (default ``"items"``).
        y_max: Top of the y axis (default: a round number at or above the tallest bar).
        y_format: Formats y tick values (default :func:`format_number`).

    Returns:
        The ``<svg>`` element.
    """
    body = _plot(
        bars,
        series,
        x_label=x_label,
        y_label=y_label,
        y_max=y_max,
        y_format=y_format,
        bar_labels=True,
    )
    return _frame(chart_id, title, description, body)


def histogram(
    *,
    chart_id: str,
    title: str,
    description: str,
    bins: Sequence[tuple[float, float]],
    counts: Sequence[tuple[float, ...]],
    series: Sequence[Series],
    x_label: str,
    unit: str = "",
    markers: Sequence[tuple[str, float]] = (),
) -> str:
    """A histogram over equal-width ``bins``, stacked by series, with labelled markers.

    Args:
        chart_id: Unique id prefix of the chart's title and description elements.
        title: The chart's accessible name.
        description: The data in words.
        bins: ``(low, high)`` of each bin, ascending and adjacent (see :func:`equal_bins`);
            at least one.
        counts: For each bin, one count per series.
        series: The stacked parts.
        x_label: Caption under the x axis.
        unit: Appended to values in tooltips and tick labels (e.g. ``" s"``).
        markers: ``(name, value)`` pairs drawn as dashed vertical lines (e.g. p50), each
            labelled right of its line, or left of it near the chart's right edge.

    Returns:
        The ``<svg>`` element.
    """
    bars = []
    for (low, high), values in zip(bins, counts, strict=True):
        parts = ", ".join(
            f"{part.name} {format_number(value)}"
            for part, value in zip(series, values, strict=True)
            if value
        )
        bars.append(
            Bar(
                label="",
                values=values,
                tooltip=f"{format_number(low)}-{format_number(high)}{unit}: "
                f"{format_number(sum(values))} items" + (f" ({parts})" if parts else ""),
            )
        )
    body = _plot(
        bars,
        series,
        x_label=x_label,
        y_label="items",
        y_max=None,
        y_format=format_number,
        bar_labels=False,
    )
    low, high = bins[0][0], bins[-1][1]
    span = high - low
    edges = [low + span * i / 4 for i in range(5)] if span else [low]
    for index, edge in enumerate(edges):
        x = _LEFT + (_PLOT_W * (edge - low) / span if span else _PLOT_W / 2)
        anchor = "middle" if len(edges) == 1 or 0 < index < len(edges) - 1 else "start"
        if index == len(edges) - 1 and index:
            anchor = "end"
        body.append(
            f'<text class="tick" x="{x:.1f}" y="{_TOP + _PLOT_H + 16}" text-anchor="{anchor}">'
            f"{_e(format_number(edge) + unit)}</text>"
        )
    for index, (name, value) in enumerate(markers if span else ()):
        x = _LEFT + _PLOT_W * (value - low) / span
        # Right of the line, or left of it where the label would run past the chart's edge.
        fits = x + 3 + _MARKER_CHAR_W * len(name) <= WIDTH
        label_x, anchor = (x + 3, "start") if fits else (x - 3, "end")
        body.append(
            f'<g class="marker"><title>{_e(name)} {_e(format_number(value) + unit)}</title>'
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_TOP}" y2="{_TOP + _PLOT_H}"/>'
            f'<text x="{label_x:.1f}" y="{_TOP + 10 + 11 * index}" text-anchor="{anchor}">'
            f"{_e(name)}</text></g>"
        )
    return _frame(chart_id, title, description, body)


def share_bar(
    *,
    chart_id: str,
    title: str,
    parts: Sequence[tuple[Series, int]],
) -> str:
    """One horizontal bar split into the share of each part (e.g. items by outcome).

    Returns:
        The ``<svg>`` element; its description lists every part's count and share.
    """
    total = sum(count for _, count in parts)
    description = (
        ", ".join(f"{part.name} {count} ({count / total:.0%})" for part, count in parts if count)
        if total
        else "no items"
    )
    width, height = 1000, 28
    body: list[str] = []
    x = 0.0
    for part, count in parts:
        if not count:
            continue
        share = width * count / total
        body.append(
            f'<rect x="{x:.2f}" y="0" width="{share:.2f}" height="{height}" '
            f'fill="{_e(part.color)}"><title>{_e(part.name)}: {count} '
            f"({count / total:.1%})</title></rect>"
        )
        x += share
    if not total:
        body.append(f'<rect x="0" y="0" width="{width}" height="{height}" class="empty"/>')
    return (
        f'<svg class="share" viewBox="0 0 {width} {height}" preserveAspectRatio="none" '
        f'role="img" aria-labelledby="{chart_id}-title {chart_id}-desc" '
        'xmlns="http://www.w3.org/2000/svg">'
        f'<title id="{chart_id}-title">{_e(title)}</title>'
        f'<desc id="{chart_id}-desc">{_e(description)}</desc>' + "".join(body) + "</svg>"
    )
