"""Caller text in log lines: escaped, so no request can forge or break a line.

Rollout ids, error messages, paths and other text that comes from callers or user code
reach the server's log lines as arguments. :func:`log_text` escapes such a value (control
characters, line breaks, ANSI escapes and other non-printable code points as ``repr``
does) and shortens it; :data:`ESCAPE_CALLER_TEXT`, a filter on every logger of the server
(:func:`get_logger`), applies it to each argument of each record the logger emits
(:func:`log_list` builds an argument listing many values, each escaped). The format
strings and tracebacks are the server's own and stay as they are.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable
from typing import Final

__all__ = ["ESCAPE_CALLER_TEXT", "MAX_LOGGED_CHARS", "get_logger", "log_list", "log_text"]

MAX_LOGGED_CHARS: Final = 1000
"""Longest caller text (characters, after escaping) a log line carries; the rest is
replaced by a note of how many characters were left out."""


def log_text(value: object) -> str:
    """``value`` as text safe for one log line.

    Printable text is kept as it is (non-ASCII letters included); text holding anything
    else (line breaks, control characters, lone surrogates, ...) is shown as its Python
    ``repr``, quotes and backslash escapes included, so it cannot end the line or pass for
    other output. Either is cut to :data:`MAX_LOGGED_CHARS` characters.

    Args:
        value: A string, or any object (its ``str()`` is used).

    Returns:
        One printable line.
    """
    text = value if isinstance(value, str) else str(value)
    if not text.isprintable():
        text = repr(text)
    if len(text) > MAX_LOGGED_CHARS:
        text = f"{text[:MAX_LOGGED_CHARS]}...(+{len(text) - MAX_LOGGED_CHARS} chars)"
    return text


class _Safe(str):
    """Text made safe for a log line already (the filter leaves it as it is)."""


def log_list(values: Iterable[object], limit: int) -> str:
    """``values`` as one log argument: each escaped with :func:`log_text`, comma-separated,
    the first ``limit`` of them (the rest counted)."""
    items = list(values)
    text = ", ".join(log_text(value) for value in items[:limit])
    if len(items) > limit:
        text += f" and {len(items) - limit} more"
    return _Safe(text)


class _Escaped(_Safe):
    """An argument escaped by :func:`log_text` that keeps an escaped ``repr`` for ``%r``."""

    _repr: str

    def __new__(cls, original: object) -> _Escaped:
        escaped = super().__new__(cls, log_text(original))
        escaped._repr = log_text(repr(original))
        return escaped

    def __repr__(self) -> str:
        return self._repr


def _escaped(arg: object) -> object:
    if isinstance(arg, _Safe):
        return arg
    if isinstance(arg, str):
        return arg if arg.isprintable() and len(arg) <= MAX_LOGGED_CHARS else _Escaped(arg)
    if arg is None or isinstance(arg, numbers.Number):
        return arg  # numbers format as numbers (%d, %.1f) and hold no text
    return _Escaped(arg)


class _EscapeCallerText(logging.Filter):
    """Escapes every argument of a record with :func:`log_text` (never drops a record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and args:
            record.args = tuple(_escaped(arg) for arg in args)
        return True


ESCAPE_CALLER_TEXT: Final = _EscapeCallerText()
"""The filter :func:`get_logger` puts on each logger of the server."""


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with :data:`ESCAPE_CALLER_TEXT` on it (added once).

    Each module of the server takes its logger from here, so the arguments of every line
    it logs are escaped; records of other loggers are left alone.
    """
    logger = logging.getLogger(name)
    if ESCAPE_CALLER_TEXT not in logger.filters:
        logger.addFilter(ESCAPE_CALLER_TEXT)
    return logger
