"""Serving one rollout app: bind, announce, wait for the stop signal, run the staged
drain while still listening, then stop. Also what the serving process is tuned with (the
listen backlog, the cyclic collector) and the startup line that says what is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, Final

from aiohttp import web

from rollout_types import PROTOCOL_VERSION

from .._logtext import get_logger
from ..http._app import ROLLOUT_SERVER_KEY
from ..state._store import parse_state_url

__all__ = [
    "GC_YOUNG_THRESHOLD",
    "LISTEN_BACKLOG",
    "describe_served",
    "loop_name",
    "serve",
    "tune_collector",
    "write_port_file",
]

logger: Final = get_logger("rollout_server.cli")

# Speed: benchmarks/README.md, "Server: the `rollout-server serve` process", row "Listen backlog of
#   4096"
LISTEN_BACKLOG: Final = 4096
"""Accept-queue length of the listening socket (``listen()`` backlog)."""

# Speed: benchmarks/README.md, "Server: the `rollout-server serve` process", row "The collector
#   tuned for serving ..."
GC_YOUNG_THRESHOLD: Final = 10_000
"""Net container allocations between young-generation collections in the served process
(CPython's default is 700). With thousands of rollouts in flight, the default promotes
enough short-lived objects to trigger full collections that walk every live rollout: 5,000
held rollouts released at once spent 0.5-0.75 s of about 3 s in the collector with the
default, and 0.06-0.09 s with this value. Cyclic garbage still goes; it is found a little
later."""


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
            loop_name(loop),
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


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    return type(loop).__module__.partition(".")[0]


def describe_served(target: str, app: web.Application) -> str:
    """The startup line's text: what ``app`` serves, as an operator wants to know it.

    Names the target, the backend's class with its slots (``max_concurrent``), queue bound
    (``max_queued``) and artifact root (``artifact_root``) when the backend has these
    attributes, whether auth is on, where the state is kept, the protocol version and the
    event loop.
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
        f"auth {'on' if server.requires_auth else 'off'}; state {_state_text(server.state)}; "
        f"protocol {PROTOCOL_VERSION}; loop {loop_name(asyncio.get_running_loop())}"
    )


def _state_text(url: str) -> str:
    """The state on the startup line: the file, or what ``memory:`` means."""
    if parse_state_url(url).durable:
        return url
    return f"{url} (nothing survives a restart; pass --state sqlite:///ABS/PATH.db to keep it)"


# Speed: benchmarks/README.md, "Server: the `rollout-server serve` process", row "The collector
#   tuned for serving ..."
def tune_collector() -> None:
    """Tune CPython's cyclic collector for serving: move everything alive now (modules, the
    app) out of its reach, so full collections walk only the rollouts' own objects, and
    collect the young generation every :data:`GC_YOUNG_THRESHOLD` container allocations
    (the older generations' thresholds are kept)."""
    gc.collect()
    gc.freeze()
    _young, *older = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *older)
