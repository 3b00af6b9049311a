"""Checks of the arguments callers pass to :class:`RolloutClient`, before any I/O."""

from __future__ import annotations

import math

__all__ = ["check_api_key", "check_seconds"]


def check_seconds(name: str, value: object, *, positive: bool) -> float:
    """Return ``value`` as float seconds.

    Raises:
        ValueError: ``value`` is not a number, not finite, or (with ``positive``) not > 0.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number of seconds; got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds):
        raise ValueError(f"{name} must be finite; got {value!r}")
    if positive and seconds <= 0:
        raise ValueError(f"{name} must be greater than 0; got {value!r}")
    return seconds


def check_api_key(api_key: object) -> str | None:
    """Return the server's bearer key, or None for a server without authentication.

    Raises:
        ValueError: The key is not a string, is blank, or holds control characters.
    """
    if api_key is None:
        return None
    if not isinstance(api_key, str) or not api_key.strip():
        raise ValueError(
            "api_key must be a non-blank string (the server's bearer key), or None for a "
            f"server without authentication; got {api_key!r}"
        )
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in api_key):
        raise ValueError(
            "api_key must not contain control characters (they cannot travel in an "
            "Authorization header)"
        )
    return api_key
