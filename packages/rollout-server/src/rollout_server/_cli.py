"""The ``rollout-server`` command (also ``python -m rollout_server``).

``rollout-server serve MODULE:ATTR`` imports ``MODULE`` (from ``--app-dir``, default the
current directory, then ``sys.path``), takes ``ATTR`` (dotted attributes allowed) and
serves it:

* an aiohttp app built by :func:`~rollout_server.create_rollout_server` is served as is;
* an :class:`~rollout_server.ExecutionBackend` is served by ``create_rollout_server()``
  with the command's options;
* a zero-argument callable (a factory function, sync or async, or a backend class) is
  called, and its result must be one of the above.

The command runs on uvloop when it is installed, logs ``rollout-server listening on
http://HOST:PORT (LOOP)`` once it is bound (the real port when ``--port 0``), optionally writes
the bound port to ``--port-file``, and on SIGTERM or SIGINT runs the staged shutdown
(admissions close, results stay collectable) before it stops listening and exits 0. A
second signal cuts the remaining waits short. The API key is read from the environment
variable that ``--api-key-env`` names, never from the command line.

Exit status: 0 after a clean shutdown, 1 if the server could not start (for example the
port is taken), 2 for a bad command line or target.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import inspect
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from aiohttp import web

from ._app import (
    DEFAULT_KEEPALIVE_TIMEOUT_SEC,
    DEFAULT_MAX_BODY_BYTES,
    ROLLOUT_SERVER_KEY,
    create_rollout_server,
)
from ._backend import ExecutionBackend
from ._errors import ServerConfigError, ServeTargetError
from ._imports import resolve_import_string
from ._logsink import TurnBufferedStreamHandler
from ._registry import DEFAULT_STATUS_CHANGE_GRACE_SEC
from ._shutdown import ShutdownTimeouts

__all__ = ["GC_YOUNG_THRESHOLD", "build_app", "load_target", "main", "serve", "tune_collector"]

logger: Final = logging.getLogger("rollout_server.cli")

PORT_ENV: Final = "_OSMOSIS_ROLLOUT_PORT"
"""Default of ``--port`` when set (the variable osmosis-ai entrypoints read); else 8000."""

LOG_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"

LISTEN_BACKLOG: Final = 4096
"""Accept-queue length of the listening socket (``listen()`` backlog)."""

GC_YOUNG_THRESHOLD: Final = 10_000
"""Net container allocations between young-generation collections in the served process
(CPython's default is 700). With thousands of rollouts in flight, the default promotes
enough short-lived objects to trigger full collections that walk every live rollout: 5,000
held rollouts released at once spent 0.5-0.75 s of about 3 s in the collector with the
default, and 0.06-0.09 s with this value. Cyclic garbage still goes; it is found a little
later."""

_SERVER_OPTIONS: Final = (
    "api_key_env",
    "result_wait_timeout_sec",
    "polling_lease_timeout_sec",
    "result_retention_sec",
    "max_body_bytes",
    "keepalive_timeout_sec",
    "status_change_grace_sec",
    "access_log",
    "drain_timeout_sec",
    "cleanup_timeout_sec",
    "force_timeout_sec",
    "backend_shutdown_timeout_sec",
    "collect_timeout_sec",
)


def _default_port() -> int:
    value = os.environ.get(PORT_ENV, "")
    try:
        return int(value) if value.strip() else 8000
    except ValueError:
        return 8000


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``rollout-server``."""
    parser = argparse.ArgumentParser(
        prog="rollout-server",
        description="Serve the rollout protocol (wire-compatible with osmosis-ai 0.3.8).",
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_cmd = commands.add_parser(
        "serve",
        help="serve an app, a backend, or a factory of either",
        allow_abbrev=False,
        description=(
            "Serve MODULE:ATTR: an app built by create_rollout_server(), an ExecutionBackend, "
            "or a zero-argument (sync or async) factory of either."
        ),
        epilog=(
            "Once bound, one line 'rollout-server listening on http://HOST:PORT (LOOP)' is "
            "logged. On SIGTERM or SIGINT, admissions answer 503 at once while result polls "
            "are served; active work is drained, then cancelled, then force-cancelled; then "
            "backend.shutdown() runs and pollers get the collect window before the server "
            "stops listening. A second signal cuts the remaining waits short. The API key is "
            "only ever read from the environment (--api-key-env). Exit status: 0 after a "
            "clean shutdown, 1 if the server could not listen, 2 for a bad command line or "
            "target."
        ),
    )
    serve_cmd.add_argument(
        "target", metavar="MODULE:ATTR", help="what to serve, e.g. my_project.server:backend"
    )
    serve_cmd.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)"
    )
    serve_cmd.add_argument(
        "--port",
        type=int,
        default=_default_port(),
        help=f"port to bind, 0 for a free one (default ${PORT_ENV} when set, else 8000)",
    )
    serve_cmd.add_argument(
        "--port-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="write the bound port to this file (atomically) once listening; removed at exit",
    )
    serve_cmd.add_argument(
        "--app-dir",
        default=".",
        metavar="DIR",
        help="directory put first on sys.path (default .)",
    )
    serve_cmd.add_argument(
        "--loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="event loop (default auto: uvloop when installed)",
    )
    serve_cmd.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="log level of the root logger (default INFO)",
    )
    options = serve_cmd.add_argument_group(
        "server options", "apply when MODULE:ATTR is a backend or a factory of one"
    )
    options.add_argument(
        "--api-key-env",
        metavar="NAME",
        default=None,
        help="require 'Authorization: Bearer <key>', the key read from environment variable NAME",
    )
    seconds: dict[str, str] = {
        "--result-wait-timeout-sec": "long-poll wait (default 30)",
        "--polling-lease-timeout-sec": "polling lease (default 120)",
        "--result-retention-sec": "retention of published results (default 900)",
        "--keepalive-timeout-sec": f"HTTP keep-alive (default {DEFAULT_KEEPALIVE_TIMEOUT_SEC:.0f})",
        "--status-change-grace-sec": (
            "how long a long poll waits on after a non-terminal status change for the result "
            f"(default {DEFAULT_STATUS_CHANGE_GRACE_SEC:g}; 0: answer each change at once)"
        ),
        "--drain-timeout-sec": "shutdown: wait for active work (default 10)",
        "--cleanup-timeout-sec": "shutdown: wait after requesting cancellation (default 120)",
        "--force-timeout-sec": "shutdown: wait after forced cancellation (default 10)",
        "--backend-shutdown-timeout-sec": "shutdown: bound on backend.shutdown() (default 30)",
        "--collect-timeout-sec": "shutdown: window to collect drained results (default 5)",
    }
    for flag, text in seconds.items():
        options.add_argument(flag, type=float, default=None, metavar="SEC", help=f"{text}, seconds")
    options.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        metavar="N",
        help=f"largest accepted request body (default {DEFAULT_MAX_BODY_BYTES})",
    )
    options.add_argument(
        "--access-log",
        action="store_true",
        default=None,
        help="log one line per request (logger rollout_server.access)",
    )
    return parser


def load_target(spec: str, *, app_dir: str | None = ".") -> Any:
    """Import ``MODULE:ATTR`` and return the attribute (``ATTR`` may be dotted).

    Args:
        spec: ``"package.module:attr"``.
        app_dir: Directory put first on ``sys.path`` before importing; None for none.

    Raises:
        ServeTargetError: If ``spec`` is malformed, the module cannot be imported, or the
            attribute does not exist.
    """
    if app_dir is not None:
        directory = os.path.abspath(app_dir)
        if directory not in sys.path:
            sys.path.insert(0, directory)
    where = "on sys.path" if app_dir is None else f"in --app-dir ({app_dir}) or on sys.path"
    try:
        return resolve_import_string(
            spec,
            what="target",
            missing_module_hint=f"it is not {where}; check the spelling, or pass --app-dir",
        )
    except (ValueError, ImportError) as exc:
        # Chained to what the resolver chained: main() shows a traceback only when code in
        # the module failed (not for a malformed string, a missing module or attribute).
        raise ServeTargetError(str(exc)) from exc.__cause__


def _given_server_options(args: argparse.Namespace) -> list[str]:
    return [
        "--" + name.replace("_", "-")
        for name in _SERVER_OPTIONS
        if getattr(args, name, None) is not None
    ]


def _server_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if args.api_key_env is not None:
        key = os.environ.get(args.api_key_env)
        if key is None or not key.strip():
            raise ServerConfigError(
                f"environment variable {args.api_key_env} (named by --api-key-env) is not set "
                "or blank; export the API key in it, or drop --api-key-env to serve without auth"
            )
        kwargs["api_key"] = key
    for name in (
        "result_wait_timeout_sec",
        "polling_lease_timeout_sec",
        "result_retention_sec",
        "keepalive_timeout_sec",
        "status_change_grace_sec",
        "max_body_bytes",
    ):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    if args.access_log:
        kwargs["access_log"] = True
    stages = {
        "drain_sec": args.drain_timeout_sec,
        "cleanup_sec": args.cleanup_timeout_sec,
        "force_sec": args.force_timeout_sec,
        "backend_sec": args.backend_shutdown_timeout_sec,
        "collect_sec": args.collect_timeout_sec,
    }
    given = {name: value for name, value in stages.items() if value is not None}
    if given:
        kwargs["shutdown_timeouts"] = ShutdownTimeouts(**given)
    return kwargs


async def build_app(target: Any, args: argparse.Namespace) -> web.Application:
    """Turn a loaded target into the app to serve (see the module docstring).

    Raises:
        ServeTargetError: If the target is none of the accepted kinds, or its factory fails.
        ServerConfigError: If the command's server options are invalid.
    """
    value = target
    called = False
    while True:
        if isinstance(value, web.Application):
            if ROLLOUT_SERVER_KEY not in value:
                raise ServeTargetError(
                    f"{args.target} is an aiohttp Application that create_rollout_server() did "
                    "not build; serve a rollout app, a backend, or a factory of either"
                )
            given = _given_server_options(args)
            if given:
                raise ServeTargetError(
                    f"{', '.join(given)} configure the server that the command builds from a "
                    f"backend, but {args.target} is an app built already; pass these settings to "
                    "create_rollout_server() instead, or point the command at the backend"
                )
            return value
        if isinstance(value, ExecutionBackend):
            return create_rollout_server(backend=value, **_server_kwargs(args))
        if callable(value) and not called:
            called = True
            try:
                value = value()
                if inspect.isawaitable(value):
                    value = await value
            except Exception as exc:
                raise ServeTargetError(f"calling {args.target}() failed: {exc!r}") from exc
            continue
        kind = "the result of calling " if called else ""
        raise ServeTargetError(
            f"{kind}{args.target} is a {type(value).__name__}, not an aiohttp app built by "
            "create_rollout_server(), an ExecutionBackend, or a zero-argument factory of either"
        )


def write_port_file(path: Path, port: int) -> None:
    """Write ``port`` (decimal, newline-terminated) to ``path`` atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n", encoding="ascii")
    os.replace(tmp, path)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(
    app: web.Application,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    port_file: Path | None = None,
    stop: asyncio.Event | None = None,
    on_signal: Callable[[int], None] | None = None,
) -> None:
    """Serve a rollout app until ``stop`` is set (or SIGTERM/SIGINT), then shut down in stages.

    The staged drain of the app's :class:`~rollout_server.RolloutServer` runs while the
    server still listens; only then does the site stop.

    Args:
        app: An app built by :func:`~rollout_server.create_rollout_server`.
        host: Address to bind; default ``127.0.0.1``.
        port: Port to bind, 0 for a free one; default 8000.
        port_file: If given, the bound port is written there once listening (and the file
            removed at the end).
        stop: Set it to begin the shutdown; default: a new event set by SIGTERM/SIGINT.
        on_signal: Called with the signal number of each SIGTERM/SIGINT received.
    """
    server = app[ROLLOUT_SERVER_KEY]
    loop = asyncio.get_running_loop()
    stop = asyncio.Event() if stop is None else stop
    signals_seen: list[int] = []

    def handle_signal(signum: int) -> None:
        signals_seen.append(signum)
        if on_signal is not None:
            on_signal(signum)
        if len(signals_seen) == 1:
            logger.info("Received %s: shutting down", signal.Signals(signum).name)
            stop.set()
        else:
            logger.info(
                "Received %s again: cutting the shutdown waits short", signal.Signals(signum).name
            )
            server.hurry()

    installed: list[int] = []
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=5.0)
    await runner.setup()
    try:
        # A deep accept queue: thousands of callers opening long-poll connections at once
        # must not see SYNs dropped (aiohttp's default backlog is 128); the kernel caps it
        # at net.core.somaxconn.
        site = web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG)
        await site.start()
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signum, handle_signal, signum)
                installed.append(signum)
        bound_host, bound_port = runner.addresses[0][:2]
        if port_file is not None:
            write_port_file(port_file, bound_port)
        logger.info(
            "rollout-server listening on %s (%s)",
            _url(str(bound_host), int(bound_port)),
            type(loop).__module__.partition(".")[0],
        )
        await stop.wait()
        await server.drain()
    finally:
        for installed_signum in installed:
            loop.remove_signal_handler(installed_signum)
        await runner.cleanup()
        if port_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(port_file)


def _loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ServerConfigError(
                "--loop uvloop: uvloop is not installed; install it or pass --loop asyncio"
            ) from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def tune_collector() -> None:
    """Tune CPython's cyclic collector for serving: move everything alive now (modules, the
    app) out of its reach, so full collections walk only the rollouts' own objects, and
    collect the young generation every :data:`GC_YOUNG_THRESHOLD` container allocations
    (the older generations' thresholds are kept)."""
    gc.collect()
    gc.freeze()
    _young, *older = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *older)


async def _serve_command(args: argparse.Namespace) -> int:
    target = load_target(args.target, app_dir=args.app_dir)
    app = await build_app(target, args)
    tune_collector()
    try:
        await serve(app, host=args.host, port=args.port, port_file=args.port_file)
    except OSError as exc:
        logger.error("rollout-server could not listen on %s: %s", _url(args.host, args.port), exc)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rollout-server``; return the exit status (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        # One write per event-loop turn, not per line (a line per rollout at INFO).
        logging.basicConfig(
            level=args.log_level,
            format=LOG_FORMAT,
            handlers=[TurnBufferedStreamHandler(sys.stderr)],
        )
    else:
        logging.getLogger().setLevel(args.log_level)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be between 0 and 65535; got {args.port}")
    try:
        factory = _loop_factory(args.loop)
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(_serve_command(args))
    except (ServeTargetError, ServerConfigError) as exc:
        cause = exc.__cause__
        show_traceback = cause is not None and not isinstance(
            cause, ModuleNotFoundError | AttributeError
        )
        logger.error("rollout-server: %s", exc, exc_info=show_traceback)
        return 2
