"""Recording HTTP exchanges: an ASGI middleware and the uvicorn server it runs behind."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass
class Exchange:
    """One HTTP request/response pair as the ASGI app saw it."""

    method: str
    path: str
    request_headers: dict[str, str]
    request_body: bytearray = field(default_factory=bytearray)
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    response_body: bytearray = field(default_factory=bytearray)


def _decode_headers(raw: Any) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}


class Recorder:
    """ASGI middleware that keeps every HTTP exchange passing through it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.exchanges: list[Exchange] = []
        self.changed = asyncio.Condition()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        exchange = Exchange(scope["method"], path, _decode_headers(scope["headers"]))
        self.exchanges.append(exchange)

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                exchange.request_body += message.get("body", b"")
            return message

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
                exchange.response_headers = _decode_headers(message.get("headers", []))
                async with self.changed:
                    self.changed.notify_all()
            elif message["type"] == "http.response.body":
                exchange.response_body += message.get("body", b"")
            await send(message)

        await self.app(scope, recording_receive, recording_send)

    async def wait_for(self, method: str, path: str, needle: str) -> Exchange:
        """Wait until a ``method path`` request whose body contains ``needle`` is answered."""

        def find() -> Exchange | None:
            for exchange in self.exchanges:
                if (
                    (exchange.method, exchange.path) == (method, path)
                    and exchange.status
                    and needle.encode() in exchange.request_body
                ):
                    return exchange
            return None

        async with self.changed:
            await self.changed.wait_for(lambda: find() is not None)
        found = find()
        assert found is not None
        return found

    def last(self, method: str, path: str) -> Exchange:
        """The most recent completed exchange for ``method path``."""
        for exchange in reversed(self.exchanges):
            if exchange.method == method and exchange.path == path and exchange.status:
                return exchange
        raise LookupError(f"no recorded {method} {path}")


@contextlib.asynccontextmanager
async def serve(app: Any, *, verbose: bool) -> AsyncIterator[tuple[str, Recorder]]:
    """Serve ``app`` (recorded) with uvicorn on 127.0.0.1 until the block exits."""
    recorder = Recorder(app)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        recorder,
        lifespan="on",
        log_level="info" if verbose else "critical",
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("uvicorn stopped during startup")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}", recorder
    finally:
        server.should_exit = True
        await task
        sock.close()
