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

The process exits within the shutdown's stage bounds whatever user code does (see
:mod:`~rollout_server.cli._exit`).

Exit status: 0 after a shutdown, 1 if the server could not start (for example the port is
taken), 2 for a bad command line or target. ``--version`` prints the version; a bad option of
``serve`` prints its usage; an ``--app-dir`` that is not a directory, or a ``--port`` out of
range, prints one line saying so (and where the options are described).

The command's parts, by responsibility: the parser and the table of server options
(:mod:`~rollout_server.cli._options`), target loading (:mod:`~rollout_server.cli._target`),
serving and the startup line (:mod:`~rollout_server.cli._serve`), the bounded exit
(:mod:`~rollout_server.cli._exit`) and logging (:mod:`~rollout_server.cli._logsink`). This
module runs them in order: :func:`main`.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, NoReturn

from .._errors import ServerConfigError, ServeTargetError
from .._logtext import get_logger
from ..http._app import ROLLOUT_SERVER_KEY
from ._exit import EXIT_SLACK_SEC, LEFTOVER_TASK_GRACE_SEC, ExitGuard, end_leftover_tasks, exit_now
from ._logsink import configure_logging
from ._options import build_parser
from ._serve import describe_served, serve, tune_collector
from ._target import build_app, load_target

__all__ = ["main"]

logger: Final = get_logger("rollout_server.cli")


def _refuse(command: argparse.ArgumentParser, message: str) -> NoReturn:
    """Exit 2 with one line saying what is wrong and where the options are described (a
    value the parser accepted, so the usage would not help)."""
    command.exit(
        2, f"{command.prog}: error: {message}\nSee '{command.prog} --help' for the options.\n"
    )


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


async def _serve_command(args: argparse.Namespace, exit_guard: ExitGuard) -> int:
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
        _refuse(
            command,
            f"--app-dir {args.app_dir} {problem}; pass the directory that holds MODULE (the "
            "default is the current directory)",
        )
    if not 0 <= args.port <= 65535:
        _refuse(command, f"--port must be between 0 and 65535; got {args.port}")
    configure_logging(args.log_level, args.log_format)
    exit_guard = ExitGuard()
    exit_guard.install()
    try:
        runner = asyncio.Runner(loop_factory=_loop_factory(args.loop))
        try:
            status = runner.run(_serve_command(args, exit_guard))
            exit_guard.after_serving()
            leftover = runner.run(end_leftover_tasks(LEFTOVER_TASK_GRACE_SEC))
            if leftover:
                # asyncio.Runner would wait for them for ever: the shutdown has logged the
                # ids of abandoned rollouts; do not wait for work that ignores cancellation.
                exit_now(
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
