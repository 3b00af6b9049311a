"""What the ``rollout-server`` command's tests share: the served target module, the bounds
of their waits, and a way to start the command as a process (stopped by its PID)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

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
