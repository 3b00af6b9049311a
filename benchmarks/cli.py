"""``python -m benchmarks``: run the suite, write JSON lines and markdown to ``bench-results/``.

Usually run through ``nox -s bench`` (which builds both venvs); directly::

    python -m benchmarks --osmosis-python /path/to/osmosis-venv/bin/python --quick
    python -m benchmarks --stacks ours --workload throughput --profile tiny
    python -m benchmarks gateway --profile short    # the model gateway, on vs off

The suite runs in the venv of our stack (``--ours-python``, default this interpreter);
the osmosis-ai servers and load generators run under ``--osmosis-python``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

from benchmarks.processes import ROOT, STATES, HarnessError, ServerProcess, run_loadgen
from benchmarks.report import (
    cross_table,
    floor_table,
    main_table,
    pool_table,
    rows_for,
    summary_records,
    validate_record,
)
from benchmarks.suite import FLOOR, STACKS, WORKLOADS, Profile, RunSpec, plan_runs, profile_named

__all__ = ["main", "run_suite"]

DEFAULT_OUT_DIR: Final = ROOT / "bench-results"

_VERSIONS_SNIPPET: Final = """
import importlib.metadata as m, json, sys
names = ["rollout-types", "rollout-client", "rollout-server", "osmosis-ai", "aiohttp",
         "uvloop", "fastapi", "uvicorn", "httpx", "pydantic"]
found = {}
for name in names:
    try:
        found[name] = m.version(name)
    except m.PackageNotFoundError:
        pass
print(json.dumps({"python": sys.version.split()[0], "packages": found}))
"""


def _stack_versions(python: str) -> dict[str, Any]:
    try:
        out = subprocess.run(
            [python, "-c", _VERSIONS_SNIPPET],
            capture_output=True,
            check=True,
            timeout=60,
            cwd=ROOT,
        ).stdout
        versions: dict[str, Any] = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return versions


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _filesystem_of(path: Path) -> str:
    """The type of the filesystem holding ``path`` (from ``/proc/mounts``), or "unknown"."""
    target, best, kind = str(path.resolve()), "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1]
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return kind


def _raise_open_files_limit() -> None:
    # 10,000 long polls hold 10,000 sockets on each side; children inherit the limit.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _progress(spec: RunSpec, record: dict[str, Any], index: int, total: int) -> str:
    head = f"[{index}/{total}] {spec.label}:"
    if record.get("error"):
        return f"{head} ERROR {record['error'].splitlines()[0]}"
    if spec.shape == "closed":
        return (
            f"{head} {record.get('rollouts_per_sec') or 0:.0f} rollouts/s, "
            f"p99 {record.get('latency_ms_p99') or 0:.1f} ms, "
            f"server {record.get('server_cpu_ms_per_rollout') or 0:.2f} ms CPU/rollout, "
            f"failed {record['failed']}"
        )
    return (
        f"{head} {record.get('admission_per_sec') or 0:.0f} admissions/s, "
        f"{record.get('rss_per_inflight_kib') or 0:.1f} KiB/rollout, "
        f"idle CPU {record.get('idle_server_cpu_per_sec') or 0:.3f} s/s, "
        f"release p99 {record.get('release_late_sec_p99') or 0:.2f} s, failed {record['failed']}"
    )


def run_one(
    spec: RunSpec,
    *,
    pythons: dict[str, str],
    loops: dict[str, str],
    log_dir: Path,
    py_spy: str | None = None,
    scratch_dir: Path | None = None,
    remove_workdir: bool = True,
    ours_serve_args: Sequence[str] = (),
    state: str = "memory",
) -> dict[str, Any]:
    """Run one spec: fresh servers (``spec.servers`` of them), one load generator; return
    the run record.

    Each server's artifacts go to a new directory under ``scratch_dir``, deleted when the
    server stops unless ``remove_workdir`` is false (the caller then deletes it).

    Our servers get ``ours_serve_args`` appended to ``rollout-server serve`` and keep their
    state in ``state`` (``memory`` or a fresh ``sqlite`` file each); the first one's ``/health``
    state figures after the load go to ``record["server_state"]``.

    With ``py_spy``, each server is sampled and its profile goes to
    ``<log_dir>/<label>.profile`` (``<label>.<n>.profile`` for a further server n;
    collapsed stacks, ``python -m benchmarks.profiles`` summarises them).
    """
    record: dict[str, Any] = {
        "type": "run",
        "workloads": list(spec.workloads),
        "client": spec.client,
        "server": spec.server,
        "shape": spec.shape,
        "repetition": spec.repetition,
        "count": spec.count,
        "concurrency": spec.concurrency,
        "sleep_sec": spec.sleep_sec,
        "stagger_sec": spec.stagger_sec,
        "servers": spec.servers,
        "pool": spec.pool,
        "ok": False,
        "error": None,
    }
    try:
        with contextlib.ExitStack() as stack:
            servers = []
            for n in range(spec.servers):
                name = spec.label if n == 0 else f"{spec.label}.{n}"
                server = ServerProcess(
                    stack=spec.server,
                    python=pythons[spec.server],
                    log_path=log_dir / f"{name}.log",
                    py_spy=py_spy,
                    profile_path=log_dir / f"{name}.profile",
                    scratch_dir=scratch_dir,
                    remove_workdir=remove_workdir,
                    serve_args=ours_serve_args if spec.server == "ours" else (),
                    state=state,
                )
                servers.append(stack.enter_context(server))
            figures = run_loadgen(
                python=pythons[spec.client],
                args=spec.loadgen_args(
                    urls=[server.url for server in servers],
                    server_pids=[server.pid for server in servers],
                    loop=loops[spec.client],
                ),
                deadline_sec=spec.deadline_sec,
                log_path=log_dir / f"{spec.label}.loadgen.log",
            )
            record["server_state"] = servers[0].state_figures()
    except HarnessError as exc:
        record["error"] = str(exc)
    else:
        for key in ("shape", "count", "concurrency", "sleep_sec", "stagger_sec"):
            figures.pop(key, None)
        record.update(figures)
        record["failed"] = spec.count - int(record.get("succeeded", 0))
        if record.get("timed_out"):
            record["error"] = f"the run hit its {spec.deadline_sec:.0f} s bound"
        else:
            problems = validate_record(record)
            if problems:
                record["error"] = "malformed figures: " + "; ".join(problems)
    record["ok"] = record["error"] is None and record.get("failed") == 0
    return record


@contextlib.contextmanager
def _removed_at_exit(path: Path) -> Iterator[Path]:
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_suite(
    *,
    profile: Profile,
    workloads: tuple[str, ...],
    stacks: tuple[str, ...],
    pythons: dict[str, str],
    loops: dict[str, str],
    out_dir: Path,
    echo: TextIO,
    py_spy: str | None = None,
    scratch_dir: Path | None = None,
    ours_serve_args: Sequence[str] = (),
    state: str = "memory",
) -> tuple[Path, Path, list[dict[str, Any]]]:
    """Run every planned run, then write ``bench-<stamp>.jsonl`` and ``bench-<stamp>.md``.

    Also copies both to ``latest.jsonl`` / ``latest.md`` in ``out_dir``.

    Returns:
        The JSON-lines path, the markdown path and every record written.
    """
    _raise_open_files_limit()
    started = dt.datetime.now(dt.UTC)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = out_dir / "logs" / stamp
    jsonl_path, md_path = out_dir / f"bench-{stamp}.jsonl", out_dir / f"bench-{stamp}.md"
    meta: dict[str, Any] = {
        "type": "meta",
        "date": started.isoformat(timespec="seconds"),
        "profile": profile.name,
        "workloads": list(workloads),
        "stacks": list(stacks),
        "repetitions": profile.repetitions,
        "cpu_count": os.cpu_count() or 0,
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "load_average_start": list(os.getloadavg()),
        "versions": {stack: _stack_versions(pythons[stack]) for stack in stacks},
        "client_loops": {stack: loops[stack] for stack in stacks},
        "scratch_dir": str(scratch_dir or tempfile.gettempdir()),
        "scratch_fs": _filesystem_of(scratch_dir or Path(tempfile.gettempdir())),
        "ours_serve_args": list(ours_serve_args),
        "state": state,
    }
    specs = plan_runs(profile, workloads, stacks)
    records: list[dict[str, Any]] = [meta]
    runs: list[dict[str, Any]] = []
    # Every run's artifacts stay until the suite ends (see ServerProcess.remove_workdir).
    suite_scratch = Path(tempfile.mkdtemp(prefix="rollout-bench-suite-", dir=scratch_dir))
    with (
        open(jsonl_path, "w", encoding="utf-8") as jsonl,
        _removed_at_exit(suite_scratch),
    ):
        jsonl.write(json.dumps(meta) + "\n")
        for index, spec in enumerate(specs, start=1):
            record = run_one(
                spec,
                pythons=pythons,
                loops=loops,
                log_dir=log_dir,
                py_spy=py_spy,
                scratch_dir=suite_scratch,
                remove_workdir=False,
                ours_serve_args=ours_serve_args,
                state=state,
            )
            runs.append(record)
            records.append(record)
            jsonl.write(json.dumps(record) + "\n")
            jsonl.flush()
            echo.write(_progress(spec, record, index, len(specs)) + "\n")
            echo.flush()
        rows = rows_for(profile, workloads)
        summaries = summary_records(rows, runs, (*stacks, FLOOR) if "ours" in stacks else stacks)
        for summary in summaries:
            jsonl.write(json.dumps(summary) + "\n")
        records += summaries
    meta["load_average_end"] = list(os.getloadavg())
    md_path.write_text(
        _markdown(
            meta=meta,
            profile=profile,
            workloads=workloads,
            rows=rows,
            summaries=summaries,
            runs=runs,
        ),
        "utf-8",
    )
    for source, name in ((jsonl_path, "latest.jsonl"), (md_path, "latest.md")):
        (out_dir / name).write_bytes(source.read_bytes())
    return jsonl_path, md_path, records


def _markdown(
    *,
    meta: dict[str, Any],
    profile: Profile,
    workloads: Sequence[str],
    rows: list[Any],
    summaries: list[dict[str, Any]],
    runs: list[dict[str, Any]],
) -> str:
    versions = meta["versions"]
    python = ", ".join(f"{s}: Python {v.get('python', '?')}" for s, v in versions.items())
    ours_pkgs = versions.get("ours", {}).get("packages", {})
    theirs_pkgs = versions.get("osmosis", {}).get("packages", {})
    lines = [
        f"Measured {meta['date']} on {meta['cpu_count']} cores ({meta['cpu_model']}), "
        f"{python}; profile `{profile.name}`, {profile.repetitions} repetition(s), "
        "median (min–max); load average "  # noqa: RUF001
        f"{meta['load_average_start'][0]:.2f} at the start, "
        f"{meta['load_average_end'][0]:.2f} at the end.",
        "",
    ]
    if "ours" in versions:
        client_loops = sorted({r.get("client_loop", "?") for r in runs if r["client"] == "ours"})
        extra = " ".join(meta.get("ours_serve_args") or ())
        extra = f"--state {meta.get('state', 'memory')} {extra}".strip()
        command = f"`rollout-server serve {extra}`"
        lines.append(
            f"- ours: rollout-server {ours_pkgs.get('rollout-server', '?')} on aiohttp "
            f"{ours_pkgs.get('aiohttp', '?')} ({command}, defaults: uvloop "
            f"{ours_pkgs.get('uvloop', 'absent')}, no access log); ONE rollout-client "
            f"{ours_pkgs.get('rollout-client', '?')} instance on the "
            f"{'/'.join(client_loops) or '?'} loop."
        )
    if "osmosis" in versions:
        lines.append(
            f"- osmosis-ai {theirs_pkgs.get('osmosis-ai', '?')}: FastAPI "
            f"{theirs_pkgs.get('fastapi', '?')} on uvicorn {theirs_pkgs.get('uvicorn', '?')} "
            "(h11, asyncio loop, access log on, keep-alive 2160 s, as its entrypoint runs it); "
            f"one httpx {theirs_pkgs.get('httpx', '?')} RolloutClient per 64 rollouts in flight, "
            "on the asyncio loop."
        )
    lines += [
        f"- artifacts (both stacks create a directory and write trajectory.json per rollout) "
        f"on {meta['scratch_fs']} at `{meta['scratch_dir']}`.",
        "",
    ]
    if rows:
        lines += [main_table(rows, summaries), ""]
    floor = floor_table(rows, summaries)
    if floor is not None:
        lines += [
            "HTTP floor: our client against a bare aiohttp "
            f"{ours_pkgs.get('aiohttp', '?')} app on uvloop (`benchmarks/apps/floor_app.py`: "
            "no middleware, registry, lease or backend; the same admissions, long polls and "
            "release), to show what aiohttp and uvloop alone hold per waiting rollout.",
            "",
            floor,
            "",
        ]
    if "cross" in workloads or "throughput" in workloads:
        lines += [cross_table(profile, runs), ""]
    pool = pool_table(profile, runs) if "pool" in workloads else None
    if pool is not None:
        lines += [
            "Many servers: our client and `RolloutClientPool` (least-outstanding routing) "
            "against one or two `rollout-server serve` processes, the same trivial rollouts "
            "as the throughput workload; server CPU summed over the servers.",
            "",
            pool,
            "",
        ]
    failed = [r for r in runs if not r["ok"]]
    if failed:
        lines.append("Runs with errors or failed rollouts:")
        for run in failed:
            detail = run["error"] or f"{run['failed']} failed; errors: {run.get('errors')}"
            lines.append(
                f"- {run['workloads'][0]} {run['client']}→{run['server']} "
                f"rep {run['repetition']}: {detail.splitlines()[0]}"
            )
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--profile",
        choices=("full", "quick", "tiny"),
        default="full",
        help="counts and timings: full (the reported figures, ~10 min), quick (a smoke "
        "run, about a minute), tiny (the harness test); default full",
    )
    parser.add_argument("--quick", action="store_true", help="same as --profile quick")
    parser.add_argument(
        "--workload",
        action="append",
        choices=WORKLOADS,
        help="run only this workload (repeatable); default all",
    )
    parser.add_argument(
        "--stacks",
        action="append",
        choices=STACKS,
        help="run only this stack (repeatable); default both (cross needs both)",
    )
    parser.add_argument("--repetitions", type=int, help="override the profile's repetitions")
    parser.add_argument("--throughput-count", type=int, help="rollouts per throughput run")
    parser.add_argument(
        "--concurrency", type=int, action="append", help="throughput concurrency (repeatable)"
    )
    parser.add_argument(
        "--inflight-count",
        type=int,
        action="append",
        help="held rollouts, for every stack and the HTTP floor (repeatable)",
    )
    parser.add_argument(
        "--hold-sec", type=float, help="in-flight: seconds from first admission to release"
    )
    parser.add_argument("--ours-python", default=sys.executable, help="our stack's interpreter")
    parser.add_argument("--osmosis-python", help="the osmosis-ai 0.3.8 venv's interpreter")
    parser.add_argument(
        "--ours-client-loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="event loop of our load generator (auto: uvloop when installed)",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=DEFAULT_OUT_DIR,
        help="where results go; default bench-results/ in the repository",
    )
    parser.add_argument(
        "--scratch-dir",
        type=Path,
        help="where servers keep their artifacts (a directory and trajectory.json per "
        "rollout, on both stacks); default the system temporary directory",
    )
    parser.add_argument(
        "--py-spy",
        metavar="PATH",
        help="sample every server with this py-spy executable (profiles go next to the "
        "logs; CPU figures then include the sampling overhead, so do not report them)",
    )
    parser.add_argument(
        "--ours-serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for our rollout-server serve (repeatable), e.g. "
        "--ours-serve-arg=--no-metrics to measure the server without its metrics",
    )
    parser.add_argument(
        "--state",
        choices=STATES,
        default="memory",
        help="our server's state: memory (memory:) or sqlite (a fresh state file per server, "
        "next to its artifacts); default memory",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.profile = "quick"
    for name in ("repetitions", "throughput_count"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("concurrency", "inflight_count"):
        if any(v < 1 for v in getattr(args, name) or ()):
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    args.stacks = tuple(dict.fromkeys(args.stacks or STACKS))
    args.workloads = tuple(dict.fromkeys(args.workload or WORKLOADS))
    if "osmosis" in args.stacks and not args.osmosis_python:
        parser.error(
            "--osmosis-python is required to run the osmosis-ai stack (nox -s bench passes "
            "it); or pass --stacks ours"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite; print the markdown and where the files went.

    Returns:
        0 when every run produced well-formed figures, 1 otherwise (the files are
        written either way).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["gateway"]:  # gateway on vs off (benchmarks/gateway_bench.py)
        from benchmarks import gateway_bench

        return gateway_bench.main(argv[1:])
    args = parse_args(argv)
    profile = profile_named(args.profile)
    inflight = None
    if args.inflight_count:
        counts = tuple(args.inflight_count)
        inflight = dict.fromkeys((*STACKS, FLOOR), counts)
    profile = profile.with_overrides(
        repetitions=args.repetitions,
        throughput_count=args.throughput_count,
        concurrencies=tuple(args.concurrency) if args.concurrency else None,
        inflight_counts=inflight,
        hold_sec=args.hold_sec,
    )
    pythons = {
        "ours": args.ours_python,
        "osmosis": args.osmosis_python or "",
        FLOOR: args.ours_python,
    }
    loops = {"ours": args.ours_client_loop, "osmosis": "asyncio"}
    began = time.monotonic()
    jsonl_path, md_path, records = run_suite(
        profile=profile,
        workloads=args.workloads,
        stacks=args.stacks,
        pythons=pythons,
        loops=loops,
        out_dir=args.out_dir,
        echo=sys.stderr,
        py_spy=args.py_spy,
        scratch_dir=args.scratch_dir,
        ours_serve_args=tuple(args.ours_serve_arg),
        state=args.state,
    )
    sys.stdout.write(md_path.read_text("utf-8"))
    sys.stdout.write(f"\nwrote {jsonl_path} and {md_path} in {time.monotonic() - began:.0f} s\n")
    harness_errors = [r for r in records if r["type"] == "run" and r["error"]]
    return 1 if harness_errors else 0
