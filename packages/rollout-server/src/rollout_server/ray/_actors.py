"""How :class:`~rollout_server.RayBackend`'s worker actors are configured, named and placed.

* **Options.** The Ray actor options of every worker: the caller's ``worker_options`` over
  :data:`WORKER_OPTION_DEFAULTS`, with the options the pool sets itself
  (:data:`RESERVED_OPTIONS`: one incarnation per worker, no task retries, the concurrency
  of its slots plus :data:`CONTROL_CALLS`) (:func:`actor_options`).
* **Names and namespace.** On durable state with a Ray cluster that outlives the server,
  the workers are named, detached actors (:func:`worker_name`) in the namespace of the
  state URL (:func:`state_namespace`), and each keeps its latest outcomes
  (:func:`kept_outcomes`) for a restarted server.
* **Ending.** :func:`kill_actor` kills an actor for good (no Ray-side restart).

This module never imports Ray at import time.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Mapping
from typing import Any, Final

__all__ = [
    "CONTROL_CALLS",
    "NAME_RETRY_SEC",
    "RESERVED_OPTIONS",
    "UNLIMITED_CALLS",
    "WORKER_NAME",
    "WORKER_OPTION_DEFAULTS",
    "actor_options",
    "describe_options",
    "kept_outcomes",
    "kill_actor",
    "state_namespace",
    "worker_name",
]

CONTROL_CALLS: Final = 8
"""Actor concurrency beyond the slots: the events long poll, cancellations, pings."""

UNLIMITED_CALLS: Final = 1000
"""Actor concurrency for rollouts when the workflow config sets no slot limit (Ray's own
default for async actors)."""

RESERVED_OPTIONS: Final = frozenset(
    {"max_restarts", "max_task_retries", "max_concurrency", "concurrency_groups", "name"}
)
"""Actor options the pool sets itself (see :mod:`rollout_server.ray._pool`)."""

WORKER_OPTION_DEFAULTS: Final = {"num_cpus": 1, "enable_task_events": False}
"""Actor options of each worker unless ``worker_options`` sets them: one CPU, and no Ray
task events (a record per call in the GCS, which costs CPU there and in the server per
rollout and fills the dashboard's task table with one entry per rollout)."""

KEPT_OUTCOMES_PER_SLOT: Final = 4
KEPT_OUTCOMES_MIN: Final = 64
KEPT_OUTCOMES_UNLIMITED: Final = 1024
"""How many outcomes each named worker keeps for a restarted server (see
:func:`kept_outcomes`)."""

NAMESPACE_PREFIX: Final = "rollout-server-"

NAME_RETRY_SEC: Final = 0.2
"""Pause before creating a named worker again while Ray still holds the name of the one it
replaces (killed a moment ago)."""

WORKER_NAME: Final = re.compile(r"rollout-worker-(\d+)")


def actor_options(worker_options: Mapping[str, Any] | None, slots: int | None) -> dict[str, Any]:
    """The actor options of each worker with ``slots`` slots (None: no limit).

    Raises:
        ValueError: If ``worker_options`` sets one of :data:`RESERVED_OPTIONS`.
    """
    options = dict(worker_options or {})
    reserved = sorted(RESERVED_OPTIONS.intersection(options))
    if reserved:
        raise ValueError(
            f"worker_options must not set {', '.join(reserved)}: the pool sets them itself "
            "(one incarnation per worker, no task retries)"
        )
    options = {**WORKER_OPTION_DEFAULTS, **options}
    calls = UNLIMITED_CALLS if slots is None else slots
    options.update(
        max_restarts=0,
        max_task_retries=0,
        max_concurrency=calls + CONTROL_CALLS,
    )
    return options


def describe_options(options: Mapping[str, Any]) -> str:
    """``options`` but the reserved ones, as ``key=value`` pairs (for error messages)."""
    shown = {k: v for k, v in options.items() if k not in RESERVED_OPTIONS}
    return ", ".join(f"{k}={v!r}" for k, v in sorted(shown.items()))


def kept_outcomes(slots: int | None) -> int:
    """How many outcomes a named worker with ``slots`` slots keeps for a restarted server:
    4 per slot, at least 64; 1024 without a slot limit."""
    if slots is None:
        return KEPT_OUTCOMES_UNLIMITED
    return max(KEPT_OUTCOMES_MIN, KEPT_OUTCOMES_PER_SLOT * slots)


def state_namespace(state_url: str) -> str:
    """The Ray namespace of the named workers of a server on ``state_url``:
    ``rollout-server-`` and 16 hex digits of the URL's SHA-256 (the URL names the state
    file by its absolute path)."""
    return NAMESPACE_PREFIX + hashlib.sha256(state_url.encode()).hexdigest()[:16]


def worker_name(index: int) -> str:
    """The actor name of the named worker at position ``index``: ``rollout-worker-<index>``."""
    return f"rollout-worker-{index}"


def kill_actor(handle: Any) -> None:
    """Kill the actor of ``handle`` for good (``no_restart``); a failure is ignored (the
    actor is gone already)."""
    import ray

    with contextlib.suppress(Exception):
        ray.kill(handle, no_restart=True)
