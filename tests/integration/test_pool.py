"""``RolloutClientPool`` against three real rollout servers on 127.0.0.1.

In-process ``create_rollout_server()`` apps show routing, pinned polls and a server that
shuts down; ``rollout-server serve`` subprocesses show a server killed (SIGKILL by its PID)
and restarted on its port in the middle of a run.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest

from rollout_client import RolloutClientPool, RolloutHandle, RolloutProtocolError
from rollout_client.eval import EvalOptions, read_journal, run_eval
from rollout_server import (
    ExecutionBackend,
    ExecutionOutcome,
    ExecutionRequest,
    ExecutionResult,
    Sample,
)
from rollout_types import RolloutStatus

from .conftest import EVENT_SEC, RunningServer, Watched

MESSAGES: Final = [{"role": "user", "content": "What is 6 * 7?"}]
CHAT: Final = "http://127.0.0.1:9/v1"
HERE: Final = Path(__file__).resolve().parent
LISTENING: Final = re.compile(rb"listening on http://127\.0\.0\.1:(\d+)")


class HeldBackend(ExecutionBackend):
    """Holds every rollout until :attr:`release` is set; records what it executed."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.executed: list[str] = []
        self.started: asyncio.Queue[str] = asyncio.Queue()
        """Each rollout's id once it runs (held)."""

    async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
        self.executed.append(request.id)
        self.started.put_nowait(request.id)
        await self.release.wait()
        sample = Sample(messages=[{"role": "assistant", "content": "42"}], reward=1.0)
        return ExecutionOutcome(
            workflow=ExecutionResult(status=RolloutStatus.SUCCESS, sample=sample)
        )


async def settled(pool: RolloutClientPool, predicate: Callable[[], bool]) -> None:
    """Wait (bounded) until the pool's view of its servers satisfies ``predicate``."""
    async with asyncio.timeout(EVENT_SEC):
        await pool._wait_for(predicate)


@pytest.fixture
async def three(serve_rollout: Any) -> list[tuple[RunningServer, HeldBackend]]:
    """Three in-process rollout servers with held backends."""
    started = []
    for _ in range(3):
        backend = HeldBackend()
        started.append((await serve_rollout(backend), backend))
    return started


class TestThreeServersInProcess:
    async def test_rollouts_spread_and_each_result_comes_from_its_server(self, three):
        """Nine held rollouts land three per server; each is polled to success on the
        server that admitted it (another server would answer 404)."""
        servers = [server for server, _ in three]
        async with RolloutClientPool(urls=[s.url for s in servers]) as pool:
            handles = [
                await pool.run_rollout_async(MESSAGES, CHAT, f"r{i}", label="42") for i in range(9)
            ]
            assert [s.outstanding for s in pool.servers()] == [3, 3, 3]
            for _, backend in three:
                backend.release.set()
            async with asyncio.timeout(EVENT_SEC):
                results = [await handle for handle in handles]
            assert {r.status for r in results} == {RolloutStatus.SUCCESS}
            assert [backend.executed for _, backend in three] == [
                ["r0", "r3", "r6"],
                ["r1", "r4", "r7"],
                ["r2", "r5", "r8"],
            ]
            await settled(pool, lambda: [s.outstanding for s in pool.servers()] == [0, 0, 0])

    async def test_a_server_shutting_down_is_left_while_its_rollout_finishes(self, three):
        """A server that begins shutting down answers admissions 503 and leaves the
        rotation; the rollout it already runs is still polled there to its result."""
        (a, a_backend), (b, b_backend), (c, c_backend) = three
        async with RolloutClientPool(urls=[a.url, b.url, c.url], probe_interval_sec=60) as pool:
            first = await pool.run_rollout_async(MESSAGES, CHAT, "r0")
            a.state.begin_shutdown()
            later = [await pool.run_rollout_async(MESSAGES, CHAT, f"r{i}") for i in (1, 2, 3)]
            (status_a, *_) = pool.servers()
            assert not status_a.available
            assert "503 (shutting down)" in (status_a.reason or "")
            for backend in (a_backend, b_backend, c_backend):
                backend.release.set()
            async with asyncio.timeout(EVENT_SEC):
                results = [await handle for handle in (first, *later)]
            assert {r.status for r in results} == {RolloutStatus.SUCCESS}
            assert (a_backend.executed, b_backend.executed, c_backend.executed) == (
                ["r0"],
                ["r1", "r3"],
                ["r2"],
            )


def eight_rows_over(servers: list[RunningServer], tmp_path: Path) -> EvalOptions:
    """A run of eight rows over two servers, four at a time."""
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(
        "".join(json.dumps({"user_prompt": f"{i} + 0?", "label": str(i)}) + "\n" for i in range(8)),
        encoding="utf-8",
    )
    return EvalOptions(
        dataset=dataset,
        server_url=servers[0].url,
        extra_server_urls=(servers[1].url,),
        chat_url=CHAT,
        output=tmp_path / "out",
        concurrency=4,
        progress="off",
    )


class TestEvalOverTwoServers:
    async def test_rollout_eval_spreads_a_dataset_over_both_servers(
        self, serve_rollout: Any, tmp_path: Path
    ) -> None:
        """run_eval with two servers completes every item, each server running some."""
        backends = [HeldBackend(), HeldBackend()]
        servers = []
        for backend in backends:
            backend.release.set()
            servers.append(await serve_rollout(backend))
        report = await run_eval(eight_rows_over(servers, tmp_path), stream=io.StringIO())
        assert report.exit_code == 0
        assert report.summary["by_outcome"]["success"] == 8
        executed = [len(backend.executed) for backend in backends]
        assert sum(executed) == 8
        assert min(executed) >= 1

    async def test_both_servers_shutting_down_drain_the_run(
        self, serve_rollout: Any, tmp_path: Path
    ) -> None:
        """Both servers begin shutting down while each runs two rollouts: rollout-eval starts
        no new rollout once both refuse one (503), cancels nothing, collects and records
        the four in flight, and ends with the rest pending, the closing line and exit 1."""
        backends = [HeldBackend(), HeldBackend()]
        servers = [await serve_rollout(backend) for backend in backends]
        stream = Watched("starting no new rollouts")
        run = asyncio.ensure_future(run_eval(eight_rows_over(servers, tmp_path), stream=stream))
        try:
            async with asyncio.timeout(EVENT_SEC):
                for backend in backends:  # two rollouts held on each server
                    await backend.started.get()
                    await backend.started.get()
                for server in servers:
                    server.state.begin_shutdown()
                backends[0].release.set()  # two finish; the next admission finds no server
                await stream.seen.wait()
                backends[1].release.set()  # the other two finish during the drain
                report = await run
        finally:
            run.cancel()
        assert [len(backend.executed) for backend in backends] == [2, 2]
        records = read_journal(report.run_dir / "events.jsonl")
        assert [(r.outcome, r.reward) for r in records] == [("success", 1.0)] * 4
        assert report.summary["items"]["pending"] == 4
        assert report.exit_code == 1
        assert report.closing_line == (
            "rollout-eval: every rollout server is shutting down (none admits a new rollout); "
            "4 items pending. Re-run the same command to resume."
        )
        assert "cancelling" not in stream.getvalue()


class ServeProcess:
    """``rollout-server serve pool_backend:backend`` on 127.0.0.1, stopped by its PID."""

    def __init__(self, artifacts: Path) -> None:
        self.artifacts = artifacts
        self.port = 0
        self.process: asyncio.subprocess.Process | None = None
        self._drain: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rollout_ids(self) -> set[str]:
        """Ids whose trajectory this server wrote (its artifact directories)."""
        if not self.artifacts.exists():
            return set()
        return {path.parent.name for path in self.artifacts.glob("*/trajectory.json")}

    async def start(self) -> None:
        """Start (on the same port when restarting) and wait for the listening line."""
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rollout_server",
            "serve",
            "pool_backend:backend",
            "--app-dir",
            str(HERE),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--result-wait-timeout-sec",
            "1",
            "--polling-lease-timeout-sec",
            "20",
            "--drain-timeout-sec",
            "0",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "ROLLOUT_ARTIFACT_ROOT": str(self.artifacts)},
        )
        stream = self.process.stdout
        assert stream is not None
        seen = []
        async with asyncio.timeout(60):  # imports on a loaded 2-core machine
            while (match := LISTENING.search(line := await stream.readline())) is None:
                if not line:
                    pytest.fail(f"rollout-server exited early:\n{b''.join(seen).decode()}")
                seen.append(line)
        self.port = int(match.group(1))
        self._drain = asyncio.ensure_future(self._discard(stream))

    @staticmethod
    async def _discard(stream: asyncio.StreamReader) -> None:
        while await stream.read(65536):
            pass

    async def stop(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the process (by its PID) and wait for it to exit (bounded)."""
        process = self.process
        if process is None:
            return
        if process.returncode is None:
            process.send_signal(sig)
            try:
                async with asyncio.timeout(EVENT_SEC):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
        if self._drain is not None:
            await self._drain
        self.process = None


@pytest.fixture
async def processes(tmp_path: Path) -> AsyncIterator[list[ServeProcess]]:
    """Three ``rollout-server serve`` processes, each writing its own artifact root."""
    started = [ServeProcess(tmp_path / f"server-{i}") for i in range(3)]
    try:
        for server in started:
            await server.start()
        yield started
    finally:
        for server in started:
            await server.stop()


class TestKillAndRestart:
    @pytest.mark.slow
    async def test_a_killed_server_is_left_probed_back_and_its_restart_seen(
        self, processes: list[ServeProcess], tmp_path: Path
    ) -> None:
        """Rollouts keep running while one of three servers is killed and restarted: every
        rollout ends, each success was served by the server that admitted it, only those in
        flight on the killed server fail, the server is left out, probed back in, and its
        new process_id is counted as a restart."""
        a, b, c = processes
        outcomes: dict[str, Any] = {}
        stop = asyncio.Event()
        async with RolloutClientPool(
            urls=[s.url for s in processes], probe_interval_sec=0.2
        ) as pool:
            before = await pool.health()
            old_pid = before[b.url].process_id
            assert all(status.available for status in before.values())

            async def worker(slot: int) -> None:
                for n in range(1000):
                    if stop.is_set():
                        return
                    rollout_id = f"w{slot}-{n}"
                    try:
                        handle: RolloutHandle = await pool.run_rollout_async(
                            MESSAGES, CHAT, rollout_id, metadata={"sleep_sec": 2.0}
                        )
                        outcomes[rollout_id] = (await handle).status
                    except (RolloutProtocolError, aiohttp.ClientError, OSError) as exc:
                        outcomes[rollout_id] = exc

            workers = [asyncio.ensure_future(worker(slot)) for slot in range(6)]
            try:
                # Kill b while a rollout it admitted runs (its workflow sleeps 2 s).
                await settled(pool, lambda: b.url in {s.url for s in pool._live.values()})
                in_flight_on_b = pool.servers()[1].outstanding
                admitted_before_kill = set(pool._live)
                await b.stop(signal.SIGKILL)
                served_by_b_before = b.rollout_ids()
                await settled(pool, lambda: not pool.servers()[1].available)
                await b.start()
                await settled(pool, lambda: pool.servers()[1].available)
                assert pool.servers()[1].restarts == 1
                assert pool.servers()[1].process_id not in (None, old_pid)
                # A rollout admitted by the restarted b (those admitted before the kill may
                # still be retrying their polls there).
                await settled(
                    pool,
                    lambda: any(
                        server.url == b.url and rollout_id not in admitted_before_kill
                        for rollout_id, server in pool._live.items()
                    ),
                )
            finally:
                stop.set()
                async with asyncio.timeout(EVENT_SEC):
                    await asyncio.gather(*workers)
            idle = await pool.wait_idle(timeout_sec=EVENT_SEC, poll_interval_sec=0.1)
            assert set(idle) == {a.url, b.url, c.url}

        failed = {rid: exc for rid, exc in outcomes.items() if isinstance(exc, BaseException)}
        succeeded = {rid for rid, status in outcomes.items() if status == RolloutStatus.SUCCESS}
        assert set(outcomes) == failed.keys() | succeeded
        assert 1 <= len(failed) <= in_flight_on_b
        assert {pool._ended[rollout_id].url for rollout_id in failed} == {b.url}
        served = [s.rollout_ids() for s in processes]
        for rollout_id in succeeded:
            assert sum(rollout_id in ids for ids in served) == 1
        assert b.rollout_ids() - served_by_b_before <= succeeded
        assert b.rollout_ids() - served_by_b_before  # the restarted server served again
