"""Checks of the arguments both sides take: durations in float seconds and the bearer key.

``rollout-client`` and ``rollout-server`` check their constructor arguments with these, so a
bad value gets the same clear message on either side.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ._errors import FieldValueError

__all__ = ["check_api_key", "check_seconds"]

ErrorFactory = Callable[[str], Exception]
"""Builds the exception to raise from its message."""


def _raise(name: str, message: str, error: ErrorFactory | None) -> Exception:
    return FieldValueError(name, message) if error is None else error(message)


def check_seconds(
    name: str,
    value: object,
    *,
    allow_zero: bool = False,
    allow_negative: bool = False,
    error: ErrorFactory | None = None,
) -> float:
    """Check a duration argument in seconds; return it as a float.

    Args:
        name: The argument's name, for the message.
        value: The value given: an int or float (not a bool), finite.
        allow_zero: Accept 0 (default: the value must be > 0).
        allow_negative: Accept any finite value, zero and negatives included.
        error: Builds the exception from the message; default
            :class:`FieldValueError` naming ``name``.

    Returns:
        ``float(value)``.

    Raises:
        FieldValueError: (or what ``error`` builds) naming the argument, the bound and the
            value given.

    .. versionadded:: 0.2
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _raise(name, f"{name} must be a finite number of seconds; got {value!r}", error)
    if not allow_negative and (value < 0 or (value == 0 and not allow_zero)):
        bound = ">= 0" if allow_zero else "> 0"
        raise _raise(name, f"{name} must be {bound} seconds; got {value!r}", error)
    return float(value)


def check_api_key(api_key: object, *, error: ErrorFactory | None = None) -> str | None:
    """Check a bearer key argument (``api_key``): None, or a non-blank string to send.

    The key itself never appears in a message.

    Args:
        api_key: None (no authentication), or the key: not blank, without control
            characters (they cannot travel in an ``Authorization`` header).
        error: Builds the exception from the message; default
            :class:`FieldValueError` naming ``api_key``.

    Returns:
        ``api_key``.

    Raises:
        FieldValueError: (or what ``error`` builds) saying what is wrong with it.

    .. versionadded:: 0.2
    """
    if api_key is None:
        return None
    if not isinstance(api_key, str) or not api_key.strip():
        got = "a blank string" if isinstance(api_key, str) else type(api_key).__name__
        raise _raise(
            "api_key",
            "api_key must be a non-blank string (the bearer key), or None for no "
            f"authentication; got {got}",
            error,
        )
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in api_key):
        raise _raise(
            "api_key",
            "api_key must not contain control characters (they cannot travel in an "
            "Authorization header)",
            error,
        )
    return api_key
