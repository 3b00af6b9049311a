"""Copies of what a rollout hands to user code and keeps for its trajectory.

Each rollout gives its workflow its own copy of the request's prompt and metadata, and
keeps a snapshot of the messages the workflow returned (the trajectory's
``trajectory_messages``). These values come from JSON parsing or are built by user code as
plain dicts and lists, and :func:`copy.deepcopy` spends most of its time on bookkeeping
they do not need (its memo of shared objects and cycles): :func:`copy_json` copies them
several times faster, and falls back to :func:`copy.deepcopy` for anything else.
"""

from __future__ import annotations

import copy
from typing import Any, Final, TypeVar

__all__ = ["copy_json", "copy_or_keep", "snapshot_messages"]

_T = TypeVar("_T")

_JSON_SCALARS: Final[tuple[type, ...]] = (str, int, float, bool, type(None))


# Speed: benchmarks/README.md, "LocalBackend: files and copies", row "Prompt, metadata and the
#   trajectory snapshot copied by a JSON-aware deep copy ..."
def copy_json(value: Any) -> Any:
    """A deep copy, several times faster than :func:`copy.deepcopy` for what JSON parsing
    gives (plain dicts, lists and scalars); anything else inside is deep-copied.

    Shared sub-objects become separate copies.

    Raises:
        RecursionError: On a cycle of dicts and lists (or very deep nesting).
        Exception: Whatever :func:`copy.deepcopy` raises for an object inside.
    """
    kind = type(value)
    if kind is dict:
        return {
            key: item if type(item) in _JSON_SCALARS else copy_json(item)
            for key, item in value.items()
        }
    if kind is list:
        return [item if type(item) in _JSON_SCALARS else copy_json(item) for item in value]
    if kind in _JSON_SCALARS:
        return value
    return copy.deepcopy(value)


def snapshot_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A deep copy of ``messages``; a shallow one (new dicts, shared values) when they hold
    something that cannot be copied. Cycles are kept (:func:`copy.deepcopy` then)."""
    try:
        try:
            copied: list[dict[str, Any]] = copy_json(messages)
        except RecursionError:  # a cycle (or very deep nesting): deepcopy keeps cycles
            copied = copy.deepcopy(messages)
    except Exception:  # noqa: BLE001 - non-copyable content: a shallow snapshot will do
        return [dict(message) for message in messages]
    return copied


def copy_or_keep(value: _T) -> _T:
    """A deep copy of ``value`` (:func:`copy_json`), or ``value`` itself when it cannot be
    copied (request values are JSON, so that does not happen on the wire's path)."""
    try:
        copied: _T = copy_json(value)
    except Exception:  # noqa: BLE001 - request values are JSON; keep the original otherwise
        return value
    return copied
