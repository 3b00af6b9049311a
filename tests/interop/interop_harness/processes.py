"""Peer processes: servers (each side's venv) and client drivers, stopped by their own PID.

* :class:`ServerProcess` starts a server command with ``tools/devprocs.py`` (output to a log
  file), waits until the log holds ``... listening on http://127.0.0.1:PORT`` (both
  ``rollout-server serve`` and ``remote/osmosis_app.py`` log it), and stops it with
  SIGTERM (bounded wait, then SIGKILL). It is synchronous so module-scoped fixtures can
  share a server.
* :class:`DriverProcess` runs a client driver (``remote/driver_*.py``) and exchanges
  JSON lines with it (see ``remote/driver_common.py``).

``tools/`` is put on ``sys.path`` here; the peers' own interpreters never import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import sys
import tempfile
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from .peers import REMOTE_DIR

TOOLS_DIR: Final = Path(__file__).resolve().parents[3] / "tools"
if str(TOOLS_DIR) not in sys.path:
    sys.path.insert(0, str(TOOLS_DIR))

from devprocs import ManagedProcess, child_env, stop_async_process  # noqa: E402

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


def peer_env(
    extra: dict[str, str] | None = None, *, drop: frozenset[str] = frozenset()
) -> dict[str, str]:
    """The environment of a peer process: ours, unbuffered, without this venv's hints (nor
    the variables named in ``drop``)."""
    return child_env({"PYTHONDONTWRITEBYTECODE": "1", **(extra or {})}, drop=THIS_VENV_HINTS | drop)


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
        descriptor, log_name = tempfile.mkstemp(prefix="rollout-interop-", suffix=".log")
        os.close(descriptor)
        self._log_path = Path(log_name)
        weakref.finalize(self, self._log_path.unlink, missing_ok=True)
        self._process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The process id (after :meth:`start`)."""
        assert self._process is not None
        return self._process.pid

    def log(self) -> str:
        """Everything the process printed so far (across restarts)."""
        try:
            return self._log_path.read_text("utf-8", errors="replace")
        except OSError:
            return ""

    def start(self) -> ServerProcess:
        """Start the process and wait (bounded) until it listens.

        Raises:
            devprocs.ProcessError: If it exits or does not listen within
                ``START_TIMEOUT_SEC``.
        """
        argv = [str(part) for part in self._make_argv(self.port)]
        with self._log_path.open("a", encoding="utf-8") as log:
            log.write(f"$ {' '.join(argv)}\n")
        process = ManagedProcess(
            self.label, argv, log_path=self._log_path, env=self._env, cwd=REMOTE_DIR, append=True
        )
        self._process = process
        try:
            self.port = process.wait_for_port(listening=LISTENING, timeout_sec=START_TIMEOUT_SEC)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> int | None:
        """SIGTERM, wait (bounded), then SIGKILL; return the exit status."""
        process, self._process = self._process, None
        if process is None:
            return None
        return process.stop(timeout_sec=STOP_TIMEOUT_SEC).status

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
        """Close stdin (the driver exits), wait (bounded), else SIGTERM, then SIGKILL; by PID."""
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
        await stop_async_process(proc, patience_sec=STOP_TIMEOUT_SEC, timeout_sec=STOP_TIMEOUT_SEC)
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._proc = None
