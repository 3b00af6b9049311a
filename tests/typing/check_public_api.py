"""Checked by mypy (``nox -s typecheck``), never run: the public API types as documented."""

from __future__ import annotations

from rollout_types import (
    RolloutInitRequest,
    RolloutResultResponse,
    RolloutStatus,
    converter,
    dumps,
    structure_wire,
)

request = RolloutInitRequest(
    initial_messages=[{"role": "user", "content": "hi"}],
    rollout_id="r1",
    chat_completions_url="http://127.0.0.1:9000/v1",
)
payload: str = dumps(request)
result: RolloutResultResponse = structure_wire({}, RolloutResultResponse)
terminal: bool = result.is_terminal
status: RolloutStatus | str = result.status
document: object = converter.unstructure(request)
