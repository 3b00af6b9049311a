"""RayBackend against LocalBackend: overhead, scaling, long-poll responsiveness, recovery.

``python -m benchmarks.ray_bench`` (in a venv with rollout-client and rollout-server[ray]; the
``bench_ray`` nox session makes one) starts ``rollout-server serve
benchmarks.apps.ray_app:backend`` on 127.0.0.1 once per configuration, drives it with one
``RolloutClient`` from this process, stops it by its PID and prints one JSON line per
configuration and a markdown table. Workloads:

* ``overhead``: no-op rollouts one at a time; end-to-end latency p50/p99 and the server
  process's CPU per rollout (LocalBackend; RayBackend with 1 worker).
* ``scaling``: a closed loop at concurrency 16 of rollouts that compute 20 ms of pure Python
  each; rollouts/s (LocalBackend, RayBackend with 1 and 2 workers). Meanwhile, probe
  rollouts (sleep 0.2 s, no CPU) one at a time measure how late their result reaches the
  caller after the workflow finished (``done_at`` against the receipt, both wall clock on
  this machine; with Ray it includes the wait for the worker's own busy loop), and a
  ``GET /health`` every 50 ms measures the server's own responsiveness (what every long
  poll waits on).
* ``recovery``: RayBackend with 2 workers and 8 sleeping rollouts; SIGKILL of one worker;
  seconds until each of its rollouts is published as a failure, and until the pool serves
  again with every worker alive (a new rollout succeeds on a full pool).

Every loop is bounded in count and time; the machine's load average is recorded with each
result (the machine may be shared).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

import aiohttp

from benchmarks.processes import ROOT, HarnessError, stop_process
from benchmarks.procstat import cpu_seconds
from benchmarks.stats import percentile
from rollout_client import RolloutClient

START_TIMEOUT_SEC: Final = 120.0
PROMPT: Final = [{"role": "user", "content": "What is 6 * 7?"}]
RUN_BOUND_SEC: Final = 300.0
"""Bound on one configuration's load."""


def load_average() -> float:
    """The 1-minute load average of this machine."""
    return os.getloadavg()[0]


@contextlib.contextmanager
def server(backend: str, workers: int = 1, slots: int = 16) -> Iterator[tuple[str, int]]:
    """Serve ``benchmarks.apps.ray_app:backend`` on 127.0.0.1; yield ``(url, pid)``."""
    work = Path(tempfile.mkdtemp(prefix="rollout-ray-bench-"))
    port_file = work / "port"
    env = dict(os.environ)
    env.update(
        BENCH_BACKEND=backend,
        BENCH_WORKERS=str(workers),
        BENCH_SLOTS=str(slots),
        ROLLOUT_ARTIFACT_ROOT=str(work / "artifacts"),
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
    )
    log = open(work / "server.log", "wb")  # noqa: SIM115 - closed in the finally below
    command = [
        sys.executable, "-m", "rollout_server", "serve", "benchmarks.apps.ray_app:backend",
        "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
        "--app-dir", str(ROOT),
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_SEC
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise HarnessError(f"server did not start; see {work / 'server.log'}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text().strip()}", process.pid
    finally:
        stop_process(process)
        log.close()


@contextlib.asynccontextmanager
async def client(url: str) -> AsyncIterator[RolloutClient]:
    """One ``RolloutClient`` on ``url`` with its own session."""
    async with aiohttp.ClientSession() as session:
        yield RolloutClient(url=url, http_client=session, admission_timeout_sec=120)


async def rollout(rollout_client: RolloutClient, metadata: dict[str, Any] | None) -> Any:
    """One ungraded rollout to its result."""
    return await rollout_client.run_rollout(
        initial_messages=PROMPT,
        chat_completions_url="http://127.0.0.1:9/v1",
        rollout_id=uuid.uuid4().hex,
        metadata=metadata,
        grade=False,
    )


async def overhead(backend: str, count: int) -> dict[str, Any]:
    """No-op rollouts one at a time: latency and server CPU per rollout."""
    with server(backend) as (url, pid):
        async with client(url) as rollout_client:
            for _ in range(20):  # warm-up: connections, the worker's first imports
                await rollout(rollout_client, None)
            latencies = []
            cpu_before = cpu_seconds(pid)
            async with asyncio.timeout(RUN_BOUND_SEC):
                for _ in range(count):
                    start = time.perf_counter()
                    result = await rollout(rollout_client, None)
                    latencies.append(time.perf_counter() - start)
                    if result.status != "success":
                        raise HarnessError(f"a no-op rollout ended {result.status}")
            cpu = cpu_seconds(pid) - cpu_before
    return {
        "workload": "overhead",
        "backend": backend,
        "rollouts": count,
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "server_cpu_ms_per_rollout": cpu / count * 1e3,
    }


async def scaling(backend: str, workers: int, count: int, concurrency: int) -> dict[str, Any]:
    """A closed loop of 20 ms CPU rollouts, with sequential probes of the long poll."""
    with server(backend, workers=workers) as (url, _pid):
        async with client(url) as rollout_client:
            for _ in range(concurrency):
                await rollout(rollout_client, {"cpu_ms": 20})
            remaining = count
            stop = asyncio.Event()

            async def loop() -> None:
                nonlocal remaining
                while remaining > 0:
                    remaining -= 1
                    await rollout(rollout_client, {"cpu_ms": 20})

            delays: list[float] = []

            async def probe() -> None:
                while not stop.is_set():
                    result = await rollout(rollout_client, {"sleep_sec": 0.2})
                    received = time.time()
                    assert result.sample is not None
                    delays.append(received - float(result.sample.metrics["done_at"]))

            pings: list[float] = []

            async def ping() -> None:
                while not stop.is_set():
                    start = time.perf_counter()
                    await rollout_client.health()
                    pings.append(time.perf_counter() - start)
                    await asyncio.sleep(0.05)

            async with asyncio.timeout(RUN_BOUND_SEC):
                probers = [asyncio.create_task(probe()), asyncio.create_task(ping())]
                start = time.perf_counter()
                await asyncio.gather(*(loop() for _ in range(concurrency)))
                elapsed = time.perf_counter() - start
                stop.set()
                await asyncio.gather(*probers)
    return {
        "workload": "scaling",
        "backend": backend,
        "workers": workers if backend == "ray" else None,
        "rollouts": count,
        "concurrency": concurrency,
        "rollouts_per_sec": count / elapsed,
        "probes": len(delays),
        "notify_p50_ms": percentile(delays, 0.5) * 1e3,
        "notify_p99_ms": percentile(delays, 0.99) * 1e3,
        "health_p50_ms": percentile(pings, 0.5) * 1e3,
        "health_p99_ms": percentile(pings, 0.99) * 1e3,
    }


async def recovery(in_flight: int) -> dict[str, Any]:
    """SIGKILL of one of 2 workers with rollouts in flight: time to failures, to a full pool."""
    with server("ray", workers=2, slots=8) as (url, _pid):
        async with client(url) as rollout_client:
            handles = [
                await rollout_client.run_rollout_async(
                    initial_messages=PROMPT,
                    chat_completions_url="http://127.0.0.1:9/v1",
                    rollout_id=uuid.uuid4().hex,
                    metadata={"sleep_sec": 60},
                    grade=False,
                )
                for _ in range(in_flight)
            ]
            async with asyncio.timeout(RUN_BOUND_SEC):
                while (await rollout_client.health())["concurrency"]["running"] < in_flight:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
                pool = (await rollout_client.health())["ray"]["pool"]
                victim = pool[0]["pid"]
                killed_at = time.perf_counter()
                os.kill(victim, signal.SIGKILL)
                done, pending = await asyncio.wait(
                    [asyncio.ensure_future(handle.wait_for_completion()) for handle in handles],
                    return_when=asyncio.FIRST_COMPLETED,
                )
                failures = [task.result() for task in done]
                while len(failures) < pool[0]["running"]:
                    more, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    failures += [task.result() for task in more]
                failed_after = time.perf_counter() - killed_at
                while (await rollout_client.health())["ray"]["workers_alive"] < 2:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
                alive_after = time.perf_counter() - killed_at
                served = await rollout(rollout_client, None)
                served_after = time.perf_counter() - killed_at
                for task in pending:
                    task.cancel()
    statuses = sorted({(_text(r.status), _text(r.err_category)) for r in failures})
    return {
        "workload": "recovery",
        "backend": "ray",
        "in_flight": in_flight,
        "failed_rollouts": len(failures),
        "outcomes": [list(pair) for pair in statuses],
        "all_failed_after_sec": failed_after,
        "replacement_alive_after_sec": alive_after,
        "next_rollout": _text(served.status),
        "next_rollout_done_after_sec": served_after,
    }


def _text(value: Any) -> str:
    """An enum's value (or the value itself) as text."""
    return str(getattr(value, "value", value))


def table(results: list[dict[str, Any]]) -> str:
    """A markdown table of the results."""
    lines = ["| workload | backend | figures | load avg |", "|---|---|---|---|"]
    for result in results:
        figures = {
            k: round(v, 2) if isinstance(v, float) else str(v) if isinstance(v, list) else v
            for k, v in result.items()
            if k not in ("workload", "backend", "load_average")
        }
        lines.append(
            f"| {result['workload']} | {result['backend']} | {figures} | "
            f"{result['load_average']:.1f} |"
        )
    return "\n".join(lines)


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--overhead-count", type=int, default=300)
    parser.add_argument("--scaling-count", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--workload", action="append", choices=("overhead", "scaling", "recovery"))
    args = parser.parse_args(argv)
    chosen = args.workload or ["overhead", "scaling", "recovery"]
    runs: list[Any] = []
    if "overhead" in chosen:
        runs += [overhead("local", args.overhead_count), overhead("ray", args.overhead_count)]
    if "scaling" in chosen:
        runs += [
            scaling(backend, workers, args.scaling_count, args.concurrency)
            for backend, workers in (("local", 1), ("ray", 1), ("ray", 2))
        ]
    if "recovery" in chosen:
        runs.append(recovery(args.in_flight))
    results = []
    for run in runs:
        result = await run
        result["load_average"] = load_average()
        print(json.dumps(result), flush=True)
        results.append(result)
    print(table(results))


if __name__ == "__main__":
    asyncio.run(main())
