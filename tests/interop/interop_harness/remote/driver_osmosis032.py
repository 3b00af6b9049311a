"""Driver of osmosis-ai 0.3.2's caller, ``HttpRolloutDriver`` (pre-0.3.3 callback protocol).

Run by the osmosis-ai 0.3.2 venv's interpreter. Ops (see :mod:`driver_common`):

``open(url, admission_timeout_sec=None, client)`` and
``run_rollout(client, rollout_id, initial_messages, label=None, metadata=None, ...)``,
which POSTs the callback-protocol admission (``completion_callback_url`` and friends)
exactly as 0.3.2's ``osmosis eval`` does, then waits for the callback. An error carries
the body of the refused admission as ``response_body``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import driver_common
import httpx
from osmosis_ai.rollout.controller.store import CallbackStore
from osmosis_ai.rollout.driver import RolloutRunRequest
from osmosis_ai.rollout.http_driver import HttpRolloutDriver

KIND = "osmosis-ai-callback"
CALLBACK_BASE = "http://127.0.0.1:9/callbacks"
"""Where 0.3.2 would receive callbacks; admission fails first, so nothing listens."""

drivers: dict[str, HttpRolloutDriver] = {}
last_bodies: dict[str, str] = {}


async def _on_response(response: httpx.Response) -> None:
    request = response.request
    driver_common.event(
        kind="response", method=request.method, path=request.url.path, status=response.status_code
    )
    if request.method == "POST" and request.url.path.endswith("/rollout"):
        await response.aread()
        last_bodies["/rollout"] = response.text


async def _commit(_result: Any) -> None:
    return None


async def op_open(
    url: str, admission_timeout_sec: float | None = None, client: str = "default"
) -> dict[str, Any]:
    http = httpx.AsyncClient(event_hooks={"response": [_on_response]})
    drivers[client] = HttpRolloutDriver(
        rollout_base_url=url,
        callback_store=CallbackStore(on_terminal_commit=_commit),
        completion_url_for=lambda rid: f"{CALLBACK_BASE}/{rid}/completion",
        grader_url_for=lambda rid: f"{CALLBACK_BASE}/{rid}/grader",
        chat_completions_url_for=lambda rid: f"{CALLBACK_BASE}/{rid}/v1",
        chat_api_key=None,
        controller_api_key="interop-controller-key",
        http_client=http,
        admission_timeout_sec=admission_timeout_sec,
        callback_timeout_sec=None,
    )
    import osmosis_ai

    return {"kind": KIND, "version": getattr(osmosis_ai, "__version__", "unknown")}


async def op_run_rollout(
    rollout_id: str,
    initial_messages: list[dict[str, Any]],
    client: str = "default",
    label: str | None = None,
    metadata: dict[str, Any] | None = None,
    **_ignored: Any,
) -> Any:
    last_bodies.pop("/rollout", None)
    try:
        outcome = await drivers[client].run(
            RolloutRunRequest(
                messages=initial_messages, label=label, metadata=metadata, rollout_id=rollout_id
            )
        )
    except Exception as exc:
        exc.driver_details = {"response_body": last_bodies.get("/rollout")}  # type: ignore[attr-defined]
        raise
    return {"status": outcome.status.value, "error": outcome.error}


async def close_all() -> None:
    """Close every caller (at EOF)."""
    for driver in drivers.values():
        await driver.aclose()


OPS = {name[3:]: value for name, value in dict(globals()).items() if name.startswith("op_")}

if __name__ == "__main__":
    asyncio.run(driver_common.serve(OPS, on_exit=close_all))
