"""RayBackend against LocalBackend: overhead, scaling, long-poll responsiveness, recovery.

``python -m benchmarks.ray_bench`` (in a venv with rollout-client and rollout-server[ray]; the
``bench_ray`` nox session makes one) starts ``rollout-server serve
benchmarks.apps.ray_app:backend`` on 127.0.0.1 once per run, drives it with one
``RolloutClient`` from this process, stops it by its PID, and prints one JSON line per run,
then a summary per configuration (median, min and max over the ``--repeats`` runs). The
configurations of a workload run in turn, ABAB..., the order reversed every other round, so
a change in the machine's load hits all of them alike. Workloads:

* ``overhead``: no-op rollouts (ungraded) one at a time: end-to-end latency p50/p99, and the
  CPU per rollout of every process (LocalBackend; RayBackend with 1 worker); and, as the
  floor under RayBackend's figure, one no-op call at a time of an async Ray actor from this
  process (``ray-call``: a request-sized tuple there and back, no server);
* ``scaling``: a closed loop at ``--concurrency`` (16) of rollouts that compute 20 ms of
  pure Python each, ``--slots`` (4) per worker: rollouts/s (LocalBackend, RayBackend with 1
  and 2 workers) and CPU per rollout of every process. Meanwhile, one at a time each, probes of
  how fast a long poll learns of a result: while the loop still submits, a rollout admitted
  behind the loop's (it waits for a slot) is cancelled and the time from sending the
  cancellation to the waiting poll's answer taken (``notify``; the server alone; the count
  of probes the caller did not know as ``queued`` is reported); and a rollout that sleeps
  0.2 s (no CPU) is run, the time from its workflow's end (``done_at``, wall clock) to the
  caller's receipt taken (``result delay``; with Ray it includes the worker's own busy
  loop, which the sleeping rollout shares with the computing ones); and ``GET /health``
  round trips;
* ``recovery``: RayBackend with 2 workers of 4 slots and 8 sleeping rollouts; SIGKILL of one
  worker; seconds until each of its rollouts is published as a failure, until the pool has
  every worker alive again, and until a new rollout has succeeded.

CPU per rollout is read from ``/proc`` for the server's whole process tree (the server
itself, which is the Ray driver; ``gcs_server``; ``raylet``; the ``RolloutWorker`` actors;
any other Ray process) and for this process (the client). Every loop is bounded in count
and time; the 1-minute load average is recorded with each run (the machine may be shared).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, Final

import aiohttp

from benchmarks.processes import ROOT, HarnessError, stop_process
from benchmarks.procstat import self_cpu_seconds
from benchmarks.ray_cpu import CpuMeter
from benchmarks.stats import percentile, summarize
from rollout_client import RolloutClient

START_TIMEOUT_SEC: Final = 120.0
PROMPT: Final = [{"role": "user", "content": "What is 6 * 7?"}]
RUN_BOUND_SEC: Final = 300.0
"""Bound on one run's load."""
CPU_MS: Final = 20
"""Pure-Python CPU time of one rollout of the scaling workload, in milliseconds."""
PROBE_SETTLE_SEC: Final = 0.02
"""Pause between admitting a notify probe and cancelling it: its long poll is then waiting
(a round trip on 127.0.0.1 takes about a millisecond), and the rollouts of the loop ahead
of it (each at least 20 ms of CPU) still hold every slot."""
NOTIFY_PAUSE_SEC: Final = 0.1
"""Pause between notify probes (about 8 a second: enough samples for a p99 in a run, few
enough not to weigh on the load)."""
PROBE_SLEEP_SEC: Final = 60.0
"""What a notify probe's workflow would sleep if it got a slot: it never ends on its own."""


def load_average() -> float:
    """The 1-minute load average of this machine."""
    return os.getloadavg()[0]


@contextlib.contextmanager
def server(backend: str, workers: int = 1, slots: int = 4) -> Iterator[tuple[str, int]]:
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
        "--app-dir", str(ROOT), *(["--access-log"] if os.environ.get("BENCH_ACCESS_LOG") else []),
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
    shutil.rmtree(work, ignore_errors=True)  # kept (with its server.log) when the run failed


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


def _label(backend: str, workers: int) -> str:
    return "local" if backend == "local" else f"ray-{workers}w"


async def overhead(backend: str, count: int) -> dict[str, Any]:
    """No-op rollouts one at a time: latency and CPU per rollout."""
    load_before = load_average()
    with server(backend) as (url, pid):
        async with client(url) as rollout_client:
            for _ in range(30):  # warm-up: connections, the worker's first imports
                await rollout(rollout_client, None)
            latencies = []
            meter = CpuMeter(pid)
            meter.start()
            async with asyncio.timeout(RUN_BOUND_SEC):
                for _ in range(count):
                    start = time.perf_counter()
                    result = await rollout(rollout_client, None)
                    latencies.append(time.perf_counter() - start)
                    if result.status != "success":
                        raise HarnessError(f"a no-op rollout ended {result.status}")
            cpu = meter.per_rollout_ms(count)
    return {
        "workload": "overhead",
        "config": _label(backend, 1),
        "rollouts": count,
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "cpu_ms_per_rollout": cpu,
        "load_before": load_before,
        "load_after": load_average(),
    }


class _Echo:
    """A Ray actor whose one async method returns its argument (the floor of a call)."""

    async def run(self, payload: Any) -> Any:
        return payload


async def ray_call(count: int) -> dict[str, Any]:
    """The floor under RayBackend's overhead: one no-op call of an async actor at a time,
    awaited from this process's loop with a request-sized tuple (no server, no HTTP)."""
    load_before = load_average()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # 127.0.0.1 only
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(_Echo).options(num_cpus=1, enable_task_events=False).remote()
        payload = (1, uuid.uuid4().hex, PROMPT, "http://127.0.0.1:9/v1", None, None, None,
                   False, None, None, None, 0.001, "process")  # fmt: skip
        for _ in range(30):
            await actor.run.remote(payload)
        latencies = []
        cpu_before = self_cpu_seconds()
        async with asyncio.timeout(RUN_BOUND_SEC):
            for _ in range(count):
                start = time.perf_counter()
                await actor.run.remote(payload)
                latencies.append(time.perf_counter() - start)
        caller_cpu = self_cpu_seconds() - cpu_before
    finally:
        ray.shutdown()
    return {
        "workload": "overhead",
        "config": "ray-call",
        "rollouts": count,
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "cpu_ms_per_rollout": {"client": caller_cpu / count * 1e3},
        "load_before": load_before,
        "load_after": load_average(),
    }


async def _notify_probe(rollout_client: RolloutClient) -> tuple[float, str]:
    """Seconds from cancelling a waiting rollout to its long poll's answer, and the status
    the caller knew when it cancelled (``queued``: the server alone decided the answer)."""
    handle = await rollout_client.run_rollout_async(
        initial_messages=PROMPT,
        chat_completions_url="http://127.0.0.1:9/v1",
        rollout_id=uuid.uuid4().hex,
        metadata={"sleep_sec": PROBE_SLEEP_SEC},
        grade=False,
    )
    waiting = asyncio.ensure_future(handle.wait_for_completion())
    await asyncio.sleep(PROBE_SETTLE_SEC)
    known = _text(handle.status)
    start = time.perf_counter()
    await rollout_client.cancel_rollout(handle.rollout_id)
    result = await waiting
    elapsed = time.perf_counter() - start
    if _text(result.status) != "cancelled":
        raise HarnessError(f"a notify probe ended {result.status} (it was not waiting)")
    return elapsed, known


async def scaling(
    backend: str, workers: int, count: int, concurrency: int, slots: int
) -> dict[str, Any]:
    """A closed loop of CPU-bound rollouts, with sequential probes of the long poll."""
    load_before = load_average()
    with server(backend, workers=workers, slots=slots) as (url, pid):
        async with client(url) as rollout_client:
            await asyncio.gather(
                *(rollout(rollout_client, {"cpu_ms": CPU_MS}) for _ in range(concurrency))
            )
            remaining = count
            stop = asyncio.Event()

            async def loop() -> None:
                nonlocal remaining
                while remaining > 0:
                    remaining -= 1
                    await rollout(rollout_client, {"cpu_ms": CPU_MS})

            notifies: list[float] = []
            delays: list[float] = []

            not_queued = 0

            async def notify() -> None:
                nonlocal not_queued
                # Only while the loop still submits: every slot is then busy and rollouts
                # wait ahead of the probe (once it drains, a probe would run on a worker,
                # and its cancellation wait for that worker's busy loop).
                while not stop.is_set() and remaining > 0:
                    elapsed, known = await _notify_probe(rollout_client)
                    notifies.append(elapsed)
                    not_queued += known != "queued"
                    await asyncio.sleep(NOTIFY_PAUSE_SEC)

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

            meter = CpuMeter(pid)
            async with asyncio.timeout(RUN_BOUND_SEC):
                meter.start()
                probers = [asyncio.create_task(task()) for task in (notify, probe, ping)]
                start = time.perf_counter()
                await asyncio.gather(*(loop() for _ in range(concurrency)))
                elapsed = time.perf_counter() - start
                stop.set()
                await asyncio.gather(*probers)
            # The probes' rollouts ran too; count them with the rest.
            cpu = meter.per_rollout_ms(count + len(delays) + len(notifies))
    return {
        "workload": "scaling",
        "config": _label(backend, workers),
        "rollouts": count,
        "concurrency": concurrency,
        "slots_per_worker": slots,
        "rollouts_per_sec": count / elapsed,
        "cpu_ms_per_rollout": cpu,
        "probes": len(delays),
        "notify_probes": len(notifies),
        "notify_probes_not_queued": not_queued,
        "notify_p50_ms": percentile(notifies, 0.5) * 1e3,
        "notify_p99_ms": percentile(notifies, 0.99) * 1e3,
        "result_delay_p50_ms": percentile(delays, 0.5) * 1e3,
        "result_delay_p99_ms": percentile(delays, 0.99) * 1e3,
        "health_p50_ms": percentile(pings, 0.5) * 1e3,
        "health_p99_ms": percentile(pings, 0.99) * 1e3,
        "load_before": load_before,
        "load_after": load_average(),
    }


async def recovery(in_flight: int) -> dict[str, Any]:
    """SIGKILL of one of 2 workers with rollouts in flight: time to failures, to a full pool."""
    load_before = load_average()
    with server("ray", workers=2, slots=4) as (url, _pid):
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
        "config": "ray-2w",
        "in_flight": in_flight,
        "failed_rollouts": len(failures),
        "outcomes": [list(pair) for pair in statuses],
        "all_failed_after_sec": failed_after,
        "replacement_alive_after_sec": alive_after,
        "next_rollout": _text(served.status),
        "next_rollout_done_after_sec": served_after,
        "load_before": load_before,
        "load_after": load_average(),
    }


def _text(value: Any) -> str:
    """An enum's value (or the value itself) as text."""
    return str(getattr(value, "value", value))


def _numbers(result: dict[str, Any]) -> dict[str, float]:
    """The numeric figures of one run, nested ones flattened (``cpu_ms_per_rollout.raylet``)."""
    flat: dict[str, float] = {}
    for key, value in result.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{inner}": float(item) for inner, item in value.items()})
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[key] = float(value)
    return flat


def summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload and configuration: median, min and max of every figure over its runs."""
    groups: dict[tuple[str, str], list[dict[str, float]]] = {}
    for result in results:
        groups.setdefault((result["workload"], result["config"]), []).append(_numbers(result))
    rows = []
    for (workload, config), runs in groups.items():
        keys = sorted({key for run in runs for key in run})
        figures = {
            key: summarize([run[key] for run in runs if key in run])
            for key in keys
            if all(key in run for run in runs)
        }
        rows.append({"workload": workload, "config": config, "runs": len(runs), **figures})
    return rows


def _rounds(
    repeats: int, runs: list[Callable[[], Coroutine[Any, Any, dict[str, Any]]]]
) -> Iterator[Callable[[], Coroutine[Any, Any, dict[str, Any]]]]:
    """ABAB...: every configuration once per round, the order reversed every other round."""
    for index in range(repeats):
        yield from runs if index % 2 == 0 else reversed(runs)


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n", maxsplit=1)[0])
    parser.add_argument("--overhead-count", type=int, default=300)
    parser.add_argument("--scaling-count", type=int, default=1200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--slots", type=int, default=4, help="slots per worker (and local)")
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration")
    parser.add_argument(
        "--config",
        action="append",
        choices=("local", "ray-1w", "ray-2w"),
        help="configurations of the scaling workload (default all three)",
    )
    parser.add_argument("--workload", action="append", choices=("overhead", "scaling", "recovery"))
    parser.add_argument("--output", type=Path, help="also write every run as JSON lines here")
    args = parser.parse_args(argv)
    chosen = args.workload or ["overhead", "scaling", "recovery"]
    configs = args.config or ["local", "ray-1w", "ray-2w"]
    schedule: list[Callable[[], Coroutine[Any, Any, dict[str, Any]]]] = []
    if "overhead" in chosen:
        schedule += _rounds(
            args.repeats,
            [
                functools.partial(overhead, "local", args.overhead_count),
                functools.partial(overhead, "ray", args.overhead_count),
                functools.partial(ray_call, args.overhead_count),
            ],
        )
    if "scaling" in chosen:
        runs = [
            functools.partial(
                scaling, backend, workers, args.scaling_count, args.concurrency, args.slots
            )
            for backend, workers in (("local", 1), ("ray", 1), ("ray", 2))
            if _label(backend, workers) in configs
        ]
        schedule += _rounds(args.repeats, runs)
    if "recovery" in chosen:
        schedule += [functools.partial(recovery, args.in_flight)] * args.repeats
    results = []
    for run in schedule:
        result = await run()
        print(json.dumps(result), flush=True)
        if args.output is not None:
            with args.output.open("a", encoding="utf-8") as output:
                output.write(json.dumps(result) + "\n")
        results.append(result)
    for row in summary(results):
        print(json.dumps(row))


if __name__ == "__main__":
    asyncio.run(main())
