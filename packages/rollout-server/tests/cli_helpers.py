"""What the ``rollout-server`` command's tests share: the served target module, the bounds
of their waits, and a way to start the command as a process (stopped by its PID)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

EVENT_SEC = 10.0
START_SEC = 60.0
"""Bound on a subprocess's start-up (imports on a loaded 2-core machine)."""
EXIT_SEC = 30.0
"""Bound on a subprocess's exit once its shutdown stages (a few seconds here) are over."""
LISTENING = re.compile(rb"listening on http://127\.0\.0\.1:(\d+)")

TARGET_MODULE = '''
"""Serve targets for the tests of ``rollout-server serve``."""

import asyncio
import threading

from rollout_server import (
    AgentWorkflow,
    ExecutionBackend,
    ExecutionOutcome,
    ExecutionResult,
    LocalBackend,
    Sample,
    create_rollout_server,
)


class WaitingBackend(ExecutionBackend):
    """Every execution waits until it is cancelled."""

    async def execute(self, request):
        await asyncio.get_running_loop().create_future()


class QuickBackend(ExecutionBackend):
    """Every execution succeeds at once."""

    async def execute(self, request):
        sample = Sample(messages=[], reward=1.0)
        return ExecutionOutcome(workflow=ExecutionResult(status="success", sample=sample))


class StubbornWorkflow(AgentWorkflow):
    """Swallows every cancellation, for ever."""

    async def run(self, ctx):
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue


def stubborn():
    return LocalBackend(StubbornWorkflow, max_queued=8)


NEVER = threading.Event()


class ThreadedWorkflow(AgentWorkflow):
    """Waits in a worker thread that never returns (cancelling the rollout leaves it)."""

    async def run(self, ctx):
        await asyncio.to_thread(NEVER.wait)


def threaded():
    return LocalBackend(ThreadedWorkflow, max_queued=8)


quick = QuickBackend()


backend = WaitingBackend()
app = create_rollout_server(backend=WaitingBackend())
not_a_target = 42


def factory():
    return WaitingBackend()


async def async_factory():
    return create_rollout_server(backend=WaitingBackend())


def broken_factory():
    raise RuntimeError("factory broke")
'''


def write_targets(directory: Path) -> Path:
    """Write ``cli_targets.py`` (:data:`TARGET_MODULE`) into ``directory``; return it."""
    (directory / "cli_targets.py").write_text(textwrap.dedent(TARGET_MODULE))
    return directory


@contextlib.contextmanager
def server_process(
    app_dir: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``python -m rollout_server serve ...``; stop it by its PID at the end."""
    process = subprocess.Popen(
        [sys.executable, "-m", "rollout_server", "serve", *args, "--app-dir", str(app_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=EVENT_SEC)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=EVENT_SEC)
        if process.stdout is not None:
            process.stdout.close()


class Served:
    """One ``rollout-server serve`` process on 127.0.0.1 and the output it printed."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        *,
        start_sec: float = START_SEC,
        exit_sec: float = EXIT_SEC,
    ) -> None:
        self.process = process
        self.start_sec = start_sec
        self.exit_sec = exit_sec
        self.lines: list[bytes] = []
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def output(self) -> str:
        return b"".join(self.lines).decode(errors="replace")

    async def until(self, pattern: re.Pattern[bytes]) -> re.Match[bytes]:
        """Read output lines until one matches (bounded); fail if the process exits."""
        loop = asyncio.get_running_loop()
        stream = self.process.stdout
        assert stream is not None
        async with asyncio.timeout(self.start_sec):
            while True:
                line = await loop.run_in_executor(None, stream.readline)
                if not line:
                    pytest.fail(f"rollout-server exited early:\n{self.output}")
                self.lines.append(line)
                if match := pattern.search(line):
                    return match

    async def listening(self) -> None:
        self.port = int((await self.until(LISTENING)).group(1))

    async def exit_status(self) -> int:
        """Wait (bounded) for the exit; read the rest of the output."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.exit_sec):
            status = await loop.run_in_executor(None, self.process.wait)
        stream = self.process.stdout
        assert stream is not None
        self.lines.append(await loop.run_in_executor(None, stream.read))
        return status


@contextlib.contextmanager
def serve_target(
    app_dir: Path,
    target: str,
    *args: str,
    env: dict[str, str] | None = None,
    start_sec: float = START_SEC,
    exit_sec: float = EXIT_SEC,
) -> Iterator[Served]:
    """Serve ``target`` from ``app_dir`` (unbuffered output), its start and exit bounded by
    ``start_sec`` and ``exit_sec``; stop it by its PID at the end."""
    with server_process(
        app_dir, target, *args, env={"PYTHONUNBUFFERED": "1", **(env or {})}
    ) as process:
        yield Served(process, start_sec=start_sec, exit_sec=exit_sec)
