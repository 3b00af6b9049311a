"""Start and stop the repository's dev processes: servers, load generators, client drivers.

One module for the process handling of the demo (``tools/demo.py``), the benchmarks
(``benchmarks/processes.py``) and the interop harness
(``tests/interop/interop_harness/processes.py``). It uses the standard library only, so
any interpreter that runs one of those can import it once ``tools/`` is on ``sys.path``
(each of them puts it there).

Every process is stopped by its own PID, never by name: the stop signal (SIGTERM unless
told otherwise), a bounded wait, then SIGKILL and another bounded wait. Every wait for a
process to start is bounded too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final, NamedTuple

__all__ = [
    "KILL_WAIT_SEC",
    "START_TIMEOUT_SEC",
    "STOP_TIMEOUT_SEC",
    "ManagedProcess",
    "ProcessError",
    "Stopped",
    "child_env",
    "stop_async_process",
    "stop_process",
    "tail",
]

START_TIMEOUT_SEC: Final = 60.0
"""Default bound on a process's start-up (imports on a loaded 2-core machine)."""
STOP_TIMEOUT_SEC: Final = 30.0
"""Default bound on a graceful stop after the stop signal, before SIGKILL."""
KILL_WAIT_SEC: Final = 10.0
"""Bound on the wait after SIGKILL."""
_POLL_INTERVAL_SEC: Final = 0.05


class ProcessError(RuntimeError):
    """A dev process failed to start, to report its port, or to stop in time."""


class Stopped(NamedTuple):
    """How a process ended: its exit ``status`` (negative: killed by that signal), and
    whether it had to be SIGKILLed because it outlived the stop signal's bound."""

    status: int
    killed: bool


def child_env(
    extra: Mapping[str, str] | None = None, *, drop: Iterable[str] = ()
) -> dict[str, str]:
    """This process's environment for a child: unbuffered output, ``drop`` removed, ``extra`` set.

    Args:
        extra: Variables to set (they win over inherited ones).
        drop: Names of inherited variables to remove.
    """
    dropped = set(drop)
    env = {name: value for name, value in os.environ.items() if name not in dropped}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def stop_process(
    process: subprocess.Popen[Any],
    *,
    timeout_sec: float = STOP_TIMEOUT_SEC,
    signal_number: int = signal.SIGTERM,
) -> Stopped:
    """Stop ``process`` by its PID: ``signal_number``, wait ``timeout_sec``, then SIGKILL.

    A process that has already exited is only reaped.

    Returns:
        Its exit status, and whether it was killed.

    Raises:
        subprocess.TimeoutExpired: If it outlives SIGKILL by :data:`KILL_WAIT_SEC`.
    """
    if process.poll() is None:
        process.send_signal(signal_number)
    return _wait_or_kill(process, timeout_sec)


def _wait_or_kill(process: subprocess.Popen[Any], timeout_sec: float) -> Stopped:
    try:
        return Stopped(process.wait(timeout_sec), killed=False)
    except subprocess.TimeoutExpired:
        process.kill()
    return Stopped(process.wait(KILL_WAIT_SEC), killed=True)


async def stop_async_process(
    process: asyncio.subprocess.Process,
    *,
    patience_sec: float = 0.0,
    timeout_sec: float = STOP_TIMEOUT_SEC,
    signal_number: int = signal.SIGTERM,
) -> Stopped:
    """:func:`stop_process` for an asyncio subprocess, after an optional wait for it to exit.

    Args:
        process: The process (by its PID).
        patience_sec: How long to wait for it to exit on its own first (for a process that
            exits when its stdin closes); default 0.
        timeout_sec: Bound on the wait after ``signal_number``, before SIGKILL.
        signal_number: The stop signal; default SIGTERM.

    Raises:
        TimeoutError: If it outlives SIGKILL by :data:`KILL_WAIT_SEC`.
    """
    for deadline_sec, send in ((patience_sec, None), (timeout_sec, signal_number)):
        if process.returncode is not None:
            return Stopped(process.returncode, killed=False)
        if send is not None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(send)
        try:
            async with asyncio.timeout(deadline_sec):
                return Stopped(await process.wait(), killed=False)
        except TimeoutError:
            pass
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    async with asyncio.timeout(KILL_WAIT_SEC):
        return Stopped(await process.wait(), killed=True)


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file (``"(no log)"`` when it cannot be read)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Ask Linux to SIGTERM this child when its parent dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))


class ManagedProcess:
    """A subprocess whose merged stdout and stderr go to a log file; stopped by its PID.

    The process starts when the object is made.

    Args:
        name: Name used in error messages.
        argv: The command line (each part passed through ``str``).
        log_path: Where its output goes (created, or appended to with ``append``).
        env: Its whole environment; default this process's.
        cwd: Its working directory; default this process's.
        append: Append to ``log_path`` instead of truncating it.
        new_session: Start it in a session of its own, so a terminal's Ctrl-C reaches only
            its parent.
        die_with_parent: Have Linux SIGTERM it when the parent dies (only for parents that
            start no threads: it runs a hook between fork and exec).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[object],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        append: bool = False,
        new_session: bool = False,
        die_with_parent: bool = False,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._terminated = False
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = log_path.open("ab" if append else "wb")
        self._log_start = self._log.seek(0, os.SEEK_END)
        try:
            self.process: subprocess.Popen[bytes] = subprocess.Popen(
                [str(part) for part in argv],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
                cwd=cwd,
                start_new_session=new_session,
                preexec_fn=_die_with_parent if die_with_parent else None,  # noqa: PLW1509
            )
        except BaseException:
            self._log.close()
            raise

    @property
    def pid(self) -> int:
        """The process id."""
        return self.process.pid

    def poll(self) -> int | None:
        """Its exit status, or None while it runs."""
        return self.process.poll()

    def wait_for_port(
        self,
        *,
        port_file: Path | None = None,
        listening: re.Pattern[str] | None = None,
        ready: Callable[[int], bool] | None = None,
        timeout_sec: float = START_TIMEOUT_SEC,
    ) -> int:
        """Wait (bounded) until the process reports the port it listens on; return it.

        Args:
            port_file: A file the process writes its port to.
            listening: Or a pattern whose first group is the port, searched in its log.
            ready: Also wait until this returns True for the port (a health check).
            timeout_sec: The bound; default :data:`START_TIMEOUT_SEC`.

        Raises:
            ProcessError: If it exits first, or reports no (ready) port within the bound.
        """
        if (port_file is None) == (listening is None):
            raise ValueError("give exactly one of port_file and listening")
        deadline = time.monotonic() + timeout_sec
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ProcessError(
                    f"{self.name} exited with status {self.process.returncode} before "
                    f"listening; its log ends:\n{self.log_tail()}"
                )
            port = self._reported_port(port_file, listening)
            if port is not None and (ready is None or ready(port)):
                return port
            time.sleep(_POLL_INTERVAL_SEC)
        raise ProcessError(
            f"{self.name} did not {'listen' if ready is None else 'become ready'} within "
            f"{timeout_sec:g} s; its log ends:\n{self.log_tail()}"
        )

    def _reported_port(
        self, port_file: Path | None, listening: re.Pattern[str] | None
    ) -> int | None:
        if port_file is not None:
            with contextlib.suppress(OSError):
                text = port_file.read_text(encoding="ascii").strip()
                if text.isdigit():
                    return int(text)
            return None
        assert listening is not None
        match = listening.search(self.log())
        return int(match.group(1)) if match else None

    def terminate(self, signal_number: int = signal.SIGTERM) -> None:
        """Send the stop signal (by PID) once, unless the process has exited.

        Only once: a second SIGTERM would cut a server's graceful shutdown short (or, after
        it restored the default handler, kill it).
        """
        if not self._terminated and self.process.poll() is None:
            self._terminated = True
            self.process.send_signal(signal_number)

    def stop(
        self, *, timeout_sec: float = STOP_TIMEOUT_SEC, signal_number: int = signal.SIGTERM
    ) -> Stopped:
        """:meth:`terminate`, wait ``timeout_sec``, then SIGKILL; close the log.

        Returns:
            Its exit status, and whether it was killed.
        """
        try:
            self.terminate(signal_number)
            return _wait_or_kill(self.process, timeout_sec)
        finally:
            self._log.close()

    def log(self) -> str:
        """Everything the process printed so far (without what ``log_path`` held before)."""
        if not self._log.closed:
            self._log.flush()
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_start)
                return log.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the process's output."""
        return "\n".join(self.log().splitlines()[-lines:])
