#!/usr/bin/env python3
"""The one-command demo: ``python3 run.py demo`` (``nox -s demo``) runs this file.

It starts, on free loopback ports:

1. the chat stand-in (``examples/chat_standin/server.py``): an OpenAI-compatible
   chat-completions server that stands in for vLLM/SGLang and answers the demo questions
   through real chat and tool-call messages, with a configurable wrong-answer rate and
   latency so rewards vary;
2. ``rollout-server serve calculator_agent.backend:create_backend --app-dir examples``: the
   example LocalBackend (a multi-turn chat agent with a calculator tool, and a grader that
   compares its final answer with the label);

then runs ``rollout-eval run examples/datasets/arithmetic.jsonl --report`` against them,
which prints the summary and writes ``report.html``, and finally stops both servers with
SIGTERM (each by its PID), checking that each exits with status 0.

Results go to ``.rollout-eval/demo/`` (git-ignored; each demo starts it afresh), the
server-side trajectories to ``.rollout-eval/demo-trajectories/``. Needs the three
distributions installed (the nox session installs them from wheels).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent
EXAMPLES: Final = ROOT / "examples"
DATASET: Final = EXAMPLES / "datasets" / "arithmetic.jsonl"
STANDIN: Final = EXAMPLES / "chat_standin" / "server.py"
BACKEND_TARGET: Final = "calculator_agent.backend:create_backend"
START_TIMEOUT_SEC: Final = 60.0
STOP_TIMEOUT_SEC: Final = 30.0


class DemoError(RuntimeError):
    """A demo server failed to start or to stop cleanly."""


def _script(name: str) -> list[str]:
    """The command of a console script installed next to this interpreter."""
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if found:
        return [found]
    modules = {"rollout-server": "rollout_server", "rollout-eval": "rollout_client.eval"}
    return [sys.executable, "-m", modules[name]]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Ask Linux to SIGTERM this child when the demo process dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))


class ManagedProcess:
    """A server subprocess that reports its bound port through a port file."""

    def __init__(
        self, name: str, command: Sequence[str], *, port_file: Path, env: dict[str, str]
    ) -> None:
        self.name = name
        self.port_file = port_file
        self.log_path = port_file.with_suffix(".log")
        self._terminated = False
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            list(command),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - the demo starts no threads
        )

    def wait_for_port(self, timeout_sec: float = START_TIMEOUT_SEC) -> int:
        """Wait until the port file holds the bound port; fail if the process exits first."""
        deadline = time.monotonic() + timeout_sec
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise DemoError(
                    f"{self.name} exited with status {self.process.returncode} before listening:"
                    f"\n{self.log_tail()}"
                )
            with contextlib.suppress(FileNotFoundError, ValueError):
                return int(self.port_file.read_text().strip())
            time.sleep(0.05)
        raise DemoError(f"{self.name} did not listen within {timeout_sec:g} s:\n{self.log_tail()}")

    def terminate(self) -> None:
        """Send SIGTERM to the process (by its PID) once, unless it has exited.

        Only once: a second SIGTERM would cut the server's shutdown short (or, after it
        restored the default handler, kill it).
        """
        if not self._terminated and self.process.poll() is None:
            self._terminated = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_sec: float = STOP_TIMEOUT_SEC) -> int:
        """SIGTERM the process by its PID and wait (bounded); kill it if it hangs.

        Returns:
            The exit status.

        Raises:
            DemoError: If it had to be killed.
        """
        try:
            self.terminate()
            try:
                return self.process.wait(timeout=timeout_sec)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_sec)
                raise DemoError(
                    f"{self.name} (pid {self.process.pid}) did not exit within {timeout_sec:g} s "
                    "of SIGTERM and was killed"
                ) from None
        finally:
            self._log.close()

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the process's output."""
        if not self._log.closed:
            self._log.flush()
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def demo_servers(
    workdir: Path,
    *,
    error_rate: float = 0.1,
    latency_ms: float = 30.0,
    seed: int = 0,
    stream: bool = True,
    artifact_root: Path | None = None,
    standin_args: Sequence[str] = (),
    server_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, str, list[ManagedProcess]]]:
    """Run the chat stand-in and the example rollout server for the ``with`` block.

    Yields:
        ``(chat_url, server_url, processes)``.

    Raises:
        DemoError: If a server fails to start, or does not exit 0 after SIGTERM.
    """
    base_env = dict(os.environ if env is None else env)
    base_env["PYTHONUNBUFFERED"] = "1"
    server_env = {
        **base_env,
        "ROLLOUT_ARTIFACT_ROOT": str(artifact_root or workdir / "trajectories"),
        "EXAMPLE_AGENT_STREAM": "1" if stream else "0",
    }
    processes: list[ManagedProcess] = []
    try:
        standin = ManagedProcess(
            "chat stand-in",
            [
                sys.executable,
                str(STANDIN),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--port-file",
                str(workdir / "standin.port"),
                "--error-rate",
                str(error_rate),
                "--latency-ms",
                str(latency_ms),
                "--seed",
                str(seed),
                *standin_args,
            ],
            port_file=workdir / "standin.port",
            env=base_env,
        )
        processes.append(standin)
        server = ManagedProcess(
            "rollout-server",
            [
                *_script("rollout-server"),
                "serve",
                BACKEND_TARGET,
                "--app-dir",
                str(EXAMPLES),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--port-file",
                str(workdir / "server.port"),
                "--log-level",
                "WARNING",
                *server_args,
            ],
            port_file=workdir / "server.port",
            env=server_env,
        )
        processes.append(server)
        chat_url = f"http://127.0.0.1:{standin.wait_for_port()}/v1"
        server_url = f"http://127.0.0.1:{server.wait_for_port()}"
        yield chat_url, server_url, processes
    finally:
        problems: list[str] = []
        for process in reversed(processes):
            process.terminate()  # all at once first, so an interrupted wait leaves none behind
        for process in reversed(processes):
            try:
                status = process.stop()
            except DemoError as exc:
                problems.append(str(exc))
                continue
            if status != 0:
                problems.append(
                    f"{process.name} exited with status {status} after SIGTERM:\n"
                    f"{process.log_tail()}"
                )
        if problems and sys.exc_info()[0] is None:
            raise DemoError("\n".join(problems))


def build_parser() -> argparse.ArgumentParser:
    """The options of the demo (all have working defaults)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--error-rate",
        type=float,
        default=0.1,
        help="probability of a wrong final answer from the stand-in (default 0.1)",
    )
    parser.add_argument(
        "--latency-ms", type=float, default=30.0, help="stand-in latency per call (default 30)"
    )
    parser.add_argument("--seed", type=int, default=0, help="stand-in seed (default 0)")
    parser.add_argument("--n", type=int, default=1, help="runs per row (default 1)")
    parser.add_argument(
        "--no-stream", action="store_true", help="the agent requests non-streamed completions"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=ROOT / ".rollout-eval",
        help="output root (default .rollout-eval/, git-ignored)",
    )
    return parser


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"received signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return rollout-eval's exit status (1 if a server misbehaved)."""
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    # SIGTERM (from nox, CI or a timeout) unwinds like Ctrl-C, so the servers are stopped.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    args.output.mkdir(parents=True, exist_ok=True)
    trajectories = args.output / "demo-trajectories"
    shutil.rmtree(trajectories, ignore_errors=True)
    shutil.rmtree(args.output / "demo", ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="rollout-demo-") as tmp:
        try:
            with demo_servers(
                Path(tmp),
                error_rate=args.error_rate,
                latency_ms=args.latency_ms,
                seed=args.seed,
                stream=not args.no_stream,
                artifact_root=trajectories,
            ) as (chat_url, server_url, _processes):
                print(f"demo: chat stand-in (not a model) at {chat_url}", flush=True)
                print(
                    f"demo: rollout server (example calculator agent) at {server_url}", flush=True
                )
                command = [
                    *_script("rollout-eval"),
                    "run",
                    str(DATASET),
                    "--server",
                    server_url,
                    "--chat-url",
                    chat_url,
                    "--output",
                    str(args.output),
                    "--name",
                    "demo",
                    "--n",
                    str(args.n),
                    "--progress-interval-sec",
                    "2",
                    "--report",
                ]
                print("demo: $ rollout-eval " + " ".join(command[len(_script("rollout-eval")) :]))
                status = subprocess.run(command, cwd=ROOT, check=False).returncode
        except DemoError as exc:
            print(f"demo: error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("demo: interrupted; both servers were stopped", file=sys.stderr)
            return 130
    print("demo: both servers stopped with SIGTERM and exited with status 0")
    print(f"demo: trajectories written by the server: {trajectories}")
    if (report := args.output / "demo" / "report.html").exists():
        print(f"demo: report (open it in a browser): {report}")
    print(f"demo: finished in {time.monotonic() - started:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
