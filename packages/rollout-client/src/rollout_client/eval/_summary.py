"""The run summary: counts, reward statistics, pass rate, pass@k and latency percentiles.

The summary is a pure function of the journal and the list of selected work items, so a
resumed run and an uninterrupted run over the same results produce the same summary.

Scoring rules:

* an item's state is the ``outcome`` of its last journal record, or ``not_started``;
  an item this run cancelled when it stopped (Ctrl-C, the stop rule) is ``cancelled``
  instead (it is pending: cancelled rollouts are not journaled, and the next run starts
  it again); ``summarize`` alone, which knows only the journal, never reports one;
  ``by_status`` counts the server's terminal status of that record (``no_result`` when
  the client never received one: transport or protocol errors, timeouts);
* *scored* items are ``success`` and ``failed``; a failed rollout (an agent or model
  failure) scores reward 0; ``skipped`` and ``infra_failure`` items are never scored;
* an item *passes* when it succeeded with ``reward >= pass_threshold``;
* ``pass@k`` (reported when ``n > 1``) is the unbiased estimator of Chen et al. (2021),
  ``1 - C(m - c, k) / C(m, k)`` per row with ``m`` scored samples of which ``c`` pass,
  averaged over the rows with at least ``k`` scored samples;
* latency percentiles use linear interpolation between order statistics, over the
  scored and skipped items.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from ._failures import common_err_messages, format_common_messages
from ._journal import JournalRecord, latest_by_item, utc_now

__all__ = [
    "SUMMARY_FORMAT",
    "build_summary",
    "format_summary",
    "pass_at_k",
    "percentile",
    "summarize",
    "write_summary",
]

SUMMARY_FORMAT: Final = 1
"""Version of the ``summary.json`` layout."""

STATES: Final = ("success", "failed", "skipped", "infra_failure", "cancelled", "not_started")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of sorted values, by linear interpolation.

    Raises:
        ValueError: If there are no values or ``q`` is outside [0, 100].
    """
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError("q must be within [0, 100]")
    position = (len(sorted_values) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = position - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


def pass_at_k(samples: int, passed: int, k: int) -> float:
    """Unbiased pass@k for one row: ``1 - C(samples - passed, k) / C(samples, k)``.

    Raises:
        ValueError: If ``k`` is not in ``[1, samples]`` or ``passed`` not in ``[0, samples]``.
    """
    if not 1 <= k <= samples:
        raise ValueError(f"k must be within [1, {samples}], got {k}")
    if not 0 <= passed <= samples:
        raise ValueError(f"passed must be within [0, {samples}], got {passed}")
    if samples - passed < k:
        return 1.0
    return 1.0 - math.comb(samples - passed, k) / math.comb(samples, k)


def _k_values(n: int) -> list[int]:
    ks = {1, n}
    k = 2
    while k < n:
        ks.add(k)
        k *= 2
    return sorted(ks)


def _rounded(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def summarize(
    records: Iterable[JournalRecord],
    *,
    items: Sequence[tuple[int, int]],
    n: int,
    pass_threshold: float,
    run: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the summary document of a run.

    Args:
        records: Every journal record, in journal order.
        items: Every selected work item ``(row_index, run_index)``.
        n: Repetitions per row (``--n``).
        pass_threshold: Reward at or above which a success passes.
        run: Extra identification copied into the ``run`` key (name, dataset, ...).

    Returns:
        The JSON-ready summary (the content of ``summary.json``).
    """
    return build_summary(
        records, items=items, n=n, pass_threshold=pass_threshold, run=run, cancelled=()
    )


def build_summary(
    records: Iterable[JournalRecord],
    *,
    items: Sequence[tuple[int, int]],
    n: int,
    pass_threshold: float,
    run: Mapping[str, Any] | None,
    cancelled: Collection[tuple[int, int]],
) -> dict[str, Any]:
    """:func:`summarize`, with the items the run cancelled as it stopped counted as
    ``cancelled`` (whatever an earlier run journaled for them), not by their journal state.
    """
    all_records = list(records)
    wanted = set(items)
    latest = {item: rec for item, rec in latest_by_item(all_records).items() if item in wanted}
    states: Counter[str] = Counter(dict.fromkeys(STATES, 0))
    by_status: Counter[str] = Counter()
    by_category: Counter[str] = Counter()
    scored: list[float] = []
    success_rewards: list[float] = []
    latencies: list[float] = []
    per_row: dict[int, list[bool]] = {}
    passes = 0
    cancelled_set = set(cancelled)
    for item in items:
        record = latest.get(item)
        if item in cancelled_set:
            states["cancelled"] += 1
            continue
        if record is None:
            states["not_started"] += 1
            continue
        states[record.outcome] += 1
        by_status[record.status or "no_result"] += 1
        if record.err_category is not None:
            by_category[record.err_category] += 1
        if record.outcome in ("success", "failed"):
            reward = (
                record.reward if record.outcome == "success" and record.reward is not None else 0.0
            )
            scored.append(reward)
            passed = record.outcome == "success" and reward >= pass_threshold
            passes += passed
            per_row.setdefault(record.row_index, []).append(passed)
            if record.outcome == "success":
                success_rewards.append(reward)
        if record.outcome in ("success", "failed", "skipped") and record.latency_sec is not None:
            latencies.append(record.latency_sec)
    latencies.sort()
    infra_attempts = sum(
        1 for rec in all_records if rec.outcome == "infra_failure" and rec.item in wanted
    )
    pending = states["infra_failure"] + states["cancelled"] + states["not_started"]
    summary: dict[str, Any] = {
        "format": SUMMARY_FORMAT,
        "generated_at": utc_now(),
        "run": dict(run or {}),
        "complete": pending == 0,
        "items": {
            "total": len(items),
            "done": len(items) - pending,
            "pending": pending,
            "scored": len(scored),
        },
        "by_outcome": dict(states),
        "by_status": dict(sorted(by_status.items())),
        "by_err_category": dict(sorted(by_category.items())),
        "err_messages": common_err_messages(
            latest[item] for item in items if item in latest and item not in cancelled_set
        ),
        "reward": {
            "count": len(scored),
            "mean": _rounded(statistics.fmean(scored)) if scored else None,
            "median": _rounded(statistics.median(scored)) if scored else None,
            "min": _rounded(min(scored)) if scored else None,
            "max": _rounded(max(scored)) if scored else None,
            "mean_of_successes": _rounded(statistics.fmean(success_rewards))
            if success_rewards
            else None,
            "failed_count_as": 0.0,
        },
        "pass": {
            "threshold": pass_threshold,
            "passed": passes,
            "scored": len(scored),
            "rate": _rounded(passes / len(scored)) if scored else None,
        },
        "pass_at_k": None,
        "latency_sec": {
            "count": len(latencies),
            "p50": _rounded(percentile(latencies, 50)) if latencies else None,
            "p95": _rounded(percentile(latencies, 95)) if latencies else None,
            "p99": _rounded(percentile(latencies, 99)) if latencies else None,
            "mean": _rounded(statistics.fmean(latencies)) if latencies else None,
            "max": _rounded(latencies[-1]) if latencies else None,
        },
        "infra_failures": {"attempts": infra_attempts, "pending_items": states["infra_failure"]},
    }
    if n > 1:
        estimates: dict[str, Any] = {}
        for k in _k_values(n):
            rows = [
                pass_at_k(len(outcomes), sum(outcomes), k)
                for outcomes in per_row.values()
                if len(outcomes) >= k
            ]
            estimates[str(k)] = {
                "value": _rounded(statistics.fmean(rows)) if rows else None,
                "rows": len(rows),
            }
        summary["pass_at_k"] = estimates
    return summary


def write_summary(path: Path, summary: Mapping[str, Any]) -> None:
    """Write ``summary.json`` atomically (temporary file, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as file:
        json.dump(summary, file, indent=2, allow_nan=False)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())
    tmp.replace(path)


def _num(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def format_summary(summary: Mapping[str, Any], *, files: Sequence[str] = ()) -> str:
    """Render the summary as the plain-text table ``rollout-eval`` prints."""
    run = summary.get("run", {})
    items = summary["items"]
    state = "complete" if summary["complete"] else f"{items['pending']} pending"
    title = f"rollout-eval summary: run {run.get('name', '?')!r}, {items['total']} items ({state})"
    rows: list[tuple[str, str]] = []
    for outcome, count in summary["by_outcome"].items():
        rows.append((f"  {outcome}", str(count)))
    statuses = summary.get("by_status") or {}
    rows.append(
        ("server status", "  ".join(f"{name} {count}" for name, count in statuses.items()) or "-")
    )
    rows.append(("err_category", ""))
    categories = summary["by_err_category"]
    if categories:
        rows.extend(format_common_messages(categories, summary.get("err_messages") or {}))
    else:
        rows.append(("  (none)", ""))
    reward = summary["reward"]
    rows.append(
        (
            "reward",
            f"mean {_num(reward['mean'])}  median {_num(reward['median'])}  "
            f"over {reward['count']} scored (failed = 0)",
        )
    )
    passing = summary["pass"]
    rows.append(
        (
            "pass rate",
            f"{_pct(passing['rate'])}  ({passing['passed']}/{passing['scored']} with reward >= "
            f"{passing['threshold']:g})",
        )
    )
    if summary.get("pass_at_k"):
        text = "  ".join(
            f"pass@{k} {_num(entry['value'])}" for k, entry in summary["pass_at_k"].items()
        )
        rows.append(("pass@k", text))
    latency = summary["latency_sec"]
    rows.append(
        (
            "latency (s)",
            f"p50 {_num(latency['p50'])}  p95 {_num(latency['p95'])}  p99 {_num(latency['p99'])}",
        )
    )
    infra = summary["infra_failures"]
    rows.append(
        (
            "infra failures",
            f"{infra['pending_items']} items pending, {infra['attempts']} attempts in all",
        )
    )
    width = max(len(label) for label, _ in [("outcome", ""), *rows])
    lines = [title, f"{'outcome':<{width}}  count"]
    lines.extend(f"{label:<{width}}  {value}".rstrip() for label, value in rows)
    lines.extend(f"{'file' if i == 0 else '':<{width}}  {name}" for i, name in enumerate(files))
    return "\n".join(lines)
