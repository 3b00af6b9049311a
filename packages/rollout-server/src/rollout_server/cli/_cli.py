"""The ``rollout-server`` command (also ``python -m rollout_server``).

``rollout-server serve MODULE:ATTR`` imports ``MODULE`` (from ``--app-dir``, default the
current directory, then ``sys.path``), takes ``ATTR`` (dotted attributes allowed) and
serves it:

* an aiohttp app built by :func:`~rollout_server.create_rollout_server` is served as is;
* an :class:`~rollout_server.ExecutionBackend` is served by ``create_rollout_server()``
  with the command's options;
* a zero-argument callable (a factory function, sync or async, or a backend class) is
  called, and its result must be one of the above.

The command runs on uvloop when it is installed, logs one line saying what it serves
(target, backend slots and queue bound, artifact root, auth, protocol version, loop), then
``rollout-server listening on http://HOST:PORT (LOOP)`` once it is bound (the real port
when ``--port 0``), optionally writes the bound port to ``--port-file``, and on SIGTERM or
SIGINT runs the staged shutdown (admissions close, results stay collectable) before it
stops listening and exits 0. A second signal cuts the remaining waits short and still
exits 0. The API key is read from the environment variable that ``--api-key-env`` names,
never from the command line. ``--log-format json`` writes one JSON object per log line
(:mod:`rollout_server.observability._jsonlog`); ``--no-metrics`` turns ``GET /metrics``
off; traces are configured by the ``OTEL_*`` environment variables
(:mod:`rollout_server.observability._tracing`).

The process exits within the shutdown's stage bounds whatever user code does: tasks that
ignore cancellation after the last stage are abandoned (their rollout ids logged once by
the shutdown) and the process exits without waiting for them; should the exit itself
hang (a thread of user code that never returns, a blocked event loop), the process exits
0 once the sum of the stage bounds plus :data:`EXIT_SLACK_SEC` has passed since the
first signal (:data:`EXIT_SLACK_SEC` after a second one).

Exit status: 0 after a shutdown, 1 if the server could not start (for example the port is
taken), 2 for a bad command line or target. ``--version`` prints the version; a bad option of
``serve`` (or an ``--app-dir`` that is not a directory) prints its usage.

The module is longer than 500 lines because it is the whole command and nothing else uses
its parts: the parser with a help text per option is about 150 lines of it, and target
loading, the startup line, the loop choice and the exit guard each stay next to the serve
loop they serve.
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
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Final

from aiohttp import web

from rollout_types import PROTOCOL_VERSION

from .._errors import ServerConfigError, ServeTargetError
from .._logtext import get_logger
from .._version import VERSION
from ..execution._backend import ExecutionBackend
from ..execution._imports import resolve_import_string
from ..http._app import ROLLOUT_SERVER_KEY, create_rollout_server
from ..http._validation import MAX_POLLABLE_ID_CHARS, MAX_REQUEST_LINE_BYTES
from ..observability._jsonlog import JsonFormatter
from ..protocol._server import (
    DEFAULT_BODY_READ_TIMEOUT_SEC,
    DEFAULT_HEADER_READ_TIMEOUT_SEC,
    DEFAULT_KEEPALIVE_TIMEOUT_SEC,
    DEFAULT_MAX_BODY_BYTES,
    RolloutServer,
)
from ..protocol._shutdown import ShutdownTimeouts
from ..state._store import default_state_url
from ..state._waiting import DEFAULT_STATUS_CHANGE_GRACE_SEC
from ._logsink import TurnBufferedStreamHandler

__all__ = ["GC_YOUNG_THRESHOLD", "build_app", "load_target", "main", "serve", "tune_collector"]

logger: Final = get_logger("rollout_server.cli")

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

EXIT_SLACK_SEC: Final = 15.0
"""Time allowed, on top of the shutdown's stage bounds, for what follows the stages (the
listeners closing, in-flight requests answering, tasks ignoring cancellation getting a
last chance); past it the process exits 0 anyway (see the module docstring)."""

LEFTOVER_TASK_GRACE_SEC: Final = 1.0
"""After the shutdown, how long tasks still running (user code's own tasks, executions that
ignored every cancellation) get to end once cancelled before the process exits without
them."""

_SERVER_OPTIONS: Final = (
    "api_key_env",
    "result_wait_timeout_sec",
    "polling_lease_timeout_sec",
    "result_retention_sec",
    "max_body_bytes",
    "keepalive_timeout_sec",
    "header_read_timeout_sec",
    "body_read_timeout_sec",
    "status_change_grace_sec",
    "access_log",
    "drain_timeout_sec",
    "cleanup_timeout_sec",
    "force_timeout_sec",
    "backend_shutdown_timeout_sec",
    "collect_timeout_sec",
    "metrics",
    "state",
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
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {VERSION} (rollout protocol {PROTOCOL_VERSION})",
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
            "One line says what is served (target, slots, queue bound, artifact root, auth, "
            "protocol, loop); once bound, 'rollout-server listening on http://HOST:PORT "
            "(LOOP)' is logged. On SIGTERM or SIGINT, admissions answer 503 at once while "
            "result polls are served; active work is drained, then cancelled, then "
            "force-cancelled; then backend.shutdown() runs and pollers get the collect window "
            "(every result not yet delivered) before the server stops listening. A second "
            "signal cuts the remaining waits short. Work that ignores cancellation is "
            f"abandoned (its rollout ids logged); the process exits 0 at the latest "
            f"{EXIT_SLACK_SEC:g} s after the sum of the shutdown bounds. Requests: a request "
            f"line or header line may be at most {MAX_REQUEST_LINE_BYTES} bytes, so a "
            f"rollout_id may be at most {MAX_POLLABLE_ID_CHARS} characters once "
            "percent-encoded (longer ones get 422 at admission). The API key is only ever read "
            "from the environment (--api-key-env). Exit status: 0 after a shutdown, 1 if the "
            "server could not listen, 2 for a bad command line or target."
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
    serve_cmd.add_argument(
        "--log-format",
        default="text",
        choices=("text", "json"),
        help=(
            "text: 'TIME LEVEL LOGGER: MESSAGE' lines (default); json: one JSON object per "
            "line (timestamp, level, logger, message, and rollout_id, status, category where "
            "they apply), for log shippers"
        ),
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
        "--header-read-timeout-sec": (
            "once a request's first bytes arrive, its headers must be complete within this, "
            "else the connection is closed; idle keep-alive connections are not timed "
            f"(default {DEFAULT_HEADER_READ_TIMEOUT_SEC:g})"
        ),
        "--body-read-timeout-sec": (
            "once a request's headers arrive, its body must be complete within this, else 408 "
            f"and the connection is closed (default {DEFAULT_BODY_READ_TIMEOUT_SEC:g})"
        ),
        "--status-change-grace-sec": (
            "how long a long poll waits on after a non-terminal status change for the result "
            f"(default {DEFAULT_STATUS_CHANGE_GRACE_SEC:g}; 0: answer each change at once)"
        ),
        "--drain-timeout-sec": "shutdown: wait for active work (default 10)",
        "--cleanup-timeout-sec": "shutdown: wait after requesting cancellation (default 120)",
        "--force-timeout-sec": "shutdown: wait after forced cancellation (default 10)",
        "--backend-shutdown-timeout-sec": "shutdown: bound on backend.shutdown() (default 30)",
        "--collect-timeout-sec": (
            "shutdown: window to collect every result not yet delivered (default 5)"
        ),
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
    options.add_argument(
        "--state",
        metavar="URL",
        default=None,
        help=(
            "where admissions and results are kept so that a restart loses nothing: "
            "sqlite:///ABS/PATH.db or memory: (default: "
            "sqlite:///$XDG_STATE_HOME/rollout/state/serve-PORT.db, ~/.local/state without "
            "XDG_STATE_HOME; memory: with --port 0); the startup line names it"
        ),
    )
    options.add_argument(
        "--no-metrics",
        dest="metrics",
        action="store_const",
        const=False,
        default=None,
        help="do not serve Prometheus metrics at GET /metrics (served by default)",
    )
    for command in commands.choices.values():  # main() names the subcommand in errors
        command.set_defaults(command_parser=command)
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
        "--no-metrics" if name == "metrics" else "--" + name.replace("_", "-")
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
        "header_read_timeout_sec",
        "body_read_timeout_sec",
        "status_change_grace_sec",
        "max_body_bytes",
    ):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    if args.access_log:
        kwargs["access_log"] = True
    if args.metrics is False:
        kwargs["metrics"] = False
    kwargs["state"] = default_state_url(args.port) if args.state is None else args.state
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


_SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers


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

    installed: dict[int, _SignalHandler] = {}
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=5.0)
    await runner.setup()
    try:
        # A deep accept queue: thousands of callers opening long-poll connections at once
        # must not see SYNs dropped (aiohttp's default backlog is 128); the kernel caps it
        # at net.core.somaxconn.
        site = web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG)
        try:
            await site.start()
        except OSError as exc:
            # Said before the app's cleanup logs anything about shutting down.
            logger.error("rollout-server could not listen on %s: %s", _url(host, port), exc)
            raise
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                previous = signal.getsignal(signum)
                loop.add_signal_handler(signum, handle_signal, signum)
                installed[signum] = signal.SIG_DFL if previous is None else previous
        bound_host, bound_port = runner.addresses[0][:2]
        if port_file is not None:
            try:
                write_port_file(port_file, bound_port)
            except OSError as exc:
                logger.error("rollout-server could not write --port-file %s: %s", port_file, exc)
                raise
        logger.info(
            "rollout-server listening on %s (%s)",
            _url(str(bound_host), int(bound_port)),
            _loop_name(loop),
        )
        await stop.wait()
        await server.drain()
    finally:
        await runner.cleanup()
        # Removed only now: a signal while the listeners close still cuts waits short.
        for installed_signum, previous in installed.items():
            # Straight back to the handler found at the start: the loop's removal leaves
            # the default action (for SIGTERM, the end of the process) in between.
            loop.remove_signal_handler(installed_signum)
            signal.signal(installed_signum, previous)
        if port_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(port_file)


def _loop_name(loop: asyncio.AbstractEventLoop) -> str:
    return type(loop).__module__.partition(".")[0]


def describe_served(target: str, app: web.Application) -> str:
    """The startup line's text: what ``app`` serves, as an operator wants to know it.

    Names the target, the backend's class with its slots (``max_concurrent``), queue bound
    (``max_queued``) and artifact root (``artifact_root``) when the backend has these
    attributes, whether auth is on, the protocol version and the event loop.
    """
    server = app[ROLLOUT_SERVER_KEY]
    backend = server.backend
    details = []
    if hasattr(backend, "max_concurrent"):
        slots = backend.max_concurrent
        details.append("no slot limit" if slots is None else f"{slots} slot(s)")
    if hasattr(backend, "max_queued"):
        queued = backend.max_queued
        details.append("queue unbounded" if queued is None else f"queue bound {queued}")
    if hasattr(backend, "artifact_root"):
        details.append(f"artifact root {backend.artifact_root}")
    described = type(backend).__name__ + (f" ({', '.join(details)})" if details else "")
    return (
        f"rollout-server serving {target}: backend {described}; "
        f"auth {'on' if server.requires_auth else 'off'}; state {_state_text(server)}; "
        f"protocol {PROTOCOL_VERSION}; "
        f"loop {_loop_name(asyncio.get_running_loop())}"
    )


def _state_text(server: RolloutServer) -> str:
    url = server.state.url
    if server.state.durable:
        return url
    return f"{url} (nothing survives a restart; pass --state sqlite:///ABS/PATH.db to keep it)"


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


class _ExitGuard:
    """Bounds the command's exit, whatever user code does (see the module docstring).

    From the first signal on, a daemon timer ends the process with status 0 once the
    shutdown has had its stage bounds plus :data:`EXIT_SLACK_SEC`; a further signal moves
    that to :data:`EXIT_SLACK_SEC` from then. Once a shutdown has begun or serving is over,
    a signal that reaches the guard's handler (:meth:`install`; :func:`serve` hands the
    signals back to it when it stops listening) exits at once.
    """

    def __init__(self) -> None:
        self.bound_sec = EXIT_SLACK_SEC
        self._timer: threading.Timer | None = None
        self._signals = 0
        self._serving_over = False

    def install(self) -> None:
        """Handle SIGTERM and SIGINT before serving; until a shutdown begins, they keep their
        default action (SIGTERM ends the process, SIGINT raises KeyboardInterrupt)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, OSError):  # not the main thread
                signal.signal(signum, self._handle)

    def on_signal(self, _signum: int) -> None:
        """Called for each SIGTERM/SIGINT while serving (the drain handles the signal)."""
        self._signals += 1
        self._arm(self.bound_sec if self._signals == 1 else EXIT_SLACK_SEC)

    def after_serving(self) -> None:
        """From now on, a SIGTERM or SIGINT ends the process at once, with status 0."""
        self._serving_over = True

    def disarm(self) -> None:
        """The exit went as planned: stop the timer."""
        if self._timer is not None:
            self._timer.cancel()

    def _arm(self, seconds: float) -> None:
        self.disarm()
        message = f"Shutdown still not over {seconds:g} s after the signal; exiting now"
        self._timer = threading.Timer(seconds, _exit_now, args=(0, message))
        self._timer.daemon = True
        self._timer.start()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._serving_over or self._signals:
            _exit_now(0, f"Received {signal.Signals(signum).name} again: exiting now")
        if signum == signal.SIGINT:
            signal.default_int_handler(signum, frame)
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


def _exit_now(status: int, message: str) -> None:
    """Log ``message``, flush the logs and end the process with ``status``, without waiting
    for threads or tasks of user code."""
    logger.warning("%s", message)
    logging.shutdown()
    os._exit(status)


async def _end_leftover_tasks(grace_sec: float) -> list[asyncio.Task[Any]]:
    """Cancel every task but this one, wait up to ``grace_sec``; return those still running."""
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=grace_sec)
    return [task for task in tasks if not task.done()]


async def _serve_command(args: argparse.Namespace, exit_guard: _ExitGuard) -> int:
    target = load_target(args.target, app_dir=args.app_dir)
    app = await build_app(target, args)
    stages = app[ROLLOUT_SERVER_KEY].shutdown_timeouts
    exit_guard.bound_sec = (
        stages.drain_sec
        + stages.cleanup_sec
        + stages.force_sec
        + stages.backend_sec
        + stages.collect_sec
        + EXIT_SLACK_SEC
    )
    tune_collector()
    logger.info("%s", describe_served(args.target, app))
    try:
        await serve(
            app,
            host=args.host,
            port=args.port,
            port_file=args.port_file,
            on_signal=exit_guard.on_signal,
        )
    except OSError:
        return 1  # serve() has said what failed
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rollout-server``; return the exit status (see the module docstring)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command: argparse.ArgumentParser = args.command_parser
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    app_dir = Path(args.app_dir)
    if not app_dir.is_dir():
        problem = "is not a directory" if app_dir.exists() else "does not exist"
        command.error(
            f"--app-dir {args.app_dir} {problem}; pass the directory that holds MODULE (the "
            "default is the current directory)"
        )
    if not logging.getLogger().handlers:
        # One write per event-loop turn, not per line (a line per rollout at INFO).
        handler = TurnBufferedStreamHandler(sys.stderr)
        handler.setFormatter(
            JsonFormatter() if args.log_format == "json" else logging.Formatter(LOG_FORMAT)
        )
        logging.basicConfig(level=args.log_level, handlers=[handler])
    else:
        logging.getLogger().setLevel(args.log_level)
    if not 0 <= args.port <= 65535:
        command.error(f"--port must be between 0 and 65535; got {args.port}")
    exit_guard = _ExitGuard()
    exit_guard.install()
    try:
        runner = asyncio.Runner(loop_factory=_loop_factory(args.loop))
        try:
            status = runner.run(_serve_command(args, exit_guard))
            exit_guard.after_serving()
            leftover = runner.run(_end_leftover_tasks(LEFTOVER_TASK_GRACE_SEC))
            if leftover:
                # asyncio.Runner would wait for them for ever: the shutdown has logged the
                # ids of abandoned rollouts; do not wait for work that ignores cancellation.
                _exit_now(
                    status,
                    f"{len(leftover)} task(s) still running after the shutdown ignored "
                    "cancellation; exiting without them",
                )
        finally:
            runner.close()
    except (ServeTargetError, ServerConfigError) as exc:
        cause = exc.__cause__
        show_traceback = cause is not None and not isinstance(
            cause, ModuleNotFoundError | AttributeError
        )
        logger.error("rollout-server: %s", exc, exc_info=show_traceback)
        return 2
    finally:
        exit_guard.disarm()
    return status
