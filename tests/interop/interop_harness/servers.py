"""Command lines of the servers a pair can have, for :class:`~.processes.ServerProcess`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

from .peers import REMOTE_DIR
from .processes import ServerProcess

API_KEY_ENV: Final = "ROLLOUT_INTEROP_API_KEY"
"""The variable both servers read their bearer key from (``--api-key-env``)."""
API_KEY: Final = "interop-secret-key"

Argv = Callable[[int], Sequence[str]]


def our_server(
    python: str,
    *,
    target: str = "ours_app:backend",
    api_key: bool = False,
    wait_sec: float = 0.5,
    lease_sec: float | None = None,
    label: str = "rollout-server",
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """``rollout-server serve`` of ``remote/ours_app.py`` (not started yet).

    Args:
        python: The server side's interpreter.
        target: ``ours_app:backend`` or ``ours_app:backpressure_backend``.
        api_key: Require ``Bearer`` :data:`API_KEY`.
        wait_sec: ``--result-wait-timeout-sec``; short, so status changes show quickly.
        lease_sec: ``--polling-lease-timeout-sec``; default the server's (120 s).
        label: Name used in error messages.
        env: Extra environment variables of the server process.
    """

    def argv(port: int) -> list[str]:
        command = [
            python, "-m", "rollout_server", "serve", target,
            "--app-dir", str(REMOTE_DIR), "--host", "127.0.0.1", "--port", str(port),
            "--result-wait-timeout-sec", str(wait_sec),
            "--drain-timeout-sec", "2", "--collect-timeout-sec", "0.5",
        ]  # fmt: skip
        if lease_sec is not None:
            command += ["--polling-lease-timeout-sec", str(lease_sec)]
        if api_key:
            command += ["--api-key-env", API_KEY_ENV]
        return command

    return ServerProcess(argv, env={API_KEY_ENV: API_KEY, **(env or {})}, label=label)


def osmosis_server(
    python: str,
    *,
    api_key: bool = False,
    backpressure: bool = False,
    wait_sec: float | None = 0.5,
    lease_sec: float | None = None,
    label: str = "osmosis-ai server",
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """``remote/osmosis_app.py`` under uvicorn, in an osmosis-ai venv (not started yet).

    ``wait_sec`` and ``lease_sec`` must be None for osmosis-ai 0.3.2 (no such options).
    """

    def argv(port: int) -> list[str]:
        command = [python, str(REMOTE_DIR / "osmosis_app.py"), "--port", str(port)]
        if wait_sec is not None:
            command += ["--result-wait-timeout-sec", str(wait_sec)]
        if lease_sec is not None:
            command += ["--polling-lease-timeout-sec", str(lease_sec)]
        if api_key:
            command += ["--api-key-env", API_KEY_ENV]
        if backpressure:
            command.append("--backpressure")
        return command

    return ServerProcess(argv, env={API_KEY_ENV: API_KEY, **(env or {})}, label=label)
