"""Peer processes: servers (each side's venv) and client drivers, stopped by their own PID.

* :class:`ServerProcess` starts a server command, reads its merged output until the line
  ``... listening on http://127.0.0.1:PORT`` (both ``rollout-server serve`` and
  ``remote/osmosis_app.py`` log it), keeps draining it, and stops it with SIGTERM (bounded
  wait, then SIGKILL). It is synchronous so module-scoped fixtures can share a server.
* :class:`DriverProcess` runs a client driver (``remote/driver_*.py``) and exchanges
  JSON lines with it (see ``remote/driver_common.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

from .peers import REMOTE_DIR

LISTENING: Final = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")
START_TIMEOUT_SEC: Final = 60.0
"""Bound on a peer process's start-up (imports on a loaded 2-core machine)."""
STOP_TIMEOUT_SEC: Final = 20.0
"""Bound on a graceful stop before SIGKILL (osmosis-ai drains for up to 10 s)."""
CALL_GRACE_SEC: Final = 10.0
"""Slack on top of a driver request's own bound before the test gives up on the driver."""


THIS_VENV_HINTS: Final = frozenset({"PYTHONPATH", "VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT"})
"""Variables that point at the test venv (nox sets ``UV_PROJECT_ENVIRONMENT`` to it, so a
peer's ``uv sync`` would install into the test venv and strip it)."""


def peer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a peer process: ours, unbuffered, without this venv's hints."""
    env = {k: v for k, v in os.environ.items() if k not in THIS_VENV_HINTS}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra or {})
    return env


class ServerProcess:
    """A server subprocess bound to 127.0.0.1; ``url`` is valid after :meth:`start`.

    Args:
        make_argv: Builds the command line for a port (0 the first time; the same port on
            :meth:`restart`).
        env: Extra environment variables.
        label: Name used in error messages.
    """

    def __init__(
        self,
        make_argv: Callable[[int], Sequence[str]],
        *,
        env: dict[str, str] | None = None,
        label: str = "server",
    ) -> None:
        self._make_argv = make_argv
        self._env = peer_env(env)
        self.label = label
        self.port = 0
        self._proc: subprocess.Popen[str] | None = None
        self._lines: list[str] = []
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The process id (after :meth:`start`)."""
        assert self._proc is not None
        return self._proc.pid

    def log(self) -> str:
        """Everything the process printed so far."""
        return "".join(self._lines)

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._lines.append(line)
            if not self._ready.is_set() and (match := LISTENING.search(line)):
                self.port = int(match.group(1))
                self._ready.set()
        self._ready.set()

    def start(self) -> ServerProcess:
        """Start the process and wait (bounded) until it listens.

        Raises:
            RuntimeError: If it exits or does not listen within ``START_TIMEOUT_SEC``.
        """
        self._ready.clear()
        argv = [str(part) for part in self._make_argv(self.port)]
        self._lines.append(f"$ {' '.join(argv)}\n")
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self._env,
            cwd=REMOTE_DIR,
        )
        self._proc = proc
        self._thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_SEC) or proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"{self.label} did not start listening:\n{self.log()}")
        return self

    def stop(self) -> int | None:
        """SIGTERM, wait (bounded), then SIGKILL; return the exit status."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_TIMEOUT_SEC)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_TIMEOUT_SEC)
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_SEC)
        if proc.stdout is not None:
            proc.stdout.close()
        self._proc = None
        return proc.returncode

    def restart(self) -> ServerProcess:
        """Stop, then start again on the same port (a new process, a new ``process_id``)."""
        self.stop()
        return self.start()


class DriverError(Exception):
    """A driver op failed; the attributes describe the client's exception."""

    def __init__(self, op: str, error: dict[str, Any]) -> None:
        self.op = op
        self.error = error
        self.type: str = str(error.get("type"))
        self.module: str = str(error.get("module", ""))
        self.mro: list[str] = list(error.get("mro", []))
        self.message: str = str(error.get("message", ""))
        self.status_code: int | None = error.get("status_code")
        self.elapsed_sec: float | None = error.get("elapsed_sec")
        super().__init__(f"{op}: {self.module}.{self.type}: {self.message}")


class DriverProcess:
    """A client driver subprocess; :meth:`call` runs one op and returns its value.

    Args:
        python: The interpreter of the client side's venv.
        script: ``driver_ours.py``, ``driver_osmosis.py`` or ``driver_osmosis032.py``.
        env: Extra environment variables of the driver process.
    """

    def __init__(self, python: str, script: str, *, env: dict[str, str] | None = None) -> None:
        self.python = python
        self.script = script
        self._env = peer_env(env)
        self.events: list[dict[str, Any]] = []
        self.stderr: list[str] = []
        self._proc: asyncio.subprocess.Process | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self._exited = False

    async def start(self) -> DriverProcess:
        """Start the driver and wait (bounded) for its ready event."""
        self._proc = await asyncio.create_subprocess_exec(
            self.python,
            str(REMOTE_DIR / self.script),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self._env,
            cwd=REMOTE_DIR,
            limit=1 << 24,
        )
        self._tasks = [
            asyncio.create_task(self._read_stdout()),
            asyncio.create_task(self._read_stderr()),
        ]
        try:
            await self.wait_event(lambda e: e.get("kind") == "ready", timeout_sec=START_TIMEOUT_SEC)
        except TimeoutError:
            await self.close()
            raise RuntimeError(
                f"driver {self.script} did not start:\n{''.join(self.stderr)}"
            ) from None
        return self

    async def _read_stdout(self) -> None:
        assert self._proc is not None
        assert self._proc.stdout is not None
        while line := await self._proc.stdout.readline():
            message = json.loads(line)
            if "event" in message:
                async with self._changed:
                    self.events.append(message["event"])
                    self._changed.notify_all()
            else:
                future = self._pending.pop(int(message["id"]), None)
                if future is not None and not future.done():
                    future.set_result(message)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(
                    RuntimeError(f"driver {self.script} exited:\n{''.join(self.stderr)}")
                )
        async with self._changed:
            self._exited = True
            self._changed.notify_all()

    async def _read_stderr(self) -> None:
        assert self._proc is not None
        assert self._proc.stderr is not None
        while line := await self._proc.stderr.readline():
            self.stderr.append(line.decode(errors="replace"))

    async def call(self, op: str, *, timeout_sec: float = 30.0, **args: Any) -> Any:
        """Run ``op`` in the driver, bounded by ``timeout_sec``; return its value.

        Raises:
            DriverError: The client raised (its class, message and status code inside),
                or the op did not finish in time (type ``DriverTimeout``).
        """
        assert self._proc is not None
        assert self._proc.stdin is not None
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        line = {"id": request_id, "op": op, "args": args, "timeout_sec": timeout_sec}
        self._proc.stdin.write((json.dumps(line) + "\n").encode())
        await self._proc.stdin.drain()
        async with asyncio.timeout(timeout_sec + CALL_GRACE_SEC):
            answer = await future
        if not answer["ok"]:
            error = dict(answer["error"])
            if error.get("type") == "DriverTimeout":
                error["message"] += "; driver stderr:\n" + "".join(self.stderr[-20:])
            raise DriverError(op, error)
        return answer["value"]

    async def wait_event(
        self, predicate: Callable[[dict[str, Any]], bool], *, timeout_sec: float = 30.0
    ) -> dict[str, Any]:
        """Wait (bounded) until an event matching ``predicate`` has arrived; return it."""

        def found() -> dict[str, Any] | None:
            return next((e for e in self.events if predicate(e)), None)

        async with asyncio.timeout(timeout_sec), self._changed:
            await self._changed.wait_for(lambda: found() is not None or self._exited)
        event = found()
        if event is None:
            raise RuntimeError(f"driver {self.script} exited:\n{''.join(self.stderr)}")
        return event

    def responses(self, method: str, path_suffix: str) -> list[int]:
        """Statuses of the HTTP responses the client got for ``method`` on ``...path_suffix``."""
        return [
            int(e["status"])
            for e in self.events
            if e.get("kind") == "response"
            and e.get("method") == method
            and str(e.get("path", "")).endswith(path_suffix)
        ]

    async def close(self) -> None:
        """Close stdin (the driver exits), wait (bounded), else kill; by its own PID."""
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
        try:
            async with asyncio.timeout(STOP_TIMEOUT_SEC):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._proc = None
