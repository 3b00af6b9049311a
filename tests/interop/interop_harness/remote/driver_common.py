"""The JSON-lines loop every client driver runs (standard library only).

A driver is a small program, run by the interpreter of one client side's venv, that
lets a test drive that side's client over stdin/stdout:

* request (one JSON object per line on stdin):
  ``{"id": 7, "op": "start", "args": {...}, "timeout_sec": 30}``;
* answer (one line on stdout): ``{"id": 7, "ok": true, "value": ...}`` or
  ``{"id": 7, "ok": false, "error": {"type", "module", "mro", "message", "status_code",
  "elapsed_sec", ...}}``;
* event (unsolicited): ``{"event": {...}}``, e.g. every HTTP response the client got.

Each request runs as its own task, so a test can start a blocking call (an admission
waiting out a 429) and keep sending requests. ``timeout_sec`` bounds a request; when it
fires the error type is ``DriverTimeout``. EOF on stdin ends the driver.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

Op = Callable[..., Awaitable[Any]]


def describe(exc: BaseException, elapsed_sec: float) -> dict[str, Any]:
    """The JSON description of an exception an op raised."""
    cls = type(exc)
    info: dict[str, Any] = {
        "type": cls.__name__,
        "module": cls.__module__,
        "mro": [base.__name__ for base in cls.__mro__],
        "message": str(exc),
        "status_code": getattr(exc, "status_code", None),
        "elapsed_sec": round(elapsed_sec, 3),
    }
    extra = getattr(exc, "driver_details", None)
    if isinstance(extra, dict):
        info.update(extra)
    return info


def emit(message: dict[str, Any]) -> None:
    """Write one JSON line to stdout."""
    sys.stdout.write(json.dumps(message, default=str) + "\n")
    sys.stdout.flush()


def event(**fields: Any) -> None:
    """Send an unsolicited event to the test."""
    emit({"event": fields})


async def _answer(ops: dict[str, Op], request: dict[str, Any]) -> None:
    request_id = request.get("id")
    started = time.monotonic()
    op = ops.get(str(request.get("op")))
    if op is None:
        emit(
            {
                "id": request_id,
                "ok": False,
                "error": {"type": "DriverUnknownOp", "message": f"no op {request.get('op')!r}"},
            }
        )
        return
    timeout_sec = request.get("timeout_sec")
    try:
        async with asyncio.timeout(timeout_sec) as deadline:
            value = await op(**(request.get("args") or {}))
    except asyncio.CancelledError as exc:
        emit({"id": request_id, "ok": False, "error": describe(exc, time.monotonic() - started)})
    except BaseException as exc:
        error = describe(exc, time.monotonic() - started)
        if deadline.expired() and isinstance(exc, TimeoutError):
            error["type"] = "DriverTimeout"
            error["message"] = f"op {request.get('op')} did not finish within {timeout_sec}s"
        emit({"id": request_id, "ok": False, "error": error})
    else:
        emit({"id": request_id, "ok": True, "value": value})


async def serve(ops: dict[str, Op], on_exit: Callable[[], Awaitable[None]] | None = None) -> None:
    """Answer requests from stdin until EOF; then cancel what still runs and run ``on_exit``."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: set[asyncio.Task[None]] = set()
    emit({"event": {"kind": "ready"}})
    while line := await reader.readline():
        if not line.strip():
            continue
        task = asyncio.create_task(_answer(ops, json.loads(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if on_exit is not None:
        await on_exit()
