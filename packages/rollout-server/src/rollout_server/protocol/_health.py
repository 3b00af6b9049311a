"""The ``/health`` document of :class:`~rollout_server.RolloutServer`.

The backend's own fields (``backend.health()``) made JSON-safe, a backend that raises or
answers something other than a mapping reported as such instead of failing the request,
then the server's ``state`` fields (:func:`~rollout_server.protocol._recovery.health_fields`)
over them, and the server's identity, lifecycle and protocol version around them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from rollout_types import PROTOCOL_VERSION, RolloutHealth, RolloutLifecycle

from .._logtext import get_logger
from .._sanitize import fit_json
from ..execution._backend import ExecutionBackend
from ..state._store import StateStore
from ._recovery import Recovery, health_fields

__all__ = ["health_document"]

logger: Final = get_logger("rollout_server.app")


def health_document(
    *,
    backend: ExecutionBackend,
    store: StateStore,
    recovery: Recovery,
    instance_id: str,
    process_id: str,
    lifecycle: RolloutLifecycle,
) -> RolloutHealth:
    """The ``/health`` document: ``backend``'s fields (``{"status": "error", ...}`` when
    ``backend.health()`` raises, ``{"status": "unknown"}`` when it is not a dict; values
    that are not JSON are dropped with a warning), with the ``state`` of ``store`` and
    ``recovery``, and the identity, ``lifecycle`` and protocol version."""
    fitted: Any = None
    try:
        fields: Any = backend.health()
    except Exception as exc:
        logger.exception("backend.health() failed")
        fields = {"status": "error", "error": f"backend.health() raised {exc!r}"}
    if isinstance(fields, Mapping):
        fitted, dropped = fit_json(dict(fields), "health")
        if dropped:
            logger.warning("Dropped non-JSON backend health values: %s", ", ".join(dropped))
    if not isinstance(fitted, dict):
        logger.warning("backend.health() returned %s, not a dict", type(fields).__name__)
        fitted = {"status": "unknown"}
    # The server's own fields win over a backend's of the same name, as identity does.
    fitted["state"] = health_fields(store, recovery)
    return RolloutHealth(
        instance_id=instance_id,
        process_id=process_id,
        lifecycle=lifecycle,
        protocol_version=PROTOCOL_VERSION,
        backend=fitted,
    )
