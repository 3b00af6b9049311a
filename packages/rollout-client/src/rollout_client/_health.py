"""Reading ``GET /health`` answers: the payload, the server's lifecycle identity and state."""

from __future__ import annotations

from typing import Any

from rollout_types import RolloutLifecycle, WireValidationError, loads, structure_wire

from ._errors import RolloutProtocolError
from ._transport import HttpResponse

__all__ = ["check_identity", "health_payload", "lifecycle_of"]


def health_payload(response: HttpResponse) -> dict[str, Any]:
    """The JSON object of a 200 answer.

    Raises:
        RolloutProtocolError: A status other than 200 (``GET /health failed``), or a body
            that is not a JSON object (``GET /health returned invalid JSON``).
    """
    if response.status != 200:
        raise RolloutProtocolError(
            f"GET /health failed with HTTP {response.status}{response.detail_suffix()}",
            status_code=response.status,
        )
    try:
        data = loads(response.body)
    except WireValidationError as exc:
        raise RolloutProtocolError("GET /health returned invalid JSON", status_code=200) from exc
    if not isinstance(data, dict):
        raise RolloutProtocolError(
            f"GET /health returned invalid JSON: expected an object, got {type(data).__name__}",
            status_code=200,
        )
    return data


def check_identity(health: dict[str, Any], pinned: object) -> str:
    """Return the process id to pin, or raise when the server has none or restarted."""
    process_id = health.get("process_id")
    if not isinstance(process_id, str) or not process_id:
        raise RolloutProtocolError(
            "Server has no lifecycle identity: GET /health carries no process_id (servers "
            "before osmosis-ai 0.3.5 report none), so wait_idle() cannot tell a restart",
            status_code=200,
        )
    if pinned is None:
        return process_id
    if process_id != pinned:
        raise RolloutProtocolError(
            f"Server restarted while waiting: its process_id is {process_id!r}, expected "
            f"{pinned!r}; work of the earlier process cannot be observed any more",
            status_code=200,
        )
    return process_id


def lifecycle_of(health: dict[str, Any]) -> RolloutLifecycle:
    """The ``lifecycle`` object of a health payload.

    Raises:
        RolloutProtocolError: It is missing or invalid.
    """
    try:
        return structure_wire(health.get("lifecycle"), RolloutLifecycle, loc=("lifecycle",))
    except WireValidationError as exc:
        raise RolloutProtocolError(
            f"Server has no valid lifecycle state: {exc}", status_code=200
        ) from exc
