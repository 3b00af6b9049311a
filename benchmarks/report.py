"""Turn run records into summary records and the markdown tables, and check record shapes.

Records are JSON objects, one a line, each with a ``type``:

- ``meta``: when, where and with what the suite ran.
- ``run``: one load-generator run (the figures of :mod:`benchmarks.loadgen` plus the
  run's spec, ``ok`` and ``error``).
- ``summary``: one table cell: a metric of one stack (or of the HTTP floor) over the
  repetitions (median, min, max, n).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from benchmarks.stats import summarize
from benchmarks.suite import FLOOR, POOL_SHAPES, Profile

__all__ = [
    "Row",
    "Target",
    "cross_table",
    "floor_table",
    "main_table",
    "pool_table",
    "rows_for",
    "summary_records",
    "validate_record",
]

OSMOSIS_TITLE: Final = "osmosis-ai 0.3.8"

CLIENT_OF: Final = {"ours": "ours", "osmosis": "osmosis", FLOOR: "ours"}
"""The client of each server's summarised runs: each stack's own; the floor runs ours."""

_CLOSED_KEYS: Final = {
    "completed": int,
    "succeeded": int,
    "failed": int,
    "statuses": dict,
    "errors": dict,
    "elapsed_sec": float,
    "rollouts_per_sec": float,
    "latency_ms_p50": float,
    "latency_ms_p99": float,
    "overhead_ms_p99": float,
    "server_cpu_ms_per_rollout": float,
    "client_cpu_ms_per_rollout": float,
    "server_rss_kib": int,
}
_INFLIGHT_KEYS: Final = {
    "admitted": int,
    "succeeded": int,
    "failed": int,
    "statuses": dict,
    "errors": dict,
    "admission_per_sec": float,
    "idle_server_cpu_per_sec": float,
    "rss_peak_kib": int,
    "rss_per_inflight_kib": float,
    "release_late_sec_p50": float,
    "release_late_sec_p99": float,
}
_RUN_KEYS: Final = {
    "workloads": list,
    "client": str,
    "server": str,
    "shape": str,
    "repetition": int,
    "count": int,
    "ok": bool,
}


def _is(value: object, kind: type) -> bool:
    if kind is float:
        return (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def validate_record(record: Mapping[str, Any]) -> list[str]:
    """Problems with the shape of one record (empty when it is well-formed).

    A ``run`` record with an ``error`` needs only its spec keys; one without needs every
    figure of its shape, of the right type (numbers finite).
    """
    problems: list[str] = []

    def need(keys: Mapping[str, type]) -> None:
        for key, kind in keys.items():
            if key not in record:
                problems.append(f"missing {key!r}")
            elif not _is(record[key], kind):
                problems.append(f"{key!r} is {record[key]!r}, not {kind.__name__}")

    kind = record.get("type")
    if kind == "meta":
        need({"date": str, "profile": str, "workloads": list, "stacks": list, "cpu_count": int})
    elif kind == "summary":
        need({"workload": str, "metric": str, "label": str, "stack": str})
        need({"median": float, "min": float, "max": float, "n": int})
    elif kind == "run":
        need(_RUN_KEYS)
        if record.get("error") is None:
            shape = record.get("shape")
            if shape == "closed":
                need(_CLOSED_KEYS)
            elif shape == "inflight":
                need(_INFLIGHT_KEYS)
            else:
                problems.append(f"unknown shape {shape!r}")
        elif not isinstance(record["error"], str):
            problems.append("'error' must be a string or null")
    else:
        problems.append(f"unknown record type {kind!r}")
    return problems


@dataclass(frozen=True, kw_only=True)
class Target:
    """A target for our stack, checked on medians.

    Attributes:
        kind: ``ratio_min`` (ours/osmosis >= value), ``ratio_max`` (ours/osmosis <=
            value), ``abs_max`` (ours <= value) or ``zero`` (ours is 0 in every run).
        value: The bound.
        text: How the table states it.
    """

    kind: str
    value: float
    text: str

    def met(self, ours: Mapping[str, Any] | None, ratio: float | None) -> bool | None:
        """Whether the target is met (None when the figures to decide are missing)."""
        if ours is None:
            return None
        if self.kind == "abs_max":
            return bool(ours["median"] <= self.value)
        if self.kind == "zero":
            return bool(ours["max"] == 0)
        if ratio is None:
            return None
        if self.kind == "ratio_min":
            return ratio >= self.value
        return ratio <= self.value


@dataclass(frozen=True, kw_only=True)
class Row:
    """One line of the main table: one metric of the runs one predicate selects.

    Attributes:
        workload: The workload it belongs to.
        label: What the table calls it.
        metric: The run-record key.
        select: Which (homogeneous) runs it draws from.
        target: Our target, if any.
    """

    workload: str
    label: str
    metric: str
    select: Callable[[Mapping[str, Any]], bool]
    target: Target | None = None


def _closed(
    workload: str, concurrency: int, *, staggered: bool = False
) -> Callable[[Mapping[str, Any]], bool]:
    def select(run: Mapping[str, Any]) -> bool:
        return (
            workload in run["workloads"]
            and run["client"] == run["server"]
            and run.get("concurrency") == concurrency
            and bool(run.get("stagger_sec")) == staggered
        )

    return select


def _inflight(count: int) -> Callable[[Mapping[str, Any]], bool]:
    def select(run: Mapping[str, Any]) -> bool:
        return "inflight" in run["workloads"] and run["count"] == count

    return select


def rows_for(profile: Profile, workloads: Iterable[str]) -> list[Row]:
    """The main table's rows for the selected workloads, with the targets of issue 8."""
    chosen = set(workloads)
    rows: list[Row] = []
    fourfold = Target(kind="ratio_min", value=4.0, text=">= 4x")
    quarter = Target(kind="ratio_max", value=0.25, text="<= 0.25x")
    third = Target(kind="ratio_max", value=1 / 3, text="<= 0.33x")
    if "throughput" in chosen:
        for c in profile.concurrencies:
            select = _closed("throughput", c)
            rows += [
                Row(
                    workload="throughput",
                    label=f"rollouts/s, concurrency {c}",
                    metric="rollouts_per_sec",
                    select=select,
                    target=fourfold if c >= 64 else None,
                ),
                Row(
                    workload="throughput",
                    label=f"latency p50 ms, concurrency {c}",
                    metric="latency_ms_p50",
                    select=select,
                ),
                Row(
                    workload="throughput",
                    label=f"latency p99 ms, concurrency {c}",
                    metric="latency_ms_p99",
                    select=select,
                ),
            ]
    if "notify" in chosen:
        c = profile.notify_concurrency
        sleep_ms = f"{profile.notify_sleep_sec * 1000:.0f} ms"
        for staggered, how in ((True, "staggered starts"), (False, "lockstep")):
            select = _closed("notify", c, staggered=staggered)
            rows += [
                Row(
                    workload="notify",
                    label=f"overhead p50 ms ({sleep_ms} workflow, c {c}, {how})",
                    metric="overhead_ms_p50",
                    select=select,
                ),
                Row(
                    workload="notify",
                    label=f"overhead p99 ms ({sleep_ms} workflow, c {c}, {how})",
                    metric="overhead_ms_p99",
                    select=select,
                    target=Target(kind="abs_max", value=25.0, text="<= 25 ms")
                    if staggered
                    else None,
                ),
            ]
    if "inflight" in chosen:
        counts = sorted({n for ns in profile.inflight_counts.values() for n in ns})
        for n in counts:
            select = _inflight(n)
            rows += [
                Row(
                    workload="inflight",
                    label=f"rollouts failed of {n}",
                    metric="failed",
                    select=select,
                    target=Target(kind="zero", value=0.0, text="0"),
                ),
                Row(
                    workload="inflight",
                    label=f"admissions/s ({n})",
                    metric="admission_per_sec",
                    select=select,
                ),
                Row(
                    workload="inflight",
                    label=f"server RSS KiB per in-flight rollout ({n})",
                    metric="rss_per_inflight_kib",
                    select=select,
                    target=third,
                ),
                Row(
                    workload="inflight",
                    label=f"idle server CPU s/s ({n} long-polling)",
                    metric="idle_server_cpu_per_sec",
                    select=select,
                    target=third,
                ),
                Row(
                    workload="inflight",
                    label=f"release to client p50 s ({n} at once)",
                    metric="release_late_sec_p50",
                    select=select,
                ),
                Row(
                    workload="inflight",
                    label=f"release to client p99 s ({n} at once)",
                    metric="release_late_sec_p99",
                    select=select,
                    target=Target(kind="abs_max", value=3.0, text="<= 3 s") if n <= 5000 else None,
                ),
            ]
    if "cpu" in chosen:
        select = _closed("cpu", profile.cpu_concurrency)
        rows += [
            Row(
                workload="cpu",
                label=f"server CPU ms/rollout, c {profile.cpu_concurrency}",
                metric="server_cpu_ms_per_rollout",
                select=select,
                target=quarter,
            ),
            Row(
                workload="cpu",
                label=f"client CPU ms/rollout, c {profile.cpu_concurrency}",
                metric="client_cpu_ms_per_rollout",
                select=select,
                target=quarter,
            ),
            Row(
                workload="cpu",
                label=f"server CPU utilisation, c {profile.cpu_concurrency}",
                metric="server_cpu_util",
                select=select,
            ),
        ]
    return rows


def _cell(values: list[float]) -> dict[str, Any] | None:
    return summarize(values) if values else None


def _values(runs: Iterable[Mapping[str, Any]], metric: str) -> list[float]:
    out: list[float] = []
    for run in runs:
        value = run.get(metric)
        if run.get("error") is None and isinstance(value, int | float) and math.isfinite(value):
            out.append(float(value))
    return out


def summary_records(
    rows: Sequence[Row], runs: Sequence[Mapping[str, Any]], stacks: Iterable[str]
) -> list[dict[str, Any]]:
    """One ``summary`` record per row and stack (or :data:`~benchmarks.suite.FLOOR`) that
    has figures: the runs of that server with the client of :data:`CLIENT_OF`."""
    records: list[dict[str, Any]] = []
    for row in rows:
        for stack in stacks:
            chosen = [
                r
                for r in runs
                if r["server"] == stack and r["client"] == CLIENT_OF[stack] and row.select(r)
            ]
            cell = _cell(_values(chosen, row.metric))
            if cell is not None:
                records.append(
                    {
                        "type": "summary",
                        "workload": row.workload,
                        "metric": row.metric,
                        "label": row.label,
                        "stack": stack,
                        **cell,
                    }
                )
    return records


def fmt(value: float) -> str:
    """A figure with 3 significant digits or so (thousands separated)."""
    magnitude = abs(value)
    if float(value).is_integer() and magnitude < 100:
        return f"{int(value)}"
    if magnitude >= 100:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1 or magnitude == 0:
        return f"{value:.2f}"
    return f"{value:.3f}"


def _show(cell: Mapping[str, Any] | None) -> str:
    if cell is None:
        return "—"
    if cell["n"] == 1:
        return fmt(cell["median"])
    return f"{fmt(cell['median'])} ({fmt(cell['min'])}–{fmt(cell['max'])})"  # noqa: RUF001


def main_table(rows: Sequence[Row], summaries: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table: a column per stack, the ratio ours/osmosis, target and verdict."""
    index = {(s["label"], s["stack"]): s for s in summaries}
    lines = [
        f"| workload | metric | ours | {OSMOSIS_TITLE} | ours / osmosis | target | met |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for row in rows:
        ours, theirs = index.get((row.label, "ours")), index.get((row.label, "osmosis"))
        ratio = None
        if ours is not None and theirs is not None and theirs["median"]:
            ratio = ours["median"] / theirs["median"]
        met = row.target.met(ours, ratio) if row.target else None
        lines.append(
            "| "
            + " | ".join(
                [
                    row.workload,
                    row.label,
                    _show(ours),
                    _show(theirs),
                    "—" if ratio is None else f"{ratio:.2f}x",
                    row.target.text if row.target else "",
                    {True: "yes", False: "**no**", None: ""}[met],
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def floor_table(rows: Sequence[Row], summaries: Sequence[Mapping[str, Any]]) -> str | None:
    """Our server against the HTTP floor under the same client and in-flight load, or None
    when no floor run has figures.

    The last column (ours minus the floor) is what our server holds or spends beyond bare
    aiohttp. Failed-rollout counts are left out (the runs' records and the main table have
    them).
    """
    index = {(s["label"], s["stack"]): s for s in summaries}
    lines = [
        "| our client, in flight | bare aiohttp (floor) | ours | ours beyond the floor |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        floor, ours = index.get((row.label, FLOOR)), index.get((row.label, "ours"))
        if floor is None or row.metric == "failed":
            continue
        difference = "—" if ours is None else fmt(ours["median"] - floor["median"])
        lines.append(f"| {row.label} | {_show(floor)} | {_show(ours)} | {difference} |")
    return "\n".join(lines) if len(lines) > 2 else None


def cross_table(profile: Profile, runs: Sequence[Mapping[str, Any]]) -> str:
    """Every client/server pairing at the cross concurrency, so each side's cost shows."""
    c = profile.cross_concurrency
    metrics = (
        ("rollouts/s", "rollouts_per_sec"),
        ("latency p99 ms", "latency_ms_p99"),
        ("server CPU ms/rollout", "server_cpu_ms_per_rollout"),
        ("client CPU ms/rollout", "client_cpu_ms_per_rollout"),
    )
    lines = [
        f"| client → server (concurrency {c}) | " + " | ".join(m for m, _ in metrics) + " |",
        "|---|" + "---:|" * len(metrics),
    ]
    names = {"ours": "ours", "osmosis": "osmosis"}
    for client, server in (
        ("ours", "ours"),
        ("osmosis", "osmosis"),
        ("ours", "osmosis"),
        ("osmosis", "ours"),
    ):
        chosen = [
            r
            for r in runs
            if r["client"] == client
            and r["server"] == server
            and r.get("concurrency") == c
            and r.get("shape") == "closed"
            and not r.get("sleep_sec")
            and ("cross" in r["workloads"] or "throughput" in r["workloads"])
        ]
        cells = [_show(_cell(_values(chosen, key))) for _, key in metrics]
        lines.append(f"| {names[client]} → {names[server]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pool_table(profile: Profile, runs: Sequence[Mapping[str, Any]]) -> str | None:
    """Our client and our pool client over one and two servers (the ``pool`` workload), or
    None when no pool run has figures.

    Server CPU is summed over the run's servers; the last column is each row's rollouts/s
    over the first row's (medians).
    """
    c = profile.pool_concurrency
    metrics = (
        ("rollouts/s", "rollouts_per_sec"),
        ("latency p50 ms", "latency_ms_p50"),
        ("latency p99 ms", "latency_ms_p99"),
        ("server CPU ms/rollout", "server_cpu_ms_per_rollout"),
        ("client CPU ms/rollout", "client_cpu_ms_per_rollout"),
    )
    lines = [
        f"| ours, concurrency {c} | "
        + " | ".join(m for m, _ in metrics)
        + " | rollouts/s vs first |",
        "|---|" + "---:|" * (len(metrics) + 1),
    ]
    base: float | None = None
    filled = False
    for pool, servers in POOL_SHAPES:
        chosen = [
            r
            for r in runs
            if "pool" in r["workloads"]
            and bool(r.get("pool")) == pool
            and r.get("servers", 1) == servers
        ]
        cells = [_cell(_values(chosen, key)) for _, key in metrics]
        rate = cells[0]["median"] if cells[0] is not None else None
        if base is None:
            base = rate
        filled = filled or rate is not None
        ratio = "—" if rate is None or not base else f"{rate / base:.2f}x"
        client = "RolloutClientPool" if pool else "RolloutClient"
        noun = "server" if servers == 1 else "servers"
        lines.append(
            f"| {client} → {servers} {noun} | "
            + " | ".join(_show(cell) for cell in cells)
            + f" | {ratio} |"
        )
    return "\n".join(lines) if filled else None
