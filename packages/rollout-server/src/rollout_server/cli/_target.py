"""What ``rollout-server serve MODULE:ATTR`` serves: the target is imported (from
``--app-dir``, then ``sys.path``) and turned into a rollout app: an app built by
:func:`~rollout_server.create_rollout_server` as is, a backend through
``create_rollout_server()`` with the command's server options, a zero-argument factory (sync
or async) of either by calling it.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from typing import Any

from aiohttp import web

from .._errors import ServeTargetError
from ..execution._backend import ExecutionBackend
from ..execution._imports import resolve_import_string
from ..http._app import ROLLOUT_SERVER_KEY, create_rollout_server
from ._options import api_key_from_env, given_server_options, server_settings

__all__ = ["build_app", "load_target"]


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
            given = given_server_options(args)
            if given:
                raise ServeTargetError(
                    f"{', '.join(given)} configure the server that the command builds from a "
                    f"backend, but {args.target} is an app built already; pass these settings to "
                    "create_rollout_server() instead, or point the command at the backend"
                )
            return value
        if isinstance(value, ExecutionBackend):
            return create_rollout_server(
                backend=value, api_key=api_key_from_env(args), settings=server_settings(args)
            )
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
