"""The report's charts of a run: outcome shares, the reward and latency distributions and
pass@k, each drawn with :mod:`._charts` from the run's records and summary."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Final

from ._charts import Bar, Series, bar_chart, equal_bins, format_number, histogram, share_bar
from ._data import RunData
from ._markup import OUTCOME_SERIES, count_items, esc, fixed, percent

__all__ = ["MAX_DISCRETE_REWARDS", "charts", "outcome_share"]

MAX_DISCRETE_REWARDS: Final = 10
"""Rewards with at most this many distinct values get one bar per value, not bins."""


def outcome_share(summary: Mapping[str, Any]) -> str:
    parts = [
        (OUTCOME_SERIES[name], count)
        for name, count in summary["by_outcome"].items()
        if name in OUTCOME_SERIES
    ]
    legend = "".join(
        f'<li><span class="swatch" style="background:{series.color}"></span>'
        f"{esc(series.name)} {count}</li>"
        for series, count in parts
    )
    chart = share_bar(chart_id="chart-outcomes", title="Items by outcome", parts=parts)
    return f'<div class="panel">{chart}<ul class="legend">{legend}</ul></div>'


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
        unscored = sum(
            1
            for record in data.final_records
            if record.outcome not in names and record.latency_sec is not None
        )
        return '<p class="empty-chart">No scored or skipped item has a latency yet' + (
            f"; the time to failure of {count_items(unscored)} is in the items table.</p>"
            if unscored
            else ".</p>"
        )
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
        rate = summary["pass"]["rate"]
        return (
            '<p class="empty-chart">pass@k needs several runs per row (rollout-eval run --n K); '
            + (
                "this run has one, and no item was scored, so there is no pass rate either.</p>"
                if rate is None
                else f"this run has one: pass@1 is the pass rate, {esc(percent(rate))}.</p>"
            )
        )
    bars = [
        Bar(
            label=f"pass@{k}",
            values=(entry["value"] or 0.0,),
            tooltip=f"pass@{k}: {fixed(entry['value'])} over {entry['rows']} rows",
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


def charts(data: RunData) -> str:
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
            f'<figure class="panel"><h3>{esc(title)}</h3>{chart}'
            f"<figcaption>{esc(caption)}</figcaption></figure>"
            for title, chart, caption in figures
        )
        + "</div>"
    )
