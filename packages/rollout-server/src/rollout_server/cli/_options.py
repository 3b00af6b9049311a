"""The command line of ``rollout-server``: the parser, and the server options as one table.

Each server option is a row of :data:`SERVER_OPTIONS` naming the
:class:`~rollout_server.ServerSettings` field it sets (a field of its ``shutdown_timeouts``
for the shutdown bounds); the option's type, metavar and the default its help shows come
from that field, and :func:`server_settings` builds the settings from the rows. An option
left out is None, and the field keeps its default.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Final, NamedTuple

from rollout_types import PROTOCOL_VERSION

from .._errors import ServerConfigError
from .._version import VERSION
from ..http._validation import MAX_POLLABLE_ID_CHARS, MAX_REQUEST_LINE_BYTES
from ..protocol._settings import ServerSettings, field_default
from ..protocol._shutdown import ShutdownTimeouts
from ..state._store import default_state_url
from ._exit import EXIT_SLACK_SEC

__all__ = [
    "PORT_ENV",
    "SERVER_OPTIONS",
    "ServerOption",
    "api_key_from_env",
    "build_parser",
    "given_server_options",
    "server_settings",
]

PORT_ENV: Final = "_OSMOSIS_ROLLOUT_PORT"
"""Default of ``--port`` when set: the variable osmosis-ai sets to the port it expects a
rollout server it launches (``osmosis eval run``, training) to listen on; else 8000."""

_STAGE_FIELD: Final = "shutdown_timeouts"


class ServerOption(NamedTuple):
    """One option of ``serve`` that sets a :class:`~rollout_server.ServerSettings` field."""

    flag: str
    """The option, e.g. ``--result-wait-timeout-sec``."""
    field: str
    """The settings field it sets; ``shutdown_timeouts.NAME`` for a stage bound."""
    help: str
    """Its help text; ``{default}`` stands for the field's default."""

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments that holds the option (None: not given)."""
        return "metrics" if self.flag == "--no-metrics" else self.flag[2:].replace("-", "_")

    def default(self) -> Any:
        """The default of the field the option sets."""
        name, _, stage = self.field.partition(".")
        return getattr(field_default(name), stage) if stage else field_default(name)


SERVER_OPTIONS: Final = (
    ServerOption("--result-wait-timeout-sec", "result_wait_timeout_sec", "long-poll wait"),
    ServerOption("--polling-lease-timeout-sec", "polling_lease_timeout_sec", "polling lease"),
    ServerOption(
        "--result-retention-sec", "result_retention_sec", "retention of published results"
    ),
    ServerOption("--keepalive-timeout-sec", "keepalive_timeout_sec", "HTTP keep-alive"),
    ServerOption(
        "--header-read-timeout-sec",
        "header_read_timeout_sec",
        "once a request's first bytes arrive, its headers must be complete within this, else "
        "the connection is closed; idle keep-alive connections are not timed",
    ),
    ServerOption(
        "--body-read-timeout-sec",
        "body_read_timeout_sec",
        "once a request's headers arrive, its body must be complete within this, else 408 "
        "and the connection is closed",
    ),
    ServerOption(
        "--status-change-grace-sec",
        "status_change_grace_sec",
        "how long a long poll waits on after a non-terminal status change for the result "
        "(default {default}; 0: answer each change at once)",
    ),
    ServerOption(
        "--drain-timeout-sec", "shutdown_timeouts.drain_sec", "shutdown: wait for active work"
    ),
    ServerOption(
        "--cleanup-timeout-sec",
        "shutdown_timeouts.cleanup_sec",
        "shutdown: wait after requesting cancellation",
    ),
    ServerOption(
        "--force-timeout-sec",
        "shutdown_timeouts.force_sec",
        "shutdown: wait after forced cancellation",
    ),
    ServerOption(
        "--backend-shutdown-timeout-sec",
        "shutdown_timeouts.backend_sec",
        "shutdown: bound on backend.shutdown()",
    ),
    ServerOption(
        "--collect-timeout-sec",
        "shutdown_timeouts.collect_sec",
        "shutdown: window to collect every result not yet delivered, but for those of "
        "rollouts cancelled by request",
    ),
    ServerOption("--max-body-bytes", "max_body_bytes", "largest accepted request body"),
    ServerOption(
        "--access-log", "access_log", "log one line per request (logger rollout_server.access)"
    ),
    ServerOption(
        "--no-metrics",
        "metrics",
        "do not serve Prometheus metrics at GET /metrics (served by default)",
    ),
    ServerOption(
        "--gateway",
        "gateway",
        "run a model gateway: each rollout's workflow gets its own OpenAI-compatible base "
        "URL (RolloutContext.chat_completions_url and base_url) that forwards to the model "
        "endpoint and records every chat completion as a turn (token ids, logprobs) in "
        "trajectory.json, and in the result of a request with return_turns",
    ),
    ServerOption(
        "--model-endpoint",
        "model_endpoints",
        "a model endpoint's base URL for the gateway (repeatable; implies --gateway): "
        "rollouts go to these instead of their request's chat_completions_url, spread by "
        "consistent hashing with bounded loads on their group_id (else their id), so a "
        "rollout's turns and a group's rollouts share one endpoint and its prefix cache",
    ),
    ServerOption(
        "--state",
        "state",
        "where admissions and results are kept so that a restart loses nothing: "
        "sqlite:///ABS/PATH.db or memory: (default "
        "sqlite:///$XDG_STATE_HOME/rollout/state/serve-PORT.db, ~/.local/state without "
        "XDG_STATE_HOME; memory: with --port 0); the startup line names it",
    ),
)
"""Every option of ``serve`` that sets a server setting, in the order ``--help`` lists them."""


def _add_server_option(group: argparse._ArgumentGroup, option: ServerOption) -> None:
    """Add ``option`` to ``group``, its kind read from the default of its field: seconds
    (a float), a count (an int), or a switch (a bool: ``--x`` turns a False default on,
    ``--no-x`` a True one off)."""
    default = option.default()
    text = option.help
    if isinstance(default, tuple):  # a list of values: the option is repeated
        group.add_argument(
            option.flag, dest=option.dest, action="append", default=None, metavar="URL", help=text
        )
        return
    if isinstance(default, bool):
        # A switch is given or not: None when absent, so that only given options count.
        if default:
            group.add_argument(
                option.flag, dest=option.dest, action="store_const", const=False, help=text
            )
        else:
            group.add_argument(
                option.flag, dest=option.dest, action="store_true", default=None, help=text
            )
        return
    if isinstance(default, str):
        # A URL whose command default depends on other options (see server_settings()).
        group.add_argument(option.flag, dest=option.dest, default=None, metavar="URL", help=text)
        return
    shown = f"{default:g}" if isinstance(default, float) else str(default)
    text = text.format(default=shown) if "{default}" in text else f"{text} (default {shown})"
    if isinstance(default, float):
        kind: type = float
        metavar, text = "SEC", f"{text}, seconds"
    else:
        kind, metavar = int, "N"
    group.add_argument(
        option.flag, dest=option.dest, type=kind, default=None, metavar=metavar, help=text
    )


def given_server_options(args: argparse.Namespace) -> list[str]:
    """The server options given on the command line (``--api-key-env`` included)."""
    given = ["--api-key-env"] if getattr(args, "api_key_env", None) is not None else []
    return given + [
        option.flag for option in SERVER_OPTIONS if getattr(args, option.dest, None) is not None
    ]


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The :class:`~rollout_server.ServerSettings` the server options describe; without
    ``--state``, the state is the command's default for ``--port``
    (:func:`~rollout_server.state._store.default_state_url`).

    Raises:
        ServerConfigError: If an option is out of range (named by its field).
    """
    fields: dict[str, Any] = {}
    stages: dict[str, Any] = {}
    for option in SERVER_OPTIONS:
        value = getattr(args, option.dest)
        if value is not None:
            name, _, stage = option.field.partition(".")
            if stage:
                stages[stage] = value
            else:
                fields[name] = value
    if stages:
        fields[_STAGE_FIELD] = ShutdownTimeouts(**stages)
    if "state" not in fields:
        fields["state"] = default_state_url(args.port)
    return ServerSettings(**fields)


def api_key_from_env(args: argparse.Namespace) -> str | None:
    """The API key from the variable ``--api-key-env`` names; None without the option.

    Raises:
        ServerConfigError: If the variable is unset or blank.
    """
    if args.api_key_env is None:
        return None
    key = os.environ.get(args.api_key_env)
    if key is None or not key.strip():
        raise ServerConfigError(
            f"environment variable {args.api_key_env} (named by --api-key-env) is not set "
            "or blank; export the API key in it, or drop --api-key-env to serve without auth"
        )
    return key


def _default_port() -> int:
    value = os.environ.get(PORT_ENV, "")
    try:
        return int(value) if value.strip() else 8000
    except ValueError:
        return 8000


_EPILOG: Final = (
    "One line says what is served (target, slots, queue bound, artifact root, auth, "
    "protocol, loop); once bound, 'rollout-server listening on http://HOST:PORT "
    "(LOOP)' is logged. On SIGTERM or SIGINT, admissions answer 503 at once while "
    "result polls are served; active work is drained, then cancelled, then "
    "force-cancelled; then backend.shutdown() runs and pollers get the collect window "
    "(every result not yet delivered, but for those of rollouts cancelled by request) before "
    "the server stops listening. A second signal cuts the remaining waits short. Work that "
    "ignores cancellation is abandoned (its rollout ids logged); the process exits 0 at the "
    f"latest {EXIT_SLACK_SEC:g} s after the sum of the shutdown bounds. Requests: a request "
    f"line or header line may be at most {MAX_REQUEST_LINE_BYTES} bytes, so a "
    f"rollout_id may be at most {MAX_POLLABLE_ID_CHARS} characters once "
    "percent-encoded (longer ones get 422 at admission). The API key is only ever read "
    "from the environment (--api-key-env). Exit status: 0 after a shutdown, 1 if the "
    "server could not listen, 2 for a bad command line or target."
)


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
        epilog=_EPILOG,
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
        help=(
            f"port to bind, 0 for a free one (default ${PORT_ENV} when set, else 8000; "
            "osmosis-ai sets that variable to the port it expects when it launches a rollout "
            "server, as 'osmosis eval run' does)"
        ),
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
    for option in SERVER_OPTIONS:
        _add_server_option(options, option)
    for command in commands.choices.values():  # main() names the subcommand in errors
        command.set_defaults(command_parser=command)
    return parser
