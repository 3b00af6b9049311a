"""``python -m benchmarks.paired``: two configurations of our server, measured side by side.

A difference of a few percent of server CPU drowns in the noise of a shared machine when
the configurations run one after the other (the suite's repetitions are minutes apart).
Here both servers run at once (``rollout-server serve benchmarks.apps.ours_app:backend``,
A with ``--a-arg`` options and B with ``--b-arg``), and one ``RolloutClient`` per server,
in this process, drives them in interleaved batches (alternating which goes first): each
batch's server CPU (from ``/proc``) and rate are measured while the other server idles,
so both see the machine at nearly the same time. With no options it is an A/A run: the
noise floor of the machine. Run it in the venv of ``nox -s bench``::

    .nox/bench/bin/python -m benchmarks.paired --b-arg=--no-metrics   # metrics on vs off
    .nox/bench/bin/python -m benchmarks.paired                        # A/A

It prints one JSON object: per configuration the median, min and max of rollouts/s and
of server CPU ms per rollout over the batches, the median and range of the per-pair CPU
ratio A/B, and the load average at the start and the end. Every batch is bounded by
``--batch-timeout-sec``; each server is stopped by its PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.loadgen import CHAT_COMPLETIONS_URL, LABEL, PROMPT, status_of
from benchmarks.processes import ServerProcess
from benchmarks.procstat import cpu_seconds

__all__ = ["main", "measure"]


def _spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of ``values`` (empty for none)."""
    if not values:
        return {}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


async def _batch(client: Any, count: int, concurrency: int, timeout_sec: float) -> None:
    slots = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with slots:
            result = await client.run_rollout(
                initial_messages=[dict(message) for message in PROMPT],
                chat_completions_url=CHAT_COMPLETIONS_URL,
                rollout_id=uuid.uuid4().hex,
                label=LABEL,
            )
        if status_of(result) != "success":
            raise RuntimeError(f"a benchmark rollout ended {status_of(result)}: {result!r}")

    async with asyncio.timeout(timeout_sec):
        await asyncio.gather(*(one() for _ in range(count)))


async def measure(
    urls: dict[str, str],
    pids: dict[str, int],
    *,
    rounds: int,
    batch: int,
    concurrency: int,
    warmup: int,
    batch_timeout_sec: float,
) -> dict[str, Any]:
    """Drive the servers named in ``urls`` in interleaved batches; return the figures."""
    from rollout_client import RolloutClient

    cpu: dict[str, list[float]] = {name: [] for name in urls}
    rate: dict[str, list[float]] = {name: [] for name in urls}
    clients = {name: RolloutClient(url=url) for name, url in urls.items()}
    try:
        for client in clients.values():
            await _batch(client, warmup, concurrency, batch_timeout_sec)
        names = list(urls)
        for index in range(rounds):
            for name in names if index % 2 == 0 else reversed(names):
                before, began = cpu_seconds(pids[name]), time.monotonic()
                await _batch(clients[name], batch, concurrency, batch_timeout_sec)
                took, used = time.monotonic() - began, cpu_seconds(pids[name]) - before
                cpu[name].append(used / batch * 1000.0)
                rate[name].append(batch / took)
    finally:
        for client in clients.values():
            await client.aclose()
    first, second = list(urls)
    ratios = [a / b for a, b in zip(cpu[first], cpu[second], strict=True) if b > 0]
    return {
        "rollouts_per_sec": {name: _spread(values) for name, values in rate.items()},
        "server_cpu_ms_per_rollout": {name: _spread(values) for name, values in cpu.items()},
        "cpu_ratio_a_over_b": _spread(ratios),
        "cpu_ms_per_batch": cpu,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the paired measurement (see the module docstring); print its JSON."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paired", description=__doc__)
    parser.add_argument("--a-arg", action="append", default=[], metavar="ARG")
    parser.add_argument("--b-arg", action="append", default=[], metavar="ARG")
    parser.add_argument("--rounds", type=int, default=16, help="batches per server")
    parser.add_argument("--batch", type=int, default=1500, help="rollouts per batch")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=128, help="unmeasured rollouts first")
    parser.add_argument("--batch-timeout-sec", type=float, default=300.0)
    args = parser.parse_args(argv)
    if min(args.rounds, args.batch, args.concurrency) < 1 or args.warmup < 0:
        parser.error("--rounds, --batch and --concurrency must be at least 1")
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rollout-bench-paired-") as scratch:
        logs = Path(scratch)
        with (
            ServerProcess(
                stack="ours",
                python=sys.executable,
                log_path=logs / "a.log",
                scratch_dir=logs,
                serve_args=args.a_arg,
            ) as server_a,
            ServerProcess(
                stack="ours",
                python=sys.executable,
                log_path=logs / "b.log",
                scratch_dir=logs,
                serve_args=args.b_arg,
            ) as server_b,
        ):
            figures = asyncio.run(
                measure(
                    {"a": server_a.url, "b": server_b.url},
                    {"a": server_a.pid, "b": server_b.pid},
                    rounds=args.rounds,
                    batch=args.batch,
                    concurrency=args.concurrency,
                    warmup=args.warmup,
                    batch_timeout_sec=args.batch_timeout_sec,
                )
            )
    report = {
        "a_args": args.a_arg,
        "b_args": args.b_arg,
        "rounds": args.rounds,
        "batch": args.batch,
        "concurrency": args.concurrency,
        "cpu_count": os.cpu_count(),
        "load_average_start": list(load_start),
        "load_average_end": list(os.getloadavg()),
        **figures,
    }
    sys.stdout.write(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
