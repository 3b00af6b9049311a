"""Driver of osmosis-ai 0.3.8's ``RolloutClient`` (run by the osmosis-ai venv's interpreter).

Ops (see :mod:`driver_common` for the line protocol); ``client`` names a client opened
with ``open`` (default ``"default"``), ``rollout_id`` a handle started with ``start``:

``open(url, api_key=None, admission_timeout_sec=None, client)``, ``close(client)``,
``run_rollout(client, **kwargs)``, ``start(client, **kwargs)``,
``wait_for_running(rollout_id)``, ``wait_for_grading(rollout_id)``, ``result(rollout_id)``,
``state(rollout_id)``, ``stop_polling(rollout_id)``, ``cancel_rollout(rollout_id, client)``,
``health(client)``, ``wait_idle(client, **kwargs)``, ``peek(rollout_id, client)`` (a raw
result GET with the lease token the 202 carried, for looking after the client stopped).

Every HTTP response the client receives is reported as an event
``{"kind": "response", "method", "path", "status"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import driver_common
import httpx
from osmosis_ai.rollout.client.client import RolloutClient, RolloutHandle

KIND = "osmosis-ai"
clients: dict[str, RolloutClient] = {}
handles: dict[str, RolloutHandle] = {}
tokens: dict[str, str] = {}


async def _on_response(response: httpx.Response) -> None:
    request = response.request
    driver_common.event(
        kind="response",
        method=request.method,
        path=request.url.path,
        status=response.status_code,
        retry_after=response.headers.get("Retry-After"),
        protocol=response.headers.get("X-Rollout-Protocol-Version"),
    )
    admitted = response.status_code == 202 and request.method == "POST"
    if admitted and request.url.path.endswith("/rollout"):
        await response.aread()
        body = response.json()
        tokens[str(body.get("rollout_id"))] = str(body.get("polling_lease_token"))


def _dump(value: Any) -> Any:
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


async def op_open(
    url: str,
    api_key: str | None = None,
    admission_timeout_sec: float | None = None,
    client: str = "default",
) -> dict[str, Any]:
    http = httpx.AsyncClient(event_hooks={"response": [_on_response]})
    clients[client] = RolloutClient(
        url=url, http_client=http, admission_timeout_sec=admission_timeout_sec, api_key=api_key
    )
    import osmosis_ai

    return {"kind": KIND, "version": getattr(osmosis_ai, "__version__", "unknown")}


async def op_close(client: str = "default") -> None:
    found = clients.pop(client)
    await found.http_client.aclose()


async def op_run_rollout(client: str = "default", **kwargs: Any) -> Any:
    return _dump(await clients[client].run_rollout(**kwargs))


async def op_start(client: str = "default", **kwargs: Any) -> dict[str, Any]:
    handle = await clients[client].run_rollout_async(**kwargs)
    handles[handle.rollout_id] = handle
    return {"rollout_id": handle.rollout_id, "status": handle.status.value}


async def op_wait_for_running(rollout_id: str) -> str:
    return (await handles[rollout_id].wait_for_running()).value


async def op_wait_for_grading(rollout_id: str) -> str:
    return (await handles[rollout_id].wait_for_grading()).value


async def op_result(rollout_id: str) -> Any:
    return _dump(await handles[rollout_id])


async def op_state(rollout_id: str) -> dict[str, Any]:
    handle = handles[rollout_id]
    return {
        "status": handle.status.value,
        "done": handle.done(),
        "latest_result": _dump(handle.latest_result),
    }


async def op_stop_polling(rollout_id: str) -> bool:
    handle = handles[rollout_id]
    stopped = handle.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await handle.result_task
    return stopped


async def op_cancel_rollout(rollout_id: str, client: str = "default") -> Any:
    return _dump(await clients[client].cancel_rollout(rollout_id))


async def op_health(client: str = "default") -> Any:
    return await clients[client].health()


async def op_wait_idle(client: str = "default", **kwargs: Any) -> Any:
    return await clients[client].wait_idle(**kwargs)


async def op_peek(rollout_id: str, client: str = "default") -> dict[str, Any]:
    found = clients[client]
    response = await found.http_client.get(
        f"{found.url}/rollout/{rollout_id}/result",
        headers={**found._auth_headers, "X-Osmosis-Rollout-Lease": tokens[rollout_id]},
    )
    return {"http_status": response.status_code, "body": response.json()}


async def close_all() -> None:
    """Stop polling and close every client (at EOF)."""
    for handle in handles.values():
        handle.cancel()
    for name in list(clients):
        await op_close(name)


OPS = {name[3:]: value for name, value in dict(globals()).items() if name.startswith("op_")}

if __name__ == "__main__":
    asyncio.run(driver_common.serve(OPS, on_exit=close_all))
