"""A Ray head node on 127.0.0.1 for the dev tools (the chaos soak's ``--ray``), started and
stopped by PID, with everything it runs under one temporary directory.

:class:`LocalRayHead` runs ``ray start --head --block`` (the ``ray`` console script next to
this interpreter) with ``--temp-dir`` a fresh directory under the system's temporary
directory, ``--node-ip-address=127.0.0.1`` and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (so
the cluster only listens on and talks to 127.0.0.1; see the scale guide), and token
authentication with a fresh token in a file of that directory (``RAY_AUTH_MODE=token``,
``RAY_AUTH_TOKEN_PATH``; Ray's default token of ``~/.ray`` is neither read nor written): a
process joins with :attr:`LocalRayHead.env` in its environment. Every process of
the cluster (GCS, raylet, workers) names that directory on its command line, which is how
:func:`processes_under` finds them: to check that a stop left none behind, and to check
that a PID about to be SIGKILLed is one of the cluster's. Stdlib only: the caller need not
import Ray.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

from demo import ROOT
from devprocs import ManagedProcess, ProcessError, child_env

__all__ = ["RAY_LOCAL_ENV", "LocalRayHead", "processes_under"]

RAY_LOCAL_ENV: Final = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Set in every process that starts or joins the cluster: it keeps Ray on 127.0.0.1."""
HEAD_START_TIMEOUT_SEC: Final = 120.0
"""Bound on the head's start (GCS, raylet, dashboard-less) on 2 loaded cores."""
HEAD_STOP_TIMEOUT_SEC: Final = 60.0
"""Bound on the head's graceful stop (SIGTERM to ``ray start --block``), before SIGKILL."""
STRAY_WAIT_SEC: Final = 30.0
"""Bound on the wait for the cluster's processes to end after the head stopped."""
OBJECT_STORE_BYTES: Final = 100_000_000
_POLL_SEC: Final = 0.2


def processes_under(directory: Path) -> dict[int, str]:
    """The live processes whose command line or environment names ``directory`` (PID ->
    command line), this process excepted. (Ray workers retitle themselves, ``ray::...``,
    so their command line no longer names it; their environment, inherited from the
    raylet, does.)"""
    needle = str(directory).encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
            named = needle in command or needle in (entry / "environ").read_bytes()
        except OSError:
            continue  # ended meanwhile, or not ours to read
        if named:
            found[int(entry.name)] = command.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; split after it.
    return int(stat.rsplit(")", 1)[1].split()[1])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class LocalRayHead:
    """``ray start --head --block`` on 127.0.0.1 with its own temp directory; started when
    made, waited for (bounded) until it wrote its address.

    Args:
        log_path: Where the ``ray start`` output goes.
        num_cpus: Logical CPUs of the head (actors of the example Ray backend ask for 1 each).

    Raises:
        ProcessError: When ``ray`` is not installed next to this interpreter, or the head
            exits or does not come up within :data:`HEAD_START_TIMEOUT_SEC`.
    """

    def __init__(self, log_path: Path, *, num_cpus: int = 2) -> None:
        command = shutil.which("ray", path=str(Path(sys.executable).parent))
        if command is None:
            raise ProcessError(
                f"--ray needs `pip install 'rollout-server[ray]'`: no `ray` command next to "
                f"{sys.executable}"
            )
        self.temp_dir = Path(tempfile.mkdtemp(prefix="soakray-"))
        token = self.temp_dir / "auth_token"
        token.touch(mode=0o600)
        token.write_text(secrets.token_hex(32), encoding="ascii")
        self.env: dict[str, str] = {
            **RAY_LOCAL_ENV,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
        }
        """What a process that joins the cluster needs in its environment (with
        ``RAY_ADDRESS`` set to :attr:`address`)."""
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.process = ManagedProcess(
            "ray head",
            [
                command,
                "start",
                "--head",
                "--block",
                "--node-ip-address=127.0.0.1",
                f"--port={self.port}",
                f"--num-cpus={num_cpus}",
                f"--object-store-memory={OBJECT_STORE_BYTES}",
                "--include-dashboard=false",
                "--disable-usage-stats",
                f"--temp-dir={self.temp_dir}",
            ],
            log_path=log_path,
            env=child_env(self.env, drop=("RAY_AUTH_TOKEN", "RAY_ADDRESS")),
            cwd=ROOT,
            # If the soak dies (even by SIGKILL), Linux SIGTERMs the head, which stops
            # its cluster as on a normal stop.
            die_with_parent=True,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        marker = self.temp_dir / "ray_current_cluster"
        deadline = time.monotonic() + HEAD_START_TIMEOUT_SEC
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ProcessError(
                    f"ray head exited with status {self.process.poll()}; its log ends:\n"
                    f"{self.process.log_tail()}"
                )
            if marker.exists() and "Ray runtime started" in self.process.log():
                return
            time.sleep(_POLL_SEC)
        raise ProcessError(
            f"ray head not up within {HEAD_START_TIMEOUT_SEC:g} s; its log ends:\n"
            f"{self.process.log_tail()}"
        )

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` is a live descendant of the head's ``ray start`` process (the
        GCS, the raylet and the workers the raylet starts are)."""
        seen: set[int] = set()
        current: int | None = pid
        while current is not None and current > 1 and current not in seen:
            if current == self.process.pid:
                return True
            seen.add(current)
            current = _parent(current)
        return False

    def stop(self) -> list[str]:
        """SIGTERM the head by its PID (it stops the processes it started), bounded; then
        wait (bounded) for every process under the temp directory to end, SIGKILL those that
        outlive the bound, and remove the directory.

        Returns:
            One line per process that had to be SIGKILLed (empty when the stop was clean).
        """
        self.process.stop(timeout_sec=HEAD_STOP_TIMEOUT_SEC)
        deadline = time.monotonic() + STRAY_WAIT_SEC
        strays = processes_under(self.temp_dir)
        while strays and time.monotonic() < deadline:
            time.sleep(_POLL_SEC)
            strays = processes_under(self.temp_dir)
        killed = []
        for pid, command in strays.items():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(f"pid {pid}: {command[:160]}")
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return killed
