"""Driver of this project's ``rollout_client.RolloutClient`` (run by the client side's venv).

The same ops as :mod:`driver_osmosis` (see there), minus ``peek``: our client keeps the
lease token private. Every HTTP response the client receives is reported as an event
``{"kind": "response", "method", "path", "status"}`` (through an aiohttp trace config on
the session the driver owns and passes as ``http_client``).
"""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import aiohttp
import driver_common

import rollout_client
import rollout_types
from rollout_client import RolloutClient, RolloutHandle

KIND = "rollout-client"
clients: dict[str, tuple[RolloutClient, aiohttp.ClientSession]] = {}
handles: dict[str, RolloutHandle] = {}


async def _on_request_end(
    _session: aiohttp.ClientSession, _context: SimpleNamespace, params: Any
) -> None:
    driver_common.event(
        kind="response",
        method=params.method,
        path=params.url.path,
        status=params.response.status,
        retry_after=params.response.headers.get("Retry-After"),
        protocol=params.response.headers.get("X-Rollout-Protocol-Version"),
    )


def _dump(value: Any) -> Any:
    return rollout_types.converter.unstructure(value)


def _status(value: Any) -> str:
    return str(getattr(value, "value", value))


async def op_open(
    url: str,
    api_key: str | None = None,
    admission_timeout_sec: float | None = None,
    client: str = "default",
) -> dict[str, Any]:
    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(_on_request_end)
    session = aiohttp.ClientSession(trace_configs=[trace])
    try:
        found = RolloutClient(
            url=url,
            http_client=session,
            admission_timeout_sec=admission_timeout_sec,
            api_key=api_key,
        )
    except BaseException:
        await session.close()
        raise
    clients[client] = (found, session)
    return {
        "kind": KIND,
        "version": rollout_client.__version__,
        "protocol": rollout_types.PROTOCOL_VERSION,
    }


async def op_close(client: str = "default") -> None:
    found, session = clients.pop(client)
    await found.aclose()
    await session.close()


async def op_run_rollout(client: str = "default", **kwargs: Any) -> Any:
    return _dump(await clients[client][0].run_rollout(**kwargs))


async def op_start(client: str = "default", **kwargs: Any) -> dict[str, Any]:
    handle = await clients[client][0].run_rollout_async(**kwargs)
    handles[handle.rollout_id] = handle
    return {"rollout_id": handle.rollout_id, "status": _status(handle.status)}


async def op_wait_for_running(rollout_id: str) -> str:
    return _status(await handles[rollout_id].wait_for_running())


async def op_wait_for_grading(rollout_id: str) -> str:
    return _status(await handles[rollout_id].wait_for_grading())


async def op_result(rollout_id: str) -> Any:
    return _dump(await handles[rollout_id])


async def op_state(rollout_id: str) -> dict[str, Any]:
    handle = handles[rollout_id]
    latest = handle.latest_result
    return {
        "status": _status(handle.status),
        "done": handle.done(),
        "latest_result": None if latest is None else _dump(latest),
    }


async def op_stop_polling(rollout_id: str) -> bool:
    handle = handles[rollout_id]
    stopped = handle.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await handle
    return stopped


async def op_cancel_rollout(rollout_id: str, client: str = "default") -> Any:
    return _dump(await clients[client][0].cancel_rollout(rollout_id))


async def op_health(client: str = "default") -> Any:
    return await clients[client][0].health()


async def op_wait_idle(client: str = "default", **kwargs: Any) -> Any:
    return await clients[client][0].wait_idle(**kwargs)


async def close_all() -> None:
    """Stop polling and close every client (at EOF)."""
    for handle in handles.values():
        handle.cancel()
    for name in list(clients):
        await op_close(name)


OPS = {name[3:]: value for name, value in dict(globals()).items() if name.startswith("op_")}

if __name__ == "__main__":
    asyncio.run(driver_common.serve(OPS, on_exit=close_all))
