"""The model gateway's cost: gateway on against gateway off, same machine, same run.

``python -m benchmarks gateway`` (or ``python -m benchmarks.gateway_bench``) starts the chat
stand-in (``tools/chat_standin/server.py``) once, then, per round, ``rollout-server serve
benchmarks.apps.gateway_app:backend`` twice on 127.0.0.1: without and with ``--gateway``
(the order alternates between rounds, so a change in the machine's load hits both alike).
Each rollout is the 2-call workflow of :mod:`benchmarks.apps.gateway_app` (a tool call, then
the answer), ungraded, driven by one ``RolloutClient`` from this process:

* ``throughput``: a closed loop at ``--concurrency`` (64) of ``--count`` rollouts, after one
  unmeasured rollout per worker: rollouts/s, and the workflow-side time of each model call
  (p50, p99);
* ``latency``: ``--latency-count`` rollouts one at a time: the workflow-side time of each
  model call, p50 and p99; the gateway's added latency is the difference of these
  percentiles, gateway on minus off (negative values are noise).

Then ``memory``: in this process, one route of a started :class:`~rollout_server.ModelGateway`
captures ``--memory-turns`` turns of the same two calls against the stand-in; the bytes
traced by :mod:`tracemalloc` (after a collection) over the turns is the memory per captured
turn (request messages, answer, token ids and logprobs; the stand-in's prompts are 30 to 60
tokens, its completions about 15).

Each run prints one JSON line; the summary (median over rounds) follows, with the 1-minute
load average, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import aiohttp

from benchmarks.processes import ROOT, HarnessError
from benchmarks.stats import percentile, summarize

__all__ = ["main"]

START_TIMEOUT_SEC: Final = 120.0
RUN_BOUND_SEC: Final = 600.0
PROMPT: Final = [{"role": "user", "content": "What is 17 * 23?"}]
PROFILES: Final = {
    "short": {"count": 640, "latency_count": 100, "repeats": 2, "memory_turns": 400},
    "full": {"count": 3200, "latency_count": 400, "repeats": 3, "memory_turns": 2000},
}


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextlib.contextmanager
def _process(command: list[str], name: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """Run ``command`` (which writes its port to ``{port_file}``); yield its base URL."""
    work = Path(tempfile.mkdtemp(prefix=f"gateway-bench-{name}-"))
    port_file = work / "port"
    log = open(work / "log", "wb")  # noqa: SIM115 - closed in the finally below
    process = subprocess.Popen(
        [
            part.replace("{port_file}", str(port_file)).replace("{work}", str(work))
            for part in command
        ],
        cwd=ROOT,
        env={**os.environ, **(env or {}), "ROLLOUT_ARTIFACT_ROOT": str(work / "artifacts")},
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    failed = True
    try:
        deadline = time.monotonic() + START_TIMEOUT_SEC
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise HarnessError(f"{name} did not start; see {work / 'log'}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text().strip()}"
        failed = False
    finally:
        _stop(process)
        log.close()
        if not failed:
            shutil.rmtree(work, ignore_errors=True)


def standin() -> contextlib.AbstractContextManager[str]:
    """The chat stand-in; yields its base URL (``.../v1`` appended by callers)."""
    return _process(
        [
            sys.executable,
            "tools/chat_standin/server.py",
            "--port",
            "0",
            "--port-file",
            "{port_file}",
        ],
        "standin",
    )


def rollout_server(gateway: bool) -> contextlib.AbstractContextManager[str]:
    """``rollout-server serve benchmarks.apps.gateway_app:backend`` (with ``--gateway``)."""
    return _process(
        [
            sys.executable,
            "-m",
            "rollout_server",
            "serve",
            "benchmarks.apps.gateway_app:backend",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            "{port_file}",
            "--app-dir",
            str(ROOT),
            *(["--gateway"] if gateway else []),
        ],
        "server",
    )


async def _closed_loop(url: str, chat_url: str, count: int, concurrency: int) -> dict[str, Any]:
    from rollout_client import RolloutClient

    calls: list[float] = []
    failures: list[str] = []
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        client = RolloutClient(url=url, http_client=session, admission_timeout_sec=120)

        async def one() -> None:
            result = await client.run_rollout(
                initial_messages=PROMPT,
                chat_completions_url=chat_url,
                rollout_id=uuid.uuid4().hex,
                grade=False,
            )
            if str(result.status) != "success" or result.sample is None:
                failures.append(f"{result.status}: {result.err_message}")
                return
            calls.extend(float(result.sample.metrics[f"call{k}_ms"]) for k in range(2))

        async def worker(warm: bool) -> None:
            nonlocal done
            if warm:
                await one()
            while done < count:
                done += 1
                await one()

        async with asyncio.timeout(RUN_BOUND_SEC):
            await asyncio.gather(*(worker(True) for _ in range(concurrency)))  # warm-up
            calls.clear()
            failures.clear()
            done = 0
            began = time.perf_counter()
            await asyncio.gather(*(worker(False) for _ in range(concurrency)))
            elapsed = time.perf_counter() - began
    return {
        "rollouts": count,
        "rollouts_per_sec": count / elapsed,
        "call_ms_p50": percentile(calls, 0.5) if calls else None,
        "call_ms_p99": percentile(calls, 0.99) if calls else None,
        "failures": len(failures),
        "failure_kinds": sorted(set(failures))[:5],
    }


def _run(gateway: bool, chat_url: str, args: argparse.Namespace) -> dict[str, Any]:
    with rollout_server(gateway) as url:
        load = os.getloadavg()[0]
        throughput = asyncio.run(_closed_loop(url, chat_url, args.count, args.concurrency))
        latency = asyncio.run(_closed_loop(url, chat_url, args.latency_count, 1))
    return {
        "gateway": gateway,
        "load_average_1m": load,
        "throughput": throughput,
        "latency": latency,
    }


async def _memory(chat_url: str, turns: int) -> dict[str, Any]:
    from rollout_server import ModelGateway

    gateway = ModelGateway()
    await gateway.start()
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}]  # fmt: skip
    try:
        route = gateway.open_route(rollout_id="memory", chat_completions_url=chat_url)
        async with aiohttp.ClientSession() as session:

            async def call(messages: list[dict[str, Any]]) -> dict[str, Any]:
                async with session.post(
                    f"{route.base_url}/chat/completions",
                    json={"messages": messages, "tools": tools},
                ) as response:
                    message: dict[str, Any] = (await response.json())["choices"][0]["message"]
                    return message

            first = await call(PROMPT)  # warm the connections and caches
            second_prompt = [
                *PROMPT,
                first,
                {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "391"},
            ]
            route.turns.clear()
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            for k in range(turns):
                await call(PROMPT if k % 2 == 0 else second_prompt)
            gc.collect()
            after = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            captured = len(route.turns)
            tokens = sum(
                len(t.prompt_token_ids or ()) + len(t.completion_token_ids or ())
                for t in route.turns
            )
    finally:
        await gateway.stop()
    return {
        "turns": captured,
        "bytes_per_turn": (after - before) / captured if captured else None,
        "tokens_per_turn": tokens / captured if captured else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print JSON lines, then the summary. Returns 0, or 1 on failures."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks gateway", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--profile", choices=tuple(PROFILES), default="short")
    parser.add_argument("--count", type=int, help="rollouts per throughput run")
    parser.add_argument("--latency-count", type=int, help="rollouts per latency run (C=1)")
    parser.add_argument("--repeats", type=int, help="rounds (each: gateway off and on)")
    parser.add_argument("--memory-turns", type=int, help="turns captured for the memory figure")
    parser.add_argument("--concurrency", type=int, default=64, help="throughput concurrency")
    parser.add_argument("--output", type=Path, help="also append the JSON lines to this file")
    args = parser.parse_args(argv)
    for key, value in PROFILES[args.profile].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("count", "latency_count", "repeats", "memory_turns", "concurrency"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1")
    records: list[dict[str, Any]] = []

    def emit(record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True)
        print(line, flush=True)
        records.append(record)
        if args.output is not None:
            with args.output.open("a", encoding="utf-8") as output:
                output.write(line + "\n")

    with standin() as standin_url:
        chat_url = f"{standin_url}/v1"
        for round_ in range(args.repeats):
            order = (False, True) if round_ % 2 == 0 else (True, False)
            for gateway in order:
                emit({"type": "run", "round": round_, **_run(gateway, chat_url, args)})
        emit({"type": "memory", **asyncio.run(_memory(chat_url, args.memory_turns))})
    emit({"type": "summary", **summary(records)})
    runs = [r for r in records if r["type"] == "run"]
    return 1 if any(r[kind]["failures"] for r in runs for kind in ("throughput", "latency")) else 0


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds: the throughput ratio (on/off), and the gateway's added call
    latency (on minus off) at C=1 and at the throughput concurrency."""
    runs = [r for r in records if r["type"] == "run"]
    rounds = sorted({r["round"] for r in runs})
    by = {(r["round"], r["gateway"]): r for r in runs}
    ratio: list[float] = []
    added: dict[str, list[float]] = {
        f"{k}_{q}": [] for k in ("latency", "throughput") for q in ("p50", "p99")
    }
    for round_ in rounds:
        off, on = by[(round_, False)], by[(round_, True)]
        ratio.append(on["throughput"]["rollouts_per_sec"] / off["throughput"]["rollouts_per_sec"])
        for kind in ("latency", "throughput"):
            for q in ("p50", "p99"):
                added[f"{kind}_{q}"].append(on[kind][f"call_ms_{q}"] - off[kind][f"call_ms_{q}"])
    memory = next((r for r in records if r["type"] == "memory"), {})
    return {
        "throughput_ratio": summarize(ratio),
        "rollouts_per_sec_off": summarize(
            [by[(r, False)]["throughput"]["rollouts_per_sec"] for r in rounds]
        ),
        "rollouts_per_sec_on": summarize(
            [by[(r, True)]["throughput"]["rollouts_per_sec"] for r in rounds]
        ),
        "added_call_ms_c1_p50": summarize(added["latency_p50"]),
        "added_call_ms_c1_p99": summarize(added["latency_p99"]),
        "added_call_ms_loaded_p50": summarize(added["throughput_p50"]),
        "added_call_ms_loaded_p99": summarize(added["throughput_p99"]),
        "bytes_per_captured_turn": memory.get("bytes_per_turn"),
        "tokens_per_captured_turn": memory.get("tokens_per_turn"),
        "load_average_1m": summarize([r["load_average_1m"] for r in runs]),
    }


if __name__ == "__main__":
    sys.exit(main())
