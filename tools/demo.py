#!/usr/bin/env python3
"""The one-command demo: ``python3 run.py demo`` (``nox -s demo``) runs this file.

It starts, on free loopback ports:

1. the chat stand-in (``tools/chat_standin/server.py``): an OpenAI-compatible
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

from devprocs import STOP_TIMEOUT_SEC, ManagedProcess, ProcessError

ROOT: Final = Path(__file__).resolve().parent.parent
EXAMPLES: Final = ROOT / "examples"
DATASET: Final = EXAMPLES / "datasets" / "arithmetic.jsonl"
STANDIN: Final = ROOT / "tools" / "chat_standin" / "server.py"
BACKEND_TARGET: Final = "calculator_agent.backend:create_backend"


def _script(name: str) -> list[str]:
    """The command of a console script installed next to this interpreter."""
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if found:
        return [found]
    modules = {"rollout-server": "rollout_server", "rollout-eval": "rollout_client.eval"}
    return [sys.executable, "-m", modules[name]]


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

    Each server writes its port to ``workdir/<name>.port`` and its output to
    ``workdir/<name>.log``, and gets SIGTERM when the demo process dies.

    Yields:
        ``(chat_url, server_url, processes)``.

    Raises:
        ProcessError: If a server fails to start, or does not exit 0 after SIGTERM.
    """
    base_env = dict(os.environ if env is None else env)
    base_env["PYTHONUNBUFFERED"] = "1"
    server_env = {
        **base_env,
        "ROLLOUT_ARTIFACT_ROOT": str(artifact_root or workdir / "trajectories"),
        "EXAMPLE_AGENT_STREAM": "1" if stream else "0",
    }
    standin_port, server_port = workdir / "standin.port", workdir / "server.port"
    processes: list[ManagedProcess] = []
    try:
        standin = ManagedProcess(
            "chat stand-in",
            [
                sys.executable,
                STANDIN,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--port-file",
                standin_port,
                "--error-rate",
                error_rate,
                "--latency-ms",
                latency_ms,
                "--seed",
                seed,
                *standin_args,
            ],
            log_path=standin_port.with_suffix(".log"),
            env=base_env,
            cwd=ROOT,
            die_with_parent=True,  # the demo starts no threads
        )
        processes.append(standin)
        server = ManagedProcess(
            "rollout-server",
            [
                *_script("rollout-server"),
                "serve",
                BACKEND_TARGET,
                "--app-dir",
                EXAMPLES,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--port-file",
                server_port,
                "--log-level",
                "WARNING",
                *server_args,
            ],
            log_path=server_port.with_suffix(".log"),
            env=server_env,
            cwd=ROOT,
            die_with_parent=True,
        )
        processes.append(server)
        chat_url = f"http://127.0.0.1:{standin.wait_for_port(port_file=standin_port)}/v1"
        server_url = f"http://127.0.0.1:{server.wait_for_port(port_file=server_port)}"
        yield chat_url, server_url, processes
    finally:
        problems: list[str] = []
        for process in reversed(processes):
            process.terminate()  # all at once first, so an interrupted wait leaves none behind
        for process in reversed(processes):
            stopped = process.stop()
            if stopped.killed:
                problems.append(
                    f"{process.name} (pid {process.pid}) did not exit within "
                    f"{STOP_TIMEOUT_SEC:g} s of SIGTERM and was killed"
                )
            elif stopped.status != 0:
                problems.append(
                    f"{process.name} exited with status {stopped.status} after SIGTERM:\n"
                    f"{process.log_tail()}"
                )
        if problems and sys.exc_info()[0] is None:
            raise ProcessError("\n".join(problems))


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
        except ProcessError as exc:
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
