"""Start and stop the benchmark's processes: a rollout server of either stack, a load generator.

The process handling itself is ``tools/devprocs.py`` (shared with the demo and the interop
harness), put on ``sys.path`` here. Every process gets its own session (so a terminal's
Ctrl-C reaches only the suite) and is stopped by its own PID: SIGTERM, a bounded wait, then
SIGKILL and another bounded wait.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from devprocs import ManagedProcess, ProcessError, child_env, stop_process, tail

from benchmarks.suite import FLOOR

ROOT: Final = Path(__file__).resolve().parents[1]
"""The repository root: the working directory of every process, so ``benchmarks`` imports."""

__all__ = [
    "HarnessError",
    "ServerProcess",
    "run_loadgen",
]

HarnessError = ProcessError
"""A benchmark process failed to start, to answer, or to report."""

START_TIMEOUT_SEC: Final = 60.0
"""Longest a server may take to publish its port and answer ``GET /health``."""
STATES: Final = ("memory", "sqlite")
"""Our server's state store: ``memory:``, or a fresh SQLite file in the server's directory."""

STOP_TIMEOUT_SEC: Final = 30.0
"""Longest a server may take to exit after SIGTERM before it is killed."""

PROFILE_RATE_HZ: Final = 200
"""Samples per second py-spy takes of a profiled server."""
LOADGEN_GRACE_SEC: Final = 60.0
"""Time a load generator gets beyond its own deadline (start-up, closing) before a kill."""

_SCRUBBED_ENV: Final = (
    "_OSMOSIS_ROLLOUT_PORT",
    "_OSMOSIS_ROLLOUT_PREVIEW_ROOT",
    "OSMOSIS_ROLLOUT_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_TRACES_EXPORTER",
)


class ServerProcess:
    """One rollout server of ``stack`` ("ours", "osmosis", or the HTTP floor) on 127.0.0.1.

    Use as a context manager: entering starts it and waits until ``GET /health`` answers
    200; leaving stops it by its PID and deletes its artifact directory.

    Args:
        stack: Which implementation to serve: ``ours``, ``osmosis``, or
            :data:`~benchmarks.suite.FLOOR` (run with our stack's interpreter).
        python: The interpreter of that stack's venv.
        log_path: Where the server's stdout and stderr go.
        py_spy: A ``py-spy`` executable: when given, it samples the server while it runs
            and writes collapsed stacks to ``profile_path`` (``--format raw``).
        profile_path: Where the profile goes (required with ``py_spy``).
        scratch_dir: Where the server's temporary directory (its artifact root: one
            directory and ``trajectory.json`` per rollout) is made; default the system's
            temporary directory.
        serve_args: More arguments for our stack's ``rollout-server serve`` (say
            ``--no-metrics``); default none.
        remove_workdir: Whether stopping the server deletes that directory (default). The
            suite keeps it and deletes every run's at the end: on ext4 the inodes of a
            just-deleted tree make the next run's file creations several times dearer
            (the allocator skips recently deleted inodes), which would be charged to the
            next server.
    """

    def __init__(
        self,
        *,
        stack: str,
        python: str,
        log_path: Path,
        py_spy: str | None = None,
        profile_path: Path | None = None,
        scratch_dir: Path | None = None,
        remove_workdir: bool = True,
        serve_args: Sequence[str] = (),
        state: str = "memory",
    ) -> None:
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES}; got {state!r}")
        if py_spy is not None and profile_path is None:
            raise ValueError("profile_path is required with py_spy")
        if stack not in ("ours", "osmosis", FLOOR):
            raise ValueError(f"stack must be 'ours', 'osmosis' or {FLOOR!r}; got {stack!r}")
        self.stack = stack
        self.python = python
        self.log_path = log_path
        self.py_spy = py_spy
        self.scratch_dir = scratch_dir
        self.remove_workdir = remove_workdir
        self.serve_args = tuple(serve_args)
        self.state = state
        self.profile_path = profile_path
        self.process: ManagedProcess | None = None
        self.profiler: ManagedProcess | None = None
        self.url = ""
        self._workdir: Path | None = None

    @property
    def pid(self) -> int:
        """The server's process id (only while it runs)."""
        if self.process is None:
            raise HarnessError("the server is not running")
        return self.process.pid

    def _command(self, port_file: Path) -> list[str]:
        if self.stack == "ours":
            return [
                self.python,
                "-m",
                "rollout_server",
                "serve",
                "benchmarks.apps.ours_app:backend",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--app-dir",
                str(ROOT),
                "--state",
                self._state_url(),
                *self.serve_args,
            ]
        module = "floor_app" if self.stack == FLOOR else "osmosis_serve"
        return [self.python, "-m", f"benchmarks.apps.{module}", "--port-file", str(port_file)]

    def _state_url(self) -> str:
        if self.state == "memory":
            return "memory:"
        assert self._workdir is not None
        return f"sqlite://{self._workdir / 'state.db'}"

    def state_figures(self) -> dict[str, Any] | None:
        """Our server's ``/health`` ``state`` object (the store and its group-commit figures:
        ``commits``, ``writes``, ``largest_commit``), or None for another stack or when
        ``/health`` does not answer."""
        if self.stack != "ours" or not self.url:
            return None
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5.0) as response:  # noqa: S310
                state = json.loads(response.read()).get("state")
        except (urllib.error.URLError, OSError, ValueError):
            return None
        return state if isinstance(state, dict) else None

    def __enter__(self) -> Self:
        self._workdir = Path(
            tempfile.mkdtemp(prefix=f"rollout-bench-{self.stack}-", dir=self.scratch_dir)
        )
        artifacts = self._workdir / "artifacts"
        port_file = self._workdir / "port"
        env = child_env(drop=_SCRUBBED_ENV)
        env["ROLLOUT_ARTIFACT_ROOT"] = env["_OSMOSIS_ROLLOUT_ARTIFACT_ROOT"] = str(artifacts)
        try:
            self.process = ManagedProcess(
                f"{self.stack} server",
                self._command(port_file),
                log_path=self.log_path,
                env=env,
                cwd=ROOT,
                new_session=True,
            )
            port = self.process.wait_for_port(
                port_file=port_file,
                ready=lambda port: _healthy(f"http://127.0.0.1:{port}"),
                timeout_sec=START_TIMEOUT_SEC,
            )
            self.url = f"http://127.0.0.1:{port}"
            if self.py_spy is not None and self.profile_path is not None:
                self.profile_path.parent.mkdir(parents=True, exist_ok=True)
                self.profiler = ManagedProcess(
                    "py-spy",
                    [
                        self.py_spy,
                        "record",
                        "--pid",
                        self.pid,
                        "--rate",
                        PROFILE_RATE_HZ,
                        "--nonblocking",
                        "--format",
                        "raw",
                        "--output",
                        self.profile_path,
                    ],
                    log_path=self.log_path.with_suffix(".py-spy.log"),
                    new_session=True,
                )
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if self.profiler is not None:
                # py-spy writes its output when interrupted, before the server goes away.
                self.profiler.stop(signal_number=signal.SIGINT)
        finally:
            self.profiler = None
            try:
                if self.process is not None:
                    self.process.stop(timeout_sec=STOP_TIMEOUT_SEC)
            finally:
                self.process = None
                if self._workdir is not None and self.remove_workdir:
                    shutil.rmtree(self._workdir, ignore_errors=True)
                self._workdir = None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as response:  # noqa: S310
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def run_loadgen(
    *, python: str, args: list[str], deadline_sec: float, log_path: Path
) -> dict[str, Any]:
    """Run ``python -m benchmarks.loadgen *args`` and return the JSON it prints.

    Args:
        python: The interpreter of the client's venv.
        args: The load generator's arguments (``--deadline-sec`` among them).
        deadline_sec: The load generator's own bound; it is killed
            :data:`LOADGEN_GRACE_SEC` later.
        log_path: Where its stderr goes (appended).

    Raises:
        HarnessError: When it exits non-zero, overruns, or prints no JSON object.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [python, "-m", "benchmarks.loadgen", *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )
        try:
            stdout, _ = process.communicate(timeout=deadline_sec + LOADGEN_GRACE_SEC)
        except subprocess.TimeoutExpired:
            stop_process(process, timeout_sec=5.0)
            raise HarnessError(
                f"load generator overran {deadline_sec + LOADGEN_GRACE_SEC:.0f} s and was stopped"
            ) from None
        finally:
            if process.poll() is None:
                stop_process(process, timeout_sec=5.0)
    if process.returncode != 0:
        raise HarnessError(
            f"load generator exited with {process.returncode}; its log ends:\n{tail(log_path)}"
        )
    lines = stdout.decode("utf-8", errors="replace").strip().splitlines()
    try:
        figures = json.loads(lines[-1])
    except (IndexError, ValueError) as exc:
        raise HarnessError(f"load generator printed no JSON object: {stdout[-500:]!r}") from exc
    if not isinstance(figures, dict):
        raise HarnessError(f"load generator printed {type(figures).__name__}, not an object")
    return figures
