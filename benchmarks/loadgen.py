"""Load generator: drive one rollout server with one stack's client, print one JSON object.

Runs in the venv of the client it drives (``python -m benchmarks.loadgen --client ours``
in ours, ``--client osmosis`` in the osmosis-ai venv), in its own process, against a
server the suite started in another. It reads the server's CPU time and memory from
``/proc/<server-pid>`` and its own CPU time from ``getrusage``. Two shapes of load:

- ``closed``: ``--concurrency`` workers run ``--count`` rollouts to completion, each
  starting the next as soon as its last one finished, after ``--warmup`` unmeasured
  rollouts that open the connections. Reports rollouts/s, end-to-end latency
  percentiles, and server and client CPU per rollout. With ``--url`` (and
  ``--server-pid``) given once per server and ``--pool``, our client is a
  ``RolloutClientPool`` over all of them; server CPU and RSS are then their sums.
- ``inflight``: admits ``--count`` rollouts whose workflows hold until released, lets them
  long-poll idle, then releases them all at once with SIGUSR1 to the server. Reports the
  admission rate, server RSS per in-flight rollout, idle server CPU, and how late each
  rollout's result reached its caller.

Every loop is bounded in count, and the whole run by ``--deadline-sec``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib
import json
import math
import os
import re
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, Final, Protocol

from benchmarks.apps.behaviour import RELEASE_SIGNAL
from benchmarks.procstat import cpu_seconds, cpu_times, memory_kib, self_cpu_seconds
from benchmarks.stats import percentile

__all__ = ["main"]

CHAT_COMPLETIONS_URL: Final = "http://127.0.0.1:9/v1"
"""Sent with every rollout; never contacted (the benchmark workflow makes no LLM call)."""

PROMPT: Final = ({"role": "user", "content": "What is 6 * 7?"},)
LABEL: Final = "42"

OSMOSIS_ROLLOUTS_PER_CLIENT: Final = 64
"""In-flight rollouts per osmosis-ai client: one httpx client fails beyond about 100."""

RSS_SAMPLE_INTERVAL_SEC: Final = 0.25
_ID_OR_PORT: Final = re.compile(r"[0-9a-f]{10}-[a-z]-\d+|(?<=:)\d{2,5}\b")
ERROR_KINDS_KEPT: Final = 20


class Adapter(Protocol):
    """One stack's client behind the two calls the workloads need."""

    async def run(self, slot: int, rollout_id: str, metadata: dict[str, Any] | None) -> str:
        """Run one rollout to its end; return its terminal status string."""

    async def submit(
        self, slot: int, rollout_id: str, metadata: dict[str, Any] | None
    ) -> Awaitable[Any]:
        """Admit one rollout; return its handle (awaiting it gives the terminal result)."""

    async def aclose(self) -> None:
        """Close every HTTP client the adapter opened."""


def status_of(result: Any) -> str:
    """The terminal status of a result of either stack, as its wire string."""
    status = result.status
    return str(getattr(status, "value", status))


class OursAdapter:
    """Our ``RolloutClient`` (or ``RolloutClientPool`` over several servers): ONE instance
    carries all the load."""

    def __init__(self, urls: list[str], *, pool: bool) -> None:
        from rollout_client import RolloutClient, RolloutClientPool

        self._client: Any = RolloutClientPool(urls=urls) if pool else RolloutClient(url=urls[0])

    async def run(self, slot: int, rollout_id: str, metadata: dict[str, Any] | None) -> str:
        result = await self._client.run_rollout(
            initial_messages=[dict(message) for message in PROMPT],
            chat_completions_url=CHAT_COMPLETIONS_URL,
            rollout_id=rollout_id,
            label=LABEL,
            metadata=metadata,
        )
        return status_of(result)

    async def submit(
        self, slot: int, rollout_id: str, metadata: dict[str, Any] | None
    ) -> Awaitable[Any]:
        return await self._client.run_rollout_async(
            initial_messages=[dict(message) for message in PROMPT],
            chat_completions_url=CHAT_COMPLETIONS_URL,
            rollout_id=rollout_id,
            label=LABEL,
            metadata=metadata,
        )

    async def aclose(self) -> None:
        await self._client.aclose()


class OsmosisAdapter:
    """osmosis-ai 0.3.8's ``RolloutClient``, one per :data:`OSMOSIS_ROLLOUTS_PER_CLIENT`.

    Each client owns a default ``httpx.AsyncClient()`` (as ``RolloutClient(url=...)``
    would create); slot ``i`` uses client ``i % clients``.
    """

    def __init__(self, url: str, clients: int) -> None:
        httpx = importlib.import_module("httpx")
        client_module = importlib.import_module("osmosis_ai.rollout.client")
        self._http: list[Any] = [httpx.AsyncClient() for _ in range(clients)]
        self._clients: list[Any] = [
            client_module.RolloutClient(url=url, http_client=http) for http in self._http
        ]

    async def run(self, slot: int, rollout_id: str, metadata: dict[str, Any] | None) -> str:
        client = self._clients[slot % len(self._clients)]
        result = await client.run_rollout(
            initial_messages=[dict(message) for message in PROMPT],
            chat_completions_url=CHAT_COMPLETIONS_URL,
            rollout_id=rollout_id,
            label=LABEL,
            metadata=metadata,
        )
        return status_of(result)

    async def submit(
        self, slot: int, rollout_id: str, metadata: dict[str, Any] | None
    ) -> Awaitable[Any]:
        client = self._clients[slot % len(self._clients)]
        handle: Awaitable[Any] = await client.run_rollout_async(
            initial_messages=[dict(message) for message in PROMPT],
            chat_completions_url=CHAT_COMPLETIONS_URL,
            rollout_id=rollout_id,
            label=LABEL,
            metadata=metadata,
        )
        return handle

    async def aclose(self) -> None:
        for http in self._http:
            await http.aclose()


def make_adapter(client: str, urls: list[str], in_flight: int, *, pool: bool = False) -> Adapter:
    """The adapter of ``client`` ("ours" or "osmosis") sized for ``in_flight`` rollouts;
    with ``pool``, ours is a ``RolloutClientPool`` over ``urls``, else the first URL's."""
    if client == "ours":
        return OursAdapter(urls, pool=pool)
    if client == "osmosis":
        return OsmosisAdapter(urls[0], max(1, math.ceil(in_flight / OSMOSIS_ROLLOUTS_PER_CLIENT)))
    raise ValueError(f"client must be 'ours' or 'osmosis'; got {client!r}")


class Tally:
    """Outcomes of a batch of rollouts: latencies of finished ones, statuses and errors."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.statuses: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()

    def finished(self, status: str, latency_sec: float) -> None:
        self.statuses[status] += 1
        self.latencies.append(latency_sec)

    def failed(self, exc: BaseException) -> None:
        # One kind per exception type and message, ids and ports masked so they group.
        message = _ID_OR_PORT.sub("<n>", str(exc))[:160]
        kind = f"{type(exc).__name__}: {message}"
        if kind in self.errors or len(self.errors) < ERROR_KINDS_KEPT:
            self.errors[kind] += 1
        else:
            self.errors["(other errors)"] += 1

    def summary(self) -> dict[str, Any]:
        return {
            "completed": len(self.latencies),
            "succeeded": self.statuses["success"],
            "statuses": dict(self.statuses),
            "errors": dict(self.errors),
        }


def latency_figures(
    prefix: str, values: list[float], scale: float, offset: float = 0.0
) -> dict[str, float | None]:
    """p50, p99 and max of ``values`` minus ``offset``, times ``scale`` (None when empty)."""
    if not values:
        return {f"{prefix}_p50": None, f"{prefix}_p99": None, f"{prefix}_max": None}
    shifted = [value - offset for value in values]
    return {
        f"{prefix}_p50": percentile(shifted, 0.5) * scale,
        f"{prefix}_p99": percentile(shifted, 0.99) * scale,
        f"{prefix}_max": max(shifted) * scale,
    }


async def drive(
    adapter: Adapter,
    rollout_ids: list[str],
    concurrency: int,
    metadata: dict[str, Any] | None,
    tally: Tally,
    *,
    stagger_sec: float = 0.0,
) -> None:
    """Run ``rollout_ids`` on ``concurrency`` workers, each starting its next when done.

    Worker ``i`` starts ``stagger_sec * i / concurrency`` seconds late.
    """
    todo: Iterator[str] = iter(rollout_ids)

    async def worker(slot: int) -> None:
        if stagger_sec > 0:
            await asyncio.sleep(stagger_sec * slot / concurrency)
        for rollout_id in todo:
            started = time.perf_counter()
            try:
                status = await adapter.run(slot, rollout_id, metadata)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                tally.failed(exc)
            else:
                tally.finished(status, time.perf_counter() - started)

    async with asyncio.TaskGroup() as group:
        for slot in range(min(concurrency, len(rollout_ids))):
            group.create_task(worker(slot))


def new_ids(tag: str, count: int) -> list[str]:
    """``count`` fresh rollout ids made of ``[A-Za-z0-9-]`` (safe for both clients)."""
    run = uuid.uuid4().hex[:10]
    return [f"{run}-{tag}-{index}" for index in range(count)]


def servers_cpu_times(pids: list[int]) -> tuple[float, float]:
    """User and system CPU seconds of the server processes, summed."""
    times = [cpu_times(pid) for pid in pids]
    return sum(user for user, _ in times), sum(system for _, system in times)


async def closed_loop(args: argparse.Namespace, adapter: Adapter) -> dict[str, Any]:
    """The ``closed`` workload (see the module docstring)."""
    metadata = {"sleep_sec": args.sleep_sec} if args.sleep_sec > 0 else None
    warmup, measured = Tally(), Tally()
    timed_out = False
    elapsed = server_cpu = server_sys = client_cpu = 0.0
    try:
        async with asyncio.timeout(args.deadline_sec):
            await drive(
                adapter,
                new_ids("w", args.warmup),
                args.concurrency,
                metadata,
                warmup,
                stagger_sec=args.stagger_sec,
            )
            server_user0, server_sys0 = servers_cpu_times(args.server_pids)
            client_cpu0 = self_cpu_seconds()
            started = time.perf_counter()
            try:
                await drive(
                    adapter,
                    new_ids("m", args.count),
                    args.concurrency,
                    metadata,
                    measured,
                    stagger_sec=args.stagger_sec,
                )
            finally:
                elapsed = time.perf_counter() - started
                server_user, server_sys = servers_cpu_times(args.server_pids)
                server_sys -= server_sys0
                server_cpu = server_user - server_user0 + server_sys
                client_cpu = self_cpu_seconds() - client_cpu0
    except TimeoutError:
        timed_out = True
    done = len(measured.latencies)
    per_rollout = 1000.0 / done if done else 0.0
    return {
        "shape": "closed",
        "count": args.count,
        "concurrency": args.concurrency,
        "warmup": args.warmup,
        "sleep_sec": args.sleep_sec,
        "stagger_sec": args.stagger_sec,
        "timed_out": timed_out,
        **measured.summary(),
        "warmup_errors": dict(warmup.errors),
        "elapsed_sec": elapsed,
        "rollouts_per_sec": measured.statuses["success"] / elapsed if elapsed > 0 else None,
        **latency_figures("latency_ms", measured.latencies, 1000.0),
        **latency_figures("overhead_ms", measured.latencies, 1000.0, offset=args.sleep_sec),
        "server_cpu_sec": server_cpu,
        "server_cpu_sys_sec": server_sys,
        "server_cpu_ms_per_rollout": server_cpu * per_rollout if done else None,
        "server_cpu_util": server_cpu / elapsed if elapsed > 0 else None,
        "client_cpu_ms_per_rollout": client_cpu * per_rollout if done else None,
        "server_rss_kib": sum(memory_kib(pid)[0] for pid in args.server_pids),
    }


async def sample_rss(pid: int, peak: list[int], stop: asyncio.Event) -> None:
    """Keep ``peak[0]`` at the largest VmRSS of ``pid`` seen until ``stop`` is set."""
    while not stop.is_set():
        peak[0] = max(peak[0], memory_kib(pid)[0])
        try:
            async with asyncio.timeout(RSS_SAMPLE_INTERVAL_SEC):
                await stop.wait()
        except TimeoutError:
            pass


async def in_flight(args: argparse.Namespace, adapter: Adapter) -> dict[str, Any]:
    """The ``inflight`` workload (see the module docstring)."""
    (pid,) = args.server_pids
    rss_baseline = memory_kib(pid)[0]
    peak = [rss_baseline]
    stop_sampling = asyncio.Event()
    admission, results = Tally(), Tally()
    watchers: list[asyncio.Task[None]] = []
    released_at: float | None = None
    early = [0]
    figures: dict[str, Any] = {}
    # The workflows release themselves at the run's own bound if the signal never comes.
    metadata = {"hold_sec": args.deadline_sec}

    async def watch(handle: Awaitable[Any]) -> None:
        try:
            result = await handle
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            results.failed(exc)
        else:
            if released_at is None:  # finished while it should still be held
                early[0] += 1
                results.finished(status_of(result), 0.0)
            else:
                results.finished(status_of(result), time.perf_counter() - released_at)

    async def admit(todo: Iterator[tuple[int, str]]) -> None:
        for index, rollout_id in todo:
            try:
                handle = await adapter.submit(index, rollout_id, metadata)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                admission.failed(exc)
            else:
                admission.finished("admitted", 0.0)
                watchers.append(asyncio.create_task(watch(handle)))

    timed_out = False
    sampler = asyncio.create_task(sample_rss(pid, peak, stop_sampling))
    try:
        async with asyncio.timeout(args.deadline_sec):
            todo = iter(enumerate(new_ids("f", args.count)))
            started = time.perf_counter()
            async with asyncio.TaskGroup() as group:
                for _ in range(min(args.admission_concurrency, args.count)):
                    group.create_task(admit(todo))
            admitted_at = time.perf_counter()
            figures["admission_sec"] = admitted_at - started
            figures["admission_per_sec"] = admission.statuses["admitted"] / (admitted_at - started)
            # Let every first long poll arrive, then measure the idle-waiting server.
            await asyncio.sleep(args.settle_sec)
            idle_sec = max(args.idle_min_sec, args.hold_sec - (time.perf_counter() - started))
            cpu0, idle_started = cpu_seconds(pid), time.perf_counter()
            await asyncio.sleep(idle_sec)
            figures["idle_sec"] = time.perf_counter() - idle_started
            figures["idle_server_cpu_per_sec"] = (cpu_seconds(pid) - cpu0) / figures["idle_sec"]
            figures["rss_idle_kib"] = memory_kib(pid)[0]
            stop_sampling.set()
            await sampler
            figures["rss_peak_kib"] = peak[0]
            release_cpu0 = cpu_times(pid)
            os.kill(pid, RELEASE_SIGNAL)
            released_at = time.perf_counter()
            client_cpu0 = self_cpu_seconds()
            await asyncio.gather(*watchers)
            figures["release_sec"] = time.perf_counter() - released_at
            release_cpu1 = cpu_times(pid)
            figures["release_server_cpu_ms_per_rollout"] = (
                (sum(release_cpu1) - sum(release_cpu0)) * 1000.0 / len(watchers)
                if watchers
                else None
            )
            figures["release_server_sys_share"] = (release_cpu1[1] - release_cpu0[1]) / max(
                sum(release_cpu1) - sum(release_cpu0), 1e-9
            )
            figures["client_cpu_ms_per_release"] = (
                (self_cpu_seconds() - client_cpu0) * 1000.0 / len(watchers) if watchers else None
            )
    except TimeoutError:
        timed_out = True
    finally:
        stop_sampling.set()
        for task in [sampler, *watchers]:
            task.cancel()
        await asyncio.gather(sampler, *watchers, return_exceptions=True)
    admitted = admission.statuses["admitted"]
    rss_grown = figures.get("rss_peak_kib", peak[0]) - rss_baseline
    return {
        "shape": "inflight",
        "count": args.count,
        "hold_sec": args.hold_sec,
        "timed_out": timed_out,
        "admitted": admitted,
        "admission_errors": dict(admission.errors),
        **results.summary(),
        "finished_before_release": early[0],
        "rss_baseline_kib": rss_baseline,
        "rss_per_inflight_kib": rss_grown / admitted if admitted else None,
        **figures,
        **latency_figures("release_late_sec", results.latencies, 1.0),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", choices=("ours", "osmosis"), required=True)
    parser.add_argument(
        "--url",
        dest="urls",
        action="append",
        required=True,
        help="server base URL (loopback); once per server",
    )
    parser.add_argument(
        "--server-pid",
        dest="server_pids",
        type=int,
        action="append",
        required=True,
        help="each server's process id, in --url order",
    )
    parser.add_argument(
        "--pool", action="store_true", help="ours: drive the servers with RolloutClientPool"
    )
    parser.add_argument("--shape", choices=("closed", "inflight"), required=True)
    parser.add_argument("--count", type=int, required=True, help="measured rollouts")
    parser.add_argument("--concurrency", type=int, default=1, help="closed: workers")
    parser.add_argument("--warmup", type=int, default=0, help="closed: unmeasured rollouts")
    parser.add_argument("--sleep-sec", type=float, default=0.0, help="closed: workflow sleep")
    parser.add_argument(
        "--stagger-sec", type=float, default=0.0, help="closed: spread of worker starts"
    )
    parser.add_argument("--hold-sec", type=float, default=20.0, help="inflight: hold target")
    parser.add_argument("--idle-min-sec", type=float, default=5.0, help="inflight: idle window")
    parser.add_argument("--settle-sec", type=float, default=1.0, help="inflight: before idle")
    parser.add_argument("--admission-concurrency", type=int, default=128)
    parser.add_argument("--deadline-sec", type=float, required=True, help="bound on the run")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="asyncio")
    args = parser.parse_args(argv)
    for name in ("count", "concurrency", "admission_concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if len(args.urls) != len(args.server_pids):
        parser.error("give --server-pid once per --url")
    if len(args.urls) > 1 and not (args.pool and args.client == "ours" and args.shape == "closed"):
        parser.error("several servers need --pool, --client ours and --shape closed")
    if args.warmup < 0 or not 0 < args.deadline_sec < math.inf:
        parser.error("--warmup must be >= 0 and --deadline-sec finite and > 0")
    return args


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    in_flight_rollouts = args.count if args.shape == "inflight" else args.concurrency
    adapter = make_adapter(args.client, args.urls, in_flight_rollouts, pool=args.pool)
    workload: Callable[[argparse.Namespace, Adapter], Coroutine[Any, Any, dict[str, Any]]] = (
        closed_loop if args.shape == "closed" else in_flight
    )
    try:
        return await workload(args, adapter)
    finally:
        await adapter.aclose()


def main(argv: list[str] | None = None) -> int:
    """Run one workload and print its figures as one JSON line on stdout."""
    args = parse_args(argv)
    loop_name = args.loop
    if loop_name == "auto":
        try:
            importlib.import_module("uvloop")
        except ImportError:
            loop_name = "asyncio"
        else:
            loop_name = "uvloop"
    loop_factory = None
    if loop_name == "uvloop":
        loop_factory = importlib.import_module("uvloop").new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        figures = runner.run(_run(args))
    figures["client"] = args.client
    figures["client_loop"] = loop_name
    figures["client_python"] = sys.version.split()[0]
    sys.stdout.write(json.dumps(figures, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
